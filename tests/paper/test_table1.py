"""Table 1 assembly (symlib.paper.table1): the rows, the columns and their mathematics, on tiny inputs."""

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest
import torch

from symlib import models
from symlib import training as train
from symlib.paper import table1
from symlib.stats import metrics, mmd, predict
from symlib.symmetry import trace


def _stack(seeds):
    return {k: v.double() for k, v in train.init_params(models.OptuNet, seeds).items()}


@pytest.fixture(scope="module")
def spec():
    return trace.spec_of(models.OptuNet().double(), (1, 28, 28))


def test_plan_rows_and_sizes():
    rows = table1.plan("cpu")
    labels = [e.label for e in rows]
    assert len(labels) == len(set(labels)) == 2 * 5 + 2
    assert labels[0] == ("Dropout", "one-mode") and labels[-1] == ("HMC", "reference")
    assert ("DE", "multi-mode") in labels and ("Laplace", "multi-mode") in labels
    by = {e.label: e for e in rows}
    assert (by[("SWAG", "one-mode")].n_modes, by[("SWAG", "one-mode")].n_samples) == (1, 100)
    assert (by[("SWAG", "multi-mode")].n_modes, by[("SWAG", "multi-mode")].n_per_mode) == (10, 10)
    assert by[("DE", "multi-mode")].n_samples == 100
    # every paper row is planned at the paper's sizes
    assert set(table1.PAPER) <= set(labels)
    assert all(e.n_samples <= 10 for e in table1.plan("tiny"))
    assert table1.plan("tiny", ["laplace"], hmc=False)[-1].label == ("DE", "multi-mode")


def test_plan_rejects_unknown_method():
    with pytest.raises(ValueError, match="unknown posterior method"):
        table1.plan("tiny", ["laplace", "nuts"])
    with pytest.raises(ValueError, match="unknown posterior method"):
        table1.plan("tiny", hyper={"mcmc": {}})


def test_paper_values_are_the_notes():
    p = table1.paper_frame()
    assert list(p.columns) == list(table1.COLUMNS)
    assert p.shape == (10, 9)
    assert p.loc[("DE", "multi-mode"), "Acc"] == 95.3
    assert p.loc[("Laplace", "one-mode"), "MMD"] == 10.6
    # the paper's claims, read off its own table: multi-mode below every one-mode MMD, Laplace the
    # closest one-mode method, DE zero
    one, multi = p.xs("one-mode", level="modes"), p.xs("multi-mode", level="modes")
    assert multi["MMD"].drop("DE").max() < one["MMD"].min()
    assert one["MMD"].idxmin() == "Laplace" and one["NS"].idxmin() == "Laplace"
    assert p.loc[("DE", "multi-mode"), "MMD"] == 0.0


def test_mmd_frame_matches_the_results(spec):
    target = _stack(range(12))
    sets = {"near": _stack(range(100, 106)), "far": {k: 3 * v for k, v in _stack(range(200, 206)).items()}}
    labels = {"near": ("Near", "one-mode"), "far": ("Far", "one-mode")}
    res = mmd.table(target, sets, spec, symmetries=("raw", "ns"), n_permutations=19, n_bootstrap=30,
                    progress=False)
    f = table1.mmd_frame(res, labels)
    assert list(f.index) == [("Near", "one-mode"), ("Far", "one-mode")]
    for name, label in labels.items():
        for sym, col in (("raw", "MMD"), ("ns", "NS")):
            assert f.loc[label, col] == pytest.approx(100 * float(res[(name, sym)].value()), rel=1e-12)
            assert f.loc[label, f"{col}_lo"] <= f.loc[label, f"{col}_hi"]
            assert 1 / 20 <= f.loc[label, f"{col}_p"] <= 1
    # three times larger weights are far from the target: the smallest possible p-value with 19 permutations
    assert f.loc[("Far", "one-mode"), "MMD"] > f.loc[("Near", "one-mode"), "MMD"]
    assert f.loc[("Far", "one-mode"), "MMD_p"] == pytest.approx(1 / 20)
    v = table1.variant_frame(res, labels)
    assert list(v.columns) == ["MMD median", "MMD mean", "MMD max", "NS median", "NS mean", "NS max"]
    np.testing.assert_allclose(v["MMD median"], f["MMD"], rtol=1e-12)
    # the max over kernels bounds the median and the mean
    assert (v["MMD max"] >= v["MMD median"]).all() and (v["NS max"] >= v["NS mean"]).all()
    s = table1.with_interval(f, "MMD", digits=2)
    assert s[0].startswith(f"{f['MMD'].iloc[0]:.2f} [")


