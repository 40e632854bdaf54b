"""Figures of the book: computed arrays in, a matplotlib figure out (one function per paper figure).

Importing any of these modules sets the book's style (:mod:`~symlib.plotting.style`).

* :mod:`~symlib.plotting.figures`: the gentle example and min-mass (Figures 1, 2, 5);
* :mod:`~symlib.plotting.collapse`: functional collapse, permutation frequency, marginals (Figures 3, 4,
  7, 8 and App. D);
* :mod:`~symlib.plotting.align`: aligning variational posteriors.

The figure functions of :mod:`~symlib.plotting.figures` are re-exported here: ``plotting.figure1(...)``.
"""

from symlib.plotting import align, collapse, figures, style
from symlib.plotting.figures import figure1, figure2, imbalance_scatter, toy_data
from symlib.plotting.style import grouped_bars

__all__ = [
    "align", "collapse", "figure1", "figure2", "figures", "grouped_bars", "imbalance_scatter", "style",
    "toy_data",
]
