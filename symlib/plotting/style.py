"""The book's plotting style, set once on import, and the small drawing helpers every figure shares."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns

__all__ = ["grouped_bars"]

sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")
plt.rcParams.update({"figure.dpi": 110, "savefig.bbox": "tight", "axes.titlesize": "medium"})


def grouped_bars(ax, groups: Sequence[str], series: Sequence[str], value) -> dict:
    """Bars of ``value(series, group)`` for every group on the x axis, the series side by side within a group
    (each labelled for the legend). Returns ``{series: BarContainer}``."""
    width = 0.8 / len(series)
    pos = np.arange(len(groups))
    bars = {}
    for i, s in enumerate(series):
        heights = [value(s, g) for g in groups]
        bars[s] = ax.bar(pos + (i - (len(series) - 1) / 2) * width, heights, width, label=s)
    ax.set_xticks(pos, groups)
    return bars
