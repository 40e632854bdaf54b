"""The figures of chapter "Against the true posterior" (symlib.plotting.truth): every row drawn where its
numbers put it, axes that show all of them."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from symlib.plotting import truth as T  # noqa: E402


def _frame(to_hmc):
    rows = {}
    for i, (label, y) in enumerate(to_hmc.items()):
        x = 2.0 ** i
        rows[label] = {f"{c} to {who}{sfx}": v for c in ("MMD", "NS")
                       for who, base in (("target", x), ("HMC", y))
                       for sfx, v in (("", base), ("_lo", base - 0.5), ("_hi", base + 0.5))}
    f = pd.DataFrame.from_dict(rows, orient="index")
    f.index = pd.MultiIndex.from_tuples(list(to_hmc), names=["method", "modes"])
    return f


def test_two_targets_shows_every_row_and_picks_its_vertical_scale():
    positive = _frame({("SWAG", "one-mode"): 80.0, ("SWAG", "multi-mode"): 20.0, ("DE", "multi-mode"): 90.0})
    fig = T.two_targets(positive)
    axes = fig.axes[:2]
    for ax in axes:
        assert ax.get_yscale() == "log"
        assert ax.get_xlim()[1] >= 1.5 * positive["MMD to target_hi"].max()  # room for the farthest marker
        lo, hi = ax.get_ylim()
        assert lo <= positive["MMD to HMC_lo"].min() and hi >= positive["MMD to HMC_hi"].max()
        assert len(ax.containers) == len(positive)  # one error bar per row
    below = _frame({("SWAG", "one-mode"): 0.2, ("DE", "multi-mode"): 5.0})  # a lower bound under 0
    assert all(ax.get_yscale() == "symlog" for ax in T.two_targets(below).axes[:2])


def test_frontier_marks_sizes_and_the_budget():
    def row(hidden, n, converged, cpu):
        check = {"cpu_s": cpu, "canonical": {"rhat_max": 1.005 if converged else 1.05}}
        return {"hidden": hidden, "n_params": n, "converged": converged, "cpu_s": cpu,
                "converged_at": {"cpu_s": cpu} if converged else None, "checks": [check],
                "last": {"canonical": {"rhat_max": check["canonical"]["rhat_max"]}}}

    rows = [row([2], 40, True, 200.0), row([8, 8], 202, False, 1250.0)]
    fig = T.frontier(rows, budget=1200.0)
    ax = fig.axes[0]
    assert list(np.round(ax.get_yticks())) == [50, 100, 200, 500]  # plain ticks, not one per size
    lo, hi = ax.get_xlim()
    assert lo <= 200 and hi >= 1.6 * 1250  # the open marker's arrow included


def _boxes_meet(a, b) -> bool:
    return min(a.x1, b.x1) > max(a.x0, b.x0) and min(a.y1, b.y1) > max(a.y0, b.y0)


def test_committed_frontier_has_no_overlapping_labels_and_no_clipped_marker():
    """Fig. "the convergence frontier" from the committed results, drawn: no two labels (the sizes' names,
    the tick labels of each axis) overlap, no size's name covers a marker or the legend, every name lies in
    the axes, and every marker lies inside the axes' limits with its whole symbol visible."""
    from symlib.paper import frontier as F

    doc = F.results()
    fig = T.frontier(doc["sizes"], budget=doc["settings"]["budget"])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    frame = ax.get_window_extent(renderer)
    names = [t for t in ax.texts if t.get_text()]
    assert len(names) == len(doc["sizes"])
    boxes = {t.get_text(): t.get_window_extent(renderer) for t in names}
    for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        ticks = [lab for loc, lab in zip(axis.get_majorticklocs(), axis.get_majorticklabels(), strict=True)
                 if lo <= loc <= hi and lab.get_text()]
        assert len(ticks) >= 2
        tick_boxes = [lab.get_window_extent(renderer) for lab in ticks]
        clashes = [(a.get_text(), b.get_text()) for i, a in enumerate(ticks) for b in ticks[i + 1:]
                   if _boxes_meet(a.get_window_extent(renderer), b.get_window_extent(renderer))]
        assert not clashes, f"tick labels overlap: {clashes}"
        assert not [n for n, b in boxes.items() for t in tick_boxes if _boxes_meet(b, t)]
    text = list(boxes)
    clashes = [(a, b) for i, a in enumerate(text) for b in text[i + 1:] if _boxes_meet(boxes[a], boxes[b])]
    assert not clashes, f"labels overlap: {clashes}"
    legend = ax.get_legend().get_window_extent(renderer)
    assert not [n for n, b in boxes.items() if _boxes_meet(b, legend)], "a label under the legend"
    assert all(frame.contains(b.x0, b.y0) and frame.contains(b.x1, b.y1) for b in boxes.values()), \
        "a label outside the axes"
    (x_lo, x_hi), (y_lo, y_hi) = ax.get_xlim(), ax.get_ylim()
    drawn = [ln for ln in ax.lines if len(ln.get_xdata()) and ln.get_marker() not in (None, "None", "")]
    assert len(drawn) == len(doc["sizes"])
    half = ax.lines[0].get_markersize() / 2 * fig.dpi / 72
    for ln in drawn:
        (x,), (y,) = ln.get_xdata(), ln.get_ydata()
        assert x_lo < x < x_hi and y_lo < y < y_hi, f"marker at ({x}, {y}) outside the axes' limits"
        px, py = ax.transData.transform((x, y))
        assert frame.x0 + half <= px <= frame.x1 - half and frame.y0 + half <= py <= frame.y1 - half, \
            f"marker at ({x}, {y}) clipped by the axes' edge"
        marker = matplotlib.transforms.Bbox([[px - half, py - half], [px + half, py + half]])
        assert not [n for n, b in boxes.items() if _boxes_meet(b, marker)], f"a label covers ({x}, {y})"


def test_tau_spread_draws_each_group_in_order_with_its_panels_own_floor():
    import pandas as pd

    from symlib.plotting import truth as plotting_truth

    groups = ["all rows", "one-mode rows", "the mode split alone"]
    idx = pd.MultiIndex.from_tuples([(g, c) for c in ("raw", "NS") for g in groups])
    frame = pd.DataFrame({"tau": 0.5, "low": 0.3, "high": 0.7, "min": 0.1, "max": 0.9}, index=idx)
    fig = plotting_truth.tau_spread(frame, floors={"raw": 0.2, "NS": 0.6})
    raw, ns = fig.axes
    assert [t.get_text() for t in raw.get_yticklabels()] == groups
    assert raw.get_ylim()[0] > raw.get_ylim()[1]  # the first group on top
    dashed = {ax.get_title(): [ln.get_xdata()[0] for ln in ax.lines if ln.get_linestyle() == "--"]
              for ax in (raw, ns)}
    assert dashed == {"raw": [0.2], "NS": [0.6]}
