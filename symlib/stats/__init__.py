"""Statistics on checkpoint sets and their predictions (book: chapters "Table 1", "Functional collapse";
paper §4-5, App. B).

* :mod:`~symlib.stats.mmd`: the paper's maximum mean discrepancy between two sets of weights, with
  symmetries removed, permutation p-values and bootstrap intervals;
* :mod:`~symlib.stats.metrics`: Table 1's uncertainty metrics (accuracy, ECE, Brier, NLL, AUPR, FPR95,
  mutual information);
* :mod:`~symlib.stats.pairwise_mi`: the mutual information of every pair of checkpoints;
* :mod:`~symlib.stats.predict`: predicted probabilities of every network of a set;
* :mod:`~symlib.stats.diagnostics`: MCMC convergence diagnostics (R-hat, ESS);
* :mod:`~symlib.stats.barrier`: loss and accuracy barriers on the straight path between two networks.

Submodules load on first access.
"""

from symlib._lazy import submodules

__all__ = ["barrier", "diagnostics", "metrics", "mmd", "pairwise_mi", "predict"]
__getattr__, __dir__ = submodules(__name__, __all__)
