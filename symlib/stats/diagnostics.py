r"""Convergence diagnostics of Markov chains, ArviZ's definitions (book: chapters "A gentle example" and
"Table 1"; Vehtari, Gelman, Simpson, Carpenter & Bürkner 2021).

Draws are arrays ``(C, S, ...)``: ``C`` chains of ``S`` draws, any trailing parameter axes; every
function works on all parameters at once (vectorised over the trailing axes). The values equal
ArviZ's (``arviz_stats.base.array_stats``, the computational core of ArviZ 1.x) to rounding, odd draw
counts included (tested to 1e-10); unlike ArviZ, :func:`rhat` is also defined for a single chain (its
two halves), which is how a chain is judged on its own.

* :func:`rhat`: the rank-normalised split :math:`\hat R`, the larger of the *bulk* value (split chains,
  rank-normalised) and the *tail* value (the same on the folded draws :math:`|x - \mathrm{median}|`, the
  median of the split draws), ArviZ's default ``method="rank"``; :func:`rhat_classic` is the split
  :math:`\hat R` of BDA3 without ranks.
* :func:`ess`: the multi-chain effective sample size of the draws as given, Stan's estimator (Geyer's
  initial positive then monotone sequence, exactly as ArviZ/Stan implement it);
  :func:`ess_bulk` on rank-normalised split chains, :func:`ess_tail` the smaller of the ESS of the
  indicators :math:`x \le q_{0.05}` and :math:`x \le q_{0.95}` (split chains),
  :func:`ess_mean` on split chains; :func:`mcse_mean` the Monte-Carlo standard error of the mean.

Formulas (Vehtari et al. 2021, §3-4). Splitting a chain of ``S`` draws keeps its first and last
``S // 2`` draws as two chains (the middle draw of an odd chain is dropped). With ``n`` draws per chain,
chain means :math:`\bar x_c` and variances :math:`s_c^2`: :math:`W = \overline{s_c^2}`,
:math:`B / n = \mathrm{var}_c(\bar x_c)` (ddof 1), :math:`\widehat{\mathrm{var}}^+ = \tfrac{n-1}{n} W + B/n`,
:math:`\hat R = \sqrt{\widehat{\mathrm{var}}^+ / W}`. Rank normalisation replaces every draw by
:math:`\Phi^{-1}((r - 3/8) / (CS + 1/4))` with :math:`r` its rank among all draws (average ranks for
ties). The autocorrelation at lag :math:`t` pools the chains' autocovariances :math:`\hat\gamma_{c,t}`
(biased, FFT): :math:`\hat\rho_t = 1 - (W - \overline{\hat\gamma_{c,t}}) / \widehat{\mathrm{var}}^+`,
:math:`\hat\rho_0 = 1`. Geyer's pairs :math:`P_k = \hat\rho_{2k} + \hat\rho_{2k+1}` are summed while
positive (lags below ``n - 2``), then made non-increasing; the even lag of the pair that stopped the
sum is added once when positive (Stan's refinement), so
:math:`\hat\tau = -1 + 2 \sum_{t \le t_{max}} \hat\rho_t + \hat\rho_{t_{max}+1}`, floored at
:math:`1 / \log_{10}(CS)`, and :math:`\mathrm{ESS} = C S / \hat\tau`.

Symmetry-aware diagnostics (raw weights, canonical forms, invariant functionals) build on these in
:mod:`symlib.stats.convergence`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import special, stats

TAIL_PROB = 0.05
"""The tail ESS's quantiles: :math:`q_{0.05}` and :math:`q_{0.95}` (Vehtari et al. 2021, ArviZ)."""


def _as_chains(draws, name: str = "draws", min_draws: int = 4) -> np.ndarray:
    x = np.asarray(draws, dtype=np.float64)
    if x.ndim < 2:
        raise ValueError(f"{name} must be shaped (chains, draws, ...), got shape {x.shape}")
    if x.shape[1] < min_draws:
        raise ValueError(
            f"{name} need at least {min_draws} draws per chain (split chains of >= 2), got {x.shape[1]}"
        )
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contain non-finite values; diagnose finite draws only")
    return x


