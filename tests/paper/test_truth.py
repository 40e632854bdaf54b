"""Table 1 against the true posterior (symlib.paper.truth): the MLP setup through every method of
symlib.posteriors, the predictive comparisons of Izmailov et al. in closed form, and Kendall's tau with its
bootstrap interval."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from symlib.paper import pca_digits as P
from symlib.paper import table1, truth
from symlib.posteriors import sampling
from symlib.stats import mmd

RECIPE = dataclasses.replace(P.PROBLEM.recipe, epochs=30, batch_size=10, milestones=(20,))
TINY = dataclasses.replace(P.PROBLEM, n_per_class=4, n_test=30, n_ood=30, recipe=RECIPE)


@pytest.fixture(scope="module")
def setup():
    return P.setup((3,), "tiny", problem=TINY)


@pytest.mark.parametrize("entry", truth.plan("tiny"), ids=lambda e: f"{e.method}-{e.modes}")
def test_every_method_takes_the_mlp_setup(setup, entry):
    """Every row of the MLP's Table 1 runs through sampling.run on the stacked MLP setup: full state dicts of
    MLPClassifier, the planned sizes, finite weights, and predictions that sum to one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="VI starts from BLiTZ")
        s = sampling.run(entry.method, setup, entry.n_modes, entry.n_per_mode, 0, progress=False,
                         **dict(entry.hyper))
    ref = {k: tuple(v.shape) for k, v in setup.make_model().state_dict().items()}
    assert {k: tuple(v.shape[1:]) for k, v in s.params.items()} == ref
    assert s.n_samples == entry.n_samples and all(torch.isfinite(v).all() for v in s.params.values())
    p = truth.probabilities(s, P.load(TINY).x_test)
    assert p.shape == (entry.n_samples, 30, 10)
    torch.testing.assert_close(p.sum(-1), torch.ones(entry.n_samples, 30, dtype=torch.float64))


def test_dropout_on_the_mlp_zeroes_whole_feature_columns(setup):
    s = sampling.run("dropout", setup, 1, 4, 0, progress=False, p=0.5)
    w = s.params["fc.weight"]
    dead = (w == 0).all(1)  # (samples, features): dropped features are whole zero columns
    assert dead.any() and not dead.all()


def test_predictive_agreement_closed_form():
    """Two inputs, three classes: the averaged predictives agree on the first input only, and their total
    variation is half the L1 distance, averaged over inputs."""
    # mean over the two samples: (.5, .4, .1) and (.2, .5, .3)
    p = torch.tensor([[[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]], [[0.4, 0.5, 0.1], [0.2, 0.5, 0.3]]])
    q = torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.2, 0.7]]])
    out = truth.predictive_agreement(p, q)
    assert out["agreement"] == pytest.approx(50.0)
    tv = 0.5 * (abs(0.5 - 0.7) + abs(0.4 - 0.2) + 0.0) / 2 + 0.5 * (0.1 + 0.3 + 0.4) / 2
    assert out["total variation"] == pytest.approx(100 * tv)
    assert truth.predictive_agreement(q, q) == {"agreement": 100.0, "total variation": 0.0}
    with pytest.raises(ValueError, match="same inputs"):
        truth.predictive_agreement(p, q[:, :1])


def test_kendall_is_scipys_and_ranking_agreement_bootstraps_it(spec_sets):
    g = np.random.default_rng(0)
    a, b = g.normal(size=9), g.normal(size=9)
    assert truth.kendall(a, b) == pytest.approx(stats.kendalltau(a, b).statistic)
    assert truth.kendall(a, a) == pytest.approx(1.0) and truth.kendall(a, -a) == pytest.approx(-1.0)
    assert np.isnan(truth.kendall([1.0], [2.0]))
    lay, names = spec_sets
    res = mmd.layered_table(lay, "target", names, ("raw",), n_bootstrap=30, seed=0)
    same = truth.ranking_agreement(res, res, names)["raw"]
    assert same["tau"] == pytest.approx(1.0) and same["low"] == pytest.approx(1.0)
    assert same["replicates"] == 30
    other = mmd.layered_table(lay, "other", names, ("raw",), n_bootstrap=30, seed=0)
    out = truth.ranking_agreement(res, other, names)["raw"]
    point = stats.kendalltau([float(res[(n, "raw")].value()) for n in names],
                             [float(other[(n, "raw")].value()) for n in names])
    assert out["tau"] == pytest.approx(point.statistic) and out["p"] == pytest.approx(point.pvalue)
    assert -1 <= out["low"] <= out["high"] <= 1 and out["n"] == len(names)


