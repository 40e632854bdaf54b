"""The registry of networks: one entry per architecture that ``symlib`` builds by name (book: "Checkpoint
zoos"; ``docs/architectures.md``, "Adding a network").

A :class:`Network` says three things about an architecture: the factory that builds it, how its keyword
arguments follow from the shapes of a state dict (so a set of weights names its own network), and the
shape of one input (for tracing its symmetries). Zoo configurations (``ZooConfig.arch``), sample sets,
imported checkpoints and ``symlib compare`` all find the network here, through the
:class:`~symlib.models.recipe.Recipe` that every manifest records; adding an architecture is one
:func:`register` call.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from symlib.errors import CheckpointError
from symlib.models import nets

__all__ = ["REGISTRY", "Network", "network", "of_factory", "register", "unregister"]

Shapes = Mapping[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Network:
    """One architecture of the registry (module docstring).

    Attributes:
        name: the registry key (``"optunet"``), what zoo configurations and manifests record as ``arch``.
        factory: builds the network from keyword arguments (a class of :mod:`symlib.models`, or any
            callable returning an ``nn.Module``).
        args_of: the keyword arguments that rebuild a network with these state-dict shapes.
        input_shape: the shape of one input (without the batch axis) for these keyword arguments.
    """

    name: str
    factory: Callable[..., nn.Module]
    args_of: Callable[[Shapes], dict[str, Any]]
    input_shape: Callable[[Mapping[str, Any]], tuple[int, ...]]

    @property
    def target(self) -> str:
        """The factory's import path, ``module:qualname``."""
        return f"{self.factory.__module__}:{self.factory.__qualname__}"

    def accepts(self) -> set[str]:
        """The keyword arguments the factory takes."""
        return set(inspect.signature(self.factory).parameters)

    def arguments(self, **settings: Any) -> dict[str, Any]:
        """The subset of ``settings`` the factory takes, without ``None`` values: how a zoo configuration's
        ``num_classes``, ``in_channels`` and ``width`` become one architecture's arguments."""
        takes = self.accepts()
        return {k: v for k, v in settings.items() if k in takes and v is not None}

    def __call__(self, **kwargs: Any) -> nn.Module:
        """A freshly initialised network (global RNG)."""
        return self.factory(**kwargs)


REGISTRY: dict[str, Network] = {}
"""Every registered network by name (:func:`register`)."""


def register(name: str, factory: Callable[..., nn.Module], args_of: Callable[[Shapes], dict[str, Any]],
             input_shape: Callable[[Mapping[str, Any]], tuple[int, ...]] | tuple[int, ...]) -> Network:
    """Add an architecture to the registry; returns its :class:`Network`.

    Args:
        name: the key (lower case by convention, ``"optunet"``).
        factory: builds the network from keyword arguments.
        args_of: state-dict shapes -> keyword arguments.
        input_shape: one input's shape, or a function of the keyword arguments giving it.

    Raises:
        ValueError: ``name`` is registered to another factory (:func:`unregister` it first).
    """
    shape = input_shape if callable(input_shape) else (lambda _args, s=tuple(input_shape): s)
    net = Network(name, factory, args_of, shape)
    old = REGISTRY.get(name)
    if old is not None and old.factory is not factory:
        raise ValueError(f"network {name!r} is already registered to {old.target}; unregister it first "
                         f"(symlib.models.unregister({name!r})) or choose another name")
    REGISTRY[name] = net
    return net


def unregister(name: str) -> None:
    """Remove ``name`` from the registry (nothing happens when it is not there)."""
    REGISTRY.pop(name, None)


def network(name: str) -> Network:
    """The registered network ``name``.

    Raises:
        CheckpointError: not registered (the message lists the registered names).
    """
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"unknown network {name!r}; registered: {sorted(REGISTRY)} (add one with "
                              f"symlib.models.register)") from None


def of_factory(target: str) -> Network | None:
    """The registered network whose factory is ``target`` (``"symlib.models:OptuNet"``, or the factory's
    own ``module:qualname``); ``None`` when none is."""
    module, _, attr = target.rpartition(":")
    for net in REGISTRY.values():
        if net.target == target or (module == "symlib.models" and net.factory.__qualname__ == attr
                                    and net.factory.__module__.startswith("symlib.models")):
            return net
    return None


def _classes(shapes: Shapes) -> int:
    return int(shapes["fc.weight"][0])


def _resnet_args(shapes: Shapes) -> dict[str, Any]:
    return {"num_classes": _classes(shapes), "width": int(shapes["conv1.weight"][0]),
            "in_channels": int(shapes["conv1.weight"][1])}


def _cifar_shape(args: Mapping[str, Any]) -> tuple[int, ...]:
    return (int(args.get("in_channels", 3)), 32, 32)


register("optunet", nets.OptuNet, lambda shapes: {"num_classes": _classes(shapes)}, (1, 28, 28))
register("resnet18", nets.ResNet18, _resnet_args, _cifar_shape)
register("resnet20", nets.ResNet20, _resnet_args, _cifar_shape)
