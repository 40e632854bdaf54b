"""Full-batch HMC and its diagnostics: the integrator's geometry, moments of a known Gaussian, R-hat and
ESS against closed forms and against a loop-by-loop implementation of the same formulas."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from scipy import special, stats

from symlib import models
from symlib import training as T
from symlib.posteriors import hmc
from symlib.posteriors.base import Setup
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


def _draws_iid(c, s, k, seed):
    return np.random.default_rng(seed).standard_normal((c, s, k))


def _ar1(c, s, k, rho, seed):
    rng = np.random.default_rng(seed)
    x = np.empty((c, s, k))
    x[:, 0] = rng.standard_normal((c, k))
    e = rng.standard_normal((c, s, k)) * math.sqrt(1 - rho**2)
    for t in range(1, s):
        x[:, t] = rho * x[:, t - 1] + e[:, t]
    return x


def test_rhat_is_one_for_iid_chains_and_large_for_separated_modes():
    """Identical distributions in every chain give R-hat ~ 1 (4 x 1000 i.i.d. draws: sampling noise of
    order 1 / (C S) << 0.01); chains stuck at +-2 (two modes) give R-hat >> 1."""
    x = _draws_iid(4, 1000, 20, 0)
    assert np.all(np.abs(D.rhat(x) - 1) < 0.01) and np.all(np.abs(D.rhat_classic(x) - 1) < 0.01)
    stuck = x + np.array([-2.0, -2.0, 2.0, 2.0])[:, None, None]
    assert np.all(D.rhat(stuck) > 1.5) and np.all(D.rhat_classic(stuck) > 1.5)
    # a trend within chains is caught by splitting them
    trend = x + np.linspace(-2, 2, 1000)[None, :, None]
    assert np.all(D.rhat_classic(trend) > 1.3)


def test_ess_of_iid_and_ar1_chains():
    """ESS of n i.i.d. draws ~ n; of a stationary AR(1) chain with coefficient rho, the closed form
    n (1 - rho) / (1 + rho). Averaged over 20 independent parameters (each estimate has a relative
    error of a few percent), within 8 %."""
    n = 4 * 2000
    iid = D.ess_bulk(_draws_iid(4, 2000, 20, 1))
    assert abs(iid.mean() / n - 1) < 0.08
    for rho in (0.5, 0.8):
        x = _ar1(4, 2000, 20, rho, 2)
        expect = n * (1 - rho) / (1 + rho)
        assert abs(D.ess(x).mean() / expect - 1) < 0.08
        assert abs(D.ess_bulk(x).mean() / expect - 1) < 0.08


# --- the same formulas, written one parameter at a time with plain loops


def _naive_rhat_basic(chains):  # chains: list of 1-D arrays
    n = len(chains[0])
    means = [float(np.mean(c)) for c in chains]
    w = np.mean([np.sum((c - m) ** 2) / (n - 1) for c, m in zip(chains, means, strict=True)])
    grand = np.mean(means)
    b_over_n = np.sum([(m - grand) ** 2 for m in means]) / (len(chains) - 1)
    return math.sqrt(((n - 1) / n * w + b_over_n) / w)


def _naive_split(x2d):
    half = x2d.shape[1] // 2
    return [row[:half] for row in x2d] + [row[-half:] for row in x2d]


def _naive_rank_normal(chains):
    allv = np.concatenate(chains)
    r = stats.rankdata(allv)
    z = special.ndtri((r - 0.375) / (len(allv) + 0.25))
    out, i = [], 0
    for c in chains:
        out.append(z[i : i + len(c)])
        i += len(c)
    return out


def _naive_ess(chains):
    m, n = len(chains), len(chains[0])
    acov = []
    for c in chains:
        d = c - c.mean()
        acov.append(np.array([np.sum(d[: n - t] * d[t:]) / n for t in range(n)]))
    acov = np.array(acov)
    w = acov[:, 0].mean() * n / (n - 1)
    var_plus = w * (n - 1) / n + (np.var([c.mean() for c in chains], ddof=1) if m > 1 else 0.0)
    rho = 1 - (w - acov.mean(0)) / var_plus
    pairs, prev = [], math.inf
    for k in range(n // 2):
        pk = rho[2 * k] + rho[2 * k + 1]
        if pk <= 0:
            break
        prev = min(prev, pk)
        pairs.append(prev)
    tau = max(-1 + 2 * sum(pairs), 1 / math.log10(m * n))
    return m * n / tau


def test_diagnostics_match_a_loop_implementation():
    """Vectorised R-hat (classic, rank-normalised bulk/tail) and ESS (plain and bulk) equal a
    straightforward one-parameter-at-a-time implementation of the same formulas (float64 rounding)."""
    x = _ar1(3, 101, 4, 0.6, 5) + np.array([0.0, 0.3, -0.2])[:, None, None]  # odd length: split drops one
    for j in range(x.shape[2]):
        col = x[:, :, j]
        split = _naive_split(col)
        assert D.rhat_classic(x)[j] == pytest.approx(_naive_rhat_basic(split), rel=1e-12)
        bulk = _naive_rhat_basic(_naive_rank_normal(split))
        med = np.median(col)
        tail = _naive_rhat_basic(_naive_rank_normal(_naive_split(np.abs(col - med))))
        assert D.rhat(x)[j] == pytest.approx(max(bulk, tail), rel=1e-12)
        assert D.ess(x)[j] == pytest.approx(_naive_ess(list(col)), rel=1e-9)
        assert D.ess_bulk(x)[j] == pytest.approx(_naive_ess(_naive_rank_normal(split)), rel=1e-9)


def test_diagnostics_reject_bad_draws():
    with pytest.raises(ValueError, match="chains, draws"):
        D.rhat(np.zeros(10))
    with pytest.raises(ValueError, match="non-finite"):
        D.ess(np.full((2, 10), np.nan))


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
    out = hmc.sample(s, 2, 4, seed=0, progress=False, n_warmup=4, n_leapfrog=2, chunk=32)
    assert out.method == "hmc" and out.n_samples == 8
    assert set(out.params) == set(T.OPTUNET_SHAPES)
    assert all(torch.isfinite(v).all() for v in out.params.values())
    d = json.loads(json.dumps(out.diagnostics))
    assert len(d["accept_prob"]) == 2 and d["n_grad"] >= (4 + 4) * 2
    assert out.hyper["prior_precision"] == pytest.approx(48 * 2e-4)


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
