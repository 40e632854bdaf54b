"""Table 1's metrics against scikit-learn and torchmetrics, closed forms, and pairwise MI against a loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import entropy as scipy_entropy
from sklearn.metrics import average_precision_score, brier_score_loss, log_loss, roc_curve
from torchmetrics.functional.classification import (
    binary_average_precision,
    multiclass_accuracy,
    multiclass_calibration_error,
)

from symlib.stats import metrics as M
from symlib.stats import pairwise_mi as PM


def _probs(s, n, c, seed, temperature=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(temperature * torch.randn(s, n, c, generator=g, dtype=dtype), -1)


def _labels(n, c, seed):
    return torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ against scikit-learn / torchmetrics
@settings(max_examples=10, deadline=None)
@given(s=st.integers(1, 4), n=st.integers(1, 300), c=st.integers(2, 12), seed=st.integers(0, 2**31),
       temperature=st.sampled_from([0.5, 3.0, 60.0]))
def test_id_metrics_match_references(s, n, c, seed, temperature):
    """Accuracy, ECE (15 bins, top-label, L1), Brier (sum over classes) and NLL of the predictive equal
    torchmetrics' and scikit-learn's on the mean probabilities; temperature 60 makes confidences of exactly 1,
    which torchmetrics bins on their own. scikit-learn's binary Brier score (C = 2) is half of ours.
    torchmetrics bins float32 confidences, so ECE is compared on a float32 predictive (elsewhere ours
    bins float64 confidences: they differ only within float32 rounding of a bin edge)."""
    p = _probs(s, n, c, seed, temperature)
    y = _labels(n, c, seed + 1)
    pbar = p.mean(0)
    ref_acc = float(multiclass_accuracy(pbar, y, c, average="micro"))
    assert M.accuracy(p, y) == pytest.approx(ref_acc, abs=1e-6)
    one = p[:1].float()
    ref_ece = float(multiclass_calibration_error(one[0], y, num_classes=c, n_bins=15, norm="l1"))
    assert M.ece(one, y) == pytest.approx(ref_ece, abs=1e-6)
    assert M.ece(p, y) == pytest.approx(M.ece(pbar[None], y), abs=1e-15)  # the predictive's ECE
    ref_brier = brier_score_loss(y.numpy(), pbar.numpy(), labels=list(range(c))) * (2 if c == 2 else 1)
    assert M.brier(p, y) == pytest.approx(ref_brier, rel=1e-9, abs=1e-12)
    clipped = pbar.clamp_min(1e-12)  # NLL_EPS; scikit-learn clips at the float64 epsilon instead
    assert M.nll(p, y) == pytest.approx(log_loss(y.numpy(), clipped.numpy(), labels=list(range(c))), rel=1e-9)


def test_ece_counts_confidence_one_in_its_own_bin():
    """Confidence exactly 1 (all correct) and 0.95 (all wrong): torchmetrics gives 0.95 / 2, not the merged
    bin's |0.5 - 0.975|."""
    p = torch.tensor([[[1.0, 0.0], [0.95, 0.05]]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    assert M.ece(p, y) == pytest.approx(0.475, abs=1e-12)
    assert M.ece(p, y) == pytest.approx(float(multiclass_calibration_error(p[0], y, 2, n_bins=15)), abs=1e-7)


@settings(max_examples=25, deadline=None)
@given(n_pos=st.integers(1, 80), n_neg=st.integers(1, 80), levels=st.sampled_from([3, 10, 0]),
       seed=st.integers(0, 2**31))
def test_average_precision_and_fpr_at_tpr_match_references(n_pos, n_neg, levels, seed):
    """Average precision = scikit-learn's and torchmetrics'; FPR at 95% TPR = the first point of the ROC curve
    (all thresholds) with TPR >= 0.95. Few score levels make ties, which enter a threshold together."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n_pos + n_neg, generator=g, dtype=torch.float64)
    if levels:
        scores = torch.floor(scores * levels) / levels
    scores[:n_pos] += 0.3  # positives score higher on average
    scores = scores.float()  # torchmetrics ranks in float32: give every implementation the same ties
    labels = torch.cat([torch.ones(n_pos), torch.zeros(n_neg)]).long()
    ap = M.average_precision(scores, labels.bool())
    assert ap == pytest.approx(average_precision_score(labels.numpy(), scores.numpy()), abs=1e-12)
    assert ap == pytest.approx(float(binary_average_precision(scores, labels)), abs=1e-6)
    fpr, tpr, _ = roc_curve(labels.numpy(), scores.numpy(), drop_intermediate=False)
    expected = fpr[np.argmax(tpr >= 0.95)]
    assert M.fpr_at_tpr(scores[:n_pos], scores[n_pos:], 0.95) == pytest.approx(expected, abs=1e-12)


def test_ood_metrics_use_negated_msp_with_ood_positive():
    """AUPR and FPR95 of the predictive's maximum probability, OOD positive, by the reference functions."""
    p_id, p_ood = _probs(3, 120, 6, 0, 4.0), _probs(3, 90, 6, 1, 1.0)
    conf = torch.cat([p_id.mean(0), p_ood.mean(0)]).max(-1).values.numpy()
    ood = np.r_[np.zeros(120), np.ones(90)]
    assert M.aupr(p_id, p_ood) == pytest.approx(average_precision_score(ood, -conf), abs=1e-12)
    fpr, tpr, _ = roc_curve(ood, -conf, drop_intermediate=False)
    assert M.fpr95(p_id, p_ood) == pytest.approx(fpr[np.argmax(tpr >= 0.95)], abs=1e-12)
    # A detector that separates perfectly: AUPR 1, FPR95 0.
    certain = torch.nn.functional.one_hot(_labels(50, 6, 2), 6).double()[None].expand(3, -1, -1)
    uniform = torch.full((3, 40, 6), 1 / 6, dtype=torch.float64)
    assert M.aupr(certain, uniform) == 1.0 and M.fpr95(certain, uniform) == 0.0


@settings(max_examples=15, deadline=None)
@given(s=st.integers(1, 6), n=st.integers(1, 40), c=st.integers(2, 8), seed=st.integers(0, 2**31))
def test_mutual_information_is_entropy_of_mean_minus_mean_entropy(s, n, c, seed):
    """I = H(mean_s p_s) - mean_s H(p_s) (scipy's entropy), and 0 <= I <= log min(S, C)."""
    p = _probs(s, n, c, seed, 3.0)
    pn = p.numpy()
    ref = scipy_entropy(pn.mean(0), axis=-1) - scipy_entropy(pn, axis=-1).mean(0)
    mi = M.mutual_information(p, reduction="none")
    np.testing.assert_allclose(mi.numpy(), ref, rtol=1e-10, atol=1e-13)
    assert float(mi.min()) >= -1e-13 and float(mi.max()) <= math.log(min(s, c)) + 1e-12
    assert float(M.mutual_information(p)) == pytest.approx(ref.mean(), rel=1e-10, abs=1e-13)


# ------------------------------------------------------------------------------------- closed forms
def test_perfect_calibration_gives_zero_ece():
    """Every bin's accuracy equals its confidence: 8 of 10 correct at confidence 0.8, 3 of 5 at 0.6, all of
    4 at confidence 1."""
    rows = [([0.8, 0.2], 8, 2), ([0.6, 0.4], 3, 2), ([1.0, 0.0], 4, 0)]
    p = torch.tensor([r for r, k, w in rows for _ in range(k + w)], dtype=torch.float64)[None]
    y = torch.tensor([lab for _, k, w in rows for lab in [0] * k + [1] * w])
    assert M.ece(p, y) == pytest.approx(0.0, abs=1e-12)
    assert M.accuracy(p, y) == pytest.approx(15 / 19)


def test_constant_predictor_brier_and_nll():
    r"""A constant predictive :math:`\pi` on labels of frequencies f: Brier = 1 - 2 f.pi + |pi|^2
    (= 1 - |f|^2 at pi = f), NLL = -sum_c f_c log pi_c (the cross-entropy)."""
    y = torch.tensor([0] * 5 + [1] * 3 + [2] * 2)
    f = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    pi = torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    p = pi.expand(2, 10, 3).clone()
    assert M.brier(p, y) == pytest.approx(1 - 2 * float(f @ pi) + float(pi @ pi), abs=1e-12)
    assert M.brier(f.expand(1, 10, 3).clone(), y) == pytest.approx(1 - float(f @ f), abs=1e-12)
    assert M.nll(p, y) == pytest.approx(-float(f @ pi.log()), abs=1e-12)


def test_mutual_information_closed_forms():
    """Two certain members that disagree on 2 classes: I = ln 2; identical members: I = 0."""
    disagree = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    assert float(M.mutual_information(disagree)) == pytest.approx(math.log(2), abs=1e-15)
    same = _probs(1, 30, 5, 3).expand(4, -1, -1)
    assert float(M.mutual_information(same)) == pytest.approx(0.0, abs=1e-14)
    pair = PM.pairwise_mi(torch.cat([disagree, disagree[:1]]))
    assert pair[0:2].tolist() == pytest.approx([math.log(2), 0])


def test_evaluate_reports_percent():
    p_id, y = _probs(4, 60, 5, 0), _labels(60, 5, 1)
    p_ood = _probs(4, 30, 5, 2, 0.5)
    r = M.evaluate(p_id, y, p_ood)
    assert list(r) == list(M.METRICS)
    raw = [M.accuracy(p_id, y), M.ece(p_id, y), M.brier(p_id, y), M.nll(p_id, y), M.aupr(p_id, p_ood),
           M.fpr95(p_id, p_ood), float(M.mutual_information(p_id)), float(M.mutual_information(p_ood))]
    assert list(r.values()) == pytest.approx([100 * v for v in raw], rel=1e-12)
    assert list(M.evaluate(p_id, y)) == ["Acc", "ECE", "Brier", "NLL", "IDMI"]


# --------------------------------------------------------------------------------------- pairwise MI
def test_bad_input_names_problem_and_fix():
    p, y = _probs(2, 5, 3, 0), _labels(5, 3, 1)
    with pytest.raises(ValueError, match=r"does not sum to one.*softmax"):
        M.evaluate(torch.randn(2, 5, 3).abs(), y)
    with pytest.raises(ValueError, match="negative values.*softmax"):
        M.evaluate(p - 0.5, y)
    nan = p.clone()
    nan[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        M.evaluate(nan, y)
    with pytest.raises(ValueError, match=r"p\[None\]"):
        M.evaluate(p[0], y)
    with pytest.raises(ValueError, match="empty"):
        M.evaluate(p[:, :0], y[:0])
    with pytest.raises(ValueError, match="C >= 2"):
        M.evaluate(torch.ones(2, 5, 1), y)
    with pytest.raises(ValueError, match=r"labels in \[0, 3\].*C = 3"):
        M.evaluate(p, torch.tensor([0, 1, 2, 3, 0]))
    with pytest.raises(ValueError, match="integer tensor"):
        M.evaluate(p, y.float())
    with pytest.raises(ValueError, match="shape"):
        M.accuracy(p, y[:4])
    with pytest.raises(ValueError, match="same samples and classes"):
        M.evaluate(p, y, _probs(3, 5, 3, 2))
    with pytest.raises(ValueError, match="same samples and classes"):
        M.aupr(p, _probs(2, 5, 4, 2))
    with pytest.raises(ValueError, match="at least two models"):
        PM.pairwise_mi(p[:1])
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        PM.pairwise_mi(p, workers=0)
    M.evaluate(p, y, _probs(2, 8, 3, 2))  # a different number of OOD inputs is fine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_metrics_on_cuda_match_cpu():
    p, y, q = _probs(5, 50, 4, 0), _labels(50, 4, 1), _probs(5, 30, 4, 2, 0.5)
    cpu = M.evaluate(p, y, q)
    gpu = M.evaluate(p.cuda(), y.cuda(), q.cuda())
    assert list(gpu.values()) == pytest.approx(list(cpu.values()), rel=1e-9, abs=1e-9)
    torch.testing.assert_close(PM.pairwise_mi(p.cuda()).cpu(), PM.pairwise_mi(p), rtol=1e-9, atol=1e-12)
