r"""Uncertainty metrics of a posterior sample set (book: chapters "Table 1" and "Functional collapse").

Everything is computed from the stack of per-sample predicted probabilities
:math:`P \in [0, 1]^{S \times N \times C}` (``P[s, n] = p(\cdot \mid x_n, \theta_s)``,
e.g. from :func:`symlib.predict.probs`). The Bayesian model average, the
*predictive*, is :math:`\bar p(\cdot \mid x_n) = \frac1S \sum_s P[s, n]`; the
prediction is :math:`\hat y_n = \arg\max_c \bar p(c \mid x_n)` and its confidence
:math:`\hat c_n = \max_c \bar p(c \mid x_n)`. The metrics of the paper's Table 1
(§4, App. B), with the conventions this module fixes:

* **accuracy**: :math:`\frac1N \sum_n [\hat y_n = y_n]` (ties: the first maximal class).
* **ECE** (top-label, binned; Naeini et al. 2015): :math:`\sum_b \frac{|B_b|}{N}
  |\mathrm{acc}(B_b) - \mathrm{conf}(B_b)|` with 15 equal-width bins that are *left-closed*,
  :math:`B_b = \{n : b/15 \le \hat c_n < (b+1)/15\}`, and, exactly as torchmetrics'
  ``multiclass_calibration_error`` (which the paper's code, torch-uncertainty, wraps) counts it, a
  confidence of exactly 1 in a bin of its own. In float32, confident networks often output exactly 1.
* **Brier score**: :math:`\frac1N \sum_n \sum_c (\bar p(c \mid x_n) - [c = y_n])^2`, the sum over
  classes and the mean over examples, as torch-uncertainty and scikit-learn's multi-class
  ``brier_score_loss`` (in [0, 2]; scikit-learn's *binary* score is half of it).
* **NLL**: :math:`-\frac1N \sum_n \log \max(\bar p(y_n \mid x_n), \epsilon)` with
  :math:`\epsilon = 10^{-12}` (:data:`NLL_EPS`), so that one example costs at most 27.6 nats.
* **OOD detection** (Hendrycks & Gimpel 2017): out-of-distribution inputs are the *positive* class,
  and the score is the negated maximum softmax probability of the predictive,
  :math:`s(x) = -\max_c \bar p(c \mid x)` (higher: more likely OOD; torch-uncertainty's default
  criterion). **AUPR** is the average precision of that detector,
  :math:`\sum_k (R_k - R_{k-1}) P_k` over the distinct thresholds (scikit-learn's
  ``average_precision_score``, torchmetrics' ``binary_average_precision``). **FPR95** is the false
  positive rate at 95% true positive rate: with the threshold :math:`t` the largest score such that at
  least 95% of the OOD inputs have :math:`s \ge t`, the fraction of in-distribution inputs with
  :math:`s \ge t` (taken as OOD).
* **Mutual information** of the ensemble (epistemic uncertainty), the entropy of the mean minus the mean
  entropy, :math:`I_n = H(\bar p(\cdot \mid x_n)) - \frac1S \sum_s H(P[s, n])` in nats, averaged over
  the examples: **IDMI** on in-distribution inputs, **OODMI** on OOD inputs.

:func:`evaluate` reports them all in percent (fractions, and nats for NLL and MI, times 100), as the
paper does; the functions below return the raw values. :func:`pairwise_mi` computes, for the
functional-collapse study (§5.1, App. D.2), the mutual information of every two-member ensemble
among ``N`` models, with no Python loop over pairs.

Inputs are checked (:func:`check_probs`, :func:`check_labels`): probabilities must be finite,
non-negative and sum to one over the classes within :data:`SUM_ATOL`; a violation is a
``ValueError`` that names it and the fix.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from fractions import Fraction

import numpy as np
import torch

from symlib import progress as _progress

SUM_ATOL = 1e-3
"""Largest accepted :math:`|\\sum_c p_c - 1|`: float32 softmax outputs are off by ~1e-7 per class, logits or
unnormalised scores by far more."""
N_BINS = 15
NLL_EPS = 1e-12
METRICS = ("Acc", "ECE", "Brier", "NLL", "AUPR", "FPR95", "IDMI", "OODMI")


# --------------------------------------------------------------------------------------------- checks
def check_probs(p: torch.Tensor, name: str = "p", ndim: int = 3, atol: float = SUM_ATOL) -> torch.Tensor:
    """Validate a stack of probability vectors along the last axis and return it.

    Args:
        p: probabilities, ``(S, N, C)`` by default.
        name: how error messages call the argument.
        ndim: the expected number of dimensions.
        atol: tolerance on :math:`|\\sum_c p_c - 1|`.

    Raises:
        ValueError: not a floating tensor of ``ndim`` dimensions, an empty axis, fewer than two classes,
            non-finite or negative entries, rows that do not sum to one.
    """
    axes = "(S, N, C) = (samples, inputs, classes)" if ndim == 3 else f"{ndim} dimensions"
    if not isinstance(p, torch.Tensor) or not p.is_floating_point():
        what = f"{p.dtype} tensor" if isinstance(p, torch.Tensor) else type(p).__name__
        raise ValueError(f"{name} must be a floating-point tensor of probabilities {axes}, got a {what}")
    if p.ndim != ndim:
        hint = "; for a single model pass p[None]" if ndim == 3 and p.ndim == 2 else ""
        raise ValueError(f"{name} must have shape {axes}, got {tuple(p.shape)}{hint}")
    if p.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(p.shape)}): every axis needs at least one entry")
    if p.shape[-1] < 2:
        raise ValueError(f"{name} has {p.shape[-1]} class(es); a classifier's probabilities need C >= 2")
    if not bool(torch.isfinite(p).all()):
        bad = int((~torch.isfinite(p)).sum())
        raise ValueError(
            f"{name} holds {bad} non-finite value(s) (NaN or inf): a diverged sample? Drop or fix those "
            "samples before evaluating"
        )
    if bool((p < 0).any()):
        raise ValueError(
            f"{name} holds negative values (min {float(p.min()):.3g}): these are not probabilities; pass "
            "torch.softmax(logits, -1), not logits or log-probabilities"
        )
    dev = float((p.sum(-1, dtype=torch.float64) - 1).abs().max())
    if dev > atol:
        raise ValueError(
            f"{name} does not sum to one over the classes (last axis): max |sum - 1| = {dev:.3g} > {atol:g}. "
            "Pass probabilities, torch.softmax(logits, -1), with the classes on the last axis"
        )
    return p


def check_labels(y: torch.Tensor, n: int, num_classes: int, name: str = "y") -> torch.Tensor:
    """Validate integer labels ``(N,)`` in ``[0, C)`` and return them as int64."""
    if not isinstance(y, torch.Tensor) or y.dtype == torch.bool or y.is_floating_point() or y.is_complex():
        what = f"{y.dtype} tensor" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"{name} must be an integer tensor of class indices (N,), got a {what}")
    if y.shape != (n,):
        raise ValueError(
            f"{name} must have shape (N,) = ({n},) to match the probabilities, got {tuple(y.shape)}"
        )
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(
            f"{name} holds labels in [{lo}, {hi}] but the probabilities have C = {num_classes} classes: "
            f"labels must lie in [0, {num_classes - 1}] (wrong data set, or one-based labels?)"
        )
    return y.long()


def _check_pair(p_id: torch.Tensor, p_ood: torch.Tensor) -> None:
    if p_ood.shape[0] != p_id.shape[0] or p_ood.shape[2] != p_id.shape[2]:
        raise ValueError(
            f"ID and OOD predictions must come from the same samples and classes: p_id is (S, N, C) = "
            f"{tuple(p_id.shape)}, p_ood {tuple(p_ood.shape)} (S and C must agree; only N may differ). "
            "Predict both with the same sample set"
        )


def _labels_on(y: torch.Tensor, p: torch.Tensor, name: str = "y") -> torch.Tensor:
    return check_labels(y, p.shape[1], p.shape[2], name).to(p.device)


# --------------------------------------------------------------------------------------------- basics
def predictive(p: torch.Tensor) -> torch.Tensor:
    r"""The Bayesian model average :math:`\bar p = \frac1S \sum_s P[s]`, ``(N, C)`` in float64."""
    check_probs(p)
    return p.mean(0, dtype=torch.float64)


def entropy(p: torch.Tensor) -> torch.Tensor:
    r""":math:`H(p) = -\sum_c p_c \log p_c` in nats along the last axis (:math:`0 \log 0 = 0`); no checks."""
    return -torch.special.xlogy(p, p).sum(-1)


def mutual_information(p: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    r"""Mutual information between the prediction and the sample, per input (nats).

    .. math:: I_n = H\Big(\frac1S \sum_s P[s, n]\Big) - \frac1S \sum_s H(P[s, n])

    It is 0 when all samples agree and at most :math:`\log \min(S, C)`.

    Args:
        p: ``(S, N, C)`` probabilities.
        reduction: ``"mean"`` (over the inputs: a scalar) or ``"none"`` (``(N,)``).

    Returns:
        float64 tensor.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    mi = _mi(check_probs(p))
    return mi.mean() if reduction == "mean" else mi


