"""symlib: weight-space symmetries of neural networks.

The companion library of the living paper reproducing Laurent, Aldea & Franchi,
*A Symmetry-Aware Exploration of Bayesian Neural Network Posteriors* (ICLR 2024).
Modules hold one concept each; calls read ``symlib.canonical.normalize(...)``.
"""

from symlib import canonical, check, data, models, ops, scales, spec

__version__ = "0.1.0"
__all__ = ["canonical", "check", "data", "models", "ops", "scales", "spec", "__version__"]
