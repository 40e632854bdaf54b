r"""The figures of chapter "Against the true posterior": the convergence frontier (parameters against the
CPU time a certified posterior takes) and every approximation's distance to the deep-ensemble target
against its distance to the true posterior. Computed numbers in, a matplotlib figure out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import numpy as np

from symlib.plotting import style as _style  # noqa: F401  (sets the book's plotting style)

__all__ = ["frontier", "tau_spread", "two_targets"]


def frontier(rows: Sequence[Mapping[str, Any]], budget: float | None = None):
    r"""Parameters against sampler CPU seconds to a certified posterior (:math:`\hat R < 1.01`, bulk and
    tail ESS :math:`\ge 400` on canonical forms and invariant functionals), one point per size of
    :func:`symlib.paper.frontier.sweep`.

    A converged size is a filled marker at the CPU time of its first passing check (one hidden layer:
    circles, two: squares); a size that did not converge is an open marker at the CPU time it spent, with
    an arrow to the right (its time to convergence is larger), annotated with its worst :math:`\hat R`.
    The right panel shows, per size, the worst :math:`\hat R` on canonical forms at every check against
    the CPU time, with the threshold 1.01.

    Args:
        rows: the ``"sizes"`` of :func:`symlib.paper.frontier.results`.
        budget: the CPU budget (a vertical line), or ``None``.

    Returns:
        The figure.
    """
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for i, r in enumerate(rows):
        depth = len(r["hidden"])
        marker = "o" if depth == 1 else "s"
        colour = colours[i % len(colours)]
        label = "-".join(str(h) for h in r["hidden"])
        if r["converged"]:
            x = r["converged_at"]["cpu_s"]
            ax.plot(x, r["n_params"], marker=marker, ms=8, color=colour, ls="none")
        else:
            x = r["cpu_s"]
            ax.plot(x, r["n_params"], marker=marker, ms=8, mfc="white", color=colour, ls="none")
            ax.annotate("", xy=(x * 1.6, r["n_params"]), xytext=(x, r["n_params"]),
                        arrowprops={"arrowstyle": "->", "color": colour})
            worst = r["last"]["canonical"]["rhat_max"] if r.get("last") else float("nan")
            label += rf" ($\hat R$ {worst:.2f})"
        ax.annotate(label, (x, r["n_params"]), textcoords="offset points", xytext=(6, 5), fontsize=8)
        checks = r.get("checks") or []
        if checks:
            bx.plot([c["cpu_s"] for c in checks], [c["canonical"]["rhat_max"] for c in checks], marker=marker,
                    ms=3, color=colour, label="-".join(str(h) for h in r["hidden"]))
    ax.set(xscale="log", yscale="log", xlabel="sampler CPU seconds to convergence",
           ylabel="parameters", title="the convergence frontier")
    sizes = sorted({r["n_params"] for r in rows})
    ax.set_yticks(sizes, [str(v) for v in sizes])
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.plot([], [], "ko", label="one hidden layer")
    ax.plot([], [], "ks", label="two hidden layers")
    ax.plot([], [], "ko", mfc="white", label="not converged (time spent)")
    if budget is not None:
        ax.axvline(budget, color="0.5", ls=":", lw=1)
        bx.axvline(budget, color="0.5", ls=":", lw=1)
    ax.legend(fontsize=8, loc="upper left")
    bx.axhline(1.01, color="0.3", lw=0.8, ls="--")
    bx.set(xscale="log", yscale="log", xlabel="sampler CPU seconds",
           ylabel=r"worst $\hat R$, canonical forms",
           title="the chains judged every segment")
    bx.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.2f}"))
    bx.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.2f}"))
    bx.legend(fontsize=7, ncol=2)
    for a in (ax, bx):
        lo, hi = a.get_xlim()
        a.set_xticks([t for t in (20, 50, 100, 200, 500, 1000, 2000, 5000, 10000) if lo <= t <= hi])
        a.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    fig.tight_layout()
    return fig


def two_targets(frame, columns: Sequence[str] = ("MMD", "NS")):
    r"""Every approximation's distance to the deep-ensemble target (horizontal) against its distance to the
    true posterior (vertical), one panel per column, with both bootstrap intervals.

    Args:
        frame: indexed by ``(method, modes)``, with ``"<column> to target"`` and ``"<column> to HMC"`` and
            their ``_lo`` / ``_hi`` bounds for each of ``columns`` (:math:`100 \times` the MMD).
        columns: ``"MMD"`` (raw weights) and ``"NS"`` (symmetries removed).

    Returns:
        The figure; a perfect agreement of the two rankings is a monotone cloud. The vertical axis is
        logarithmic when every distance to the posterior is positive (else symmetric-logarithmic), the
        horizontal one symmetric-logarithmic (a deep ensemble sits at 0 from the target).
    """
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    methods = list(dict.fromkeys(frame.index.get_level_values(0)))
    fig, axs = plt.subplots(1, len(columns), figsize=(5 * len(columns), 4.2), squeeze=False)
    for ax, col in zip(axs[0], columns, strict=True):
        for (method, modes), row in frame.iterrows():
            c = colours[methods.index(method) % len(colours)]
            x, y = row[f"{col} to target"], row[f"{col} to HMC"]
            xerr = [[max(x - row[f"{col} to target_lo"], 0)], [max(row[f"{col} to target_hi"] - x, 0)]]
            yerr = [[max(y - row[f"{col} to HMC_lo"], 0)], [max(row[f"{col} to HMC_hi"] - y, 0)]]
            ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt={"one-mode": "o", "multi-mode": "s"}.get(modes, "D"),
                        color=c, ms=6, capsize=2, lw=1, label=f"{method} ({modes})")
        low = frame[[f"{col} to HMC", f"{col} to HMC_lo"]].to_numpy(float)
        high = frame[f"{col} to HMC_hi"].to_numpy(float)
        positive = low[np.isfinite(low) & (low > 0)]
        if positive.size == low[np.isfinite(low)].size and positive.size:  # a log axis shows them all
            ax.set_yscale("log")
            ax.set_ylim(0.7 * positive.min(), 1.4 * np.nanmax(high))
        else:  # a distance at or below 0 (small sets): symmetric-logarithmic, with the zero line
            ax.set_yscale("symlog")
            ax.axhline(0, color="0.6", lw=0.6)
        ax.set(xscale="symlog", xlabel=rf"{col} $\times$ 100 to the DE target",
               ylabel=rf"{col} $\times$ 100 to the true posterior",
               title={"MMD": "raw weights", "NS": "symmetries removed"}.get(col, col))
        ax.axvline(0, color="0.6", lw=0.6)
        right = np.nanmax(frame[f"{col} to target_hi"].to_numpy(float))
        if np.isfinite(right) and right > 0:  # room for the farthest marker on the symlog axis
            ax.set_xlim(right=1.6 * right)
        for a in (ax.xaxis, ax.yaxis):
            a.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    handles, labels = axs[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def tau_spread(frame, floors: Mapping[str, float] | None = None):
    r"""Kendall's :math:`\tau` of each group of rows and comparison: the point of the tables (dot), the
    percentile interval over every combination of replicates and references (thick bar) and their range
    (thin bar), one panel per comparison.

    Args:
        frame: indexed by ``(group, comparison)``, with columns ``"tau"``, ``"low"``, ``"high"``, ``"min"``,
            ``"max"`` (:func:`symlib.paper.truth.replicated_agreement`, labelled).
        floors: ``{comparison: value}`` drawn as a dashed line in that comparison's panel (e.g. what the
            one-mode/multi-mode split alone reaches), or ``None``.

    Returns:
        The figure; the groups read from the top in the order of ``frame``.
    """
    comparisons = list(dict.fromkeys(frame.index.get_level_values(1)))
    groups = list(dict.fromkeys(frame.index.get_level_values(0)))
    fig, axs = plt.subplots(1, len(comparisons), figsize=(5 * len(comparisons), 0.55 * len(groups) + 1.4),
                            squeeze=False, sharey=True)
    for ax, comp in zip(axs[0], comparisons, strict=True):
        for y, g in enumerate(groups):
            if (g, comp) not in frame.index:
                continue
            row = frame.loc[(g, comp)]
            ax.plot([row["min"], row["max"]], [y, y], color="0.55", lw=1)
            ax.plot([row["low"], row["high"]], [y, y], color="C0", lw=5, solid_capstyle="butt")
            ax.plot(row["tau"], y, "o", color="C3", ms=6, zorder=3)
        ax.axvline(0, color="0.6", lw=0.6)
        floor = (floors or {}).get(comp)
        if floor is not None and np.isfinite(floor):
            ax.axvline(floor, color="0.3", lw=0.8, ls="--")
        ax.set(xlim=(-1.05, 1.05), title=comp, xlabel=r"Kendall's $\tau$ (target vs. true posterior)")
    axs[0][0].set_yticks(range(len(groups)), groups)
    axs[0][0].set_ylim(len(groups) - 0.5, -0.5)  # the first group on top (the axis is shared)
    fig.tight_layout()
    return fig
