"""The convergence frontier (symlib.paper.frontier) and its problem (symlib.paper.pca_digits): the data, a
tiny run end to end, a killed run that resumes to the same draws, and the criterion it applies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from symlib import models, store
from symlib.paper import frontier as F
from symlib.paper import pca_digits as P
from symlib.symmetry import check

TINY = dataclasses.replace(P.PROBLEM, n_per_class=3, n_test=20, n_ood=20)
SETTINGS = dataclasses.replace(F.SETTINGS, n_chains=2, n_leapfrog=3, warmup=(10, 10), levels=4, segment=10,
                               budget=1e9, rounds=20, n_probe=4)


def test_projected_digits():
    """Components of unit variance on the 4,000 embedded training images, orthonormal directions, the first
    digits of every class, test and OOD images through the same projection, a stable fingerprint."""
    d = P.load(TINY)
    assert d.x.shape == (30, 4) and d.x_test.shape == (20, 4) and d.x_ood.shape == (20, 4)
    assert torch.bincount(d.y, minlength=10).tolist() == [3] * 10
    torch.testing.assert_close(d.basis @ d.basis.T, torch.eye(4, dtype=torch.float64), atol=1e-10, rtol=0)
    from symlib import data

    full = d.project(data.load("mnist").x)
    torch.testing.assert_close(full.std(0), torch.ones(4, dtype=torch.float64))
    assert 0 < d.explained < 1
    assert P.load(dataclasses.replace(TINY)).fingerprint == d.fingerprint
    assert P.load(dataclasses.replace(TINY, n_per_class=4)).fingerprint != d.fingerprint
    counted = sum(p.numel() for p in models.MLPClassifier((4, 8, 10)).parameters())
    assert P.n_params((8,)) == 5 * 8 + 9 * 10 == counted


def test_setup_and_likelihood():
    """The setup's prior precision is 1 / sigma_p^2 (weight decay 1 / (N sigma_p^2)); the likelihood is the
    summed cross-entropy of the module and its gradient."""
    s = P.setup((3,), "tiny", problem=TINY)
    assert s.arch == "mlp-classifier" and s.prior_precision == pytest.approx(1.0)
    lik, shapes = P.likelihood((3,), TINY)
    m = models.MLPClassifier(P.widths((3,), TINY)).double()
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])[None]
    loss, g = lik(flat)
    ref = torch.nn.functional.cross_entropy(m(P.load(TINY).x), P.load(TINY).y, reduction="sum")
    ref.backward()
    torch.testing.assert_close(loss[0], ref.detach())
    torch.testing.assert_close(g[0], torch.cat([p.grad.reshape(-1) for p in m.parameters()]))


def test_a_tiny_run_and_its_checks(tmp_path):
    r = F.run((2,), SETTINGS, tmp_path / "run", TINY)
    m = r.manifest
    assert m["done"] and m["segments"] == 2 and len(m["checks"]) == 2 and len(m["warmup"]) == 2
    last = m["checks"][-1]
    assert last["draws"] == 20 and set(last) >= {"raw", "canonical", "invariant", "sampler", "converged"}
    rep = r.report()
    assert last["converged"] == rep.converged(rhat=1.01, ess=400.0) and last["converged"] is False
    assert rep["invariant"].names[:2] == ["potential", "test log-likelihood"]
    assert len(rep["invariant"].names) == 6
    # the stored canonical forms are canonical forms of the stored draws: same functions
    seg = r.segments[0]
    from symlib.params import unflatten
    from symlib.training import mlp as tm

    shapes = tm.shapes(P.widths((2,), TINY))
    raw = unflatten(seg["draws"].reshape(-1, seg["draws"].shape[-1]), shapes)
    can = unflatten(seg["canonical"].reshape(-1, seg["draws"].shape[-1]), shapes)
    assert float(check.function_error(F.spec((2,), TINY), raw, can).max()) < 1e-9
    row = F.summary(r)
    assert row["n_params"] == P.n_params((2,), TINY) and row["converged"] is False


def test_a_killed_run_resumes_to_the_same_draws(tmp_path):
    """A run stopped after its first segment (what a killed run leaves) and resumed from its folder gives
    the draws of an uninterrupted run, bit for bit; another run's folder is refused."""
    whole = F.run((2,), SETTINGS, tmp_path / "whole", TINY).draws()["draws"]
    first = F.Run((2,), SETTINGS, tmp_path / "half", TINY)
    first.advance(max_segments=1)
    assert first.manifest["segments"] == 1 and not first.manifest["done"]
    del first
    resumed = F.Run((2,), SETTINGS, tmp_path / "half", TINY)
    assert resumed.manifest["segments"] == 1 and len(list((tmp_path / "half").glob("state-*"))) == 1
    resumed.advance()
    assert torch.equal(resumed.draws()["draws"], whole)
    with pytest.raises(store.StoreError, match="another frontier run"):
        F.Run((3,), SETTINGS, tmp_path / "whole", TINY)


