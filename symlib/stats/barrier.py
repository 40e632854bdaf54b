r"""Loss and accuracy barriers on the straight path between two networks (book: chapter "Aligning
variational posteriors"; Frankle et al. 2020, "Linear mode connectivity"; Ainsworth et al. 2023).

Along :math:`\theta_t = (1-t)\,\theta_a + t\,P\theta_b`, with :math:`P` from
:func:`symlib.symmetry.merge.match` (the identity for ``align="none"``), the loss barrier is the largest
excess of the loss over the chord between the ends, and the accuracy barrier the largest shortfall of
the accuracy under its chord:

.. math:: B_L = \max_t \Big(L(\theta_t) - \big[(1-t) L(\theta_a) + t L(\theta_b)\big]\Big), \qquad
          B_A = \max_t \Big(\big[(1-t) A(\theta_a) + t A(\theta_b)\big] - A(\theta_t)\Big),

over ``n_points`` evenly spaced :math:`t \in [0, 1]` (the ends included, so both are :math:`\ge 0`).
:math:`P\theta_b` computes the function of :math:`\theta_b`, so the ends do not depend on the alignment;
a lower barrier after matching says that the two networks lie in one basin up to permutations. The loss
is the mean cross-entropy of the logits, the accuracy the fraction of top-1 hits, on the embedded MNIST
test digits (:func:`symlib.data.load`, 1,000 images, no download) or on a batch of one's own.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from symlib.params import Params

__all__ = ["Barrier", "barrier", "default_data", "evaluate", "fit_inputs"]


@dataclasses.dataclass(frozen=True)
class Barrier:
    """The path between two networks, measured (:func:`barrier`).

    Attributes:
        align: how ``b`` was matched to ``a`` before the path was walked (``"none"``, ``"weights"``,
            ``"activations"``), ``"+orthogonal"`` added when its residual stream was rotated too.
        t: the positions on the path, 0 (``a``) to 1 (``b`` matched).
        loss, accuracy: mean cross-entropy and top-1 accuracy at every ``t``.
        loss_barrier: :math:`B_L`, the largest excess of the loss over its chord.
        accuracy_barrier: :math:`B_A`, the largest shortfall of the accuracy under its chord (a fraction).
        n: inputs evaluated at every ``t``.
    """

    align: str
    t: tuple[float, ...]
    loss: tuple[float, ...]
    accuracy: tuple[float, ...]
    loss_barrier: float
    accuracy_barrier: float
    n: int

    def to_dict(self) -> dict[str, Any]:
        """Every field, as JSON-ready numbers and lists (what ``symlib barrier --json`` prints)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def default_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The embedded MNIST test digits ``(inputs (1000, 1, 28, 28), labels (1000,))`` (no download)."""
    from symlib import data

    test = data.load("mnist", "test")
    return test.x, test.y


def evaluate(model: nn.Module, params: Params, inputs: torch.Tensor, targets: torch.Tensor,
             chunk: int = 1000) -> tuple[float, float]:
    """``(mean cross-entropy, accuracy)`` of ``model`` with weights ``params`` on ``(inputs, targets)``, in
    eval mode (``model`` itself is not modified)."""
    was_training = model.training
    model.eval()
    loss, hits = 0.0, 0
    try:
        with torch.no_grad():
            for i in range(0, len(inputs), chunk):
                out = _logits(torch.func.functional_call(model, params, (inputs[i:i + chunk],)))
                y = targets[i:i + chunk].to(out.device)
                loss += float(F.cross_entropy(out.double(), y, reduction="sum"))
                hits += int((out.argmax(-1) == y).sum())
    finally:
        model.train(was_training)
    return loss / len(inputs), hits / len(inputs)


def _logits(out) -> torch.Tensor:
    """The logits of a network's output: the tensor itself, or the first entry of a tuple or a dict (a
    Hugging Face model's ``logits``)."""
    if isinstance(out, dict):
        return next(iter(out.values()))
    return out[0] if isinstance(out, tuple | list) else out


