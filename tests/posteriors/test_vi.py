"""Mean-field VI (Bayes by Backprop): the stacked ELBO gradient, the closed-form KL, the known optimum of
Bayesian linear regression, and the generic path on a ResNet-18."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from symlib import models
from symlib import training as T
from symlib.posteriors import vi
from symlib.posteriors.base import Setup


def _optunet_setup(n=40, batch=16, epochs=2, momentum=0.9):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=g)
    rec = dataclasses.replace(T.OPTUNET_MNIST, epochs=epochs, batch_size=batch, momentum=momentum)
    return Setup("optunet", lambda: models.OptuNet().double(), x, y, rec, fill=(-0.4,), scale="tiny")


def test_stacked_elbo_gradient_equals_autograd():
    """dL/dmu = mean_k g_k + beta mu / s0^2 and dL/drho = (mean_k g_k eps_k + beta (s/s0^2 - 1/s))
    sigmoid(rho), with g_k from the hand-written OptuNet gradient, equal autograd through optunet_forward
    and the closed-form KL (float64, 2 modes x 3 Monte-Carlo samples)."""
    g = torch.Generator().manual_seed(1)
    mu, rho = vi.init_variational(models.OptuNet().double(), 2, g)
    rho = {k: v + 3.0 for k, v in rho.items()}  # sigma ~ 0.05: the noise term matters
    eps = {k: torch.randn((2, 3, *v.shape[1:]), generator=g, dtype=torch.float64) for k, v in mu.items()}
    x = torch.randn(2, 5, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (2, 5), generator=g)
    beta = 0.01
    nll, kl, g_mu, g_rho = vi.elbo_and_grads(mu, rho, eps, x, y, beta, 0.1)

    mu_a = {k: v.clone().requires_grad_() for k, v in mu.items()}
    rho_a = {k: v.clone().requires_grad_() for k, v in rho.items()}
    w = {
        k: (mu_a[k][:, None] + F.softplus(rho_a[k])[:, None] * eps[k]).reshape(6, *mu[k].shape[1:])
        for k in mu
    }
    logits = T.optunet_forward(w, x.repeat_interleave(3, 0))
    ce = F.cross_entropy(logits.transpose(1, 2), y.repeat_interleave(3, 0), reduction="none").mean(1)
    nll_a = ce.view(2, 3).mean(1)
    kl_a = vi.kl_divergence(mu_a, rho_a, 0.1)
    (nll_a + beta * kl_a).sum().backward()
    torch.testing.assert_close(nll, nll_a.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, kl_a.detach(), rtol=1e-12, atol=1e-12)
    for k in mu:
        torch.testing.assert_close(g_mu[k], mu_a[k].grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(g_rho[k], rho_a[k].grad, rtol=1e-9, atol=1e-12)


def test_kl_closed_form():
    """Closed-form KL(N(mu, s^2) || N(0, s0^2)) equals torch.distributions' per-weight KL summed, and the
    Monte-Carlo estimate E_q[log q(w) - log p(w)] (BLiTZ's) within 4 standard errors of 20,000 draws."""
    g = torch.Generator().manual_seed(2)
    mu = {
        "a": torch.randn(3, 4, 5, generator=g, dtype=torch.float64),
        "b": torch.randn(3, 7, generator=g).double(),
    }
    rho = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) - 2 for k, v in mu.items()}
    s0 = 0.3
    kl = vi.kl_divergence(mu, rho, s0)
    d = torch.distributions
    prior = d.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(s0, dtype=torch.float64))
    ref = sum(d.kl_divergence(d.Normal(mu[k], F.softplus(rho[k])), prior).reshape(3, -1).sum(1) for k in mu)
    torch.testing.assert_close(kl, ref, rtol=1e-12, atol=1e-12)
    q = {k: d.Normal(mu[k], F.softplus(rho[k])) for k in mu}
    w = {k: q[k].sample((20000,)) for k in mu}
    mc = sum((q[k].log_prob(w[k]) - prior.log_prob(w[k])).reshape(20000, 3, -1).sum(2) for k in mu)
    assert torch.all((mc.mean(0) - kl).abs() < 4 * mc.std(0) / math.sqrt(20000))


def test_linear_regression_optimum():
    """Bayesian linear regression y = Phi w + noise (sigma_n = 0.5), prior N(0, s0^2 I): the exact posterior
    is Gaussian with precision Lambda = Phi^T Phi / sigma_n^2 + I / s0^2, and the mean-field optimum of the
    ELBO has the exact posterior mean and the variances 1 / Lambda_ii. VI (generic path, per-example
    negative ELBO with beta = 1/N, Adam, 16 Monte-Carlo samples, decaying learning rate) recovers them:
    means within 0.05 posterior sd, variances within 6 % (the stochastic optimiser's residual noise)."""
    n, dim, noise, s0 = 64, 3, 0.5, 1.0
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    w_true = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    y = x @ w_true + 0.3 + noise * torch.randn(n, generator=g, dtype=torch.float64)
    phi = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)  # weights then bias
    lam = phi.T @ phi / noise**2 + torch.eye(dim + 1, dtype=torch.float64) / s0**2
    m_exact = torch.linalg.solve(lam, phi.T @ y / noise**2)
    var_mf = 1 / lam.diagonal()

    def gaussian_nll(out, target):
        return ((out.squeeze(-1) - target) ** 2).mean() / (2 * noise**2)

    rec = T.Recipe(epochs=800, batch_size=n, lr=0.03, milestones=(300, 550, 700), gamma=0.2)
    setup = Setup("linear", lambda: nn.Linear(dim, 1).double(), x, y, rec, scale="tiny")
    res = vi.fit(setup, 1, 0, progress=False, loss_fn=gaussian_nll, optimizer="adam", n_mc=16, prior_sigma=s0)
    mean = torch.cat([res.mean["weight"][0].flatten(), res.mean["bias"][0]])
    var = torch.cat([res.std["weight"][0].flatten(), res.std["bias"][0]]) ** 2
    assert torch.all((mean - m_exact).abs() < 0.05 * var_mf.sqrt())
    assert torch.all((var / var_mf - 1).abs() < 0.06)