def test_sweep_writes_the_summary(tmp_path):
    out = tmp_path / "frontier.json"
    doc = F.sweep([(2,)], SETTINGS, tmp_path / "runs", out, TINY, progress=False)
    read = F.results(out)
    assert read["sizes"][0]["hidden"] == [2] and read["format"] == "symlib-frontier/1"
    assert {"cpu", "logical_cpus", "date"} <= set(read["machine"]) and doc["sizes"] == read["sizes"]


def test_ablation_writes_the_summary_and_reuses_the_frontiers_run(tmp_path):
    """Every variant runs in a folder of its own beside the frontier's (same root): the unchanged settings
    are the frontier's own run, a changed setting adds one folder, and the file holds what is returned."""
    root, out = tmp_path / "runs", tmp_path / "ablation.json"
    F.sweep([(2,)], SETTINGS, root, None, TINY, progress=False)
    before = {p.name for p in root.iterdir()}
    assert before == {F.name((2,), SETTINGS, TINY)}
    doc = F.ablation({"as is": {}, "shorter": {"n_leapfrog": 2}}, (2,), SETTINGS, root, out, TINY,
                     progress=False)
    after = {p.name for p in root.iterdir()}
    assert before < after and len(after) == 2
    read = F.results(out)
    assert list(read["variants"]) == ["as is", "shorter"] and read["hidden"] == [2]
    assert read["variants"]["shorter"]["changes"] == {"n_leapfrog": 2}
    assert [v["row"]["hidden"] for v in read["variants"].values()] == [[2], [2]]
    assert list(doc["variants"]) == list(read["variants"])


def test_committed_frontier_is_a_sweep_of_the_chapter_settings():
    """The committed results are what `python -m symlib.paper.frontier` writes for the chapter's settings and
    problem: every size of SIZES, and its converged sizes met the criterion at the check they record."""
    doc = F.results()
    assert doc["format"] == "symlib-frontier/1"
    assert F.sampler_settings(doc["settings"]) == {**F.sampler_settings(F.SETTINGS),
                                                   "budget": doc["settings"]["budget"]}
    assert F.rule(doc["settings"]) == {k: getattr(F.SETTINGS, k) for k in F.RULE_FIELDS}  # the chapter's rule
    assert [tuple(r["hidden"]) for r in doc["sizes"]] == [tuple(h) for h in F.SIZES]
    for r in doc["sizes"]:
        assert r["n_params"] == P.n_params(r["hidden"])
        if r["converged"]:
            hit = [c for c in r["checks"] if c["converged"]] if "checks" in r else [r["last"]]
            assert hit and all(c["canonical"]["rhat_max"] < 1.01 and c["invariant"]["rhat_max"] < 1.01 and
                               c["canonical"]["ess_min"] >= 400 and c["invariant"]["ess_min"] >= 400
                               for c in hit[:1])
            # the rule: the criterion at `confirm` checks in a row, each half below 1.01, few divergences
            assert all(c["criterion"] for c in r["checks"][-F.SETTINGS.confirm:])
            assert max(hit[0]["halves"]) < 1.01
            assert hit[0]["sampler"]["divergent_share_cold"] <= F.SETTINGS.max_divergent
        assert np.isfinite(r["cpu_s"])


def test_committed_ablation_has_every_variant():
    """The committed ablation (`python -m symlib.paper.frontier --ablation`) holds every variant of
    ABLATIONS with the changes it names, on ABLATION_HIDDEN, each judged by the frontier's criterion; the
    unchanged variant is the frontier's own run of that layout (the same CPU seconds)."""
    doc = F.results(F.ABLATION)
    assert tuple(doc["hidden"]) == F.ABLATION_HIDDEN
    assert set(doc["variants"]) == set(F.ABLATIONS)
    for name, v in doc["variants"].items():
        assert v["changes"] == F.ABLATIONS[name], name
        r = v["row"]
        assert tuple(r["hidden"]) == F.ABLATION_HIDDEN and np.isfinite(r["cpu_s"])
        if r["converged"]:
            last = r["last"]
            assert r["converged_at"]["cpu_s"] <= r["cpu_s"] + 1e-9
            assert last["canonical"]["rhat_max"] < 1.01 or r["converged_at"]["draws"] < last["draws"]
    base = doc["variants"][next(iter(F.ABLATIONS))]["row"]
    front = F.results()
    if F.sampler_settings(doc["settings"]) == F.sampler_settings(front["settings"]) and \
            F.rule(doc["settings"]) == F.rule(front["settings"]):  # the same run when the settings agree
        sweep = next(r for r in front["sizes"] if tuple(r["hidden"]) == F.ABLATION_HIDDEN)
        assert base["cpu_s"] == sweep["cpu_s"]


