r"""Weights as data: the one ``Params`` type and its stacking helpers (book: "symlib on your own network").

Every function of symlib takes a network's weights as a plain ``dict[str, Tensor]`` (a ``state_dict``:
parameters and buffers by name) and returns a new dict, never modifying its input. A *stack* of ``M``
networks is the same dict with a leading axis of size ``M`` on every tensor, ``{name: (M, ...)}``: one
call of :func:`symlib.act`, :func:`symlib.canonicalize` or :func:`symlib.symmetry.minmass` then transforms all
of them. This module holds the conversions between single networks, stacks and flat vectors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

Params = dict[str, torch.Tensor]
"""Named tensors of one network (``state_dict`` names) or of a stack of networks (a leading axis)."""

__all__ = ["Params", "cast", "flatten", "n_stacked", "stack", "state_of", "unflatten", "unstack"]


def stack(states: Sequence[Mapping[str, torch.Tensor]]) -> Params:
    """``M`` state dicts with the same names and shapes as one stack ``{name: (M, ...)}`` (detached)."""
    if not states:
        raise ValueError("stack needs at least one state dict")
    return {k: torch.stack([s[k].detach() for s in states]) for k in states[0]}


def unstack(params: Mapping[str, torch.Tensor], i: int) -> Params:
    """Network ``i`` of a stack: ``{name: params[name][i]}`` (views, not copies)."""
    return {k: v[i] for k, v in params.items()}


def n_stacked(params: Mapping[str, torch.Tensor]) -> int:
    """The size of the leading axis of a stack, checked to be the same for every tensor."""
    sizes = {int(v.shape[0]) if v.ndim else -1 for v in params.values()}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"expected a stack of networks (the same leading axis on every tensor); got shapes "
            f"{[tuple(v.shape) for v in params.values()][:5]}"
        )
    return sizes.pop()


def state_of(model: torch.nn.Module) -> Params:
    """A detached copy of ``model.state_dict()`` (parameters and buffers)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def cast(
    params: Mapping[str, torch.Tensor],
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Params:
    """Every floating tensor of ``params`` in ``dtype`` and every tensor on ``device`` (book: "symlib on
    your own network").

    Integer buffers such as BatchNorm's ``num_batches_tracked`` keep their dtype. ``cast(theta,
    torch.float64)`` is the copy on which a symmetry holds to double-precision rounding (about 1e-15,
    where float32 gives about 1e-7).

    Args:
        params: one network or a stack.
        dtype: floating dtype of the result (``None``: unchanged).
        device: device of the result (``None``: unchanged).

    Returns:
        A new dict; tensors already in that dtype and on that device are the same objects, not copies.
    """
    out = {}
    for k, v in params.items():
        out[k] = v.to(device=device, dtype=dtype if v.is_floating_point() else None)
    return out


def flatten(params: Mapping[str, torch.Tensor], names: Sequence[str] | None = None) -> torch.Tensor:
    """A stack ``{name: (M, ...)}`` as one matrix ``(M, D)``: the tensors ``names`` (default: all, in the
    dict's order) flattened and concatenated along the second axis."""
    names = list(params) if names is None else list(names)
    return torch.cat([params[k].reshape(params[k].shape[0], -1) for k in names], dim=1)


def unflatten(
    flat: torch.Tensor,
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> Params:
    """Inverse of :func:`flatten`: ``(M, D)`` back to ``{name: (M, *shapes[name])}`` (views where the
    dtype is kept; cast to ``dtypes[name]`` where given)."""
    total = sum(math.prod(shape) for shape in shapes.values())
    if total != flat.shape[1]:
        raise ValueError(f"a flat stack of {flat.shape[1]} columns does not match shapes totalling {total}")
    out, i = {}, 0
    for k, shape in shapes.items():
        n = math.prod(shape)
        v = flat[:, i : i + n].reshape(flat.shape[0], *shape)
        out[k] = v.to(dtypes[k]) if dtypes is not None else v
        i += n
    return out
