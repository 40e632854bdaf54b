r"""What every posterior approximation shares: the problem, the result and the method contract (book:
chapter "Table 1").

The paper compares approximations of the Bayesian posterior by the *weights they produce* (§4, App. B):
every method turns a training problem into a set of full weight samples, so that MMD, canonical forms,
uncertainty metrics and plots treat a deep ensemble, 100 SWAG draws and 100 HMC samples alike.

* :class:`Setup` is the training problem: architecture, data on the device, the recipe of the base
  models and the weight decay that becomes the Gaussian prior.
* :class:`SampleSet` is what a method returns: stacked state dicts ``(S, ...)`` (``S = n_modes *
  n_per_mode``, mode-major: samples ``i * n_per_mode ...`` come from mode ``i``), with the method's
  hyper-parameters and diagnostics as JSON.
* :class:`Method` is the contract every method module fulfils: a name, how it uses trained base models
  (:data:`BASE_USES`) and a *draw* function of a checked :class:`Request` and the method's own
  hyper-parameters. ``Method.sample`` (each module's ``sample``) checks the request once for all methods:
  sizes, the base models against the architecture, and the hyper-parameter names, before any work.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from symlib import scales as _scales
from symlib import training as _train
from symlib.errors import ArgumentError
from symlib.params import Params

__all__ = [
    "BASE_USES",
    "Method",
    "Request",
    "SampleSet",
    "Setup",
    "check_base",
    "check_positive",
    "check_sizes",
    "reference_state",
]

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
        """Where the training data lives, hence where the methods train."""
        return self.x.device

    @property
    def n_train(self) -> int:
        """:math:`N`, the number of training examples."""
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
        """``n_modes * n_per_mode``."""
        return self.n_modes * self.n_per_mode

    @property
    def modes(self) -> torch.Tensor:
        """The mode index of every sample, ``(S,)``."""
        return torch.arange(self.n_modes).repeat_interleave(self.n_per_mode)


# ----------------------------------------------------------------------------- argument checks


def check_positive(**values: float) -> None:
    """Raise a ``ValueError`` naming every hyper-parameter that is not a finite positive number."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite positive number, got {v!r}")


def check_sizes(n_modes: int, n_per_mode: int) -> None:
    """``n_modes`` and ``n_per_mode`` are integers >= 1 (a clear error otherwise)."""
    _scales.check_int("n_modes", n_modes, 1)
    _scales.check_int("n_per_mode", n_per_mode, 1)


def reference_state(setup: Setup) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one model's state dict (built on the meta device)."""
    with torch.device("meta"):
        model = setup.make_model()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_base(setup: Setup, base: Params | None, n_modes: int, method: str) -> Params:
    """Validate stacked base models ``(n_modes, ...)`` against the setup's architecture; return them on
    the setup's device."""
    if base is None:
        raise ValueError(
            f"{method} starts from trained base models; it needs trained networks: pass base=<stacked "
            f"state dicts (n_modes, ...)>, e.g. from symlib.posteriors.sampling.base_models(setup, n_modes, "
            f"seed) or a checkpoint zoo of the same preset (symlib.zoo.load_or_train), or use "
            f"sampling.run(...)"
        )
    ref = reference_state(setup)
    if set(base) != set(ref):
        missing, extra = sorted(set(ref) - set(base)), sorted(set(base) - set(ref))
        raise ValueError(
            f"{method}: the base models are not {setup.arch!r} networks of this setup (missing tensors "
            f"{missing[:5]}, unexpected {extra[:5]}): a base zoo of another architecture? Pass base models "
            f"trained for this setup"
        )
    for k, v in base.items():
        if tuple(v.shape) != (n_modes, *ref[k]):
            raise ValueError(
                f"{method}: base tensor {k!r} has shape {tuple(v.shape)}, expected {(n_modes, *ref[k])} "
                f"({n_modes} stacked {setup.arch!r} models; another width or number of classes?)"
            )
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ValueError(f"{method}: base tensor {k!r} holds NaN or infinite values")
    return {k: v.detach().to(setup.device) for k, v in base.items()}


# ----------------------------------------------------------------------------- the method contract

BASE_USES = ("required", "optional", "ignored", "forbidden")
"""How a method uses trained base models: SWAG and Laplace start from them (``"required"``); SGHMC and
HMC start their chains from them when given (``"optional"``, else from initialisation); VI trains its own
posteriors and warns that given ones are not used (``"ignored"``); deep ensembles and MC dropout train
their own networks and refuse them (``"forbidden"``)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request for samples, what a method's draw function receives.

    Attributes:
        setup: the training problem.
        n_modes, n_per_mode: sizes (1 x 100: one-mode; 10 x 10: the paper's multi-mode).
        seed: the run's seed (base models :func:`~symlib.posteriors.seeds.base_seeds`, the method's own
            streams :func:`~symlib.posteriors.seeds.stream_seeds`).
        base: the stacked base models ``(n_modes, ...)`` on the setup's device, checked against its
            architecture, or ``None``.
        progress: show progress bars.
    """

    setup: Setup
    n_modes: int
    n_per_mode: int
    seed: int
    base: Params | None
    progress: bool


_COMMON_ARGS = """\
setup: the training problem (:class:`~symlib.posteriors.base.Setup`).
n_modes: number of modes (independent base models, chains or posteriors).
n_per_mode: samples per mode; the set holds ``n_modes * n_per_mode``, mode-major.
seed: the run's seed.
base: stacked trained base models ``(n_modes, ...)``: {base}.
progress: show progress bars."""

_BASE_TEXT = {
    "required": "required (SWAG and Laplace start from trained networks)",
    "optional": "optional; the chains start from them when given, else from the initialisation",
    "ignored": "not used (a warning says so); the method trains its own networks",
    "forbidden": "must be ``None``; the method trains its own networks",
}


