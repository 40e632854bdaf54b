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
    assert list(np.round(ax.get_yticks())) == [40, 202]
    lo, hi = ax.get_xlim()
    assert lo <= 200 and hi >= 1250


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
