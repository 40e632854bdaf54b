"""The Laplace approximation (symlib.posteriors.laplace) against laplace-torch, closed forms and its own
sampling distribution. Everything is float64 and tiny: the claims are exact up to rounding."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from symlib import models, threads
from symlib import training as T
from symlib.posteriors import laplace as L
from symlib.posteriors.base import Setup

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # laplace-torch's dependencies warn about torch.jit on import
    from laplace import Laplace
    from laplace.curvature import CurvlinopsHessian

LAM = 0.7
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread (multithreaded LAPACK crawls on an oversubscribed CPU)."""
    with threads.single():
        yield


def _mlp():
    return models.MLP([4, 6, 3]).double()


def _mlp_data(n=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _stack(*nets):
    return {k: torch.stack([n.state_dict()[k].detach() for n in nets]) for k in nets[0].state_dict()}


def _loader(x, y, batch_size=10):
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _setup(arch, make, x, y, wd=1e-3):
    return Setup(
        arch=arch, make_model=make, x=x, y=y, recipe=T.Recipe(epochs=1, batch_size=8, lr=0.1, weight_decay=wd)
    )


# ----------------------------------------------------------------------------- full GGN / Hessian


def test_full_ggn_posterior_equals_laplace_torch():
    """Our H + lambda I and its inverse equal laplace-torch's full Laplace (all weights, full GGN,
    summed over the data). Tolerance 1e-6 relative: laplace-torch's curvlinops backend multiplies the
    GGN operator by a float32 identity, so its matrix carries float32 rounding (~1e-7)."""
    torch.manual_seed(0)
    net = _mlp()
    x, y = _mlp_data()
    la = Laplace(
        net, "classification", subset_of_weights="all", hessian_structure="full", prior_precision=LAM
    )
    la.fit(_loader(x, y))
    h, loss = L.full_curvature(_mlp, _stack(net), x, y)
    torch.testing.assert_close(h[0], la.H, rtol=1e-6, atol=1e-6)
    cov = torch.linalg.inv(h[0] + LAM * torch.eye(h.shape[-1], dtype=torch.float64))
    torch.testing.assert_close(cov, la.posterior_covariance, rtol=1e-5, atol=1e-6)
    assert float(loss[0]) == pytest.approx(float(la.loss), rel=1e-12)
    # the evidence in closed form (eigenvalues) equals laplace-torch's log det for every lambda
    eigs, theta = torch.linalg.eigvalsh(h[0]), torch.cat([p.reshape(-1) for p in net.parameters()]).detach()
    for lam in (0.01, LAM, 30.0):
        ours = L.log_marginal_likelihood(eigs, float(theta @ theta), -float(loss[0]), lam)
        assert float(ours) == pytest.approx(float(la.log_marginal_likelihood(torch.tensor(lam))), rel=1e-6)


def test_exact_hessian_equals_laplace_torch_hessian_backend():
    """hessian="full" is the exact Hessian of the summed cross-entropy (laplace-torch with curvlinops'
    Hessian backend; float32-identity tolerance as above); it differs from the GGN off the optimum."""
    torch.manual_seed(1)
    net = _mlp()
    x, y = _mlp_data(seed=1)
    la = Laplace(net, "classification", "all", "full", backend=CurvlinopsHessian)
    la.fit(_loader(x, y))
    h, _ = L.full_curvature(_mlp, _stack(net), x, y, hessian="full", chunk_size=7)
    torch.testing.assert_close(h[0], la.H, rtol=1e-6, atol=1e-6)
    ggn, _ = L.full_curvature(_mlp, _stack(net), x, y)
    assert (h[0] - ggn[0]).abs().max() > 1e-3  # an untrained network: the residual term is not zero


def test_optunet_fast_ggn_equals_laplace_torch():
    """The hand-written batched OptuNet GGN equals laplace-torch's full GGN of nn.Module OptuNet, mode by
    mode, and stacking modes changes nothing."""
    nets = [T.init_model(models.OptuNet, s).double() for s in (3, 4)]
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(4, 1, 28, 28, generator=g, dtype=torch.float64),
        torch.randint(0, 10, (4,), generator=g),
    )
    h, loss = L.full_curvature(models.OptuNet, _stack(*nets), x, y, arch="optunet", chunk_size=6)
    la = Laplace(nets[1], "classification", "all", "full", prior_precision=LAM)
    la.fit(_loader(x, y, 4))
    assert h.shape == (2, 392, 392)
    torch.testing.assert_close(h[1], la.H, rtol=1e-6, atol=1e-6)
    assert float(loss[1]) == pytest.approx(float(la.loss), rel=1e-12)
    one, _ = L.full_curvature(models.OptuNet, _stack(nets[0]), x, y, arch="optunet")
    torch.testing.assert_close(one[0], h[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h.transpose(1, 2), rtol=0, atol=1e-12)
    assert torch.linalg.eigvalsh(h).min() > -1e-10  # a GGN is positive semi-definite


def test_optunet_fast_exact_hessian_equals_laplace_torch_and_torch_func():
    """hessian="full" on OptuNet: the hand-written Hessian (GGN + residual, whose only non-zero second
    derivatives of the features are the conv-1 x conv-2 cross terms) equals laplace-torch's Hessian
    backend (float32-identity tolerance) and torch.func.hessian (to rounding)."""
    net = T.init_model(models.OptuNet, 11).double()
    g = torch.Generator().manual_seed(2)
    x, y = (
        torch.randn(3, 1, 28, 28, generator=g, dtype=torch.float64),
        torch.randint(0, 10, (3,), generator=g),
    )
    fast, _ = L.full_curvature(models.OptuNet, _stack(net), x, y, arch="optunet", hessian="full")
    la = Laplace(net, "classification", "all", "full", backend=CurvlinopsHessian)
    la.fit(_loader(x, y, 3))
    torch.testing.assert_close(fast[0], la.H, rtol=1e-6, atol=1e-6)
    slow, _ = L.full_curvature(models.OptuNet, _stack(net), x, y, arch="", hessian="full")
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)