class Method:
    """A posterior approximation: its name, how it uses base models and its draw function.

    Args:
        name: the method's name (``"swag"``), recorded in every sample set.
        draw: ``draw(request, **hyper) -> SampleSet``; its keyword-only parameters are the method's
            hyper-parameters (defaults included), documented in its docstring.
        base: how the method uses base models, one of :data:`BASE_USES`.
        hyper: the hyper-parameter names, when ``draw`` takes ``**hyper`` (default: its keyword-only
            parameters).
        ignored_warning: the warning of a method that ignores given base models.
        check: ``check(**hyper)`` raises a ``ValueError`` naming a given hyper-parameter value the method
            refuses (a negative scale, a string for a learning rate), without any work, so that
            :meth:`check_hyper` refuses it before base models are trained.
    """

    def __init__(
        self,
        name: str,
        draw: Callable[..., SampleSet],
        base: str,
        hyper: tuple[str, ...] | None = None,
        ignored_warning: str = "",
        check: Callable[..., None] | None = None,
    ):
        if base not in BASE_USES:
            raise ValueError(f"base must be one of {BASE_USES}, got {base!r}")
        self.name, self.draw, self.base = name, draw, base
        params = inspect.signature(draw).parameters.values()
        own = tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
        self.hyper = tuple(hyper) if hyper is not None else own
        self.ignored_warning = ignored_warning or f"{name} trains its own networks; base models are not used"
        self.check = check

    def __repr__(self) -> str:
        return f"Method({self.name!r}, base={self.base!r}, hyper={list(self.hyper)})"

    def check_hyper(self, hyper: Mapping[str, Any]) -> None:
        """Refuse unknown hyper-parameter names, listing the valid ones, and values the method refuses
        (its ``check``), before any work is done."""
        unknown = sorted(set(hyper) - set(self.hyper))
        if unknown:
            raise ArgumentError(
                f"unknown {self.name} hyper-parameter(s) {unknown}; valid: {sorted(self.hyper)}"
            )
        if self.check is not None:
            self.check(**hyper)

    def request(
        self, setup: Setup, n_modes: int, n_per_mode: int, seed: int, base: Params | None, progress: bool
    ) -> Request:
        """Check sizes, seed and base models once for every method and return the :class:`Request`."""
        check_sizes(n_modes, n_per_mode)
        _scales.check_int("seed", seed, 0)
        if self.base == "required" or (self.base == "optional" and base is not None):
            base = check_base(setup, base, n_modes, self.name)
        elif self.base == "ignored" and base is not None:
            warnings.warn(self.ignored_warning, stacklevel=4)
            base = None
        elif self.base == "forbidden" and base is not None:
            raise ValueError(f"{self.name} trains its own networks from scratch; do not pass base models")
        return Request(setup, n_modes, n_per_mode, seed, base, bool(progress))

    def sample(
        self,
        setup: Setup,
        n_modes: int,
        n_per_mode: int,
        seed: int = 0,
        *,
        base: Params | None = None,
        progress: bool = True,
        **hyper: Any,
    ) -> SampleSet:
        """Check the request and the hyper-parameters, then draw the samples."""
        self.check_hyper(hyper)
        req = self.request(setup, n_modes, n_per_mode, seed, base, progress)
        return self.draw(req, **hyper)

    def sampler(self) -> Callable[..., SampleSet]:
        """The module-level ``sample(setup, n_modes, n_per_mode, seed=0, *, base=None, progress=True,
        **hyper)`` of this method, with the draw function's documentation and hyper-parameters in its
        signature and docstring."""
        method = self

        def sample(setup, n_modes, n_per_mode, seed=0, *, base=None, progress=True, **hyper):
            return method.sample(setup, n_modes, n_per_mode, seed, base=base, progress=progress, **hyper)

        p = inspect.Parameter
        common = [
            p("setup", p.POSITIONAL_OR_KEYWORD, annotation="Setup"),
            p("n_modes", p.POSITIONAL_OR_KEYWORD, annotation="int"),
            p("n_per_mode", p.POSITIONAL_OR_KEYWORD, annotation="int"),
            p("seed", p.POSITIONAL_OR_KEYWORD, default=0, annotation="int"),
            p("base", p.KEYWORD_ONLY, default=None, annotation="Params | None"),
            p("progress", p.KEYWORD_ONLY, default=True, annotation="bool"),
        ]
        own = [q for q in inspect.signature(self.draw).parameters.values() if q.kind is p.KEYWORD_ONLY]
        if not own and self.hyper:
            own = [p("hyper", p.VAR_KEYWORD)]
        sample.__signature__ = inspect.Signature(common + own, return_annotation="SampleSet")
        common_doc = _COMMON_ARGS.format(base=_BASE_TEXT[self.base])
        sample.__doc__ = _merge_args(inspect.getdoc(self.draw) or "", common_doc)
        sample.__module__ = self.draw.__module__
        sample.__qualname__ = sample.__name__ = "sample"
        sample.method = self
        return sample


def _merge_args(doc: str, common: str) -> str:
    """``doc`` (Google style) with the lines ``common`` first in its ``Args:`` section (added if absent)."""
    block = "\n".join("    " + line for line in common.splitlines())
    lines = doc.splitlines()
    if "Args:" in lines:
        i = lines.index("Args:")
        return "\n".join(lines[: i + 1] + block.splitlines() + lines[i + 1 :])
    for j, line in enumerate(lines):
        if line in ("Returns:", "Raises:"):
            return "\n".join(lines[:j] + ["Args:", *block.splitlines(), ""] + lines[j:])
    return "\n".join([*lines, "", "Args:", *block.splitlines()])
