r"""Samples of Normal Computing's ``posteriors`` library as a stacked set (book: "symlib on your own
network").

``posteriors`` works on *trees* of tensors, the parameters of ``torch.func.functional_call`` (usually
``dict(model.named_parameters())``); its samplers and approximations give samples as a tree with a
leading axis of samples on every leaf (``posteriors.vi.diag.sample(state, (n,))``,
``posteriors.laplace.diag_fisher.sample(state, (n,))``, or the ``params`` of a chain's states stacked
with ``torch.stack``). :func:`samples` flattens such a tree into ``{name: (n, ...)}`` (the keys of nested
dicts, lists and named tuples joined by dots, as ``state_dict`` names are) and, given the model, adds
what the tree does not hold (buffers such as BatchNorm statistics, parameters left out of the posterior)
from the model, and checks every shape::

    draws = posteriors.vi.diag.sample(state, (100,))
    theta = symlib.ckpt.from_posteriors.samples(draws, model)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from symlib.ckpt.errors import CheckpointError
from symlib.params import Params

__all__ = ["flatten", "samples"]


def flatten(tree: Any) -> dict[str, torch.Tensor]:
    """The leaves of a tree of tensors by dotted path (``optree``'s paths, as ``posteriors`` uses)."""
    if hasattr(tree, "params") and not isinstance(tree, Mapping | list | tuple):
        tree = tree.params  # a posteriors state: its parameters
    if isinstance(tree, Mapping) and all(isinstance(v, torch.Tensor) for v in tree.values()):
        return {str(k): v for k, v in tree.items()}
    import optree

    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    out = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            where = ".".join(map(str, path))
            raise CheckpointError(f"the tree holds a {type(leaf).__name__} at {where}, not a tensor")
        out[".".join(map(str, path))] = leaf
    return out


def samples(tree: Any, model: torch.nn.Module | None = None) -> Params:
    """A tree of samples (a leading sample axis on every leaf) as whole networks ``{name: (n, ...)}``
    (module docstring).

    Args:
        tree: the samples (or a ``posteriors`` state, whose ``params`` are taken).
        model: the network; its ``state_dict`` fills what the tree lacks and sets the expected shapes.

    Raises:
        CheckpointError: an empty tree, leaves with different numbers of samples, a name or shape the
            model does not have.
    """
    leaves = flatten(tree)
    if not leaves:
        raise CheckpointError("the tree of samples is empty")
    counts = {k: int(v.shape[0]) if v.ndim else None for k, v in leaves.items()}
    if None in counts.values() or len(set(counts.values())) != 1:
        raise CheckpointError(f"every leaf needs the same leading axis of samples; got "
                              f"{ {k: tuple(v.shape) for k, v in list(leaves.items())[:4]} }")
    n = next(iter(counts.values()))
    if model is None:
        return {k: v.detach().clone() for k, v in leaves.items()}
    state = model.state_dict()
    for k, v in leaves.items():
        if k not in state:
            raise CheckpointError(f"sample tensor {k!r} is not in {type(model).__name__}'s state_dict (first "
                                  f"names: {list(state)[:4]}): another model?")
        if tuple(v.shape[1:]) != tuple(state[k].shape):
            raise CheckpointError(f"sample tensor {k!r} has shape {tuple(v.shape[1:])} per sample, "
                                  f"{tuple(state[k].shape)} in {type(model).__name__}")
    return {k: leaves[k].detach().to(v.dtype).clone() if k in leaves
            else v.detach().unsqueeze(0).expand(n, *v.shape).clone() for k, v in state.items()}
