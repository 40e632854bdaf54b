"""Full-batch HMC: the integrator's geometry, moments of a known Gaussian, the OptuNet potential and the
method end to end."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from symlib import models
from symlib import training as T
from symlib.posteriors import hmc
from symlib.posteriors.base import Setup
from symlib.posteriors.hmc import tempering
from symlib.stats import diagnostics as D


def _gaussian(cov: torch.Tensor, mean: torch.Tensor):
    prec = torch.linalg.inv(cov)

    def potential(theta):
        d = theta - mean
        g = d @ prec
        return 0.5 * (g * d).sum(1), g

    return potential


def _quartic(theta):
    """A non-quadratic 2-D potential U = x^4/4 + y^2/2 + x y / 2 + sin(y)."""
    x, y = theta[:, 0], theta[:, 1]
    u = x**4 / 4 + y**2 / 2 + x * y / 2 + torch.sin(y)
    return u, torch.stack([x**3 + y / 2, y + x / 2 + torch.cos(y)], 1)


def test_leapfrog_is_reversible_and_volume_preserving():
    """Leapfrog is a symplectic involution up to the momentum flip: integrating back from (theta', -p')
    returns (theta, -p) to rounding, and the Jacobian of (theta, p) -> (theta', p') has determinant 1."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(3, 2, generator=g, dtype=torch.float64)
    p = torch.randn(3, 2, generator=g, dtype=torch.float64)
    _, grad = _quartic(theta)
    th1, p1, _, g1 = hmc.leapfrog(theta, p, grad, 0.1, 7, _quartic)
    th2, p2, _, _ = hmc.leapfrog(th1, -p1, g1, 0.1, 7, _quartic)
    torch.testing.assert_close(th2, theta, rtol=0, atol=1e-12)
    torch.testing.assert_close(-p2, p, rtol=0, atol=1e-12)

    def flow(z):
        th, pp = z[:2][None], z[2:][None]
        a, b, _, _ = hmc.leapfrog(th, pp, _quartic(th)[1], 0.1, 7, _quartic)
        return torch.cat([a[0], b[0]])

    for i in range(3):
        jac = torch.autograd.functional.jacobian(flow, torch.cat([theta[i], p[i]]))
        assert abs(float(torch.linalg.det(jac)) - 1.0) < 1e-10


def test_leapfrog_energy_error_is_second_order():
    """Over a fixed time T = 1, the energy error of leapfrog is O(eps^2): halving eps divides it by ~4
    (between 3 and 5: the constant of the next order term is not exactly zero at eps = 0.05)."""
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(64, 2, generator=g, dtype=torch.float64)
    p = torch.randn(64, 2, generator=g, dtype=torch.float64)
    u0, grad = _quartic(theta)
    h0 = u0 + 0.5 * (p * p).sum(1)
    errs = []
    for eps in (0.04, 0.02, 0.01):
        _, p1, u1, _ = hmc.leapfrog(theta, p, grad, eps, round(1 / eps), _quartic)
        errs.append(float((u1 + 0.5 * (p1 * p1).sum(1) - h0).abs().mean()))
    assert 3.0 < errs[0] / errs[1] < 5.0 and 3.0 < errs[1] / errs[2] < 5.0


def test_hmc_recovers_a_correlated_gaussian():
    """10-D Gaussian with correlations up to 0.6 and scales 0.3..3 (condition number ~200): every mean
    within 4.5 Monte-Carlo standard errors (sd / sqrt(ESS), 10 coordinates: a false alarm has
    probability < 1e-4), every covariance entry within 5 standard errors of a covariance estimate,
    sqrt((S_ii S_jj + S_ij^2) / ESS) with the smallest bulk ESS; dual averaging lands the acceptance at
    or a little above its target."""
    d = 10
    g = torch.Generator().manual_seed(2)
    a = torch.randn(d, d, generator=g, dtype=torch.float64)
    s0 = a @ a.T / d + 0.2 * torch.eye(d, dtype=torch.float64)
    corr = s0 / torch.sqrt(torch.outer(s0.diagonal(), s0.diagonal()))
    scales = torch.logspace(math.log10(0.3), math.log10(3), d, dtype=torch.float64)
    cov = corr * scales[:, None] * scales[None, :]
    mean = torch.linspace(-2, 2, d, dtype=torch.float64)
    theta0 = torch.randn(4, d, generator=g, dtype=torch.float64) * 3
    res = hmc.run_chains(_gaussian(cov, mean), theta0, 200, 600, 12, seed=3, progress=False)
    x = res.draws.numpy()
    flat = x.reshape(-1, d)
    mcse = D.mcse_mean(x)
    assert np.all(np.abs(flat.mean(0) - mean.numpy()) < 4.5 * mcse)
    n_eff = D.ess_bulk(x).min()
    s = cov.numpy()
    se = np.sqrt((np.outer(np.diag(s), np.diag(s)) + s**2) / n_eff)
    assert np.all(np.abs(np.cov(flat.T) - s) < 5 * se)
    # the averaged step size of dual averaging is smaller than its last iterate: acceptance lands at or
    # somewhat above the target 0.75 (Stan shows the same)
    assert np.all((res.accept_prob.numpy() > 0.65) & (res.accept_prob.numpy() < 0.95))
    diag = res.diagnostics()
    assert diag["rhat_max"] < 1.05 and diag["n_grad"] > 0
    assert len(diag["rhat_potential_per_chain"]) == 4 and max(diag["rhat_potential_per_chain"]) < 1.1
    json.dumps(diag)


