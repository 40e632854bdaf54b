r"""The marginalised predictive along a path between two mean-field posteriors (book: chapter
"Aligning variational posteriors"; Rossi, Singh & Hannagan 2023).

A mean-field Gaussian posterior :math:`q = \mathcal N(m, \mathrm{diag}\,s^2)` predicts with its
*marginalised* (Bayesian model average) predictive, estimated by Monte Carlo over weight samples:

.. math:: \hat p(y \mid x) = \frac1S \sum_{k=1}^S \mathrm{softmax}\big(f(x; m + s \odot \epsilon_k)\big)_y,
          \qquad \epsilon_k \sim \mathcal N(0, I).

Along the straight path :math:`q_t` from :math:`q_0` to :math:`q_1` (means and standard deviations
interpolated linearly, :func:`symlib.symmetry.align.interpolate`), the test loss :math:`L(t) = -\frac1N \sum_n
\log \hat p_t(y_n \mid x_n)` and the accuracy of :math:`\hat p_t` are measured at a grid of ``t``; the
*loss barrier* is :math:`\max_t L(t) - [(1-t) L(0) + t L(1)]` (:func:`symlib.symmetry.align.barrier`).

The noise :math:`\epsilon_k` is drawn once and shared by every ``t`` (common random numbers): the curve
then moves only because the posterior does, and the Monte-Carlo error of differences along the path is
much smaller than that of single points.

**BatchNorm.** The running statistics of an interpolated network are not those of the network: the
mean of two networks' statistics is not the statistic of the mean network (Jordan et al. 2023). With
``bn_x`` given, each weight sample's BatchNorm statistics are recomputed on those inputs (cumulative
averages in training mode) before it predicts, as Ainsworth et al. (2023) do along their paths.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from symlib.symmetry import align as _align
from symlib.symmetry.spec import Params


@dataclasses.dataclass
class Path:
    r"""The marginalised predictive along a path (:func:`path`).

    Attributes:
        ts: positions ``(T,)`` on the path, 0 and 1 included.
        nll: test loss of the marginalised predictive at each ``t`` ``(T,)`` (nats per example).
        acc: its accuracy at each ``t`` ``(T,)``, in [0, 1].
        barrier: the loss barrier :math:`\max_t L(t) - [(1-t)L(0) + tL(1)]`.
        acc_drop: the accuracy barrier :math:`\max_t [(1-t)A(0) + tA(1)] - A(t)`.
    """

    ts: np.ndarray
    nll: np.ndarray
    acc: np.ndarray
    barrier: float
    acc_drop: float


def _noise(std: Params, n_samples: int, seed: int) -> list[Params]:
    gen = torch.Generator().manual_seed(int(seed))
    return [{k: torch.randn(v.shape, generator=gen, dtype=torch.float64).to(v) for k, v in std.items()}
            for _ in range(n_samples)]


def _reset_batchnorm(net: nn.Module, bn_x: torch.Tensor, chunk: int) -> None:
    """Recompute every BatchNorm's running statistics of ``net`` on ``bn_x`` (cumulative averages)."""
    bns = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    net.train()
    with torch.no_grad():
        for i in range(0, len(bn_x), chunk):
            net(bn_x[i:i + chunk])
    net.eval()