def split_chains(x: np.ndarray) -> np.ndarray:
    """``(C, S, ...) -> (2C, S // 2, ...)``: the first and the last ``S // 2`` draws of every chain."""
    half = x.shape[1] // 2
    return np.concatenate([x[:, :half], x[:, x.shape[1] - half :]], axis=0)


def rank_normalize(x: np.ndarray) -> np.ndarray:
    r"""Normal scores of the pooled ranks, per parameter: :math:`\Phi^{-1}((r - 3/8) / (CS + 1/4))`."""
    c, s = x.shape[:2]
    flat = x.reshape(c * s, -1)
    r = stats.rankdata(flat, axis=0, method="average")
    return special.ndtri((r - 0.375) / (c * s + 0.25)).reshape(x.shape)


def _rhat_basic(x: np.ndarray) -> np.ndarray:
    """:math:`\\hat R` of chains ``x`` as given (no split, no ranks)."""
    n = x.shape[1]
    w = x.var(axis=1, ddof=1).mean(axis=0)
    b_over_n = x.mean(axis=1).var(axis=0, ddof=1)
    var_plus = (n - 1) / n * w + b_over_n
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.sqrt(var_plus / w)
    # constant draws: identical chains give 1, different constants never mix
    return np.where(w > 0, r, np.where(b_over_n > 0, np.inf, 1.0))


def rhat_classic(draws) -> np.ndarray:
    r"""Split :math:`\hat R` (BDA3), per parameter: ``(C, S, ...) -> (...)``."""
    return _rhat_basic(split_chains(_as_chains(draws)))


def rhat_bulk(draws) -> np.ndarray:
    r"""Bulk :math:`\hat R`: split chains, rank-normalised (ArviZ ``method="z_scale"``)."""
    return _rhat_basic(rank_normalize(split_chains(_as_chains(draws))))


def rhat_tail(draws) -> np.ndarray:
    r"""Tail :math:`\hat R`: split chains folded around their median, rank-normalised (ArviZ
    ``method="folded"``)."""
    split = split_chains(_as_chains(draws))
    folded = np.abs(split - np.median(split.reshape(-1, *split.shape[2:]), axis=0))
    return _rhat_basic(rank_normalize(folded))


def rhat(draws) -> np.ndarray:
    r"""Rank-normalised split :math:`\hat R` (Vehtari et al. 2021): the larger of :func:`rhat_bulk` and
    :func:`rhat_tail` (ArviZ's default ``method="rank"``), per parameter: ``(C, S, ...) -> (...)``.
    One chain (``C = 1``) is judged on its two halves."""
    return np.maximum(rhat_bulk(draws), rhat_tail(draws))


def _autocov(x: np.ndarray) -> np.ndarray:
    """Biased autocovariance of every chain along axis 1, by FFT: ``(C, S, ...)``."""
    s = x.shape[1]
    xc = x - x.mean(axis=1, keepdims=True)
    nfft = 1 << int(np.ceil(np.log2(2 * s)))
    f = np.fft.rfft(xc, n=nfft, axis=1)
    return np.fft.irfft(f * np.conj(f), n=nfft, axis=1)[:, :s] / s


def _tau(rho: np.ndarray, n_draws: int) -> np.ndarray:
    """Stan's / ArviZ's integrated autocorrelation time from autocorrelations ``rho (S, P)`` (``rho[0]`` is
    ignored and taken as 1): the initial positive sequence of Geyer's pairs, then the initial monotone
    one, written as ArviZ's loop over lags, vectorised over the ``P`` parameters."""
    s, p = rho.shape
    rt = np.zeros_like(rho)
    rt[0] = 1.0
    if s > 1:
        rt[1] = rho[1]
    even = np.ones(p)
    odd = rho[1].copy() if s > 1 else np.zeros(p)
    t_end = np.ones(p, dtype=np.int64)  # the loop's t when it stops, per parameter
    alive = np.ones(p, dtype=bool)
    t = 1
    while t < n_draws - 3:
        alive &= (even + odd) > 0
        if not alive.any():
            break
        e, o = rho[t + 1], rho[t + 2]
        even, odd = np.where(alive, e, even), np.where(alive, o, odd)
        keep = alive & (e + o >= 0)
        rt[t + 1] = np.where(keep, e, rt[t + 1])
        rt[t + 2] = np.where(keep, o, rt[t + 2])
        t_end = np.where(alive, t + 2, t_end)
        t += 2
    max_t = t_end - 2
    cols = np.arange(p)
    last = np.minimum(max_t + 1, s - 1)
    rt[last, cols] = np.where(even > 0, even, rt[last, cols])
    # initial monotone sequence: a pair larger than the one before takes the previous pair's mean
    t = 1
    while t + 2 < s:
        on = t <= max_t - 2
        if not on.any():
            break
        prev = rt[t - 1] + rt[t]
        bump = on & (rt[t + 1] + rt[t + 2] > prev)
        rt[t + 1] = np.where(bump, prev / 2, rt[t + 1])
        rt[t + 2] = np.where(bump, prev / 2, rt[t + 2])
        t += 2
    lags = np.arange(s)[:, None]
    weight = np.where(lags <= max_t[None], 2.0, np.where(lags == max_t[None] + 1, 1.0, 0.0))
    return -1.0 + (weight * rt).sum(axis=0)