def test_optunet_fast_ggn_equals_torch_func():
    """Same matrix as the generic path (vmap of jacrev over functional_call), to rounding."""
    net = T.init_model(models.OptuNet, 7).double()
    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randn(4, 1, 28, 28, generator=g, dtype=torch.float64),
        torch.randint(0, 10, (4,), generator=g),
    )
    fast, _ = L.full_curvature(models.OptuNet, _stack(net), x, y, arch="optunet")
    slow, _ = L.full_curvature(models.OptuNet, _stack(net), x, y, arch="")
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- last-layer KFAC


def test_kfac_equals_laplace_torch_last_layer_kron():
    """Kron factors, posterior precision (prior added to the Kronecker eigenvalues) and evidence equal
    laplace-torch's subset_of_weights="last_layer", hessian_structure="kron" (separate bias block; factors
    accumulated over several batches)."""
    torch.manual_seed(2)
    net = _mlp()
    x, y = _mlp_data(seed=2)
    la = Laplace(net, "classification", "last_layer", "kron", prior_precision=LAM)
    la.fit(_loader(x, y, 7))
    fac = L.kron_factors(_mlp, _stack(net), x, y, chunk_size=11)[0]
    (g_ref, a_ref), (g_bias,) = la.H_facs.kfacs
    torch.testing.assert_close(fac.g, g_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fac.a, a_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fac.g, g_bias, rtol=1e-12, atol=1e-12)
    post = L.KronPosterior(fac, LAM)
    torch.testing.assert_close(post.precision(), la.posterior_precision.to_matrix(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(post.mean(), la.mean, rtol=0, atol=0)
    ours = L.log_marginal_likelihood(
        post.curvature_eigenvalues(), float(post.mean() @ post.mean()), -fac.loss, LAM
    )
    assert float(ours) == pytest.approx(float(la.log_marginal_likelihood()), rel=1e-10)


@pytest.mark.parametrize("bias", ["separate", "augmented"])
def test_kfac_is_exact_for_one_example(bias):
    """With one data point, Lambda_1 (x) a_1 a_1^T is the exact last-layer GGN: the KFAC weight block (or
    the [W | b] block with augmented inputs (a, 1)) equals the corresponding block of the full GGN."""
    torch.manual_seed(3)
    net = _mlp()
    x, y = _mlp_data(1, seed=3)
    h, _ = L.full_curvature(_mlp, _stack(net), x, y)
    fac = L.kron_factors(_mlp, _stack(net), x, y, bias=bias)[0]
    post = L.KronPosterior(fac, LAM)
    n_ll = 6 * 3 + 3  # last layer: weight (3, 6) then bias (3,)
    exact = h[0, -n_ll:, -n_ll:]
    prec = post.precision() - LAM * torch.eye(n_ll, dtype=torch.float64)
    if bias == "separate":
        torch.testing.assert_close(prec[:18, :18], exact[:18, :18], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(prec[18:, 18:], exact[18:, 18:], rtol=1e-12, atol=1e-12)
    else:  # vec([W | b]) row-major -> [vec(W), b]
        order = torch.tensor([o * 7 + i for o in range(3) for i in range(6)] + [o * 7 + 6 for o in range(3)])
        torch.testing.assert_close(prec[order][:, order], exact, rtol=1e-12, atol=1e-12)


def test_kfac_is_an_approximation_for_many_examples():
    """Negative control of the test above: with 30 examples G (x) A differs from the exact block."""
    torch.manual_seed(3)
    net = _mlp()
    x, y = _mlp_data(30, seed=3)
    h, _ = L.full_curvature(_mlp, _stack(net), x, y)
    post = L.KronPosterior(L.kron_factors(_mlp, _stack(net), x, y)[0], LAM)
    kfac = post.precision()[:18, :18] - LAM * torch.eye(18, dtype=torch.float64)
    assert (kfac - h[0, -21:-3, -21:-3]).abs().max() > 1e-2


def test_kfac_factors_of_resnet18_equal_laplace_torch():
    """ResNet-18 (width 4, 100 classes, 32x32 images, BatchNorm in eval mode with non-trivial
    statistics): our last-layer factors equal laplace-torch's."""
    torch.manual_seed(4)
    net = models.randomize_batchnorm(models.ResNet18(num_classes=100, width=4)).double().eval()
    g = torch.Generator().manual_seed(4)
    x, y = (
        torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64),
        torch.randint(0, 100, (4,), generator=g),
    )
    la = Laplace(net, "classification", "last_layer", "kron", prior_precision=LAM)
    la.fit(_loader(x, y, 2))
    fac = L.kron_factors(lambda: models.ResNet18(num_classes=100, width=4), _stack(net), x, y, chunk_size=3)[
        0
    ]
    (g_ref, a_ref), _ = la.H_facs.kfacs
    torch.testing.assert_close(fac.g, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fac.a, a_ref, rtol=1e-10, atol=1e-12)


def test_resnet18_kron_samples_perturb_only_the_last_layer():
    """Paper-scale path on synthetic data: every sample is a full ResNet-18 state dict whose layers before
    the head (BatchNorm buffers included) are the base model's, whose head differs, and all finite."""
    make = lambda: models.ResNet18(num_classes=100, width=4)  # noqa: E731
    torch.manual_seed(5)
    nets = [models.randomize_batchnorm(make()).eval() for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 100, (4,), generator=g)
    setup = _setup("resnet18", make, x, y, wd=5e-4)
    base = _stack(*nets)
    ss = L.sample(setup, 2, 3, seed=1, base=base, progress=False)
    assert ss.hyper["structure"] == "kron" and ss.hyper["last_layer"] == "fc"
    for k, v in ss.params.items():
        assert v.shape == (6, *base[k].shape[1:]) and v.dtype == base[k].dtype
        ref = base[k].repeat_interleave(3, 0)
        if k.startswith("fc."):
            assert torch.isfinite(v).all() and (v != ref).all()
        else:
            assert torch.equal(v, ref), k
    json.dumps(ss.hyper), json.dumps(ss.diagnostics)


# ----------------------------------------------------------------------------- samples


def test_full_samples_have_the_posterior_covariance():
    """theta* + L^{-T} z has mean theta* and covariance (L L^T)^{-1}: with S = 20000 draws the whitened
    sample covariance L^T C L is I up to its sampling error (entries of sd ~ 1/sqrt(S) = 0.007; bound 0.05)
    and the whitened mean is 0 within 5/sqrt(S)."""
    torch.manual_seed(6)
    net = _mlp()
    x, y = _mlp_data(seed=6)
    base = _stack(net)
    ss = L.sample(_setup("mlp", _mlp, x, y), 1, 20000, seed=3, base=base, progress=False, prior_precision=LAM)
    flat = torch.cat([ss.params[k].reshape(20000, -1) for k, _ in net.named_parameters()], 1)
    mean = torch.cat([p.reshape(-1) for p in net.parameters()]).detach()
    h, _ = L.full_curvature(_mlp, base, x, y)
    chol = torch.linalg.cholesky(h[0] + LAM * torch.eye(h.shape[-1], dtype=torch.float64))
    w = (flat - mean) @ chol  # whitened: rows ~ N(0, I)
    assert w.mean(0).abs().max() < 5 / math.sqrt(20000)
    cov = w.T @ w / 20000
    assert (cov - torch.eye(cov.shape[0], dtype=torch.float64)).abs().max() < 0.05


@pytest.mark.parametrize("bias", ["separate", "augmented"])
def test_kron_samples_have_the_kron_covariance(bias):
    """Last-layer KFAC draws: the whitened covariance of the head is I (same tolerance reasoning); the
    layers before the head are the base model's."""
    torch.manual_seed(7)
    net = _mlp()
    x, y = _mlp_data(seed=7)
    base = _stack(net)
    ss = L.sample(
        _setup("mlp", _mlp, x, y),
        1,
        20000,
        seed=4,
        base=base,
        progress=False,
        structure="kron",
        prior_precision=LAM,
        bias=bias,
    )
    assert ss.hyper["bias"] == bias
    post = L.KronPosterior(L.kron_factors(_mlp, base, x, y, bias=bias)[0], LAM)
    w_s, b_s = ss.params["2.weight"], ss.params["2.bias"]
    if bias == "separate":
        flat = torch.cat([w_s.reshape(20000, -1), b_s], 1)
    else:  # vec([W | b])
        flat = torch.cat([w_s, b_s[..., None]], 2).reshape(20000, -1)
    w = (flat - post.mean()) @ torch.linalg.cholesky(post.precision())
    cov = w.T @ w / 20000
    assert w.mean(0).abs().max() < 5 / math.sqrt(20000)
    assert (cov - torch.eye(cov.shape[0], dtype=torch.float64)).abs().max() < 0.05
    assert torch.equal(ss.params["0.weight"], base["0.weight"].expand(20000, -1, -1))


def test_optunet_sample_set():
    """OptuNet, 2 modes x 3 samples: full state dicts, mode-major, finite, seeded, default prior N * wd,
    JSON-able manifest entries. (The nearest-mode check uses a strong prior: around these untrained
    networks on 20 random images the default posterior, lambda = 0.004, is wider than the gap between
    the modes.)"""
    g = torch.Generator().manual_seed(8)
    x, y = torch.randn(20, 1, 28, 28, generator=g), torch.randint(0, 10, (20,), generator=g)
    setup = _setup("optunet", models.OptuNet, x, y, wd=2e-4)
    base = T.init_params(models.OptuNet, [0, 1])
    ss = L.sample(setup, 2, 3, seed=0, base=base, progress=False, base_seeds=[0, 1])
    again = L.sample(setup, 2, 3, seed=0, base=base, progress=False)
    tight = L.sample(setup, 2, 3, seed=1, base=base, progress=False, prior_precision=1e4)
    assert (
        ss.hyper["prior_precision"] == pytest.approx(20 * 2e-4) and ss.hyper["prior_source"] == "weight_decay"
    )
    assert ss.hyper["subset_of_weights"] == "all" and ss.hyper["hessian_structure"] == "full"
    assert ss.base_seeds == [0, 1] and ss.n_samples == 6
    for k in base:
        v = ss.params[k]
        assert v.shape == (6, *base[k].shape[1:]) and v.dtype == base[k].dtype and torch.isfinite(v).all()
        assert torch.equal(v, again.params[k])
        d = (tight.params[k][:, None] - base[k][None]).flatten(2).norm(dim=-1)  # (sample, mode)
        assert (d.argmin(1) == ss.modes).all() and (d.min(1).values > 0).all()
    json.dumps(ss.hyper), json.dumps(ss.diagnostics)


# ----------------------------------------------------------------------------- marginal likelihood


def test_marglik_tuning_finds_the_maximum():
    """The tuned lambda maximises the closed-form evidence: the derivative changes sign around it, it
    beats a fine grid, and it satisfies MacKay's gamma(lambda) = lambda ||theta*||^2."""
    torch.manual_seed(9)
    net = _mlp()
    x, y = _mlp_data(seed=9)
    h, loss = L.full_curvature(_mlp, _stack(net), x, y)
    eigs = torch.linalg.eigvalsh(h[0])
    theta = torch.cat([p.reshape(-1) for p in net.parameters()]).detach()
    sq = float(theta @ theta)
    lam = L.tune_prior_precision(eigs, sq)
    f = lambda v: float(L.log_marginal_likelihood(eigs, sq, 0.0, v))  # noqa: E731
    assert f(lam) > f(lam * 1.001) and f(lam) > f(lam / 1.001)
    grid = torch.logspace(-4, 4, 4001, dtype=torch.float64)
    assert f(lam) >= float(L.log_marginal_likelihood(eigs, sq, 0.0, grid).max()) - 1e-12
    assert float((eigs / (eigs + lam)).sum()) == pytest.approx(lam * sq, rel=1e-8)
    ss = L.sample(_setup("mlp", _mlp, x, y), 1, 2, base=_stack(net), progress=False, tune="marglik")
    assert ss.diagnostics["prior_precision"][0] == pytest.approx(lam, rel=1e-9)
    assert ss.hyper["prior_source"] == "marglik"
    # last-layer KFAC: the same condition on the Kronecker eigenvalues (and the bias block's)
    kr = L.sample(
        _setup("mlp", _mlp, x, y), 1, 2, base=_stack(net), progress=False, tune="marglik", structure="kron"
    )
    post = L.KronPosterior(L.kron_factors(_mlp, _stack(net), x, y)[0], 1.0)
    e, sq_ll = post.curvature_eigenvalues(), float(post.mean() @ post.mean())
    lam_k = kr.diagnostics["prior_precision"][0]
    assert float((e / (e + lam_k)).sum()) == pytest.approx(lam_k * sq_ll, rel=1e-8)


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_clear_errors():
    torch.manual_seed(10)
    x, y = _mlp_data(seed=10)
    setup = _setup("mlp", _mlp, x, y)
    base = _stack(_mlp())
    with pytest.raises(ValueError, match="trained networks: pass base="):
        L.sample(setup, 1, 2, progress=False)
    other = _stack(models.MLP([4, 5, 3]).double())
    with pytest.raises(ValueError, match="shape"):
        L.sample(setup, 1, 2, base=other, progress=False)
    with pytest.raises(ValueError, match="not 'optunet' networks"):
        L.sample(_setup("optunet", models.OptuNet, x, y), 1, 2, base=base, progress=False)
    for lam in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="prior_precision must be a finite positive number"):
            L.sample(setup, 1, 2, base=base, progress=False, prior_precision=lam)
    with pytest.raises(ValueError, match="weight_decay > 0"):
        L.sample(_setup("mlp", _mlp, x, y, wd=0.0), 1, 2, base=base, progress=False)
    with pytest.raises(ValueError, match="needs structure='full'"):
        L.sample(setup, 1, 2, base=base, progress=False, structure="kron", hessian="full")
    with pytest.raises(ValueError, match="structure must be one of"):
        L.sample(setup, 1, 2, base=base, progress=False, structure="diag")
    huge = {k: v * 1e200 for k, v in base.items()}  # finite weights whose logits overflow
    with pytest.raises(FloatingPointError, match="GGN of mode 0 is not finite"):
        L.sample(setup, 1, 2, base=huge, progress=False)
    nan = {k: v.clone() for k, v in base.items()}
    nan["0.weight"][0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        L.sample(setup, 1, 2, base=nan, progress=False)