def predictive(model: nn.Module, mean: Params, std: Params | None, x: torch.Tensor, n_samples: int = 32,
               seed: int = 0, bn_x: torch.Tensor | None = None, chunk: int = 1000,
               noise: list[Params] | None = None) -> torch.Tensor:
    r"""Monte-Carlo marginalised predictive :math:`\hat p(y \mid x)` of a mean-field posterior.

    Args:
        model: a module of the architecture (its own weights are not used; it is copied).
        mean: full state dict of the posterior means (point-estimated parameters and buffers included).
        std: standard deviations of the stochastic tensors (a subset of ``mean``'s keys; the others
            are deterministic); ``None`` for a point estimate (one "sample", the means).
        x: inputs ``(N, ...)``.
        n_samples: weight samples :math:`S` (the appendix uses 128).
        seed: seed of the noise (ignored when ``noise`` is given).
        bn_x: inputs on which to recompute BatchNorm statistics per sample (module docstring); ``None``
            keeps the statistics of ``mean``.
        chunk: examples per forward pass.
        noise: the standard normal draws ``[{name: tensor}] * S`` to use (shared along a path).

    Returns:
        Probabilities ``(N, classes)``, float64.
    """
    if std is None or not std:
        std, noise = {}, [{}]
    elif noise is None:
        noise = _noise(std, n_samples, seed)
    missing = [k for k in std if k not in mean]
    if missing:
        raise KeyError(f"std has tensors {missing[:3]} that mean lacks; pass the full state dict of means")
    net = copy.deepcopy(model).eval()
    probs = torch.zeros(x.shape[0], 0, dtype=torch.float64)
    for eps in noise:
        w = {k: (v + std[k] * eps[k]) if k in std else v for k, v in mean.items()}
        if bn_x is not None:  # the module's own state: BatchNorm statistics are recomputed in place
            net.load_state_dict(w)
            _reset_batchnorm(net, bn_x, chunk)
            f = net
        else:
            def f(xb, w=w):
                return torch.func.functional_call(net, w, (xb,))
        with torch.no_grad():
            p = torch.cat([F.softmax(f(x[i:i + chunk]).double(), -1) for i in range(0, len(x), chunk)])
        probs = p if probs.shape[1] == 0 else probs + p
    return (probs / len(noise)).cpu()


def scores(probs: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(nll, accuracy)`` of predicted probabilities ``(N, C)`` against labels ``(N,)``."""
    y = y.to(probs.device)
    nll = float(-torch.log(probs.gather(1, y[:, None]).clamp_min(1e-300)).mean())
    acc = float((probs.argmax(1) == y).double().mean())
    return nll, acc


def path(model: nn.Module, mean0: Params, std0: Params | None, mean1: Params, std1: Params | None,
         x: torch.Tensor, y: torch.Tensor, ts=11, n_samples: int = 32, seed: int = 0,
         bn_x: torch.Tensor | None = None, chunk: int = 1000, ends: dict | None = None) -> Path:
    r"""Loss and accuracy of the marginalised predictive of :math:`q_t` along the straight path.

    Args:
        model: a module of the architecture.
        mean0, std0, mean1, std1: the two posteriors (align side 1 first to measure a barrier modulo
            permutations, :func:`symlib.symmetry.align.align`); stds ``None`` for point estimates.
        x, y: test inputs and labels.
        ts: positions in [0, 1] including both ends, or their number (evenly spaced).
        n_samples, seed, bn_x, chunk: as in :func:`predictive`; one noise draw serves every ``t``.
        ends: ``{0.0: (nll, acc), 1.0: (nll, acc)}`` already measured with the same noise (the ends of
            paths between one pair of posteriors are the same functions whatever the alignment);
            filled in place when missing.

    Returns:
        A :class:`Path`.
    """
    ts = np.linspace(0.0, 1.0, ts) if isinstance(ts, int) else np.asarray(ts, dtype=float)
    if len(ts) < 2 or not math.isclose(ts[0], 0.0) or not math.isclose(ts[-1], 1.0):
        raise ValueError(f"ts must run from 0 to 1 with at least two points, got {ts.tolist()}")
    ends = {} if ends is None else ends
    noise = _noise(std0, n_samples, seed) if std0 else None
    nll, acc = [], []
    for t in ts:
        key = 0.0 if math.isclose(t, 0.0) else 1.0 if math.isclose(t, 1.0) else None
        if key is not None and key in ends:
            v = ends[key]
        else:
            m, s = _align.interpolate(mean0, std0, mean1, std1, float(t))
            v = scores(predictive(model, m, s, x, n_samples, seed, bn_x, chunk, noise), y)
            if key is not None:
                ends[key] = v
        nll.append(v[0])
        acc.append(v[1])
    nll, acc = np.array(nll), np.array(acc)
    drop = max(float((1 - t) * acc[0] + t * acc[-1] - a) for t, a in zip(ts, acc, strict=True))
    return Path(ts, nll, acc, _barrier(ts, nll), drop)


def _barrier(ts: np.ndarray, values: np.ndarray) -> float:
    """:func:`symlib.symmetry.align.barrier` for any grid ``ts`` (the same on an even grid)."""
    if np.allclose(ts, np.linspace(0, 1, len(ts))):
        return _align.barrier(values)
    return float(np.max(values - ((1 - ts) * values[0] + ts * values[-1])))
