r"""What every posterior approximation shares (book: chapter "Table 1").

The paper compares approximations of the Bayesian posterior by the *weights they
produce* (§4, App. B): every method turns a training problem into a set of full
weight samples, so that MMD, canonical forms, uncertainty metrics and plots treat
a deep ensemble, 100 SWAG draws and 100 HMC samples alike.

* :class:`Setup` is the training problem: architecture, data on the device, the
  recipe of the base models and the weight decay that becomes the Gaussian prior.
* :class:`SampleSet` is what a method returns: stacked state dicts ``(S, ...)``
  (``S = n_modes * n_per_mode``, mode-major: samples ``i * n_per_mode ...`` come
  from mode ``i``), with the method's hyper-parameters and diagnostics as JSON.

Each method lives in its own module of :mod:`symlib.posteriors` and exposes
``sample(setup, n_modes, n_per_mode, seed, ..., progress=True) -> SampleSet``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from symlib import train as _train

Params = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Setup:
    """A training problem shared by every posterior method.

    Attributes:
        arch: ``"optunet"`` (stacked fast paths), ``"resnet18"``, ``"resnet20"`` or ``"mlp"``.
        make_model: builds a freshly initialised ``nn.Module`` of the architecture (global RNG).
        x, y: training images ``(N, C, H, W)`` and labels ``(N,)``, on the device to train on.
        recipe: the SGD recipe of the base models (paper App. B.1); its ``weight_decay`` is the
            precision of the Gaussian prior for the methods that need one (see :attr:`prior_precision`).
        fill: value of the padding pixels of random crops (per channel, normalised black).
        num_classes: number of outputs.
        name: a label for manifests (e.g. the zoo preset ``"mnist-optunet"``).
        scale: ``"tiny"``, ``"cpu"`` or ``"paper"``.
        data_info: the data fingerprint (as in zoo manifests).
    """

    arch: str
    make_model: Callable[[], torch.nn.Module]
    x: torch.Tensor
    y: torch.Tensor
    recipe: _train.Recipe
    fill: tuple[float, ...] = (0.0,)
    num_classes: int = 10
    name: str = ""
    scale: str = "cpu"
    data_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def n_train(self) -> int:
        return int(self.x.shape[0])

    @property
    def prior_precision(self) -> float:
        r"""Precision :math:`\lambda` of the isotropic Gaussian prior that matches the recipe's weight
        decay: SGD on the mean loss :math:`\bar L + \tfrac{wd}{2}\lVert\theta\rVert^2` is gradient descent
        on :math:`-\log p(\theta \mid D) / N` with :math:`p(\theta) = \mathcal N(0, \lambda^{-1} I)` and
        :math:`\lambda = N \cdot wd`."""
        return self.n_train * self.recipe.weight_decay


@dataclasses.dataclass
class SampleSet:
    """Full weight samples of one posterior approximation.

    Attributes:
        params: stacked state dicts ``{name: (S, ...)}`` (``S = n_modes * n_per_mode``, mode-major).
        method: the method's name (``"swag"``, ``"laplace"``, ...).
        n_modes: independently trained base models (1: one-mode, 10: the paper's multi-mode).
        n_per_mode: samples drawn around / from each mode.
        hyper: the method's hyper-parameters (JSON-able).
        base_seeds: seeds of the base models (their zoo seeds), one per mode.
        diagnostics: method-specific diagnostics (JSON-able), e.g. HMC's acceptance rate and R-hat.
    """

    params: Params
    method: str
    n_modes: int
    n_per_mode: int
    hyper: dict[str, Any] = dataclasses.field(default_factory=dict)
    base_seeds: list[int] = dataclasses.field(default_factory=list)
    diagnostics: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n = {int(v.shape[0]) for v in self.params.values()}
        if len(n) != 1 or n.pop() != self.n_modes * self.n_per_mode:
            raise ValueError(
                f"a SampleSet holds n_modes * n_per_mode = {self.n_modes * self.n_per_mode} samples along "
                f"the first axis of every tensor; got shapes {[tuple(v.shape) for v in self.params.values()]}"
            )

    @property
    def n_samples(self) -> int:
        return self.n_modes * self.n_per_mode

    @property
    def modes(self) -> torch.Tensor:
        """The mode index of every sample, ``(S,)``."""
        return torch.arange(self.n_modes).repeat_interleave(self.n_per_mode)
