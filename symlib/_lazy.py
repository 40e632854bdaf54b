"""Submodules loaded on first access, for the package faces of symlib (``symlib.stats.mmd`` imports
:mod:`symlib.stats.mmd` when it is first used)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence


def submodules(package: str, names: Sequence[str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` that import ``package.<name>`` on first access."""

    def __getattr__(name: str):
        if name in names:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
