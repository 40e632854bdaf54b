r"""The posterior's marginals, with and without symmetries (book: chapter "The posterior's marginals";
paper App. D.1, D.3).

The paper's Proposition 1 writes the posterior of a ReLU network as a mixture, over all
permutations of its hidden neurons, of copies of one identifiable posterior. A corollary: as long
as the permutations are not removed, every neuron of a layer has the same marginal distribution,
since a uniformly random relabelling makes the neurons exchangeable. This module provides what the
chapter needs to look at it on real checkpoints:

* :func:`regression_data` and :func:`train_mlps`: many ReLU MLPs trained at once on a small real
  regression dataset that scikit-learn ships (no download): the diabetes data, 442 patients x 10
  features (the paper used UCI energy efficiency, 768 x 8, which is not shipped by any installed
  package);
* :func:`stages`: the checkpoints raw, after permutation removal, after permutation and scaling
  removal (:mod:`symlib.symmetry.canonical`);
* :func:`neuron_values` and :func:`ks_between_neurons`: one weight per neuron across checkpoints
  and two-sample Kolmogorov-Smirnov tests of equal marginals for every pair of neurons;
* :func:`flatten`, :func:`pca_explained` and :func:`condensed_distances`: weight-space geometry of
  a set of checkpoints (PCA by SVD; pairwise Euclidean distances in ``scipy``'s condensed order);
* :func:`mean_shift` and :func:`meanshift_counts`: the number of modes mean shift finds as its
  bandwidth varies (App. D.1), vectorised over the seeds (scikit-learn's ``MeanShift`` is the test
  reference).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np
import torch

from symlib.paper.toy import init_mlps
from symlib.progress import bar as progress_bar
from symlib.symmetry import canonical
from symlib.symmetry.spec import Params, Spec

DATASETS = ("diabetes",)


@dataclasses.dataclass(frozen=True)
class RegressionData:
    """Standardised regression data: ``x (N, d)``, ``y (N,)``, and where it comes from."""

    x: torch.Tensor
    y: torch.Tensor
    name: str
    source: str


def regression_data(name: str = "diabetes", dtype=torch.float32) -> RegressionData:
    """A small real regression dataset shipped with scikit-learn, features and target standardised.

    Args:
        name: ``"diabetes"`` (Efron et al. 2004: 442 patients, 10 baseline variables, disease
            progression after one year), from :func:`sklearn.datasets.load_diabetes`.
        dtype: of the returned tensors.
    """
    if name not in DATASETS:
        raise ValueError(
            f"unknown regression dataset {name!r}; choose one of {DATASETS} (shipped with scikit-learn, "
            "so nothing is downloaded)"
        )
    from sklearn.datasets import load_diabetes

    raw = load_diabetes()
    x = np.asarray(raw.data, dtype=np.float64)
    y = np.asarray(raw.target, dtype=np.float64)
    x = (x - x.mean(0)) / x.std(0)
    y = (y - y.mean()) / y.std()
    return RegressionData(torch.tensor(x, dtype=dtype), torch.tensor(y, dtype=dtype), name,
                          "sklearn.datasets.load_diabetes")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """Stacked trained MLPs ``{name: (M, ...)}`` (keys of :class:`symlib.models.MLP`), their final
    training mean squared errors ``(M,)`` and the training time."""

    theta: Params
    mse: torch.Tensor
    seconds: float


def _forward(ws: list[torch.Tensor], bs: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``M`` stacked ReLU MLPs, each on its own batch ``x (M, B, d)``: outputs ``(M, B, out)``."""
    h = x
    for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
        h = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
        if i < len(ws) - 1:
            h = torch.relu(h)
    return h


