"""The figure of the chapter "Symmetries of real architectures": the size of each network's symmetry
group, with and without the ties that residual connections and groups impose
(:func:`symlib.symmetry.counting.summary` in, a matplotlib figure out)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from symlib.plotting import style as _style  # noqa: F401 (sets the book's plotting style)

__all__ = ["group_sizes"]


def group_sizes(summary: pd.DataFrame):
    """log10 of the permutation group's order of every model, tied (what the network has) and untied (if
    every layer could be permuted on its own), and its scaling degrees of freedom.

    Args:
        summary: :func:`symlib.symmetry.counting.summary`'s table (``model``, ``log10_permutations``,
            ``log10_permutations_untied``, ``scaling_dof``).
    """
    rows = summary.set_index("model")
    fig, axs = plt.subplots(1, 2, figsize=(10, 0.6 * len(rows) + 1.6), sharey=True)
    y = range(len(rows))
    axs[0].barh([i + 0.2 for i in y], rows["log10_permutations_untied"], 0.4, label="untied", color="0.75")
    axs[0].barh([i - 0.2 for i in y], rows["log10_permutations"], 0.4, label="with residual ties and groups")
    axs[0].set(yticks=list(y), yticklabels=list(rows.index), xscale="log",
               xlabel="log10 of the permutation group's order", title="permutations")
    axs[0].invert_yaxis()
    axs[0].legend(fontsize="small", loc="lower right")
    axs[1].barh(list(y), rows["scaling_dof"], 0.5)
    axs[1].set(xscale="log", xlabel="scaling degrees of freedom", title="scalings")
    fig.tight_layout()
    return fig