@pytest.fixture(scope="module")
def spec_sets():
    """Five sets of 3-3-10 MLPs at growing distances from a target, and an unrelated second target."""
    from symlib import models
    from symlib.symmetry import trace

    g = torch.Generator().manual_seed(2)
    shapes = {k: tuple(v.shape) for k, v in models.MLPClassifier((3, 3, 10)).state_dict().items()}

    def draw(n, shift):
        return {k: torch.randn(n, *s, generator=g, dtype=torch.float64) + shift for k, s in shapes.items()}

    sets = {"target": draw(40, 0.0), "other": draw(40, 0.3), **{f"m{i}": draw(20, 0.2 * i) for i in range(5)}}
    spec = trace.spec_of(models.MLPClassifier((3, 3, 10)).double(), (3,))
    return mmd.layered(sets, spec, ("raw",)), [f"m{i}" for i in range(5)]


def test_reference_set_takes_evenly_spaced_draws(tmp_path):
    from symlib.paper import frontier as F

    s = dataclasses.replace(truth.REFERENCE["tiny"], rounds=20, segment=10)
    r = F.run((2,), s, tmp_path / "ref", TINY)
    ref = truth.reference_set(r, 6)
    d = r.draws()["draws"]
    assert ref["fc.bias"].shape == (6, 10)
    torch.testing.assert_close(ref["fc.bias"][2].double(), d[0, -1, -10:].float().double())  # last of chain 0
    assert table1.Entry("ensemble", "target", truth.target_size("tiny"), 1).label == ("DE", "target")


def test_the_chapters_defaults_are_what_make_zoo_caches():
    """The chapter's parameters cell, at its defaults, asks for the reference that `make zoo` caches
    (truth.REFERENCE["cpu"], the frontier's settings until converged within a budget) and for the layout
    truth.HIDDEN."""
    import re
    from pathlib import Path

    from symlib.paper import frontier as F

    text = (Path(__file__).resolve().parents[2] / "notebooks/true_posterior.md").read_text()
    cell = re.search(r":tags: \[parameters\]\n\n(.*?)```", text, re.S).group(1)
    ns: dict = {}
    exec(cell, ns)
    settings = dataclasses.replace(F.SETTINGS, n_chains=ns["n_chains"], n_leapfrog=ns["n_leapfrog"],
                                   warmup=tuple(ns["warmup"]), mass=ns["mass"], orbit_moves=ns["orbit_moves"],
                                   shift_moves=ns["shift_moves"], budget=ns["frontier_budget"],
                                   target_accept=ns["target_accept"])
    assert settings == F.SETTINGS
    until_converged = dataclasses.replace(settings, rounds=None, budget=ns["reference_budget"])
    assert until_converged == truth.REFERENCE["cpu"]
    assert dataclasses.replace(settings, rounds=ns["reference_rounds"]) == truth.REFERENCE["paper"]
    assert tuple(ns["hidden"]) == truth.HIDDEN and ns["scale"] == "cpu"
    assert tuple(ns["hidden_large"]) == truth.HIDDEN_LARGE