# R-hat and ESS themselves: tests/stats/test_diagnostics.py (against ArviZ).


# --- OptuNet


def _setup(n=48, wd=2e-4, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 28, 28, generator=g, dtype=dtype)
    y = torch.randint(0, 10, (n,), generator=g)
    recipe = dataclasses.replace(T.OPTUNET_MNIST, epochs=1, batch_size=16, weight_decay=wd)
    return Setup("optunet", lambda: models.OptuNet().to(dtype), x, y, recipe, name="synthetic", scale="tiny")


def test_stacked_potential_equals_autograd():
    """The stacked full-batch potential (hand-written OptuNet gradient over chunks) equals the
    torch.func path (vmap of grad of functional_call) in float64: U = N mean CE + lambda/2 |theta|^2."""
    s = _setup()
    theta = hmc.flatten({k: v.double() for k, v in T.init_params(s.make_model, [1, 2, 3]).items()})
    u1, g1 = hmc.stacked_potential(s.x, s.y, s.prior_precision, chunk=20)(theta)
    pot, _ = hmc.module_potential(s.make_model, s.x, s.y, s.prior_precision, chunk=48)
    u2, g2 = pot(theta)
    torch.testing.assert_close(u1, u2, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-10)


def test_sample_optunet_tiny():
    """A tiny run end to end: chain-major SampleSet of OptuNet weights, finite, JSON diagnostics."""
    s = _setup(dtype=torch.float32)
    out = hmc.sample(s, 2, 4, seed=0, progress=False, n_warmup=4, n_leapfrog=2, grad_chunk=32)
    assert out.method == "hmc" and out.n_samples == 8
    assert set(out.params) == set(T.OPTUNET_SHAPES)
    assert all(torch.isfinite(v).all() for v in out.params.values())
    d = json.loads(json.dumps(out.diagnostics))
    assert len(d["accept_prob"]) == 2 and d["n_grad"] >= (4 + 4) * 2
    assert out.hyper["prior_precision"] == pytest.approx(48 * 2e-4)


def test_sample_optunet_with_the_gauged_metric():
    """gauge_sigma end to end: the mass matrix follows the orbits, and the potential the diagnostics judge
    is the posterior's (the gauge's energy taken out): it equals U recomputed at the kept draws."""
    s = _setup(dtype=torch.float64)
    out = hmc.sample(s, 2, 5, seed=0, progress=False, n_warmup=3, n_leapfrog=2, grad_chunk=32, metric="ggn",
                     gauge_sigma=0.1, orbit_moves=True)
    d = out.diagnostics
    assert out.hyper["mass_matrix"] == "ggn, following the scaling orbits" and "orbit_accept" in d
    theta = hmc.flatten(out.params).reshape(2, 5, -1)
    u, _ = hmc.stacked_potential(s.x, s.y, s.prior_precision, chunk=32)(theta.reshape(10, -1))
    recorded = np.asarray(d["potential_trace"]) * s.n_train
    np.testing.assert_allclose(recorded, u.reshape(2, 5).numpy(), rtol=1e-10)
    without = hmc.sample(s, 2, 5, seed=0, progress=False, n_warmup=3, n_leapfrog=2, grad_chunk=32,
                         metric="ggn", gauge_sigma=0.1)
    assert "orbit_accept" not in without.diagnostics
    with pytest.raises(ValueError, match="metric='ggn'"):
        hmc.Config(n_warmup=1, n_leapfrog=1, gauge_sigma=0.1)
    with pytest.raises(ValueError, match="gauge_sigma"):
        hmc.Config(n_warmup=1, n_leapfrog=1, metric="ggn", gauge_sigma=-1.0)


