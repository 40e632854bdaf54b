"""symlib: weight-space symmetries of neural networks.

The companion library of the living paper reproducing Laurent, Aldea & Franchi,
*A Symmetry-Aware Exploration of Bayesian Neural Network Posteriors* (ICLR 2024).
Modules hold one concept each; calls read ``symlib.canonical.normalize(...)``.

The core modules import eagerly; the heavier ones (``minmass`` pulls in cvxpy
lazily, ``zoo`` and ``train`` the data loaders) load on first access.
"""

import importlib

from symlib import canonical, check, counting, data, models, ops, scales, spec, trace

__version__ = "0.1.0"
_LAZY = (
    "align", "cli", "collapse", "interp", "kernels", "marginals", "metrics", "minmass", "mmd", "permfreq",
    "plotting", "plotting_align", "plotting_collapse", "posteriors", "predict", "table1", "toy", "train",
    "zoo",
)
__all__ = ["canonical", "check", "counting", "data", "models", "ops", "scales", "spec", "trace",
           *_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"symlib.{name}")
    raise AttributeError(f"module 'symlib' has no attribute {name!r}")