def test_stacked_path_equals_generic_path():
    """Same seeds -> same BLiTZ initialisation, batches, crops and Monte-Carlo noise: the stacked OptuNet
    VI (hand-written gradients, stacked SGD with momentum) reproduces the generic path (functional_call,
    autograd, torch.optim.SGD) mode by mode, to float64 rounding."""
    setup = _optunet_setup()
    fast = vi.fit(setup, 2, 5, progress=False)
    slow = vi.fit(setup, 2, 5, progress=False, loss_fn=F.cross_entropy)
    for k in fast.mean:
        torch.testing.assert_close(fast.mean[k], slow.mean[k], rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(fast.rho[k], slow.rho[k], rtol=1e-9, atol=1e-11)
    # training moved the means, and the history holds one row of per-mode values per epoch
    assert len(fast.history["objective"]) == 2 and len(fast.history["objective"][0]) == 2


def test_sample_set_optunet():
    """sample(): mode-major draws w = mu + sigma eps with the BLiTZ prior/initialisation recorded, the KL
    weight 1/N, and draws whose spread around each mode's mean is its sigma."""
    setup = _optunet_setup(epochs=1)
    out = vi.sample(setup, 2, 400, seed=1, progress=False)
    assert out.method == "vi" and out.n_samples == 800 and out.hyper["kl_weight"] == pytest.approx(1 / 40)
    assert set(out.params) == set(T.OPTUNET_SHAPES)
    res = vi.fit(setup, 2, 1, progress=False)
    for k, v in out.params.items():
        draws = v.view(2, 400, *v.shape[1:])
        torch.testing.assert_close(draws.mean(1), res.mean[k], atol=5 * float(res.std[k].max()) / 20, rtol=0)
        ratio = draws.std(1) / res.std[k]
        assert 0.85 < float(ratio.mean()) < 1.15
    with pytest.warns(UserWarning, match="base models are not used"):
        vi.sample(setup, 1, 1, progress=False, base=T.init_params(models.OptuNet, [0]), epochs=1)


def test_resnet18_generic_path_runs():
    """ResNet-18 of width 4 on synthetic CIFAR-shaped data: a couple of steps through functional_call with
    BatchNorm (point-estimated affine weights, running statistics updated), finite objective, full state
    dicts that load into the model and give finite outputs."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, 32, 32, generator=g)
    y = torch.randint(0, 100, (8,), generator=g)
    rec = dataclasses.replace(T.RESNET18_CIFAR100, epochs=1, batch_size=4)
    setup = Setup("resnet18", lambda: models.ResNet18(width=4), x, y, rec, fill=(0.0, 0.0, 0.0), scale="tiny")
    out = vi.sample(setup, 1, 2, progress=False)
    net = models.ResNet18(width=4)
    assert list(out.params) == list(net.state_dict())
    assert all(torch.isfinite(v.float()).all() for v in out.params.values())
    assert math.isfinite(out.diagnostics["final_objective"][0])
    net.load_state_dict({k: v[1] for k, v in out.params.items()})
    assert bool(torch.isfinite(net.eval()(x)).all())
    assert not torch.equal(out.params["bn1.running_mean"][0], torch.zeros(4))  # trained in training mode
    assert "conv1.weight" in vi.bayesian_layers(net) and "bn1.weight" not in vi.bayesian_layers(net)


def test_bad_input_is_named():
    setup = _optunet_setup(epochs=1)
    with pytest.raises(ValueError, match="prior_sigma"):
        vi.fit(setup, 1, progress=False, prior_sigma=0.0)
    with pytest.raises(ValueError, match="optimizer"):
        vi.fit(setup, 1, progress=False, optimizer="rmsprop")
    with pytest.raises(TypeError, match="unknown vi hyper-parameter"):
        vi.fit(setup, 1, progress=False, n_samples=3)
    with pytest.raises(ValueError, match="no Linear or Conv"):
        vi.init_variational(nn.ReLU(), 1, torch.Generator())
    with pytest.raises(FloatingPointError, match="mode"):
        vi.fit(setup, 1, progress=False, lr=1e30)


def test_std_init_sets_the_initial_standard_deviation():
    """Config(std_init=s) starts every weight's sigma = softplus(rho) near s (rho jittered by N(0, 0.1^2));
    the default keeps BLiTZ's rho_0 = -6 for linear layers."""
    net = models.MLP([5, 7, 3]).double()
    g = torch.Generator().manual_seed(0)
    _, rho = vi.init_variational(net, 2, g, std_init=0.01)
    sigma = torch.cat([torch.nn.functional.softplus(v).flatten() for v in rho.values()])
    assert abs(float(sigma.median()) - 0.01) < 0.002
    _, rho = vi.init_variational(net, 2, torch.Generator().manual_seed(0))
    assert abs(float(torch.cat([v.flatten() for v in rho.values()]).mean()) - vi.RHO_INIT["linear"]) < 0.05
    with pytest.raises(ValueError, match="std_init"):
        vi.Config(std_init=-1.0)
    assert math.isfinite(float(sigma.max()))