def test_bad_input_is_named():
    s = _setup(wd=0.0)
    with pytest.raises(ValueError, match="prior precision"):
        hmc.sample(s, 1, 4, progress=False)
    pot = _gaussian(torch.eye(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="step_size"):
        hmc.run_chains(pot, torch.zeros(2, 2, dtype=torch.float64), 0, 4, 2, step_size=-0.1, progress=False)
    bad = torch.zeros(3, 2, dtype=torch.float64)
    bad[1, 0] = math.nan
    with pytest.raises(FloatingPointError, match=r"chain\(s\) \[1\]"):
        hmc.run_chains(pot, bad, 2, 4, 2, progress=False)

    def explodes(theta):
        u, g = pot(theta)
        return torch.where(theta[:, 0] > 0.5, math.inf, u), g

    start = torch.tensor([[0.0, 0.0], [0.4, 0.0]], dtype=torch.float64)
    with pytest.raises(FloatingPointError, match="trajectory"):
        hmc.run_chains(explodes, start, 0, 50, 5, step_size=0.5, on_nonfinite="raise", progress=False)
    res = hmc.run_chains(explodes, start, 0, 50, 5, step_size=0.5, progress=False)
    assert int(res.divergences.sum()) > 0 and bool((res.draws[..., 0] <= 0.5).all())
    with pytest.raises(TypeError, match="unknown hmc hyper-parameter"):
        hmc.sample(_setup(), 1, 4, progress=False, n_leap=3)


def test_generic_fallback_for_other_architectures():
    """An architecture without a stacked gradient (an MLP) falls back to torch.func, with a warning;
    a network with BatchNorm is refused (its posterior is not a function of the weights alone)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(30, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (30,), generator=g)
    rec = T.Recipe(epochs=1, batch_size=10, lr=0.1, weight_decay=1e-2)
    make = lambda: models.MLP([5, 4, 3]).double()  # noqa: E731
    s = Setup("mlp", make, x, y, rec, num_classes=3, scale="tiny")
    base = T.init_params(make, [0, 1])
    with pytest.warns(UserWarning, match="falls back"):
        out = hmc.sample(s, 2, 4, base=base, progress=False, n_warmup=5, n_leapfrog=3)
    assert list(out.params) == list(dict(make().named_parameters()))
    assert out.diagnostics["rhat_max"] is not None
    with pytest.raises(ValueError, match="BatchNorm"):
        hmc.module_potential(lambda: models.ResNet18(width=4), x, y, 1.0)


# --- mass matrices, the MLP likelihood, replica exchange


def test_dense_metric_leapfrog_is_reversible_and_samples_an_ill_conditioned_gaussian():
    """With the posterior's precision as mass matrix, a Gaussian of condition number 1e4 is as easy as a
    standard one: leapfrog stays reversible, and 4 chains x 400 draws of 3 leapfrog steps recover every
    mean within 4.5 Monte-Carlo standard errors and every variance within 5 standard errors, sd
    sqrt(2 / ESS) var with the ESS of the squared deviations (the same budget with the identity mass
    leaves the widest direction almost unexplored)."""
    d = 6
    g = torch.Generator().manual_seed(4)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    cov = q @ torch.diag(torch.logspace(-2, 2, d, dtype=torch.float64)) @ q.T
    mean = torch.linspace(-1, 1, d, dtype=torch.float64)
    pot = _gaussian(cov, mean)
    prec = torch.linalg.inv(cov)
    met = hmc.metric.from_curvature(prec.expand(4, d, d) - 1e-3 * torch.eye(d, dtype=torch.float64), 1e-3)
    theta = torch.randn(4, d, generator=g, dtype=torch.float64)
    p = met.momentum(theta.shape, g, theta.dtype, theta.device)
    th1, p1, _, g1 = hmc.leapfrog(theta, p, pot(theta)[1], 0.3, 5, pot, met)
    th2, p2, _, _ = hmc.leapfrog(th1, -p1, g1, 0.3, 5, pot, met)
    torch.testing.assert_close(th2, theta, rtol=0, atol=1e-10)
    torch.testing.assert_close(-p2, p, rtol=0, atol=1e-10)
    res = hmc.run_chains(pot, theta, 100, 400, 3, seed=5, progress=False, metric=met)
    x = res.draws.numpy()
    assert np.all(np.abs(x.reshape(-1, d).mean(0) - mean.numpy()) < 4.5 * D.mcse_mean(x))
    var = np.diag(cov.numpy())
    n_sq = D.ess_mean((x - mean.numpy()) ** 2)  # the ESS of the squares (HMC can be antithetic in x)
    assert np.all(np.abs(x.reshape(-1, d).var(0) - var) < 5 * var * np.sqrt(2 / n_sq))
    assert res.metric["mass_matrix"] == "dense" and res.diagnostics()["rhat_max"] < 1.1


def test_mlp_likelihood_equals_autograd():
    """The hand-written batched likelihood of stacked MLPs equals autograd through models.MLP (float64):
    Bernoulli = summed BCE on the logit, Gaussian = summed squared error / (2 sigma^2) + N log(sigma
    sqrt(2 pi))."""
    g = torch.Generator().manual_seed(8)
    widths = [3, 5, 4, 1]
    x = torch.randn(17, 3, generator=g, dtype=torch.float64)
    for kind, y in (("bernoulli", (torch.rand(17, generator=g) > 0.5).double()),
                    ("gaussian", torch.randn(17, generator=g, dtype=torch.float64))):
        lik, shapes = hmc.mlp_likelihood(widths, x, y, kind, noise_sd=0.7)
        flat = torch.randn(3, sum(math.prod(s) for s in shapes.values()), generator=g, dtype=torch.float64)
        nll, grad = lik(flat)
        for i in range(3):
            net = models.MLP(widths).double()
            torch.nn.utils.vector_to_parameters(flat[i], net.parameters())
            out = net(x)[:, 0]
            if kind == "bernoulli":
                ref = torch.nn.functional.binary_cross_entropy_with_logits(out, y, reduction="sum")
            else:
                ref = 0.5 * ((out - y) ** 2).sum() / 0.49 + 17 * math.log(0.7 * math.sqrt(2 * math.pi))
            ref.backward()
            torch.testing.assert_close(nll[i], ref.detach(), rtol=1e-12, atol=1e-12)
            gref = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            torch.testing.assert_close(grad[i], gref, rtol=1e-10, atol=1e-12)


def _two_modes():
    """A 1-D likelihood with two separated modes, exp(-L) = 0.3 N(-3, 0.2^2) + 0.7 N(3, 0.2^2) (up to a
    constant), and the prior N(0, 10^2): the posterior's mass at theta > 0 by quadrature."""
    def lik(theta):
        with torch.enable_grad():
            t = theta.detach().requires_grad_(True)
            z = t[:, 0]
            nll = -torch.logsumexp(torch.stack([math.log(0.3) - 0.5 * ((z + 3) / 0.2) ** 2,
                                                math.log(0.7) - 0.5 * ((z - 3) / 0.2) ** 2]), 0)
            (g,) = torch.autograd.grad(nll.sum(), t)
        return nll.detach(), g
    grid = torch.linspace(-8, 8, 200001, dtype=torch.float64)[:, None]
    logp = -lik(grid)[0] - 0.5 * grid[:, 0] ** 2 / 100
    w = torch.exp(logp - logp.max())
    return lik, float(w[grid[:, 0] > 0].sum() / w.sum())


def test_replica_exchange_recovers_the_weights_of_two_modes():
    """Plain HMC started in the light mode never leaves it; replica exchange (8 temperatures down to 1e-3)
    moves between the modes and puts the right mass in each: within 5 standard errors of a proportion
    with the bulk ESS of the indicator."""
    lik, mass_right = _two_modes()
    start = torch.full((4, 1), -3.0, dtype=torch.float64)
    plain = hmc.run_chains(hmc.with_prior(lik, 0.01), start, 100, 300, 5, seed=1, progress=False)
    assert bool((plain.draws < 0).all()), "a single chain stays in its mode"
    res = tempering.run_tempered(lik, 0.01, start, tempering.geometric_ladder(8, 1e-3), 100, 1500, 5,
                                 seed=2, progress=False)
    right = (res.draws[..., 0] > 0).double().numpy()
    n_eff = float(D.ess_bulk(right[..., None])[0])
    se = math.sqrt(mass_right * (1 - mass_right) / n_eff)
    assert abs(right.mean() - mass_right) < 5 * se, (right.mean(), mass_right, n_eff)
    d = res.diagnostics()
    assert all(0 < a < 1 for a in d["swap_accept"]) and min(d["round_trips"]) > 0
    json.dumps(d)
    with pytest.raises(ValueError, match="decrease strictly from 1"):
        tempering.run_tempered(lik, 0.01, start, torch.tensor([0.5, 0.1]), 1, 4, 2, progress=False)
