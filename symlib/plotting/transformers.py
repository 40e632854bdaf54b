"""Figures of the chapter "Transformers: permutations without scalings": computed tables in, a matplotlib
figure out (the book's style comes from :mod:`symlib.plotting`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from symlib.plotting import style as _style  # noqa: F401 (sets the book's plotting style)

__all__ = ["barrier_paths", "distances"]


def barrier_paths(paths: pd.DataFrame):
    """Test loss and accuracy along the straight path between two networks, one line per way of matching
    them (the mean over pairs; a band from the lowest to the highest pair).

    Args:
        paths: :func:`symlib.paper.transformers.barriers`' rows (``pair``, ``alignment``, ``t``, ``loss``,
            ``accuracy``).
    """
    fig, axs = plt.subplots(1, 2, figsize=(10, 3.8))
    for way, rows in paths.groupby("alignment", sort=False):
        for ax, col in zip(axs, ("loss", "accuracy"), strict=True):
            by_t = rows.groupby("t")[col]
            mean, lo, hi = by_t.mean(), by_t.min(), by_t.max()
            line, = ax.plot(mean.index, mean.values, marker="o", ms=3, label=way)
            ax.fill_between(mean.index, lo.values, hi.values, color=line.get_color(), alpha=0.15, lw=0)
    axs[0].set(xlabel="$t$ (from network $a$ to network $b$, matched)", ylabel="test loss (nats)",
               title="loss along the path")
    axs[1].set(xlabel="$t$ (from network $a$ to network $b$, matched)", ylabel="test accuracy (%)",
               title="accuracy along the path")
    axs[0].legend(fontsize="small")
    fig.tight_layout()
    return fig


def distances(table: pd.DataFrame):
    """The squared distance of set B's networks to a reference network outside both sets, as a share of
    their raw distance, for each removal of the symmetries (bars per network kind).

    Args:
        table: one row per network kind and removal, with columns ``network``, ``weights`` and ``distance
            to the reference (% of raw)``.
    """
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    pivot = table.pivot(index="weights", columns="network", values="distance to the reference (% of raw)")
    pivot = pivot.reindex([w for w in dict.fromkeys(table["weights"]) if w in pivot.index])
    pivot.plot.bar(ax=ax, rot=0)
    ax.axhline(100, color="0.4", lw=0.8, ls=":")
    ax.set(xlabel="symmetries removed", ylabel="squared distance (% of raw)",
           title="set B to a reference network outside both sets")
    ax.legend(fontsize="small", title=None)
    fig.tight_layout()
    return fig