def test_metric_frame_closed_forms():
    """Copies of one network: the ensemble is that network, so its mutual information is 0 and its
    accuracy is the network's; two networks: the table's values are metrics.evaluate's."""
    gen = torch.Generator().manual_seed(0)
    x, x_ood = torch.randn(40, 1, 28, 28, generator=gen), torch.randn(30, 1, 28, 28, generator=gen)
    one = {k: v.float() for k, v in _stack([5]).items()}
    copies = {k: v.repeat(4, *([1] * (v.ndim - 1))) for k, v in one.items()}
    p1 = predict.probs(one, x)
    y = p1[0].argmax(-1)
    y[:10] = (y[:10] + 1) % 10  # 30 of 40 right
    two = _stack([1, 2])
    f = table1.metric_frame({("Copies", "one-mode"): copies, ("Two", "multi-mode"): two}, x, y, x_ood)
    assert list(f.columns) == [*table1.METRIC_COLUMNS, "NLL"]
    c = f.loc[("Copies", "one-mode")]
    assert c["Acc"] == pytest.approx(75.0)
    assert abs(c["IDMI"]) < 1e-4 and abs(c["OODMI"]) < 1e-4
    ref = metrics.evaluate(predict.probs(two, x), y, predict.probs(two, x_ood))
    for k in table1.METRIC_COLUMNS:
        assert f.loc[("Two", "multi-mode"), k] == pytest.approx(ref[k], rel=1e-9, abs=1e-9)


def test_rank_correlation_orientation():
    idx = pd.MultiIndex.from_tuples([(f"m{i}", "one-mode") for i in range(5)], names=["method", "modes"])
    mmd_ = np.array([5.0, 1.0, 3.0, 2.0, 4.0])
    frame = pd.DataFrame({"MMD": mmd_, "Acc": 90 - mmd_, "ECE": 2 * mmd_ + 1, "OODMI": mmd_ ** 2}, index=idx)
    r = table1.rank_correlation(frame, columns=["Acc", "ECE", "OODMI"])
    # lower MMD, higher accuracy and lower ECE: both "better" -> rho = -1 once oriented
    assert r.loc["Acc", "rho"] == pytest.approx(-1.0)
    assert r.loc["ECE", "rho"] == pytest.approx(-1.0)
    assert r.loc["OODMI", "rho"] == pytest.approx(1.0)
    raw = table1.rank_correlation(frame, columns=["ECE"], oriented=False)
    assert raw.loc["ECE", "rho"] == pytest.approx(1.0)
    frame.loc[("m0", "one-mode"), "Acc"] = np.nan
    short = table1.rank_correlation(frame.iloc[:3], columns=["Acc"])
    assert short.loc["Acc", "n"] == 2 and math.isnan(short.loc["Acc", "rho"])


def test_side_by_side_aligns_the_paper():
    ours = table1.paper_frame().iloc[[4, 9]].copy() + 1.0
    hmc = pd.DataFrame([[1.0] * 9], columns=list(table1.COLUMNS),
                       index=pd.MultiIndex.from_tuples([("HMC", "reference")], names=["method", "modes"]))
    ours = pd.concat([ours, hmc])
    s = table1.side_by_side(ours)
    assert s.loc[("Laplace", "one-mode"), ("MMD", "paper")] == 10.6
    assert s.loc[("Laplace", "one-mode"), ("MMD", "ours")] == 11.6
    assert math.isnan(s.loc[("HMC", "reference"), ("Acc", "paper")])


