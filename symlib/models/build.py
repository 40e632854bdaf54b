"""Networks from stored weights: the record a manifest keeps of a registered network, and one
``nn.Module`` per network of a stacked set (book: "Checkpoint zoos", "symlib on your own network").

A stacked set holds ``n`` networks of one architecture, every tensor of the state dict stacked along a new
first axis, ``{name: (n, ...)}``. :func:`networks` unstacks it: network ``i`` is built by a
:class:`~symlib.models.recipe.Recipe` and loaded with ``{name: t[i]}``. :func:`model_spec` is the older
record of the same architecture that manifests keep beside the recipe (``"model"``: a class of
:mod:`symlib.models` and its keyword arguments, which the registry derives from the tensor shapes), so that
a reader can check that a manifest's architecture and tensors agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from symlib.errors import StoreError
from symlib.models import registry
from symlib.models.recipe import Recipe

__all__ = ["model_spec", "networks"]


def model_spec(arch: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The :mod:`symlib.models` class and its keyword arguments that rebuild a network of the registered
    architecture ``arch`` with these state-dict ``shapes`` (:mod:`symlib.models.registry`); ``{"class":
    None}`` for an architecture outside the registry.

    Raises:
        KeyError, IndexError: the shapes lack a tensor the registry reads the arguments from (they are not
            this architecture's).
    """
    net = registry.REGISTRY.get(arch)
    if net is None:
        return {"class": None, "kwargs": {}}
    return {"class": net.factory.__name__, "kwargs": net.args_of(shapes)}


def networks(params: Mapping[str, torch.Tensor], recipe: Recipe, where: str = "") -> list[torch.nn.Module]:
    """One eval-mode ``nn.Module`` per network of a stacked set, built by ``recipe`` in the set's precision
    and device and loaded with its weights, in the set's order.

    Args:
        params: the stacked set ``{name: (n, ...)}``.
        recipe: the architecture of every network.
        where: the folder the set was read from (for the message).

    Raises:
        StoreError: the weights do not fit the recipe's network (an edited or damaged manifest).
    """
    out = []
    n = next(iter(params.values())).shape[0]
    dev = next(iter(params.values())).device
    dtype = next(v.dtype for v in params.values() if v.is_floating_point())
    for i in range(n):
        m = recipe.build(meta=True)  # shapes only; built for real when a buffer is not in the set (the
        if any(k not in params for k, _ in m.named_buffers()):  # constructor computes it: position ids)
            m = recipe.build()
        real = not any(t.is_meta for t in m.state_dict().values())
        m = m.to(dev, dtype) if real else m.to_empty(device=dev).to(dtype)  # the set's precision
        missing, unexpected = m.load_state_dict({k: v[i] for k, v in params.items()}, strict=False)
        names = {k for k, _ in m.named_parameters()}
        gaps = [k for k in missing if not real or k in names]
        if gaps or unexpected:
            raise StoreError(
                f"{where}: network {i} does not fit the manifest's architecture {recipe.describe()} (missing "
                f"{gaps[:3]}, unexpected {unexpected[:3]}); the manifest was edited or damaged: "
                f"restore it, or rerun the command that wrote the folder"
            )
        out.append(m.eval())
    return out
