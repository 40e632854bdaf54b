r"""Convergence diagnostics of Markov chains, with ArviZ's conventions (book: chapter "Table 1").

Draws are arrays ``(C, S, ...)``: ``C`` chains of ``S`` draws, any trailing parameter axes; every
function works on all parameters at once (vectorised over the trailing axes).

* :func:`rhat`: the rank-normalised split :math:`\hat R` of Vehtari et al. (2021), the larger of the
  *bulk* value (split chains, rank-normalised) and the *tail* value (the same on the folded draws
  :math:`|x - \mathrm{median}(x)|`), ArviZ's default ``method="rank"``; :func:`rhat_classic` is the
  split :math:`\hat R` of Gelman et al. (BDA3) without ranks.
* :func:`ess_bulk`: the bulk effective sample size, :func:`ess` on rank-normalised split chains;
  :func:`ess`: the multi-chain ESS with Geyer's initial monotone sequence estimator.

Formulas (Vehtari et al. 2021, §3-4). Splitting a chain of ``S`` draws keeps its first and last
``S // 2`` draws as two chains. With ``n`` draws per chain, chain means :math:`\bar x_c`, chain variances
:math:`s_c^2`: :math:`W = \overline{s_c^2}`, :math:`B / n = \mathrm{var}_c(\bar x_c)` (ddof 1),
:math:`\widehat{\mathrm{var}}^+ = \tfrac{n-1}{n} W + B/n`,
:math:`\hat R = \sqrt{\widehat{\mathrm{var}}^+ / W}`.
Rank normalisation replaces every draw by :math:`\Phi^{-1}((r - 3/8) / (CS + 1/4))` with :math:`r` its rank
among all draws (average ranks for ties). The autocorrelation at lag :math:`t` pools the chains'
autocovariances :math:`\hat\gamma_{c,t}` (biased, FFT):
:math:`\hat\rho_t = 1 - (W - \overline{\hat\gamma_{c,t}}) / \widehat{\mathrm{var}}^+`;
with pair sums :math:`P_k = \hat\rho_{2k} + \hat\rho_{2k+1}` kept while positive
(truncated at the first negative one) and made non-increasing, :math:`\hat\tau = -1 + 2 \sum_k P_k` and
:math:`\mathrm{ESS} = C S / \hat\tau` (at most ``C S log10(C S)``, as ArviZ caps it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import special, stats


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


def rhat(draws) -> np.ndarray:
    r"""Rank-normalised split :math:`\hat R` (Vehtari et al. 2021): max of bulk and tail (folded) values."""
    x = _as_chains(draws)
    bulk = _rhat_basic(rank_normalize(split_chains(x)))
    folded = np.abs(x - np.median(x.reshape(-1, *x.shape[2:]), axis=0))
    tail = _rhat_basic(rank_normalize(split_chains(folded)))
    return np.maximum(bulk, tail)


def _autocov(x: np.ndarray) -> np.ndarray:
    """Biased autocovariance of every chain along axis 1, by FFT: ``(C, S, ...)``."""
    s = x.shape[1]
    xc = x - x.mean(axis=1, keepdims=True)
    nfft = 1 << int(np.ceil(np.log2(2 * s)))
    f = np.fft.rfft(xc, n=nfft, axis=1)
    return np.fft.irfft(f * np.conj(f), n=nfft, axis=1)[:, :s] / s


def ess(draws) -> np.ndarray:
    """Multi-chain effective sample size of the draws as given (no split, no ranks): ``(...)``."""
    x = _as_chains(draws, min_draws=2)
    c, s = x.shape[:2]
    acov = _autocov(x)  # (C, S, ...)
    w = acov[:, 0].mean(axis=0) * s / (s - 1)  # mean within-chain variance (ddof 1)
    var_plus = w * (s - 1) / s
    if c > 1:
        var_plus = var_plus + x.mean(axis=1).var(axis=0, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (w - acov.mean(axis=0)) / var_plus  # (S, ...); rho[0] = 1
    n_pairs = s // 2
    pairs = rho[0 : 2 * n_pairs : 2] + rho[1 : 2 * n_pairs : 2]  # P_k, (K, ...)
    positive = np.cumprod(pairs > 0, axis=0).astype(bool)  # initial positive sequence
    monotone = np.minimum.accumulate(np.where(positive, pairs, np.inf), axis=0)
    tau = -1.0 + 2.0 * np.where(positive, monotone, 0.0).sum(axis=0)
    n = c * s
    tau = np.maximum(tau, 1.0 / np.log10(n))
    out = n / tau
    return np.where(var_plus > 0, out, float(n))


def ess_bulk(draws) -> np.ndarray:
    """Bulk ESS (Vehtari et al. 2021): :func:`ess` of the rank-normalised split chains."""
    return ess(rank_normalize(split_chains(_as_chains(draws))))


def mcse_mean(draws) -> np.ndarray:
    r"""Monte-Carlo standard error of the posterior mean: :math:`\mathrm{sd} / \sqrt{\mathrm{ESS}}`."""
    x = _as_chains(draws)
    return x.reshape(-1, *x.shape[2:]).std(axis=0, ddof=1) / np.sqrt(ess(split_chains(x)))


def summary(draws) -> dict[str, Any]:
    """JSON-able summary over all parameters of ``(C, S, ...)`` draws: max/median R-hat (rank-normalised
    split), min/median bulk ESS, and the number of parameters."""
    x = _as_chains(draws)
    x = x.reshape(x.shape[0], x.shape[1], -1)
    r, e = rhat(x), ess_bulk(x)
    return {
        "n_chains": int(x.shape[0]),
        "n_draws": int(x.shape[1]),
        "n_params": int(x.shape[2]),
        "rhat_max": float(np.max(r)),
        "rhat_median": float(np.median(r)),
        "ess_bulk_min": float(np.min(e)),
        "ess_bulk_median": float(np.median(e)),
    }