def test_hmc_diagnostics_flatten():
    class S:
        diagnostics = {"accept_prob": [0.8, 0.9], "rhat_potential": 1.2, "n_chains": 2, "note": "x",
                       "nested": {"a": 1}, "rhat_max": None}

    d = table1.hmc_diagnostics(S())
    assert d["accept_prob (mean)"] == pytest.approx(0.85) and d["accept_prob (min)"] == 0.8
    assert d["rhat_potential"] == 1.2 and d["n_chains"] == 2.0 and d["nested.a"] == 1.0
    assert "note" not in d and math.isnan(d["rhat_max"])


def test_produce_writes_then_reloads(tmp_path):
    """A deep ensemble of 2 tiny OptuNets is trained once into the cache; the second call loads the same
    weights from disk (the chapter's reruns and nbval reuse the sets)."""
    from symlib.posteriors import sampling

    setup = sampling.setup_for("mnist-optunet", "tiny")
    rows = [table1.Entry("ensemble", "multi-mode", 2, 1)]
    first = table1.produce(setup, rows, root=tmp_path / "sets", cache_dir=tmp_path / "zoo", progress=False)
    path = table1.sets_dir(setup, 0, tmp_path / "sets") / rows[0].key
    assert (path / "manifest.json").exists()
    again = table1.produce(setup, rows, root=tmp_path / "sets", cache_dir=tmp_path / "zoo", progress=False)
    s1, s2 = first[("DE", "multi-mode")], again[("DE", "multi-mode")]
    assert s2.n_samples == 2
    for k in s1.params:
        assert torch.equal(s1.params[k].cpu(), s2.params[k].cpu())
    # a changed training problem (here: one more epoch) gets its own folder, not the stale sets
    longer = dataclasses.replace(setup, recipe=setup.recipe.scaled(setup.recipe.epochs + 1))
    assert table1.sets_dir(longer, 0, tmp_path / "sets") != table1.sets_dir(setup, 0, tmp_path / "sets")


def test_layered_compare_is_mmd_table(spec):
    """Removing symmetries once and pairing any two sets gives exactly symlib.stats.mmd.table's results."""
    target = _stack(range(10))
    sets = {"a": _stack(range(50, 56)), "b": {k: 2 * v for k, v in _stack(range(60, 66)).items()}}
    ref = mmd.table(target, sets, spec, symmetries=("raw", "ns"), n_permutations=9, n_bootstrap=7, seed=3,
                    progress=False)
    lay = mmd.layered({"target": target, **sets}, spec, ("raw", "ns"))
    ours = mmd.layered_table(lay, "target", ["a", "b"], ("raw", "ns"), n_permutations=9, n_bootstrap=7,
                             seed=3)
    assert set(ours) == set(ref)
    for k in ref:
        for field in ("values", "permuted", "boot", "bandwidths"):
            a, b = getattr(ours[k], field), getattr(ref[k], field)
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # a pair with the roles swapped is another comparison (the reference's rows are X)
    assert lay.pair("a", "target", "ns").m == 6
    with pytest.raises(KeyError, match="minmass"):
        lay.pair("target", "a", "minmass")


def test_p_values_at_their_floor_read_as_bounds():
    assert table1.p_floor(100) == 1 / 101 and table1.p_floor(200, two_sided=True) == 2 / 201
    # at the floor a p-value means "at most 1/(B+1)": rounded up, never printed as a point value
    assert table1.format_p(1 / 101, table1.p_floor(100)) == "\u2264 0.01"
    assert table1.format_p(2 / 201, table1.p_floor(200, True)) == "\u2264 0.01"
    assert table1.format_p(1 / 201, table1.p_floor(200)) == "\u2264 0.005"
    assert table1.format_p(1 / 100, table1.p_floor(99)) == "\u2264 0.01"
    assert table1.format_p(1 / 1001, table1.p_floor(1000)) == "\u2264 0.001"
    assert table1.format_p(0.234, table1.p_floor(100)) == "0.23"
    assert table1.format_p(0.02, None) == "0.02"
    assert table1.format_p(float("nan"), 0.01) == table1.MISSING
    with pytest.raises(ValueError):
        table1.p_floor(0)