def test_the_reference_samples_on_one_thread_whatever_the_callers_count(tmp_path, monkeypatch):
    """The reference's budget counts CPU seconds: it runs on one intra-op thread (as every run of the
    frontier, Run.advance), so that many idle threads cannot spend it, and the caller's count comes back
    afterwards."""
    from symlib.paper import frontier as F

    seen = []
    real = F.Run._advance
    monkeypatch.setattr(F.Run, "_advance",
                        lambda self, *a: seen.append(torch.get_num_threads()) or real(self, *a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        s = dataclasses.replace(truth.REFERENCE["tiny"], rounds=10, segment=10)
        r = truth.reference("tiny", (2,), cache_dir=tmp_path, settings=s, problem=TINY)
        assert seen == [1] and torch.get_num_threads() == 2
        assert r.manifest["done"] and r.draws()["draws"].shape[:2] == (s.n_chains, 10)
    finally:
        torch.set_num_threads(before)


def test_each_label_gets_its_own_tau_where_raw_and_ns_rankings_differ(spec_sets):
    """The two comparisons rank the rows differently (NS reverses the raw order): each labelled row of the
    table carries the tau of its own key, recomputed here with scipy from the distances it ranks."""
    lay, names = spec_sets
    raw_t = mmd.layered_table(lay, "target", names, ("raw",), n_bootstrap=20, seed=0)
    raw_o = mmd.layered_table(lay, "other", names, ("raw",), n_bootstrap=20, seed=0)
    # "ns": the same results with the truth's order reversed, so its tau is minus the raw one
    ns_t = {(n, "ns"): raw_t[(n, "raw")] for n in names}
    ns_o = {(n, "ns"): raw_o[(names[-1 - i], "raw")] for i, n in enumerate(names)}
    table = truth.labelled(truth.ranking_agreement({**raw_t, **ns_t}, {**raw_o, **ns_o}, names))
    a = [float(raw_t[(n, "raw")].value()) for n in names]
    b = [float(raw_o[(n, "raw")].value()) for n in names]
    tau_raw = stats.kendalltau(a, b).statistic
    tau_ns = stats.kendalltau(a, b[::-1]).statistic
    assert tau_raw != pytest.approx(tau_ns)
    assert table.loc[truth.SYMMETRIES["raw"], "tau"] == pytest.approx(tau_raw)
    assert table.loc[truth.SYMMETRIES["ns"], "tau"] == pytest.approx(tau_ns)
    with pytest.raises(KeyError, match="no label"):
        truth.labelled({"sorted": {"tau": 0.0}})


def test_replicated_tau_is_scipys_for_every_combination():
    """Every combination of replicates (one per row, the same in both orders) and references gives scipy's
    tau_b of the rows it picks, ties of an indicator included."""
    import itertools

    g = np.random.default_rng(0)
    n, r, k = 5, 3, 2
    a, b = g.normal(size=(n, r)), g.normal(size=(n, r, k))
    indicator = np.repeat(np.array([[0.0], [0.0], [1.0], [1.0], [1.0]]), r, 1)
    for scores in (a, indicator):
        taus = truth.replicated_tau(scores, b)
        assert taus.shape == (r,) * n + (k,)
        for combo in itertools.product(range(r), repeat=n):
            for q in range(k):
                x = [scores[i, combo[i]] for i in range(n)]
                y = [b[i, combo[i], q] for i in range(n)]
                assert taus[combo + (q,)] == pytest.approx(stats.kendalltau(x, y).statistic, abs=1e-12)
    with pytest.raises(ValueError, match="rows, replicates, references"):
        truth.replicated_tau(a, b[:, :2])


def test_replicated_agreement_spans_the_replicates_and_names_missing_ones():
    g = np.random.default_rng(1)
    rows, reps, refs = [f"m{i}" for i in range(6)], [0, 2, 3], [0, 1]
    base = np.arange(6.0)
    to_target = {"raw": {(n, r): base[i] + 0.8 * g.normal() for i, n in enumerate(rows) for r in reps}}
    to_truth = {"raw": {(n, r, q): base[i] + 0.8 * g.normal() for i, n in enumerate(rows) for r in reps
                        for q in refs}}
    out = truth.replicated_agreement(to_target, to_truth, {"all": rows, "first half": rows[:3]})
    row = out[("all", "raw")]
    assert row["combinations"] == 3**6 * 2 and row["n"] == 6
    assert row["min"] <= row["low"] <= row["mean"] <= row["high"] <= row["max"]
    point = stats.kendalltau([to_target["raw"][(n, 0)] for n in rows],
                             [to_truth["raw"][(n, 0, 0)] for n in rows]).statistic
    assert row["tau"] == pytest.approx(point)
    assert out[("first half", "raw")]["combinations"] == 3**3 * 2
    del to_truth["raw"][("m1", 2, 1)]
    with pytest.raises(KeyError, match="m1"):
        truth.replicated_agreement(to_target, to_truth, {"all": rows})


def test_replicate_seeds_skip_the_targets():
    assert truth.replicate_seeds(0, "cpu") == [0, 2, 3]
    assert truth.replicate_seeds(5, "tiny") == [5, 7]
    assert all(s != 4 + truth.TARGET_SEED_OFFSET for s in truth.replicate_seeds(4, "paper"))


def test_distances_are_the_tables_values_and_reuse_what_is_known(spec_sets, monkeypatch):
    lay, names = spec_sets
    table = mmd.layered_table(lay, "target", names, ("raw",), n_permutations=20, seed=0)
    fresh = truth.distances(lay, {(n, 0): n for n in names}, "target", ("raw",))["raw"]
    for n in names:
        assert fresh[(n, 0)] == pytest.approx(100 * float(table[(n, "raw")].value()), rel=1e-12)

    def measured(*a, **k):
        raise AssertionError("a known distance was measured again")

    monkeypatch.setattr(mmd, "mmd", measured)
    again = truth.distances(lay, {(n, 0): n for n in names}, "target", ("raw",), known=table)["raw"]
    assert again == {(n, 0): 100 * float(table[(n, "raw")].value()) for n in names}


def test_spread_is_keyed_by_row_and_label():
    to_target = {"ns": {("a", 0): 1.0, ("a", 2): 3.0, ("b", 0): 5.0, ("b", 2): 7.0}}
    to_truth = {"ns": {("a", 0, 0): 2.0, ("a", 0, 1): 4.0, ("a", 2, 0): 6.0, ("a", 2, 1): 8.0,
                       ("b", 0, 0): 1.0, ("b", 0, 1): 1.0, ("b", 2, 0): 1.0, ("b", 2, 1): 1.0}}
    frame = truth.spread(to_target, to_truth, ["b", "a"])
    lab = truth.SYMMETRIES["ns"]
    assert list(frame.index) == ["b", "a"]
    assert frame.loc["a", (lab, "to target", "mean")] == 2.0
    assert frame.loc["a", (lab, "to HMC", "least")] == 2.0
    assert frame.loc["a", (lab, "to HMC", "largest")] == 8.0
    assert frame.loc["b", (lab, "to HMC", "mean")] == 1.0
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a block is selected without pandas' lexsort PerformanceWarning
        assert list(frame[(lab, "to HMC")].columns) == ["mean", "least", "largest"]