def fit_inputs(model_shape: tuple[int, ...] | None, x: torch.Tensor) -> torch.Tensor:
    """``x`` reshaped to the network's input shape when only the layout differs (flattened digits)."""
    if model_shape is None or tuple(x.shape[1:]) == tuple(model_shape):
        return x
    if math.prod(x.shape[1:]) == math.prod(model_shape):
        return x.reshape(len(x), *model_shape)
    raise ValueError(f"the data's inputs have shape {tuple(x.shape[1:])} and the network takes "
                     f"{tuple(model_shape)}: pass data=(inputs, targets) of the network's input shape (the "
                     f"default data are the embedded MNIST digits, 1 x 28 x 28)")


def barrier(
    a: Params,
    b: Params,
    model: nn.Module,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    spec=None,
    align: str = "weights",
    n_points: int = 11,
    orthogonal: bool = False,
    batch: torch.Tensor | None = None,
    seed: int = 0,
) -> Barrier:
    r"""Loss and accuracy along :math:`(1-t)\,\theta_a + t\,P\theta_b` and their barriers (module docstring;
    book: chapter "Aligning variational posteriors").

    Args:
        a, b: full state dicts of one network each, of ``model``'s architecture.
        model: the network (evaluated functionally with :func:`torch.func.functional_call`; not modified).
        data: ``(inputs, targets)`` with integer class targets; default the embedded MNIST test digits
            (:func:`default_data`), reshaped to the network's input when only the layout differs.
        spec: the symmetries of ``model`` (default: traced by :func:`symlib.spec_of` on the inputs' shape);
            not needed for ``align="none"``.
        align: ``"none"``, ``"weights"`` or ``"activations"`` (:func:`symlib.merge`'s ``how``).
        n_points: evenly spaced ``t`` from 0 to 1, the ends included (at least 2).
        orthogonal: also rotate ``b``'s residual stream onto ``a``'s (:func:`symlib.merge`).
        batch: inputs for activation matching (default: the data's inputs).
        seed: of the weight matching's visiting order.

    Returns:
        A :class:`Barrier`.

    Raises:
        ValueError: fewer than 2 points, an unknown ``align``, data of another shape.
        SymmetryError: ``a`` or ``b`` do not fit the network's spec.
    """
    from symlib.symmetry import merge as merging
    from symlib.symmetry.align import barrier as bump
    from symlib.symmetry.align import interpolate

    if n_points < 2:
        raise ValueError(f"n_points={n_points}: the path needs at least its two ends (n_points >= 2)")
    if align not in merging.HOWS:
        raise ValueError(f"unknown align={align!r}; choose one of {merging.HOWS}")
    inputs, targets = default_data() if data is None else data
    if len(inputs) != len(targets) or not len(inputs):
        raise ValueError(f"data holds {len(inputs)} inputs and {len(targets)} targets: pass (inputs, "
                         f"targets) of one non-empty length")
    ref = next(v for v in a.values() if v.is_floating_point())
    shape = spec.input_shape if spec is not None else _first_input_shape(model, inputs)
    inputs = fit_inputs(shape, inputs).to(ref.device)
    if inputs.is_floating_point():
        inputs = inputs.to(ref.dtype)
    if spec is None and (align != "none" or orthogonal):
        from symlib.symmetry.trace import spec_of

        spec = spec_of(model, tuple(inputs.shape[1:]))
    moved = b if spec is None else merging.match(
        a, b, spec, align, inputs if batch is None else fit_inputs(shape, batch).to(inputs),
        orthogonal=orthogonal, model=model, seed=seed)
    ts = tuple(i / (n_points - 1) for i in range(n_points))
    points = [evaluate(model, interpolate(a, None, moved, None, t)[0], inputs, targets) for t in ts]
    loss = tuple(p[0] for p in points)
    acc = tuple(p[1] for p in points)
    return Barrier(align + ("+orthogonal" if orthogonal else ""), ts, loss, acc, bump(loss),
                   bump([-x for x in acc]), len(inputs))


def _first_input_shape(model: nn.Module, inputs: torch.Tensor) -> tuple[int, ...] | None:
    """The input shape a network's first layer implies when the data's does not fit it: ``(features,)``
    for a network that opens with a ``Linear`` layer, else ``None`` (the data's shape is used)."""
    first = next((m for m in model.modules() if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)), None)
    if isinstance(first, nn.Linear) and inputs.ndim > 2 and first.in_features == math.prod(inputs.shape[1:]) \
            and not any(isinstance(m, nn.Flatten) for m in model.modules()):
        return (first.in_features,)
    return None