def test_display_reads_like_a_paper():
    ours = table1.paper_frame() * 1.1
    ours.loc[("HMC", "reference"), :] = 5.0
    tables = table1.paper_tables(ours)
    assert [list(dict.fromkeys(t.columns.get_level_values(0))) for t in tables] == [
        list(g) for g in table1.PAPER_GROUPS]
    assert all(len(t) == len(ours) for t in tables)
    assert np.isnan(tables[0].loc[("HMC", "reference"), ("MMD", "paper")])  # the frame keeps its numbers
    html = table1.display(tables[0], uuid="t").to_html()
    assert "nan" not in html.lower() and table1.MISSING in html  # "–" where the paper reports nothing
    assert "multi\u2011mode" in html and "multi-mode" not in html  # labels do not wrap at the hyphen
    assert "white-space: nowrap" in html and "overflow-x: auto" in html and 'id="T_t"' in html
    assert ">16.5<" in html  # one decimal, as the paper
    shown = pd.DataFrame({"MMD [95% CI]": ["56.4 [55.7, 57.1]", "0.0 [-0.1, 0.1]"], "MMD p": [1 / 101, 0.23]},
                         index=["a", "b"])
    html = table1.display(shown, p_columns=["MMD p"], floor=table1.p_floor(100)).to_html()
    assert "56.4 [55.7, 57.1]" in html and "\u2264 0.01" in html and ">0.23<" in html


def test_display_keeps_its_caption_and_integer_counts():
    """A caption is the table's own (an HTML caption, so two tables of one cell keep theirs); an integer
    column prints its counts without decimals, and a missing count (pd.NA) as the dash."""
    frame = pd.DataFrame({"parameters": pd.array([392, pd.NA], dtype="Int64"), "MMD": [56.44, 0.0]},
                         index=["OptuNet", "MLP"])
    html = table1.display(frame, uuid="c", caption="to the DE target:").to_html()
    assert "<caption>to the DE target:</caption>" in html and html.index("<caption>") < html.index("<thead>")
    assert ">392<" in html and "392.0" not in html and table1.MISSING in html and ">56.4<" in html
    assert "<caption" not in table1.display(frame, uuid="d").to_html()


def test_subsample_tests_sizes_and_bounds():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(30, 4, generator=gen, dtype=torch.float64),)
    y = (torch.randn(20, 4, generator=gen, dtype=torch.float64) + 3.0,)
    pair = mmd.Pair(("l",), (4,), x, y)
    frame = table1.subsample_tests(pair, [3, 15], repeats=4, n_permutations=49, seed=1)
    assert list(frame.columns) == ["n", "repeat", "MMD", "p"] and len(frame) == 8
    assert ((frame["p"] >= 1 / 50 - 1e-12) & (frame["p"] <= 1)).all()
    # a shift of 3 standard deviations: 15 samples a side always reach the floor, 3 often do not
    assert (frame.loc[frame["n"] == 15, "p"] == 1 / 50).all()
    again = table1.subsample_tests(pair, [3, 15], repeats=4, n_permutations=49, seed=1)
    pd.testing.assert_frame_equal(frame, again)
    with pytest.raises(ValueError, match="exceeds"):
        table1.subsample_tests(pair, [21])


@pytest.mark.parametrize("scale", ["tiny", "cpu", "paper"])
def test_every_planned_row_passes_through_sampling_run(scale):
    """A row's hyper-parameters go to ``sampling.run(..., **hyper)`` beside run's own keywords: a method
    hyper-parameter named like one of them (HMC's former ``chunk``) would fail only when the set is made."""
    import inspect

    from symlib.posteriors import sampling

    own = set(inspect.signature(sampling.run).parameters) - {"hyper"}
    for e in table1.plan(scale):
        clash = own & set(e.hyper)
        assert not clash, f"{e.label}: hyper-parameter(s) {sorted(clash)} shadow sampling.run's keywords"
        sampling.method(e.method).check_hyper(dict(e.hyper))
