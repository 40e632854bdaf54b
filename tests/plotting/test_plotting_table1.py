"""Table 1's distance figure (symlib.plotting.table1): it draws from computed frames and labels what it
should: one panel per column, the methods on the vertical axis, a legend entry per kind of row and for
the paper's values."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from symlib.plotting import table1 as plotting_table1  # noqa: E402


def _frame():
    rows = [("Dropout", "one-mode"), ("Laplace", "one-mode"), ("Dropout", "multi-mode"),
            ("Laplace", "multi-mode"), ("DE", "multi-mode"), ("HMC", "reference")]
    v = np.array([56.4, 20.9, 6.6, 2.2, 0.02, 15.8])
    frame = pd.DataFrame({"MMD": v, "MMD_lo": v - 0.5, "MMD_hi": v + 0.5, "NS": v / 2, "NS_lo": v / 2 - 0.1,
                          "NS_hi": v / 2 + 0.1},
                         index=pd.MultiIndex.from_tuples(rows, names=["method", "modes"]))
    paper = pd.DataFrame({"MMD": [15.0, 10.6, 2.1, 1.8, 0.0], "NS": [14.3, 9.5, 2.1, 0.8, 0.0]},
                         index=pd.MultiIndex.from_tuples(rows[:5], names=["method", "modes"]))
    return frame, paper


def test_distances_draws_and_labels():
    frame, paper = _frame()
    fig = plotting_table1.distances(frame, paper)
    try:
        assert len(fig.axes) == 2
        mmd_ax, ns_ax = fig.axes
        assert "MMD" in mmd_ax.get_xlabel() and "NS" in ns_ax.get_xlabel()
        assert mmd_ax.get_xscale() == "symlog"
        assert [t.get_text() for t in mmd_ax.get_yticklabels()] == ["Dropout", "Laplace", "DE", "HMC"]
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["one-mode", "multi-mode", "reference", "paper"]
        # the paper's crosses: one per row it reports, in each panel
        crosses = [line for line in mmd_ax.get_lines() if line.get_marker() == "x" and len(line.get_xdata())]
        assert sum(len(line.get_xdata()) for line in crosses) == 5
        # the first method is drawn on top
        lo, hi = mmd_ax.get_ylim()
        assert lo > hi
        fig.canvas.draw()  # renders without error (symlog axis, negative interval ends)
    finally:
        plt.close(fig)


def test_distances_without_paper_or_intervals():
    frame, _ = _frame()
    fig = plotting_table1.distances(frame[["MMD"]], columns=("MMD",))
    try:
        assert len(fig.axes) == 1
        assert not [line for line in fig.axes[0].get_lines() if line.get_marker() == "x"]
        fig.canvas.draw()
    finally:
        plt.close(fig)
