"""Posterior approximations as checkpoint sets (book: chapter "Table 1"; paper §4, App. B).

One module per method, each a :class:`~symlib.posteriors.base.Method` with the same
``sample(setup, n_modes, n_per_mode, seed, *, base=None, progress=True, **hyper) -> SampleSet``:
:mod:`~symlib.posteriors.ensemble`, :mod:`~symlib.posteriors.dropout`, :mod:`~symlib.posteriors.vi`,
:mod:`~symlib.posteriors.sghmc`, :mod:`~symlib.posteriors.swag`, :mod:`~symlib.posteriors.laplace` and,
beyond the paper, :mod:`~symlib.posteriors.hmc`. Around them: :mod:`~symlib.posteriors.base` (the
problem, the result, the method contract), :mod:`~symlib.posteriors.seeds`,
:mod:`~symlib.posteriors.modules`, :mod:`~symlib.posteriors.sgd` (training networks),
:mod:`~symlib.posteriors.sampling` (presets, cached base models, resumable runs) and
:mod:`~symlib.posteriors.io` (sample sets on disk). Modules load on first access:
``symlib.posteriors.swag.sample(...)``.
"""

import importlib

from symlib.posteriors.base import Method, SampleSet, Setup

METHODS = ("ensemble", "dropout", "vi", "sghmc", "swag", "laplace", "hmc")
_LAZY = (*METHODS, "base", "io", "modules", "sampling", "seeds", "sgd")
__all__ = ["METHODS", "Method", "SampleSet", "Setup", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"symlib.posteriors.{name}")
    raise AttributeError(f"module 'symlib.posteriors' has no attribute {name!r}")