def test_frame_lines_up_the_committed_runs():
    """frontier.frame: one line per run, named by layout or by the labels given; a size that did not
    converge has no time to convergence; the figures are the rows' own."""
    doc = F.results()
    t = F.frame(doc["sizes"])
    assert t.index.name == "hidden" and list(t.index) == ["-".join(map(str, h)) for h in F.SIZES]
    for r in doc["sizes"]:
        line = t.loc["-".join(map(str, r["hidden"]))]
        assert line["parameters"] == r["n_params"] and line["CPU s spent"] == r["cpu_s"]
        assert (line["converged"] == "yes") == r["converged"]
        assert np.isnan(line["CPU s to converge"]) != r["converged"]
        assert line["worst R-hat (canonical)"] == r["last"]["canonical"]["rhat_max"]
    abl = F.results(F.ABLATION)["variants"]
    a = F.frame([v["row"] for v in abl.values()], labels=list(abl))
    assert a.index.name == "variant" and list(a.index) == list(abl)
    with pytest.raises(ValueError, match="2 labels for 1 rows"):
        F.frame(doc["sizes"][:1], labels=["a", "b"])


def test_frame_keeps_counts_integer():
    """Counts (parameters, levels, draws, round trips, divergences) stay integers in frontier.frame, also
    beside a run that did not converge (NaN times) and in a one-line table: a table shows 392, not 392.0."""
    def row(hidden, n, converged):
        check = {"cpu_s": 10.0, "wall_s": 20.0, "draws": 250,
                 "sampler": {"levels": 7, "step_cold": 0.05, "round_trips": [3, 2], "divergences": 1},
                 "canonical": {"rhat_max": 1.004, "ess_min": 512.5}, "invariant": {"rhat_max": 1.002,
                                                                                  "ess_min": 640.0}}
        return {"hidden": hidden, "n_params": n, "converged": converged, "cpu_s": 12.5, "last": check,
                "converged_at": check if converged else None, "warmup": {"barrier": 3.5}}

    counts = ["parameters", "levels", "draws per chain", "round trips (least chain)",
              "divergent trajectories"]
    for rows in ([row([2], 40, True), row([4, 4], 90, False)], [row([8], 130, False)]):
        t = F.frame(rows)
        assert all(t[c].dtype.kind == "i" for c in counts), t.dtypes
        assert t["CPU s to converge"].dtype.kind == "f" and t["converged"].tolist()[-1] == "no"
        assert t.loc["-".join(map(str, rows[0]["hidden"])), "parameters"] == rows[0]["n_params"]
        assert t.loc[t.index[-1], "round trips (least chain)"] == 2


def test_certification_needs_consecutive_checks_both_halves_and_few_divergences():
    """The rule fixed before looking: the criterion at the last two checks in a row, each half alone below
    R-hat 1.01, and a divergent share at the posterior's level at most the stated one."""
    from symlib.paper.frontier import judging

    s = judging.SETTINGS
    assert s.confirm == 2 and s.halves and s.max_divergent == 0.01
    good = [1.004, 1.006]
    assert judging.certify([False, True, True], good, 0.0, s)
    assert not judging.certify([False, True], good, 0.0, s)  # the first check that passes is not enough
    assert not judging.certify([True, False, True], good, 0.0, s)
    assert not judging.certify([True, True], [1.004, 1.019], 0.0, s)  # one half alone fails
    assert not judging.certify([True, True], None, 0.0, s)
    assert not judging.certify([True, True], good, 0.011, s)
    assert judging.certify([True, True], good, 0.01, s)
    earlier = dataclasses.replace(s, confirm=1, halves=False, max_divergent=1.0)
    assert judging.certify([False, True], None, 0.5, earlier)


def test_committed_replicates_are_the_frontier_from_other_seeds():
    """Each committed replicate is a sweep of the chapter's settings but its seed, over layouts the
    frontier also ran; `replicates` puts one line per layout and seed."""
    docs = [F.results()] + [F.results(p) for p in F.REPLICATES if p.is_file()]
    assert len(docs) == 3
    seeds = [int(d["settings"]["seed"]) for d in docs]
    assert len(set(seeds)) == 3
    base = {k: v for k, v in docs[0]["settings"].items() if k != "seed"}
    for d in docs[1:]:
        assert {k: v for k, v in d["settings"].items() if k != "seed"} == base
        assert {tuple(r["hidden"]) for r in d["sizes"]} <= {tuple(r["hidden"]) for r in docs[0]["sizes"]}
    table = F.replicates(docs)
    assert table.index.names == ["hidden", "seed"]
    ran = {("-".join(map(str, r["hidden"])), int(d["settings"]["seed"]))
           for d in docs[1:] for r in d["sizes"]}
    assert {h for h, _ in ran} == set(table.index.get_level_values("hidden"))
    assert set(table.index) == ran | {(h, seeds[0]) for h, _ in ran}
    for (h, seed), row in table.iterrows():
        r = next(r for d in docs if int(d["settings"]["seed"]) == seed for r in d["sizes"]
                 if "-".join(map(str, r["hidden"])) == h)
        assert (row["certified"] == "yes") == r["converged"]
        assert (row["CPU s to certify"] == r["converged_at"]["cpu_s"]) if r["converged"] else \
            np.isnan(row["CPU s to certify"])