def _mi(p: torch.Tensor) -> torch.Tensor:
    p64 = p.to(torch.float64)
    return entropy(p64.mean(0)) - entropy(p64).mean(0)


# ------------------------------------------------------------------------------ in-distribution metrics
def accuracy(p: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy of the predictive's top class (a fraction)."""
    return _accuracy(predictive(p), _labels_on(y, p))


def _accuracy(pbar: torch.Tensor, y: torch.Tensor) -> float:
    return float((pbar.max(-1).indices == y).double().mean())


def ece(p: torch.Tensor, y: torch.Tensor, n_bins: int = N_BINS) -> float:
    r"""Top-label expected calibration error of the predictive with ``n_bins`` equal-width bins (a fraction).

    .. math:: \mathrm{ECE} = \sum_b \frac{|B_b|}{N}\,
              \Big| \frac{1}{|B_b|} \sum_{n \in B_b} [\hat y_n = y_n]
              - \frac{1}{|B_b|} \sum_{n \in B_b} \hat c_n \Big|

    Bins :math:`B_b = \{n : b / n_{bins} \le \hat c_n < (b+1)/n_{bins}\}` are left-closed; a confidence of
    exactly 1 gets a bin of its own (torchmetrics' convention, ``bucketize(right=True)``).
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    return _ece(predictive(p), _labels_on(y, p), n_bins)


def _ece(pbar: torch.Tensor, y: torch.Tensor, n_bins: int = N_BINS) -> float:
    conf, pred = pbar.max(-1)
    correct = (pred == y).double()
    edges = torch.linspace(0, 1, n_bins + 1, dtype=conf.dtype, device=conf.device)
    idx = torch.bucketize(conf, edges, right=True) - 1  # in [0, n_bins]; n_bins only for conf == 1
    gap = torch.zeros(n_bins + 1, dtype=torch.float64, device=conf.device)
    gap.index_add_(0, idx, correct - conf)  # sum over each bin of (correct - confidence)
    return float(gap.abs().sum() / conf.shape[0])


def brier(p: torch.Tensor, y: torch.Tensor) -> float:
    r"""Brier score of the predictive, :math:`\frac1N \sum_n \sum_c (\bar p_{nc} - [c = y_n])^2`
    (in [0, 2])."""
    return _brier(predictive(p), _labels_on(y, p))


def _brier(pbar: torch.Tensor, y: torch.Tensor) -> float:
    onehot = torch.nn.functional.one_hot(y, pbar.shape[-1]).to(pbar.dtype)
    return float(((pbar - onehot) ** 2).sum(-1).mean())


def nll(p: torch.Tensor, y: torch.Tensor, eps: float = NLL_EPS) -> float:
    r"""Negative log-likelihood of the predictive (nats),
    :math:`-\frac1N \sum_n \log \max(\bar p(y_n \mid x_n), \epsilon)`."""
    return _nll(predictive(p), _labels_on(y, p), eps)


def _nll(pbar: torch.Tensor, y: torch.Tensor, eps: float = NLL_EPS) -> float:
    return float(-pbar.gather(1, y[:, None])[:, 0].clamp_min(eps).log().mean())


# ------------------------------------------------------------------------------------- OOD detection
def ood_score(p: torch.Tensor) -> torch.Tensor:
    r"""The OOD score of every input, :math:`s(x_n) = -\max_c \bar p(c \mid x_n)`
    (higher: more likely OOD)."""
    return -predictive(p).max(-1).values


def average_precision(scores: torch.Tensor, positive: torch.Tensor) -> float:
    r"""Average precision of ranking by ``scores`` (higher: positive), :math:`\sum_k (R_k - R_{k-1}) P_k`.

    Thresholds are the distinct scores (tied inputs enter together), as in scikit-learn's
    ``average_precision_score``.

    Args:
        scores: ``(M,)`` real scores.
        positive: ``(M,)`` booleans, at least one true.
    """
    positive = positive.to(torch.bool)
    if scores.ndim != 1 or positive.shape != scores.shape or not bool(positive.any()):
        raise ValueError("average_precision needs 1-D scores and labels of equal length with a positive")
    order = torch.argsort(scores, descending=True, stable=True)
    s, pos = scores[order], positive[order].to(torch.float64)
    tp, fp = pos.cumsum(0), (1 - pos).cumsum(0)
    last = torch.ones_like(s, dtype=torch.bool)
    last[:-1] = s[1:] != s[:-1]  # the last input of each run of tied scores closes a threshold
    tp, fp = tp[last], fp[last]
    precision, recall = tp / (tp + fp), tp / tp[-1]
    return float((torch.diff(recall, prepend=recall.new_zeros(1)) * precision).sum())


def fpr_at_tpr(scores_pos: torch.Tensor, scores_neg: torch.Tensor, tpr: float = 0.95) -> float:
    r"""False positive rate at true positive rate ``tpr``.

    With :math:`t` the largest threshold such that a fraction at least ``tpr`` of the positives score
    :math:`\ge t` (the :math:`\lceil \mathrm{tpr} \cdot M_+ \rceil`-th largest positive score), the fraction
    of negatives scoring :math:`\ge t`. Equals ``fpr[argmax(tpr_curve >= tpr)]`` on scikit-learn's
    ``roc_curve(..., drop_intermediate=False)``.
    """
    if not 0 < tpr <= 1:
        raise ValueError(f"tpr must lie in (0, 1], got {tpr}")
    if scores_pos.numel() == 0 or scores_neg.numel() == 0:
        raise ValueError("fpr_at_tpr needs at least one positive and one negative score")
    frac = Fraction(tpr).limit_denominator(10**6)  # exact rational: no rounding at ceil(0.95 * M)
    k = -(-(frac.numerator * scores_pos.numel()) // frac.denominator)
    t = torch.sort(scores_pos.reshape(-1), descending=True).values[k - 1]
    return float((scores_neg >= t).double().mean())


def aupr(p_id: torch.Tensor, p_ood: torch.Tensor) -> float:
    """Area under the precision-recall curve (average precision) of detecting OOD inputs (positive) by
    :func:`ood_score` (a fraction)."""
    pbar_id, pbar_ood = _predictives(p_id, p_ood)
    return _aupr(pbar_id, pbar_ood)


def _predictives(p_id: torch.Tensor, p_ood: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_probs(p_ood, "p_ood")
    _check_pair(check_probs(p_id, "p_id"), p_ood)
    return p_id.mean(0, dtype=torch.float64), p_ood.mean(0, dtype=torch.float64)


def _aupr(pbar_id: torch.Tensor, pbar_ood: torch.Tensor) -> float:
    scores = -torch.cat([pbar_id, pbar_ood]).max(-1).values
    positive = torch.zeros_like(scores, dtype=torch.bool)
    positive[pbar_id.shape[0] :] = True
    return average_precision(scores, positive)


def fpr95(p_id: torch.Tensor, p_ood: torch.Tensor) -> float:
    """Fraction of in-distribution inputs flagged as OOD by :func:`ood_score` at the threshold that flags 95%
    of the OOD inputs (OOD positive; a fraction)."""
    return _fpr95(*_predictives(p_id, p_ood))


def _fpr95(pbar_id: torch.Tensor, pbar_ood: torch.Tensor) -> float:
    return fpr_at_tpr(-pbar_ood.max(-1).values, -pbar_id.max(-1).values, 0.95)


# ------------------------------------------------------------------------------------------ one call
def evaluate(p_id: torch.Tensor, y_id: torch.Tensor, p_ood: torch.Tensor | None = None) -> dict[str, float]:
    """Table 1's metrics of one posterior sample set, in percent as the paper reports them.

    Args:
        p_id: ``(S, N, C)`` per-sample probabilities on the in-distribution test set.
        y_id: ``(N,)`` its labels.
        p_ood: ``(S, N', C)`` per-sample probabilities on the OOD set (same samples), or ``None``.

    Returns:
        ``{"Acc", "ECE", "Brier", "NLL", "IDMI"}`` and, with ``p_ood``, ``{"AUPR", "FPR95", "OODMI"}``,
        each the raw value (fraction, or nats for NLL and MI) times 100, in the order of :data:`METRICS`.
    """
    check_probs(p_id, "p_id")
    y = _labels_on(y_id, p_id, "y_id")
    if p_ood is not None:
        check_probs(p_ood, "p_ood")
        _check_pair(p_id, p_ood)
    pbar = p_id.mean(0, dtype=torch.float64)  # checked once; every metric reads the same predictive
    out = {
        "Acc": _accuracy(pbar, y),
        "ECE": _ece(pbar, y),
        "Brier": _brier(pbar, y),
        "NLL": _nll(pbar, y),
        "IDMI": float(_mi(p_id).mean()),
    }
    if p_ood is not None:
        pbar_ood = p_ood.mean(0, dtype=torch.float64)
        out["AUPR"], out["FPR95"] = _aupr(pbar, pbar_ood), _fpr95(pbar, pbar_ood)
        out["OODMI"] = float(_mi(p_ood).mean())
    return {k: 100 * out[k] for k in METRICS if k in out}


# ------------------------------------------------------------------------------------ pairwise MI
CPU_MAX_WIDTH = 2_500
"""Most features per chunk on the CPU: bounds the length of one float32 dot product, whose rounding
is about one ulp of its result (against float64 blocks, on randomly initialised OptuNets: 3.7e-7 nats of
MI with 10,000 features in one chunk, 1.8e-7 in chunks of 2,500, at the same speed), and stays below
OpenBLAS's threading threshold."""


def _write_rows(out, acc, r0: int, n: int) -> None:
    """Rows ``i = r0, r0 + 1, ...`` of ``acc`` (columns ``j = r0 + 1, ..., n - 1``) into ``out``, the
    condensed vector in ``scipy.spatial.distance.squareform`` order: pairs ``(i, j > i)`` start at
    ``n i - i (i + 1) / 2``."""
    for k in range(acc.shape[0]):
        i = r0 + k
        s = n * i - i * (i + 1) // 2
        out[s : s + n - i - 1] = acc[k, k:]


def _layout(feats: int, block: int, max_width: int) -> tuple[int, int, int, int]:
    """``(chunks, width, rows, cols)``: the features in ``chunks`` chunks of equal ``width`` (at most
    ``max_width`` and ``block``; the last one padded), and square blocks of ``rows`` x ``cols`` pairs of
    at most ``block`` elements (each column block read from memory once for ``rows`` rows)."""
    chunks = -(-feats // min(feats, max_width, block))
    width = -(-feats // chunks)
    side = max(1, math.isqrt(block // width))
    return chunks, width, side, side


def _chunked_halves(p: torch.Tensor, dtype: torch.dtype, chunks: int, width: int) -> torch.Tensor:
    r"""``(chunks, N, width)`` contiguous: the halved probabilities of each model, feature chunk first.

    Zeros are floored at the smallest normal number so that :math:`\log q` is finite: a zero probability
    contributes :math:`\mathrm{tiny} \log \mathrm{tiny} \approx 10^{-36}` (float32) instead of
    :math:`0 \log 0 = 0`, far below rounding. The last chunk is padded with halves 1/2: there
    :math:`q = 1` and :math:`q \log q = 0` exactly.
    """
    n = p.shape[0]
    half = torch.full((n, chunks * width), 0.5, dtype=dtype, device=p.device)
    half[:, : p[0].numel()] = (p.reshape(n, -1).to(dtype) * 0.5).clamp_min_(torch.finfo(dtype).tiny)
    return half.view(n, chunks, width).transpose(0, 1).contiguous()


def _row_block_np(hc: np.ndarray, r0: int, r1: int, bufs: tuple[np.ndarray, ...], out: np.ndarray) -> None:
    r"""Write :math:`\sum_{x, c} q \log q` of the pairs ``(i, j)``, ``r0 <= i < r1``, ``j > i``, into their
    condensed positions of ``out`` (numpy: the CPU path).

    ``hc`` is the ``(chunks, N, width)`` array of halves (:func:`_chunked_halves`); ``bufs`` are a thread's
    buffers ``q`` and ``log_q`` of shape ``(rows, cols, width)`` and ``dots`` ``(rows, cols, 1, 1)``. The
    columns ``j > r0`` are taken ``cols`` at a time; each block and chunk is one broadcast addition into
    ``q``, one base-2 logarithm into ``log_q`` (numpy's float32 ``log2`` is 1.5x the speed of ``log``) and
    one BLAS dot product :math:`(1, w) \times (w, 1)` per pair (matmul: no product pass), accumulated in
    float64; the sums are multiplied by :math:`\ln 2` at the end.
    """
    chunks, n, _ = hc.shape
    rows, c_first = r1 - r0, r0 + 1
    q, log_q, dots = (b[:rows] for b in bufs)
    cols = q.shape[1]
    full = q, log_q, dots, q[:, :, None, :], log_q[:, :, :, None]
    acc = np.zeros((rows, n - c_first))
    for c0 in range(c_first, n, cols):
        m = min(cols, n - c0)
        if m == cols:
            qq, ll, dd, q4, l4 = full
        else:
            qq, ll, dd = q[:, :m], log_q[:, :m], dots[:, :m]
            q4, l4 = qq[:, :, None, :], ll[:, :, :, None]
        dst = acc[:, c0 - c_first : c0 - c_first + m]
        for k in range(chunks):
            hk = hc[k]
            np.add(hk[r0:r1, None], hk[None, c0 : c0 + m], out=qq)
            np.log2(qq, out=ll)
            np.matmul(q4, l4, out=dd)
            dst += dd[:, :, 0, 0]
    acc *= math.log(2)
    _write_rows(out, acc, r0, n)


def _row_block_torch(hc: torch.Tensor, r0: int, r1: int, cols: int, q: torch.Tensor, log_q: torch.Tensor,
                     out: torch.Tensor) -> None:
    """:func:`_row_block_np` in torch (the CUDA path): natural logarithm, product and float32 sum (pairwise
    summation) per chunk, accumulated in float64; ``q`` and ``log_q`` are flat buffers."""
    chunks, n, width = hc.shape
    c_first = r0 + 1
    acc = hc.new_zeros((r1 - r0, n - c_first), dtype=torch.float64)
    for c0 in range(c_first, n, cols):
        c1 = min(c0 + cols, n)
        shape = (r1 - r0, c1 - c0, width)
        size = math.prod(shape)
        qq, ll = q[:size].view(shape), log_q[:size].view(shape)
        for k in range(chunks):
            hk = hc[k]
            torch.add(hk[r0:r1, None], hk[None, c0:c1], out=qq)
            torch.log(qq, out=ll)
            acc[:, c0 - c_first : c1 - c_first] += torch.mul(qq, ll, out=ll).sum(-1).double()
    _write_rows(out, acc, r0, n)


@torch.no_grad()
def pairwise_mi(
    p: torch.Tensor,
    square: bool = False,
    block: int | None = None,
    dtype: torch.dtype | None = None,
    progress: bool = False,
    workers: int | None = None,
    native: bool = True,
) -> torch.Tensor:
    r"""Mutual information of every two-member ensemble, averaged over the inputs (§5.1, App. D.2).

    For models :math:`i < j` with probabilities :math:`p_i, p_j` on inputs :math:`x_1..x_n`,

    .. math:: \mathrm{MI}_{ij} = \frac1n \sum_x \Big[ H\Big(\frac{p_i(x) + p_j(x)}{2}\Big)
              - \frac{H(p_i(x)) + H(p_j(x))}{2} \Big]
              = -\frac1n \sum_{x, c} q \log q \,\Big|_{q = \frac{p_i + p_j}{2}} - \frac{h_i + h_j}{2},

    where :math:`h_i = \frac1n \sum_x H(p_i(x))` is computed once per model (float64). The pairwise term
    is computed for blocks of rows :math:`i` times columns :math:`j > i` (upper triangle only) and
    chunks of the flattened ``(input, class)`` axis: one broadcast addition of the halved probabilities
    (halving is exact; zeros are floored at the smallest normal number), one logarithm and one reduction
    per block, on at most ``block`` elements (two buffers: memory bounded), the chunk sums accumulated in
    float64. No Python loop runs over pairs.

    The cost is one logarithm per pair, input and class. On the CPU in float32 (the default for float32
    ``p``) the pairwise term is the compiled kernel of :mod:`symlib.kernels` where it builds: one pass per
    pair with the addition, a vectorised logarithm (Cephes' ``logf``, about one ulp) and the product-sum in
    registers, summed in float32 over 256 values and then in float64, rows in blocks of 8 over ``workers``
    threads. Otherwise (float64, ``native=False``, no compiler) the blocks are numpy arrays:
    numpy's vectorised float32 logarithm (AVX-512) is about three times as fast as torch's, in base 2
    four times (:math:`\sum q \log q = \ln 2 \sum q \log_2 q`, the factor applied to the float64 sums;
    numpy's float32 ``log2`` is also within one ulp), and the product and the sum are one BLAS dot
    product per pair and chunk (no product pass). The models' halves and mean entropies, then the blocks
    of rows, are split over ``workers`` threads (numpy releases the GIL), each with its own buffers; a
    pair's value does not depend on the thread that computes it, so the result is the same for every
    ``workers``. numpy's ``matmul`` keeps the GIL (about a sixth of the work), so on the 2-core machine
    of the book two workers are about 1.3x one. The input check runs as three fast passes, deferring to
    :func:`check_probs` unless ``p`` is plainly valid. On CUDA the same blocks run in torch.
    ``benchmarks/pairwise_mi.py`` times it against a per-pair loop.

    Args:
        p: ``(N, n, C)`` probabilities of ``N >= 2`` models on ``n`` inputs.
        square: return the symmetric ``(N, N)`` matrix (zero diagonal) instead of the condensed vector.
        block: elements per block (default :math:`2^{17}` on CPU, :math:`2^{24}` on CUDA); a feature chunk
            holds at most ``block`` (and on the CPU :data:`CPU_MAX_WIDTH`) features.
        dtype: the dtype of the blocks (default: ``p``'s); float64 for exact checks.
        progress: show a progress bar over row blocks.
        workers: CPU threads (default ``torch.get_num_threads()``); ignored on CUDA.
        native: use the compiled CPU kernel for float32 where available (``False``: the numpy blocks).

    Returns:
        float64 tensor on ``p``'s device: the condensed vector of the :math:`N(N-1)/2` pairs in
        ``scipy.spatial.distance.squareform`` order (``(0,1), (0,2), ..., (1,2), ...``), or the square matrix.
    """
    _check_probs_quick(p)
    n_models, n_inputs, n_classes = p.shape
    if n_models < 2:
        raise ValueError(f"pairwise_mi needs at least two models, got p of shape {tuple(p.shape)}")
    dtype = dtype or p.dtype
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    on_cpu = p.device.type == "cpu"
    if block is None:
        block = 2**17 if on_cpu else 2**24
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive integer (elements per block), got {block!r}")
    if workers is None:
        workers = torch.get_num_threads()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer (CPU threads), got {workers!r}")
    dev = p.device
    feats = n_inputs * n_classes
    chunks, width, rows, cols = _layout(feats, block, CPU_MAX_WIDTH if on_cpu else feats)
    sums = torch.empty(n_models * (n_models - 1) // 2, dtype=torch.float64, device=dev)
    total = len(range(0, n_models - 1, rows))
    if on_cpu and dtype == torch.float32 and native and _native_kernels():
        total = len(range(0, n_models - 1, NATIVE_ROWS))
    with _progress.bar(total=total, desc="pairwise MI", enabled=progress) as pbar:
        if on_cpu and dtype == torch.float32 and native and _native_kernels():
            h = _pairwise_sums_native(p, sums, workers, pbar)
        elif on_cpu:
            h = _pairwise_sums_cpu(p, dtype, chunks, width, rows, cols, sums.numpy(), workers, pbar)
            h = torch.from_numpy(h)
        else:
            h = _pairwise_sums_torch(p, dtype, chunks, width, rows, cols, sums, pbar)
    iu = torch.triu_indices(n_models, n_models, 1, device=dev)
    out = -sums / n_inputs - (h[iu[0]] + h[iu[1]]) / 2
    if not square:
        return out
    mat = torch.zeros(n_models, n_models, dtype=torch.float64, device=dev)
    mat[iu[0], iu[1]] = out
    return mat + mat.T


NATIVE_ROWS = 8  # rows of the upper triangle per task of the compiled path


def _native_kernels() -> bool:
    from symlib import kernels

    return kernels.available()


def _mean_entropies(flat: np.ndarray, n_inputs: int) -> np.ndarray:
    r""":math:`h_i = -\frac1n \sum_f p_{if} \log p_{if}` of the rows of ``flat`` (``(N, n C)``), in
    float64, one dot product per row (zeros floored at the smallest normal number: :math:`0 \log 0 = 0`)."""
    x = flat.astype(np.float64)
    logs = np.log(np.maximum(x, np.finfo(np.float64).tiny))
    return -np.matmul(x[:, None, :], logs[:, :, None])[:, 0, 0] / n_inputs


def _pairwise_sums_native(p: torch.Tensor, out: torch.Tensor, workers: int, pbar) -> torch.Tensor:
    r"""The compiled CPU path of :func:`pairwise_mi` (float32): the halves in one ``(N, F')`` array
    (floored at the smallest normal float, padded with 1/2 to whole vectors), then
    :func:`symlib.kernels.pairwise_xlogx_rows` on blocks of :data:`NATIVE_ROWS` rows spread over
    ``workers`` threads (the library call releases the GIL). Returns the models' mean entropies (float64).
    """
    from symlib import kernels

    n_models, n_inputs = p.shape[:2]
    flat = p.detach().reshape(n_models, -1)
    half = _chunked_halves(flat, torch.float32, 1, -(-flat.shape[1] // 16) * 16)[0]
    h = _mean_entropies(flat.numpy(), n_inputs)

    def rows(r0: int) -> None:
        kernels.pairwise_xlogx_rows(half, r0, min(r0 + NATIVE_ROWS, n_models), out)

    _in_threads(rows, list(range(0, n_models - 1, NATIVE_ROWS)), workers, pbar)
    return torch.from_numpy(h)


def _pairwise_sums_torch(p: torch.Tensor, dtype: torch.dtype, chunks: int, width: int, rows: int, cols: int,
                         out: torch.Tensor, pbar) -> torch.Tensor:
    r"""The torch path of :func:`pairwise_mi` (CUDA): as :func:`_pairwise_sums_cpu`, on ``p``'s device, one
    row block after the other."""
    n_models, n_inputs = p.shape[:2]
    hc = _chunked_halves(p, dtype, chunks, width)
    p64 = p.reshape(n_models, -1).double()
    h = -torch.special.xlogy(p64, p64).sum(1) / n_inputs
    q, log_q = torch.empty(2, rows * cols * width, dtype=dtype, device=p.device)
    for r0 in range(0, n_models - 1, rows):
        _row_block_torch(hc, r0, min(r0 + rows, n_models), cols, q, log_q, out)
        pbar.update(1)
    return h


def _check_probs_quick(p: torch.Tensor) -> None:
    """:func:`check_probs` ``(p, "p")``, in three fast passes (numpy minimum, maximum, float32 row sums by
    BLAS) when ``p`` is a plainly valid CPU tensor; anything else, and row sums within rounding of the
    tolerance, goes to :func:`check_probs` itself (same decisions, same messages)."""
    if (p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64) and p.ndim == 3
            and p.numel() > 0 and p.shape[-1] >= 2 and p.is_contiguous()):
        a = p.detach().numpy().reshape(-1, p.shape[-1])
        lo, hi = a.min(), a.max()  # NaN propagates: then lo >= 0 is false
        if lo >= 0 and np.isfinite(hi):
            dev = float(np.abs(a @ np.ones(a.shape[1], a.dtype) - 1).max())
            # a sum of C non-negative terms near 1 is off by at most C eps from the float64 sum
            if dev + 2 * a.shape[1] * np.finfo(a.dtype).eps <= SUM_ATOL:
                return
    check_probs(p, "p")


def _in_threads(fn, items: list, workers: int, pbar=None) -> None:
    """``fn(item)`` for every item, on ``workers`` threads (one: this thread); ``pbar`` counts the items."""
    if workers == 1 or len(items) == 1:
        for item in items:
            fn(item)
            if pbar is not None:
                pbar.update(1)
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="pairwise_mi") as pool:
        for future in as_completed([pool.submit(fn, item) for item in items]):
            future.result()  # re-raises a worker's error
            if pbar is not None:
                pbar.update(1)


def _pairwise_sums_cpu(p: torch.Tensor, dtype: torch.dtype, chunks: int, width: int, rows: int, cols: int,
                       out: np.ndarray, workers: int, pbar) -> np.ndarray:
    r"""The CPU path of :func:`pairwise_mi`, numpy on ``workers`` threads: write the pairs'
    :math:`\sum_{x, c} q \log q` into ``out`` (condensed) and return the models' mean entropies
    :math:`h` (float64).

    Two passes, each split over the threads: per block of 8 models, their halves (as
    :func:`_chunked_halves`) and :math:`h_i = -\frac1n p_i \cdot \log p_i` (float64, one dot product);
    then :func:`_row_block_np` per block of ``rows`` rows, each thread with its own two buffers.
    """
    n_models, n_inputs = p.shape[:2]
    flat = p.detach().reshape(n_models, -1)
    flat = (flat if flat.dtype in (torch.float32, torch.float64) else flat.to(dtype)).numpy()
    feats = flat.shape[1]
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    hc = np.empty((chunks, n_models, width), dtype=np_dtype)
    hc[-1, :, feats - (chunks - 1) * width :] = 0.5  # padding: q = 1, q log q = 0
    h = np.empty(n_models)
    tiny = np.finfo(np_dtype).tiny

    def prepare(m0: int) -> None:
        m1 = min(m0 + 8, n_models)
        h[m0:m1] = _mean_entropies(flat[m0:m1], n_inputs)
        for k in range(chunks):
            f0, f1 = k * width, min((k + 1) * width, feats)
            dst = hc[k, m0:m1, : f1 - f0]
            np.multiply(flat[m0:m1, f0:f1], 0.5, out=dst)
            np.maximum(dst, tiny, out=dst)

    local = threading.local()

    def row_block(r0: int) -> None:
        if not hasattr(local, "bufs"):
            shapes = [(rows, cols, width)] * 2 + [(rows, cols, 1, 1)]  # q, log_q, the dot products
            local.bufs = tuple(np.empty(shape, np_dtype) for shape in shapes)
        _row_block_np(hc, r0, min(r0 + rows, n_models), local.bufs, out)

    _in_threads(prepare, list(range(0, n_models, 8)), workers)
    _in_threads(row_block, list(range(0, n_models - 1, rows)), workers, pbar)
    return h