def ess(draws) -> np.ndarray:
    """Multi-chain effective sample size of the draws as given (no split, no ranks): ``(...)``."""
    x = _as_chains(draws, min_draws=2)
    c, s = x.shape[:2]
    flat = x.reshape(c, s, -1)
    acov = _autocov(flat)  # (C, S, P)
    w = acov[:, 0].mean(axis=0) * s / (s - 1)  # mean within-chain variance (ddof 1)
    var_plus = w * (s - 1) / s
    if c > 1:
        var_plus = var_plus + flat.mean(axis=1).var(axis=0, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (w - acov.mean(axis=0)) / var_plus  # (S, P)
    n = c * s
    constant = (flat.max(axis=(0, 1)) - flat.min(axis=(0, 1))) < np.finfo(float).resolution
    rho = np.where(constant[None], 0.0, rho)
    tau = np.maximum(_tau(rho, s), 1.0 / np.log10(n))
    return np.where(constant, float(n), n / tau).reshape(x.shape[2:])


def ess_bulk(draws) -> np.ndarray:
    """Bulk ESS (Vehtari et al. 2021): :func:`ess` of the rank-normalised split chains."""
    return ess(rank_normalize(split_chains(_as_chains(draws))))


def ess_mean(draws) -> np.ndarray:
    """ESS of the mean: :func:`ess` of the split chains (ArviZ ``method="mean"``)."""
    return ess(split_chains(_as_chains(draws)))


def ess_tail(draws, prob: float = TAIL_PROB) -> np.ndarray:
    r"""Tail ESS (Vehtari et al. 2021): the smaller of the ESS of the indicators :math:`x \le q_{p}` and
    :math:`x \le q_{1-p}` on split chains, the quantiles of all draws (numpy's linear rule)."""
    x = _as_chains(draws)
    flat = x.reshape(*x.shape[:2], -1)
    out = []
    for q in sorted((prob, 1.0 - prob)):
        level = np.quantile(flat.reshape(-1, flat.shape[2]), q, axis=0)
        out.append(ess(split_chains((flat <= level).astype(np.float64))))
    return np.minimum(*out).reshape(x.shape[2:])


def mcse_mean(draws) -> np.ndarray:
    r"""Monte-Carlo standard error of the posterior mean: :math:`\mathrm{sd} / \sqrt{\mathrm{ESS}_{mean}}`."""
    x = _as_chains(draws)
    return x.reshape(-1, *x.shape[2:]).std(axis=0, ddof=1) / np.sqrt(ess_mean(x))


def summary(draws) -> dict[str, Any]:
    """JSON-able summary over all parameters of ``(C, S, ...)`` draws: max/median R-hat (rank-normalised
    split), min/median bulk and tail ESS, and the number of parameters."""
    x = _as_chains(draws)
    x = x.reshape(x.shape[0], x.shape[1], -1)
    r, e, t = rhat(x), ess_bulk(x), ess_tail(x)
    return {
        "n_chains": int(x.shape[0]),
        "n_draws": int(x.shape[1]),
        "n_params": int(x.shape[2]),
        "rhat_max": float(np.max(r)),
        "rhat_median": float(np.median(r)),
        "ess_bulk_min": float(np.min(e)),
        "ess_bulk_median": float(np.median(e)),
        "ess_tail_min": float(np.min(t)),
    }
