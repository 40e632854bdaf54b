r"""Small helpers the chapters share, kept out of the notebooks (book: chapters "Table 1" and "Aligning
variational posteriors").

* :class:`Clock` times the steps of a chapter (wall clock and CPU seconds of the process);
* :func:`random_posterior` draws a mean-field posterior around a freshly initialised network, for timing
  alignment costs on networks of growing width;
* :func:`remove` is the symmetry removal of the alignment chapter: the MMD's removals
  (:func:`symlib.stats.mmd.remove_symmetries`) plus alignment to a reference network, with or without
  normalising the neurons first.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from symlib import models
from symlib.params import Params
from symlib.stats import mmd
from symlib.symmetry import align, canonical
from symlib.symmetry.spec import Spec

__all__ = ["REMOVALS", "Clock", "random_posterior", "remove"]

REMOVALS = ("raw", "perm", "ns", "align", "ns+align")
"""The removals of :func:`remove`: nothing, sorting, normalising then sorting (the paper's NS), aligning
to a reference by weight matching, normalising then aligning."""


class Clock:
    """Seconds per step of a chapter: ``clock.tic()`` then ``clock.toc("metrics")`` (or ``with
    clock("metrics"): ...``) adds the wall-clock and the CPU time (of this process, all its threads) in
    between to step ``"metrics"``; ``clock.steps`` holds ``{step: (wall, cpu)}`` in the order the steps
    first ran."""

    def __init__(self) -> None:
        self.steps: dict[str, tuple[float, float]] = {}
        self._start = (time.perf_counter(), time.process_time())

    def tic(self) -> None:
        """Start timing."""
        self._start = (time.perf_counter(), time.process_time())

    def toc(self, step: str) -> None:
        """Add the time since the last :meth:`tic` to ``step``."""
        wall, cpu = self.steps.get(step, (0.0, 0.0))
        wall0, cpu0 = self._start
        self.steps[step] = (wall + time.perf_counter() - wall0, cpu + time.process_time() - cpu0)

    @contextlib.contextmanager
    def __call__(self, step: str) -> Iterator[None]:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            wall, cpu = self.steps.get(step, (0.0, 0.0))
            self.steps[step] = (wall + time.perf_counter() - wall0, cpu + time.process_time() - cpu0)

    def frame(self):
        """The steps as a DataFrame with columns ``wall s`` and ``CPU s`` and a ``total`` row."""
        import pandas as pd

        out = pd.DataFrame.from_dict(self.steps, orient="index", columns=["wall s", "CPU s"])
        out.loc["total"] = out.sum()
        return out


def random_posterior(arch: str, width: int, seed: int) -> tuple[torch.nn.Module, Params, Params]:
    """A network at PyTorch's initialisation (``torch.manual_seed(seed)``) and a mean-field posterior
    around it: the means are its weights, the standard deviations uniform in ``[0.01, 0.1)`` (another
    generator, ``seed + 1``). ``arch``: ``"mlp"`` (784-w-w-w-10) or ``"resnet20"`` (width ``w``).

    Returns:
        ``(network, means, stds)``.
    """
    if arch not in ("mlp", "resnet20"):
        raise ValueError(f"arch must be 'mlp' or 'resnet20', got {arch!r}")
    torch.manual_seed(seed)
    net = models.MLP([784, width, width, width, 10]) if arch == "mlp" else models.ResNet20(width=width)
    g = torch.Generator().manual_seed(seed + 1)
    mean = {k: v.detach().clone() for k, v in net.state_dict().items()}
    std = {
        k: 0.01 + 0.09 * torch.rand(v.shape, generator=g) for k, v in mean.items() if v.is_floating_point()
    }
    return net, mean, std


def remove(params: Params, spec: Spec, how: str, reference: Params | None = None, seed: int = 0) -> Params:
    """A stacked set of networks with symmetries removed by ``how`` (one of :data:`REMOVALS`).

    ``"raw"``, ``"perm"`` and ``"ns"`` are :func:`symlib.stats.mmd.remove_symmetries`; ``"align"`` aligns
    every network to ``reference`` (one network, no batch axis) by weight matching
    (:func:`symlib.symmetry.align.align_many`); ``"ns+align"`` normalises the neurons of both first.
    """
    if how in ("raw", "perm", "ns"):
        return mmd.remove_symmetries(params, spec, how)
    if how not in REMOVALS:
        raise ValueError(f"unknown removal {how!r}; choose one of {REMOVALS}")
    if reference is None:
        raise ValueError(f"removal {how!r} aligns to a reference network: pass reference=<one state dict>")
    if how == "align":
        return align.align_many(reference, params, spec, cost="weights", seed=seed)[0]
    normed = canonical.normalize(params, spec)
    ref_n = canonical.normalize({k: v[None] for k, v in reference.items()}, spec)
    ref_n = {k: v[0] for k, v in ref_n.items()}
    return align.align_many(ref_n, normed, spec, cost="weights", seed=seed)[0]
