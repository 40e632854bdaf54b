r"""Functional collapse of a checkpoint zoo: the mutual information of every two-member ensemble on
in-distribution and out-of-distribution data (book: chapter "Functional collapse"; paper §5.1,
App. D.2, Fig. 3, 7 and 8).

For checkpoints :math:`i < j` with predictive distributions :math:`p_i(x)`, :math:`p_j(x)`,

.. math:: \mathrm{MI}(i, j) = \frac{1}{|D|}\sum_{x \in D}\Big[ H\big(\tfrac{p_i(x) + p_j(x)}{2}\big)
          - \tfrac{1}{2} H\big(p_i(x)\big) - \tfrac{1}{2} H\big(p_j(x)\big) \Big] \in [0, \ln 2],

computed on an ID test set and on its OOD set (:func:`symlib.data.ood_pair`: FashionMNIST for
MNIST, SVHN for CIFAR-100, Textures for TinyImageNet); the paper then asks whether the two
correlate across pairs (Pearson's :math:`r`).

* :func:`pairwise_study` takes a stacked zoo and the two image sets, evaluates every checkpoint
  once (:func:`symlib.stats.predict.probs`), and returns both condensed MI vectors and their correlation;
* :func:`eval_sets` gives the ID and OOD test images of a zoo configuration (real datasets at the
  ``paper`` scale, random images of the right shape for the synthetic smoke-test presets);
* :func:`zoo_collapse` chains them for a named preset (``"cifar100-resnet18"``,
  ``"tinyimagenet-resnet18"``): load or train the zoo, evaluate, correlate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch
from scipy import stats

from symlib.params import Params
from symlib.stats import pairwise_mi as _pairwise_mi
from symlib.stats import predict as _predict


@dataclasses.dataclass(frozen=True)
class PairwiseMI:
    """The pairwise mutual information of a zoo on ID and OOD data, and their correlation.

    Attributes:
        mi_id, mi_ood: ``(P,)`` float64 MI of the ``P = N(N-1)/2`` pairs, in nats, in the condensed
            order of ``scipy.spatial.distance.squareform`` (``(0,1), (0,2), ..., (1,2), ...``).
        r, p_value: Pearson's correlation between ``mi_id`` and ``mi_ood`` and its two-sided p-value
            (which treats the pairs as independent; they are not, each network is in ``N - 1`` pairs).
        ci: its 95% confidence interval (Fisher's transformation), ``(low, high)``.
        n_models: ``N``; n_id, n_ood: images of each set; labels: names of the two sets.
    """

    mi_id: np.ndarray
    mi_ood: np.ndarray
    r: float
    p_value: float
    ci: tuple[float, float]
    n_models: int
    n_id: int
    n_ood: int
    labels: tuple[str, str]

    @property
    def n_pairs(self) -> int:
        return len(self.mi_id)

    def summary(self) -> dict[str, float]:
        """Median, coefficient of variation and range of both sets' MI, and the share of pairs whose
        ID MI is below half its median (the paper's "MI twice lower than expected")."""
        out = {}
        for tag, v in (("id", self.mi_id), ("ood", self.mi_ood)):
            out.update({f"median_{tag}": float(np.median(v)), f"cv_{tag}": float(v.std() / v.mean()),
                        f"min_{tag}": float(v.min()), f"max_{tag}": float(v.max())})
        out["below_half_median"] = float((self.mi_id < np.median(self.mi_id) / 2).mean())
        return out


def correlation(mi_id: np.ndarray, mi_ood: np.ndarray, level: float = 0.95
                ) -> tuple[float, float, tuple[float, float]]:
    """Pearson's ``r`` between two MI vectors, its p-value and its ``level`` confidence interval.

    Raises:
        ValueError: fewer than four pairs (the interval needs ``P > 3``) or a constant vector.
    """
    mi_id, mi_ood = np.asarray(mi_id, dtype=np.float64), np.asarray(mi_ood, dtype=np.float64)
    if mi_id.shape != mi_ood.shape or mi_id.ndim != 1:
        raise ValueError(f"mi_id and mi_ood must be vectors of the same length, got {mi_id.shape}, "
                         f"{mi_ood.shape}")
    if len(mi_id) < 4:
        raise ValueError(f"Pearson's confidence interval needs at least 4 pairs (4 checkpoints give 6), "
                         f"got {len(mi_id)}; use a zoo of at least 4 checkpoints")
    if np.ptp(mi_id) == 0 or np.ptp(mi_ood) == 0:
        raise ValueError("a constant MI vector has no correlation: are all checkpoints the same network?")
    res = stats.pearsonr(mi_id, mi_ood)
    ci = res.confidence_interval(level)
    return float(res.statistic), float(res.pvalue), (float(ci.low), float(ci.high))


def pairwise_study(params: Params, x_id: torch.Tensor, x_ood: torch.Tensor,
                   arch: str | Callable[[], torch.nn.Module] | torch.nn.Module = "optunet",
                   labels: tuple[str, str] = ("ID", "OOD"), batch_size: int = 256, chunk: int | None = None,
                   device: str | torch.device | None = None, dtype: torch.dtype = torch.float32,
                   progress: bool = False) -> PairwiseMI:
    """The MI of every pair of checkpoints on ``x_id`` and ``x_ood``, and their Pearson correlation.

    Args:
        params: the stacked zoo ``{name: (N, ...)}`` (``zoo.load_or_train(cfg)[0]``), buffers included.
        x_id, x_ood: in- and out-of-distribution images ``(n, C, H, W)``.
        arch: ``"optunet"`` or the module factory of the checkpoints (a zoo config's ``make_model``),
            as :func:`symlib.stats.predict.probs` takes it.
        labels: names of the two sets (figures, tables).
        batch_size, chunk, device, dtype, progress: passed to :func:`symlib.stats.predict.probs`; the MI is
            computed in ``dtype`` too and accumulated in float64.

    Returns:
        A :class:`PairwiseMI`.
    """
    mi = []
    for x in (x_id, x_ood):
        p = _predict.probs(params, x, arch=arch, batch_size=batch_size, chunk=chunk, device=device,
                           dtype=dtype, progress=progress)
        mi.append(torch.as_tensor(_pairwise_mi.pairwise_mi(p)).double().cpu().numpy())
        del p
    r, p_value, ci = correlation(mi[0], mi[1])
    n_models = int(next(iter(params.values())).shape[0])
    return PairwiseMI(mi_id=mi[0], mi_ood=mi[1], r=r, p_value=p_value, ci=ci, n_models=n_models,
                      n_id=int(x_id.shape[0]), n_ood=int(x_ood.shape[0]), labels=tuple(labels))


DISPLAY = {"mnist": "MNIST", "fashion-mnist": "FashionMNIST", "cifar100": "CIFAR-100", "svhn": "SVHN",
           "tinyimagenet": "TinyImageNet", "textures": "Textures"}


def eval_sets(cfg, n_images: int | None = None, device: str | torch.device = "cpu",
              data_root=None) -> tuple[torch.Tensor, torch.Tensor, tuple[str, str]]:
    """The ID test images of a zoo configuration, its OOD images, and their names.

    Real data (``cfg.source`` ``"torchvision"`` or ``"embedded"``): the ID test split
    (:func:`symlib.data.load`) and the paired OOD set normalised (and resized) as the ID set
    (:func:`symlib.data.load_ood`); a missing dataset raises :mod:`symlib.data`'s
    ``FileNotFoundError`` naming the file and how to fetch it. Synthetic configurations (smoke tests):
    the zoo's random test images (:func:`symlib.zoo.load_data`) as ID, and random images of the same
    shape drawn from another distribution (uniform, wider) as OOD.

    Args:
        cfg: a :class:`symlib.zoo.ZooConfig`.
        n_images: keep the first ``n_images`` of each set (default: all).
        device: where to put the images.
        data_root: folder of the datasets (default ``$SYMLIB_DATA``).
    """
    from symlib import data as _data
    from symlib import zoo as _zoo

    ood_name = _data.ood_pair(cfg.dataset)
    labels = (DISPLAY.get(cfg.dataset, cfg.dataset), DISPLAY.get(ood_name, ood_name))
    if cfg.source == "synthetic":
        x_id = _zoo.load_data(cfg).x_test
        g = torch.Generator().manual_seed(2024)
        x_ood = torch.rand(x_id.shape, generator=g).mul_(4).sub_(2)  # uniform on [-2, 2]
        labels = (f"{labels[0]} (synthetic)", f"{labels[1]} (synthetic)")
    else:
        x_id = _data.load(cfg.dataset, "test", source=cfg.source, data_root=data_root).x
        x_ood = _data.load_ood(cfg.dataset, "test", source=cfg.source, data_root=data_root).x
    return x_id[:n_images].to(device), x_ood[:n_images].to(device), labels


def zoo_collapse(cfg, device: str | torch.device = "cpu", seed: int | None = None,
                 n_images: int | None = None, dtype: torch.dtype = torch.float32, chunk: int | None = None,
                 batch_size: int = 256, cache_dir=None, data_root=None, progress: bool = True
                 ) -> tuple[PairwiseMI, dict]:
    """Functional collapse of a zoo: load (or train) it, then :func:`pairwise_study` on its ID and OOD
    test sets (:func:`eval_sets`). Paper Fig. 3 (``"cifar100-resnet18"``, SVHN) and Fig. 8
    (``"tinyimagenet-resnet18"``, Textures) at the ``paper`` scale.

    The data are loaded before the zoo, so that a missing dataset fails at once, not after training.

    Args:
        cfg: a :class:`symlib.zoo.ZooConfig` (:func:`symlib.zoo.preset`).
        device: where to train and evaluate.
        seed: replaces ``cfg.seed`` (another, independent zoo), as in :func:`symlib.zoo.load_or_train`.
        n_images: images of each set (default: all).
        dtype, chunk, batch_size: of the evaluation (:func:`symlib.stats.predict.probs`).
        cache_dir: the zoo cache (default ``$SYMLIB_CACHE``); data_root: the datasets' folder.
        progress: progress bars.

    Returns:
        ``(study, manifest)``: the :class:`PairwiseMI` and the zoo's manifest (per-model accuracy).
    """
    from symlib import zoo as _zoo

    if cfg.n_models < 4:
        raise ValueError(f"{cfg.preset}/{cfg.scale} has {cfg.n_models} checkpoints: Pearson's interval needs "
                         "at least 4 (6 pairs); use dataclasses.replace(cfg, n_models=4) or more")
    x_id, x_ood, labels = eval_sets(cfg, n_images, device, data_root)
    params, manifest = _zoo.load_or_train(cfg, device=device, cache_dir=cache_dir, seed=seed,
                                          progress=progress)
    arch = "optunet" if cfg.arch == "optunet" else cfg.make_model
    study = pairwise_study(params, x_id, x_ood, arch=arch, labels=labels, batch_size=batch_size, chunk=chunk,
                           device=device, dtype=dtype, progress=progress)
    return study, manifest