def mse(theta: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of every stacked MLP on the whole set: ``(M,)``."""
    n_layers = len(theta) // 2
    ws = [theta[f"{2 * i}.weight"] for i in range(n_layers)]
    bs = [theta[f"{2 * i}.bias"] for i in range(n_layers)]
    m = ws[0].shape[0]
    with torch.no_grad():
        out = _forward(ws, bs, x.expand(m, *x.shape))[..., 0]
    return (out - y).pow(2).mean(-1)


def train_mlps(
    data: RegressionData,
    n_models: int,
    widths: Sequence[int] = (10, 16, 16, 1),
    epochs: int = 100,
    batch_size: int = 32,
    lr: float = 0.01,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    seed: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> TrainResult:
    r"""Train ``n_models`` ReLU MLPs at once on mean squared error with SGD (momentum, weight decay).

    Every model has its own initialisation (PyTorch's default, :func:`symlib.paper.toy.init_mlps`) and
    its own shuffling of the data every epoch; all models take their steps together, as batched
    matrix products over a leading model axis, and autograd differentiates the sum of the models'
    losses (each model's gradient is that of its own loss).

    Args:
        data: the training set (:func:`regression_data`).
        n_models: independent networks.
        widths: layer widths, input first, one output.
        epochs, batch_size, lr, momentum, weight_decay: the SGD recipe (``torch.optim.SGD``'s update).
        seed: seeds the initialisations and the data orders.
        device: where to train.
        progress: show a progress bar over the epochs.
    """
    if widths[0] != data.x.shape[1] or widths[-1] != 1:
        raise ValueError(
            f"widths must start with the {data.x.shape[1]} input features and end with 1 output, "
            f"got {list(widths)}"
        )
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    theta = {k: v.to(device) for k, v in init_mlps(widths, n_models, gen, dtype=data.x.dtype).items()}
    params = [theta[k].requires_grad_() for k in theta]
    bufs = [torch.zeros_like(p) for p in params]
    n_layers = len(widths) - 1
    x, y = data.x.to(device), data.y.to(device)
    n = x.shape[0]
    start = time.perf_counter()
    bar = progress_bar(epochs, "epochs", enabled=progress)
    for _ in range(epochs):
        order = torch.rand(n_models, n, generator=gen).argsort(-1).to(device)
        for s in range(0, n, batch_size):
            idx = order[:, s: s + batch_size]
            out = _forward(params[0::2], params[1::2], x[idx])[..., 0]
            loss = (out - y[idx]).pow(2).mean(-1).sum()
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g, b in zip(params, grads, bufs, strict=True):
                    d = g.add(p, alpha=weight_decay)
                    b.mul_(momentum).add_(d)
                    p.sub_(lr * b)
        bar.update()
    bar.close()
    theta = {f"{2 * i}.{kind}": params[2 * i + j].detach().cpu()
             for i in range(n_layers) for j, kind in enumerate(("weight", "bias"))}
    return TrainResult(theta, mse(theta, data.x, data.y), time.perf_counter() - start)


STAGES = ("raw", "permutations removed", "permutations and scalings removed")


def stages(theta: Params, spec: Spec, key: str = "max", p: float = 2.0) -> dict[str, Params]:
    """The checkpoints raw, after sorting the neurons (``key``), after normalising and sorting.

    Returns:
        ``{stage name: params}`` with the names of :data:`STAGES`; every stage computes the same
        functions as ``theta`` (checked by :mod:`symlib.symmetry.canonical`).
    """
    return {
        STAGES[0]: theta,
        STAGES[1]: canonical.sort(theta, spec, key=key),
        STAGES[2]: canonical.canonicalize(theta, spec, p=p, key=key),
    }


def neuron_values(theta: Params, param: str, neuron_axis: int = 0, index: int = 0) -> torch.Tensor:
    """One weight per neuron across checkpoints: ``(M, n)``.

    ``theta[param]`` is stacked ``(M, ...)``; the neurons are along ``neuron_axis`` of one model's
    tensor and the weight kept is entry ``index`` of the other axes, flattened. For the output
    weights of the last hidden layer of an MLP, ``param="4.weight", neuron_axis=1``: neuron ``i``'s
    value is its outgoing weight.
    """
    t = theta[param]
    t = t.movedim(1 + neuron_axis, 1)
    return t.reshape(t.shape[0], t.shape[1], -1)[..., index]


@dataclasses.dataclass(frozen=True)
class KSResult:
    """Two-sample KS tests between neurons ``i < j`` (``scipy``'s condensed pair order).

    Attributes:
        pairs: ``(P, 2)`` neuron indices; statistic, pvalue: ``(P,)``.
        n1, n2: sample sizes of the two sides.
    """

    pairs: np.ndarray
    statistic: np.ndarray
    pvalue: np.ndarray
    n1: int
    n2: int

    def matrix(self, what: str = "pvalue") -> np.ndarray:
        """``(n, n)`` symmetric matrix of ``statistic`` or ``pvalue`` (diagonal NaN)."""
        n = int(self.pairs.max()) + 1
        out = np.full((n, n), np.nan)
        v = getattr(self, what)
        out[self.pairs[:, 0], self.pairs[:, 1]] = v
        out[self.pairs[:, 1], self.pairs[:, 0]] = v
        return out

    def rejected(self, alpha: float = 0.05) -> float:
        """Fraction of pairs whose test rejects equal marginals at level ``alpha``."""
        return float((self.pvalue < alpha).mean())


def ks_between_neurons(values: torch.Tensor | np.ndarray, split: bool = True) -> KSResult:
    """Two-sample Kolmogorov-Smirnov tests of equal marginals for every pair of neurons.

    The two values of one checkpoint are dependent, and KS assumes two independent samples; with
    ``split=True`` neuron ``i`` is therefore read on the first half of the checkpoints and neuron
    ``j`` on the second half, so that each test compares independent samples and its p-value is
    valid under the null hypothesis of equal marginals. All pairs go to one
    :func:`scipy.stats.ks_2samp` call along an axis.

    Args:
        values: ``(M, n)`` one weight per neuron and checkpoint (:func:`neuron_values`).
        split: use disjoint halves of the checkpoints for the two sides.
    """
    from scipy import stats

    v = np.asarray(values, dtype=np.float64)
    m, n = v.shape
    if n < 2 or m < (4 if split else 2):
        raise ValueError(f"need at least 2 neurons and {4 if split else 2} checkpoints, got values {v.shape}")
    i, j = np.triu_indices(n, 1)
    a, b = (v[: m // 2], v[m // 2:]) if split else (v, v)
    res = stats.ks_2samp(a[:, i], b[:, j], axis=0)
    return KSResult(np.stack([i, j], 1), np.atleast_1d(res.statistic), np.atleast_1d(res.pvalue),
                    a.shape[0], b.shape[0])


def flatten(theta: Params, keys: Sequence[str] | None = None) -> torch.Tensor:
    """Stacked parameters ``{name: (M, ...)}`` as one ``(M, D)`` matrix (``keys`` in the given order)."""
    keys = list(theta) if keys is None else list(keys)
    return torch.cat([theta[k].reshape(theta[k].shape[0], -1) for k in keys], dim=1)


def pca_explained(flat: torch.Tensor) -> torch.Tensor:
    r"""Explained variance ratio of every principal component of the rows of ``flat (M, D)``.

    With :math:`X` the centred matrix and :math:`s_k` its singular values, component ``k`` explains
    :math:`s_k^2 / \sum_j s_j^2` of the total variance (the ratio scikit-learn's PCA reports).

    Returns:
        ``(min(M, D),)`` float64, decreasing, summing to 1.
    """
    x = flat.to(torch.float64)
    x = x - x.mean(0, keepdim=True)
    s = torch.linalg.svdvals(x)
    var = s.pow(2)
    return var / var.sum()


def components_for(ratio: torch.Tensor, fraction: float) -> int:
    """Smallest number of components whose explained variance reaches ``fraction`` of the total."""
    return int(torch.searchsorted(ratio.cumsum(0), torch.tensor(fraction - 1e-12, dtype=ratio.dtype))) + 1


def condensed_distances(flat: torch.Tensor) -> torch.Tensor:
    """Euclidean distances between all pairs of rows ``i < j`` of ``flat (M, D)``, in the order of
    :func:`scipy.spatial.distance.pdist` (``M (M - 1) / 2`` values, float64)."""
    return torch.nn.functional.pdist(flat.to(torch.float64))


def mean_shift(points: torch.Tensor | np.ndarray, bandwidth: float, max_iter: int = 300
               ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Flat-kernel mean shift from every point at once (the algorithm of scikit-learn's ``MeanShift``
    with every point as a seed, vectorised over the seeds).

    Each seed moves to the mean of the points within ``bandwidth`` of it until it moves less than
    ``1e-3 * bandwidth`` or ``max_iter`` is reached; the converged positions are then merged, most
    populated first, dropping any within ``bandwidth`` of a kept one.

    Returns:
        ``(centres (K, D), intensities (K,))``: the modes and how many points lay within
        ``bandwidth`` of each at convergence.
    """
    x = torch.as_tensor(np.asarray(points, dtype=np.float64))
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    means = x.clone()
    active = torch.ones(len(x), dtype=torch.bool)
    count = torch.zeros(len(x), dtype=torch.float64)
    for _ in range(max_iter):
        idx = active.nonzero().squeeze(1)
        if len(idx) == 0:
            break
        near = (torch.cdist(means[idx], x) <= bandwidth).to(torch.float64)  # (k, n)
        count[idx] = near.sum(1)
        new = near @ x / count[idx].unsqueeze(1)
        done = (new - means[idx]).norm(dim=1) <= 1e-3 * bandwidth
        means[idx] = new
        active[idx[done]] = False
    order = torch.argsort(count, descending=True, stable=True)
    means, count = means[order], count[order]
    keep = torch.ones(len(means), dtype=torch.bool)
    close = torch.cdist(means, means) <= bandwidth
    for i in range(len(means)):
        if keep[i]:
            drop = close[i].clone()
            drop[: i + 1] = False
            keep &= ~drop
    return means[keep], count[keep]


def meanshift_counts(points: np.ndarray | torch.Tensor, bandwidths: Sequence[float], max_points: int = 2000,
                     seed: int = 0, standardize: bool = True, max_iter: int = 300) -> np.ndarray:
    """Number of modes (cluster centres) mean shift finds at each bandwidth (paper App. D.1).

    Args:
        points: ``(M, D)`` checkpoints (or any sample).
        bandwidths: kernel bandwidths, in the units of the (standardised) points.
        max_points: a random subset of this many points is used (mean shift is quadratic).
        seed: draws the subset.
        standardize: give every coordinate zero mean and unit variance first.
        max_iter: iterations per seed (every point is a seed), see :func:`mean_shift`.

    Returns:
        ``(len(bandwidths),)`` integer counts.
    """
    x = _prepare(points, max_points, seed, standardize)
    return np.asarray([len(mean_shift(x, float(h), max_iter)[0]) for h in bandwidths])


def _prepare(points, max_points: int, seed: int, standardize: bool) -> np.ndarray:
    x = np.asarray(points, dtype=np.float64)
    if len(x) > max_points:
        x = x[np.random.default_rng(seed).choice(len(x), max_points, replace=False)]
    if standardize:
        x = (x - x.mean(0)) / np.where(x.std(0) > 0, x.std(0), 1.0)
    return x


def median_distance(points: np.ndarray | torch.Tensor, max_points: int = 2000, seed: int = 0,
                    standardize: bool = True) -> float:
    """Median Euclidean distance between two points of the (subsampled, standardised) sample: the unit
    in which :func:`meanshift_counts`' bandwidths are naturally chosen."""
    x = _prepare(points, max_points, seed, standardize)
    return float(np.median(condensed_distances(torch.from_numpy(x)).numpy()))


def log10_modes(widths: Sequence[int]) -> float:
    r"""log10 of the number of permutation-induced copies of an MLP, :math:`\prod_\ell n_\ell!` over
    its hidden layers (paper App. D.1; :mod:`symlib.symmetry.counting` counts any architecture)."""
    return sum(math.lgamma(n + 1) for n in widths[1:-1]) / math.log(10)
