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
    Both axes are logarithmic with plain ticks (1, 2, 5 times a power of ten) and room for every marker,
    arrow and label; each label is put beside its marker where it overlaps no other label, marker or the
    legend. The right panel shows, per size, the worst :math:`\hat R` on canonical forms at every check
    against the CPU time, with the threshold 1.01.

    Args:
        rows: the ``"sizes"`` of :func:`symlib.paper.frontier.results`.
        budget: the CPU budget (a vertical line), or ``None``.

    Returns:
        The figure.
    """
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    points, labels, reach, arrows = [], [], [], []
    for i, r in enumerate(rows):
        depth = len(r["hidden"])
        marker = "o" if depth == 1 else "s"
        colour = colours[i % len(colours)]
        label = "-".join(str(h) for h in r["hidden"])
        if r["converged"]:
            x = r["converged_at"]["cpu_s"]
            ax.plot(x, r["n_params"], marker=marker, ms=8, color=colour, ls="none")
            reach.append(x)
        else:
            x = r["cpu_s"]
            ax.plot(x, r["n_params"], marker=marker, ms=8, mfc="white", color=colour, ls="none")
            ax.annotate("", xy=(x * _ARROW, r["n_params"]), xytext=(x, r["n_params"]),
                        arrowprops={"arrowstyle": "->", "color": colour})
            reach.append(x * _ARROW)
            arrows.append(((x, r["n_params"]), (x * _ARROW, r["n_params"])))
            worst = r["last"]["canonical"]["rhat_max"] if r.get("last") else float("nan")
            label += rf" ($\hat R$ {worst:.2f})"
        points.append((x, r["n_params"]))
        labels.append(label)
        checks = r.get("checks") or []
        if checks:
            bx.plot([c["cpu_s"] for c in checks], [c["canonical"]["rhat_max"] for c in checks], marker=marker,
                    ms=3, color=colour, label="-".join(str(h) for h in r["hidden"]))
    ax.set(xscale="log", yscale="log", xlabel="sampler CPU seconds to convergence",
           ylabel="parameters", title="the convergence frontier")
    if points:
        xs = [p[0] for p in points] + reach + ([budget] if budget is not None else [])
        ys = [p[1] for p in points]
        # room on the left and right for labels and arrows, above for the legend
        ax.set_xlim(min(xs) / 1.6, max(xs) * 2.2)
        ax.set_ylim(min(ys) / 1.6, max(ys) * 3.0)
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
    for a, axis in ((ax, ax.xaxis), (ax, ax.yaxis), (bx, bx.xaxis)):
        lo, hi = a.get_xlim() if axis is a.xaxis else a.get_ylim()
        axis.set_ticks([t for t in _PLAIN_TICKS if lo <= t <= hi])
        axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_locator(matplotlib.ticker.NullLocator())
    fig.tight_layout()
    _place_labels(ax, points, labels, arrows)
    return fig


_ARROW = 1.6  # a non-converged size's arrow ends at this multiple of the CPU time it spent
_PLAIN_TICKS = tuple(m * 10.0 ** e for e in range(0, 6) for m in (1, 2, 5))
# where a label may sit beside its marker, in points: right, left (right-aligned), then farther away
_OFFSETS = ((7, 4, "left"), (7, -12, "left"), (-7, 4, "right"), (-7, -12, "right"), (7, 14, "left"),
            (-7, 14, "right"), (7, -22, "left"), (-7, -22, "right"), (0, 16, "center"), (0, -24, "center"))


def _place_labels(ax, points: Sequence[tuple[float, float]], labels: Sequence[str],
                  arrows: Sequence[tuple[tuple[float, float], tuple[float, float]]] = ()) -> None:
    """Each label beside its marker at the first offset of ``_OFFSETS`` where its box stays inside the axes
    and overlaps no label already placed, no marker, no arrow and not the legend (else where it overlaps
    least)."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    to_px = fig.dpi / 72.0
    markers = []
    for x, y in points:
        cx, cy = ax.transData.transform((x, y))
        half = 6 * to_px  # an 8-point marker and its edge
        markers.append(matplotlib.transforms.Bbox([[cx - half, cy - half], [cx + half, cy + half]]))
    for start, end in arrows:
        (x0, y0), (x1, y1) = ax.transData.transform(start), ax.transData.transform(end)
        markers.append(matplotlib.transforms.Bbox([[x0, y0 - 2 * to_px], [x1, y1 + 2 * to_px]]))
    legend = ax.get_legend()
    obstacles = markers + ([legend.get_window_extent(renderer)] if legend is not None else [])
    placed = []
    for (x, y), label in zip(points, labels, strict=True):
        best = None
        for dx, dy, ha in _OFFSETS:
            text = ax.annotate(label, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=8, ha=ha)
            box = text.get_window_extent(renderer)
            cost = sum(_overlap(box, o) for o in obstacles + placed) + _outside(box, inside)
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, text, box)
            else:
                text.remove()
            if cost == 0:
                break
        placed.append(best[2])


def _overlap(a, b) -> float:
    """The area two boxes share (0 when they do not meet)."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(w, 0.0) * max(h, 0.0)


def _outside(box, frame) -> float:
    """The area of ``box`` outside ``frame``."""
    return box.width * box.height - _overlap(box, frame)


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
