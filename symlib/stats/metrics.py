r"""Uncertainty metrics of a posterior sample set (book: chapters "Table 1" and "Functional collapse").

Everything is computed from the stack of per-sample predicted probabilities
:math:`P \in [0, 1]^{S \times N \times C}` (``P[s, n] = p(\cdot \mid x_n, \theta_s)``,
e.g. from :func:`symlib.stats.predict.probs`). The Bayesian model average, the
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
paper does; the functions below return the raw values. :func:`symlib.stats.pairwise_mi.pairwise_mi`
computes the mutual information of every two-member ensemble among ``N`` models.

Inputs are checked (:func:`check_probs`, :func:`check_labels`): probabilities must be finite,
non-negative and sum to one over the classes within :data:`SUM_ATOL`; a violation is a
``ValueError`` that names it and the fix.
"""

from __future__ import annotations

from fractions import Fraction

import torch

__all__ = [
    "METRICS",
    "NLL_EPS",
    "N_BINS",
    "SUM_ATOL",
    "accuracy",
    "aupr",
    "average_precision",
    "brier",
    "check_labels",
    "check_probs",
    "ece",
    "entropy",
    "evaluate",
    "fpr95",
    "fpr_at_tpr",
    "mutual_information",
    "nll",
    "ood_score",
    "predictive",
]

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
