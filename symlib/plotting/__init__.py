"""Figures of the book: computed arrays in, a matplotlib figure out (one function per paper figure).

Importing any of these modules sets the book's style (:mod:`~symlib.plotting.style`).

* :mod:`~symlib.plotting.figures`: the gentle example and min-mass (Figures 1, 2, 5);
* :mod:`~symlib.plotting.collapse`: functional collapse, permutation frequency, marginals (Figures 3, 4,
  7, 8 and App. D);
* :mod:`~symlib.plotting.align`: aligning variational posteriors;
* :mod:`~symlib.plotting.table1`: Table 1's distances with their intervals, beside the paper's.

The figure functions of :mod:`~symlib.plotting.figures` are re-exported here: ``plotting.figure1(...)``.
"""

from symlib.plotting import align, collapse, figures, style, table1
from symlib.plotting.figures import figure1, figure2, imbalance_scatter, toy_data
from symlib.plotting.style import grouped_bars

__all__ = [
    "align", "collapse", "figure1", "figure2", "figures", "grouped_bars", "imbalance_scatter", "style",
    "table1", "toy_data",
]
