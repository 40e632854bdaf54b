r"""The figure of chapter "Table 1: how good are posterior approximations?": each method's distance to
the target, with its interval, one-mode beside multi-mode, the paper's value marked (paper §4, Table 1).
Computed frames in, a matplotlib figure out (the book's style comes from :mod:`symlib.plotting`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from symlib.plotting import style as _style  # noqa: F401  (sets the book's plotting style)

__all__ = ["MARKERS", "distances"]

# How each kind of row is drawn: one-mode and multi-mode sets, and a reference sample (HMC).
MARKERS = {"one-mode": "o", "multi-mode": "s", "reference": "D"}


def distances(frame, paper=None, columns: Sequence[str] = ("MMD", "NS"),
              titles: Mapping[str, str] | None = None, linthresh: float = 1.0):
    r"""Each row's distance to the target with its bootstrap interval, one panel per column (Table 1).

    The methods run down the vertical axis; within a method, its one-mode, multi-mode and reference rows
    sit side by side, each drawn with its own marker and colour, with a horizontal bar for its interval.
    The paper's value of the same row, where it reports one, is a cross at the same height, in the row's
    colour. The horizontal axis is symmetric-logarithmic (linear within ``linthresh`` of 0), so that the
    one-mode distances (tens) and the multi-mode ones (units), a deep ensemble at 0 and an interval
    reaching below 0 are all readable in one panel.

    Args:
        frame: a DataFrame indexed by ``(method, modes)`` with, for each ``c`` of ``columns``, the value
            ``c`` and optionally its interval ``c_lo`` and ``c_hi``
            (:func:`symlib.paper.table1.frames.mmd_frame`: the MMD :math:`\times 100`).
        paper: the paper's values on the same index layout
            (:func:`symlib.paper.table1.frames.paper_frame`), or ``None``; rows or columns it lacks are
            simply not marked.
        columns: the columns to draw, one panel each (default ``MMD`` on raw weights and ``NS`` with the
            symmetries removed).
        titles: panel titles by column (default: raw weights / symmetries removed for MMD / NS).
        linthresh: half-width of the linear part of the horizontal axis.

    Returns:
        The figure; ``fig.axes[i]`` is the panel of ``columns[i]``.
    """
    methods = list(dict.fromkeys(frame.index.get_level_values(0)))
    modes = list(dict.fromkeys(frame.index.get_level_values(1)))
    titles = {"MMD": "raw weights (MMD)", "NS": "symmetries removed (NS)", **(titles or {})}
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    offsets = np.linspace(-0.22, 0.22, len(modes)) if len(modes) > 1 else np.zeros(1)
    fig, axs = plt.subplots(1, len(columns), figsize=(4.6 * len(columns), 0.42 * len(methods) + 1.6),
                            sharey=True, squeeze=False)
    axs = axs[0]
    ys = np.arange(len(methods), dtype=float)
    for ax, col in zip(axs, columns, strict=True):
        marked_paper = False
        for k, mode in enumerate(modes):
            rows = [(m, mode) for m in methods]
            sub = frame.reindex(rows)
            v = sub[col].to_numpy(float)
            ok = ~np.isnan(v)
            if not ok.any():
                continue
            y = ys + offsets[k]
            xerr = None
            if f"{col}_lo" in sub and f"{col}_hi" in sub:
                lo, hi = sub[f"{col}_lo"].to_numpy(float), sub[f"{col}_hi"].to_numpy(float)
                xerr = np.vstack([np.clip(v - lo, 0, None), np.clip(hi - v, 0, None)])[:, ok]
            ax.errorbar(v[ok], y[ok], xerr=xerr, fmt=MARKERS.get(mode, "^"), ms=5, capsize=2.5, lw=1.2,
                        color=colours[k % len(colours)], label=mode)
            if paper is not None and col in paper:
                pv = paper[col].reindex(rows).to_numpy(float)
                have = ~np.isnan(pv)
                if have.any():
                    ax.plot(pv[have], y[have], ls="none", marker="x", ms=7, mew=1.6,
                            color=colours[k % len(colours)])
                    marked_paper = True
        if marked_paper:  # one legend entry for the crosses of every kind of row
            ax.plot([], [], ls="none", marker="x", ms=7, mew=1.6, color="black", label="paper")
        ax.set_xscale("symlog", linthresh=linthresh)
        hi = np.nanmax(np.abs(frame[[c for c in (col, f"{col}_hi") if c in frame]].to_numpy(float)))
        if paper is not None and col in paper:
            hi = max(hi, np.nanmax(np.abs(paper[col].to_numpy(float))))
        ticks = [t for t in (0, 1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= 1.5 * hi or t <= 1]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.axvline(0, color="0.4", lw=0.8)
        ax.set(xlabel=rf"{col} $\times$ 100 (symmetric log scale)", title=titles.get(col, col))
    axs[0].set_yticks(ys, methods)
    axs[0].set_ylim(len(methods) - 0.5, -0.5)  # the first method on top, as in the table
    entries = {}
    for ax in axs:  # a mode present in one panel only still gets its legend entry
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(lab, h)
    labels = [lab for lab in (*modes, "paper") if lab in entries]
    fig.legend([entries[lab] for lab in labels], labels, loc="lower center", ncol=len(labels), frameon=False,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig
