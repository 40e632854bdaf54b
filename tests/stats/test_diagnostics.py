"""MCMC diagnostics: ArviZ's values to 1e-10 (odd draw counts and ties included), closed forms of R-hat and
ESS, a one-parameter-at-a-time implementation of the same formulas, and bad input named."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from symlib.stats import diagnostics as D

az = pytest.importorskip("arviz_stats.base").array_stats  # ArviZ 1.x's computational core (test-only)


def _draws(c, s, k, kind, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((c, s, k))
    if kind == "ar":  # strongly autocorrelated: Geyer's sequence runs long
        for t in range(1, s):
            x[:, t] = 0.9 * x[:, t - 1] + 0.4 * x[:, t]
    elif kind == "shifted":  # chains disagree and drift: R-hat far above 1
        x += 0.7 * np.arange(c)[:, None, None] + np.linspace(0, 1, s)[None, :, None]
    elif kind == "ties":  # rounded: average ranks
        x = np.round(2 * x) / 2
    elif kind == "antithetic":  # negative lag-1 autocorrelation: the sum stops early
        x[:, 1::2] = -0.8 * x[:, 0:-1:2][:, : x[:, 1::2].shape[1]] + 0.2 * x[:, 1::2]
    return x


def _close(ours, theirs):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    finite = np.isfinite(theirs)
    assert np.array_equal(finite, np.isfinite(ours))
    np.testing.assert_allclose(ours[finite], theirs[finite], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["iid", "ar", "shifted", "ties", "antithetic"])
@pytest.mark.parametrize(("c", "s"), [(2, 4), (2, 5), (4, 25), (3, 51), (8, 100), (4, 201)])
def test_rhat_and_ess_equal_arviz(kind, c, s):
    """Rank-normalised split R-hat (and its bulk, tail and classic parts), bulk / tail / mean ESS and the
    MCSE of the mean equal arviz-stats' array functions to 1e-10, for odd draw counts too (the split drops
    the middle draw; the tail R-hat folds around the median of the split draws)."""
    x = _draws(c, s, 5, kind, seed=c * 1000 + s)
    kw = {"chain_axis": 0, "draw_axis": 1}
    _close(D.rhat(x), az.rhat(x, method="rank", **kw))
    _close(D.rhat_bulk(x), az.rhat(x, method="z_scale", **kw))
    _close(D.rhat_tail(x), az.rhat(x, method="folded", **kw))
    _close(D.rhat_classic(x), az.rhat(x, method="split", **kw))
    _close(D.ess_bulk(x), az.ess(x, method="bulk", **kw))
    _close(D.ess_tail(x), az.ess(x, method="tail", prob=0.05, **kw))
    _close(D.ess_mean(x), az.ess(x, method="mean", **kw))
    _close(D.ess(x), az.ess(x, method="identity", **kw))
    _close(D.mcse_mean(x), az.mcse(x, method="mean", **kw))


def test_one_chain_is_its_two_halves():
    """ArviZ has no R-hat for one chain; ours is the R-hat of its two halves as chains of their own, and its
    ESS is ArviZ's single-chain ESS."""
    x = _draws(1, 61, 3, "ar", 3)
    halves = np.stack([x[0, :30], x[0, 31:]])  # split: first 30, last 30
    pooled_ranks = D.rank_normalize(halves)
    np.testing.assert_allclose(D.rhat_bulk(x), D._rhat_basic(pooled_ranks), rtol=1e-12)
    _close(D.ess_bulk(x), az.ess(x, method="bulk", chain_axis=0, draw_axis=1))


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
    order 1 / (C S) << 0.01); chains stuck at +-2 (two modes) give R-hat >> 1; a trend within chains is
    caught by splitting them."""
    x = np.random.default_rng(0).standard_normal((4, 1000, 20))
    assert np.all(np.abs(D.rhat(x) - 1) < 0.01) and np.all(np.abs(D.rhat_classic(x) - 1) < 0.01)
    stuck = x + np.array([-2.0, -2.0, 2.0, 2.0])[:, None, None]
    assert np.all(D.rhat(stuck) > 1.5) and np.all(D.rhat_classic(stuck) > 1.5)
    trend = x + np.linspace(-2, 2, 1000)[None, :, None]
    assert np.all(D.rhat_classic(trend) > 1.3) and np.all(D.rhat(trend[:1]) > 1.3)


def test_ess_of_iid_and_ar1_chains():
    """ESS of n i.i.d. draws ~ n; of a stationary AR(1) chain with coefficient rho, the closed form
    n (1 - rho) / (1 + rho). Averaged over 20 independent parameters (each estimate has a relative
    error of a few percent), within 8 %; the tail ESS of i.i.d. draws ~ n too."""
    n = 4 * 2000
    iid = np.random.default_rng(1).standard_normal((4, 2000, 20))
    assert abs(D.ess_bulk(iid).mean() / n - 1) < 0.08 and abs(D.ess_tail(iid).mean() / n - 1) < 0.1
    for rho in (0.5, 0.8):
        x = _ar1(4, 2000, 20, rho, 2)
        expect = n * (1 - rho) / (1 + rho)
        assert abs(D.ess(x).mean() / expect - 1) < 0.08
        assert abs(D.ess_bulk(x).mean() / expect - 1) < 0.08


# --- the same formulas, written one parameter at a time with plain loops (Stan's estimator)


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
    """Stan's ESS (``stan::analyze::compute_effective_sample_size``), transcribed with scalar loops: pairs
    of autocorrelations summed while positive, the even lag of the pair that stops the sum counted once,
    the pairs made non-increasing."""
    m, n = len(chains), len(chains[0])
    acov = []
    for c in chains:
        d = c - c.mean()
        acov.append(np.array([np.sum(d[: n - t] * d[t:]) / n for t in range(n)]))
    acov = np.array(acov)
    w = acov[:, 0].mean() * n / (n - 1)
    var_plus = w * (n - 1) / n + (np.var([c.mean() for c in chains], ddof=1) if m > 1 else 0.0)
    rho = [1.0] + [1 - (w - acov[:, t].mean()) / var_plus for t in range(1, n)]
    kept = [0.0] * n
    kept[0], kept[1] = 1.0, rho[1]
    even, odd, t = 1.0, rho[1], 1
    while t < n - 3 and even + odd > 0:
        even, odd = rho[t + 1], rho[t + 2]
        if even + odd >= 0:
            kept[t + 1], kept[t + 2] = even, odd
        t += 2
    max_t = t - 2
    if even > 0:
        kept[max_t + 1] = even
    t = 1
    while t <= max_t - 2:
        if kept[t + 1] + kept[t + 2] > kept[t - 1] + kept[t]:
            kept[t + 1] = kept[t + 2] = (kept[t - 1] + kept[t]) / 2
        t += 2
    tau = -1 + 2 * sum(kept[: max_t + 1]) + kept[max_t + 1]
    return m * n / max(tau, 1 / math.log10(m * n))


def test_diagnostics_match_a_loop_implementation():
    """Vectorised R-hat (classic, rank-normalised bulk/tail) and ESS (plain and bulk) equal a
    straightforward one-parameter-at-a-time implementation of the same formulas (float64 rounding)."""
    x = _ar1(3, 101, 4, 0.6, 5) + np.array([0.0, 0.3, -0.2])[:, None, None]  # odd length: split drops one
    for j in range(x.shape[2]):
        col = x[:, :, j]
        split = _naive_split(col)
        assert D.rhat_classic(x)[j] == pytest.approx(_naive_rhat_basic(split), rel=1e-12)
        bulk = _naive_rhat_basic(_naive_rank_normal(split))
        med = np.median(np.concatenate(split))
        tail = _naive_rhat_basic(_naive_rank_normal([np.abs(c - med) for c in split]))
        assert D.rhat(x)[j] == pytest.approx(max(bulk, tail), rel=1e-12)
        assert D.ess(x)[j] == pytest.approx(_naive_ess(list(col)), rel=1e-9)
        assert D.ess_bulk(x)[j] == pytest.approx(_naive_ess(_naive_rank_normal(split)), rel=1e-9)


def test_diagnostics_reject_bad_draws():
    with pytest.raises(ValueError, match="chains, draws"):
        D.rhat(np.zeros(10))
    with pytest.raises(ValueError, match="non-finite"):
        D.ess(np.full((2, 10), np.nan))
    with pytest.raises(ValueError, match="at least 4 draws"):
        D.rhat(np.zeros((2, 3)))
    # constant draws: identical chains agree, different constants never mix, ESS is the number of draws
    assert D.rhat(np.ones((2, 10)))[()] == 1.0 and math.isinf(D.rhat(np.array([[0.0] * 10, [1.0] * 10])))
    assert D.ess_bulk(np.ones((2, 10)))[()] == 20.0
