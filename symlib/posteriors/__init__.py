"""Posterior approximations as checkpoint sets (book: chapter "Table 1"; paper §4, App. B).

One module per method, each with ``sample(setup, n_modes, n_per_mode, seed, ...) -> SampleSet``
(see :mod:`symlib.posteriors.base`): ``ensemble``, ``dropout``, ``vi``, ``sghmc``, ``swag``,
``laplace`` and, beyond the paper, ``hmc``. Modules load on first access:
``symlib.posteriors.swag.sample(...)``.
"""

import importlib

from symlib.posteriors.base import SampleSet, Setup

METHODS = ("ensemble", "dropout", "vi", "sghmc", "swag", "laplace", "hmc")
_LAZY = (*METHODS, "io", "diagnostics", "sampling")
__all__ = ["SampleSet", "Setup", "METHODS", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"symlib.posteriors.{name}")
    raise AttributeError(f"module 'symlib.posteriors' has no attribute {name!r}")
