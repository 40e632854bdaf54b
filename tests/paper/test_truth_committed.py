"""The committed references of chapter "Against the true posterior" (symlib.paper.truth.commit): the
certification rule recomputed from the committed draws, the first rounds of a fresh start of this code
against the ones each reference recorded, and a committed file that does not match its settings refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from symlib.paper import frontier, truth

SEEDS = truth.REFERENCE_SEEDS
LAYOUTS = (truth.HIDDEN, truth.HIDDEN_LARGE)


def _settings(seed: int) -> frontier.Settings:
    return dataclasses.replace(truth.REFERENCE["cpu"], seed=seed)


@pytest.fixture(scope="module", params=[(h, k) for h in LAYOUTS for k in SEEDS],
                ids=lambda p: f"{'x'.join(map(str, p[0]))}-seed{p[1]}")
def committed(request):
    hidden, seed = request.param
    ref = truth.committed(hidden, _settings(seed))
    layout = " ".join(map(str, hidden))
    assert ref is not None, (f"no committed reference for {hidden}, seed {seed}: run `python -m "
                             f"symlib.paper.truth --hidden {layout} --seeds {seed}`")
    return ref


@pytest.mark.parametrize("hidden", LAYOUTS, ids=lambda h: "x".join(map(str, h)))
def test_two_independent_references_are_committed(hidden):
    refs = [truth.committed(hidden, _settings(k)) for k in SEEDS]
    assert len(SEEDS) >= 2 and all(r is not None for r in refs)
    assert not torch.equal(refs[0].samples[:, :10], refs[1].samples[:, :10])


@pytest.mark.slow
def test_the_committed_draws_meet_the_certification_rule(committed):
    """Recomputed here from the float32 draws: the criterion on canonical forms and invariant functionals,
    R-hat below 1.01 on each half alone, and the recorded divergent share at the posterior's level."""
    ref = committed
    assert ref.certified and ref.source == "committed"
    checks = ref.manifest["checks"]
    assert all(c["criterion"] for c in checks[-ref.settings.confirm:])  # two checks in a row
    rep = ref.report()
    for sc in ("canonical", "invariant"):
        assert float(rep[sc].rhat.max()) < frontier.RHAT, sc
        assert float(rep[sc].ess_bulk.min()) >= frontier.ESS and float(rep[sc].ess_tail.min()) >= frontier.ESS
        # the same diagnostics as the run's last check (on every draw), up to the float32 storage and the
        # thinning of the stored draws
        assert float(rep[sc].rhat.max()) == pytest.approx(checks[-1][sc]["rhat_max"], abs=3e-3)
    assert max(ref.halves()) < frontier.RHAT
    assert ref.samples.shape[1] == -(-checks[-1]["draws"] // ref.thin) or ref.samples.shape[1] == \
        checks[-1]["draws"] // ref.thin
    assert ref.samples.numel() * 4 <= truth.MAX_BYTES
    per_level, n = ref.stats["divergences_per_level"], ref.stats["trajectories_per_level"]
    assert n > 0 and per_level[0] / n <= ref.settings.max_divergent


def test_a_fresh_start_replays_the_recorded_first_rounds(committed):
    """This code and these settings start the committed chains: the first rounds of a fresh run (one
    thread, float64) equal the ones the reference recorded when it was committed."""
    meta, _ = truth._committed_paths(committed.hidden, committed.settings, committed.problem)
    recorded = torch.tensor(json.loads(meta.read_text())["replay"], dtype=torch.float64)
    again = truth.replay(committed.hidden, committed.settings, committed.problem)
    torch.testing.assert_close(again, recorded, rtol=1e-9, atol=1e-9)


def test_an_edited_or_renamed_reference_is_refused(tmp_path):
    s = _settings(SEEDS[0])
    meta, tensors = truth._committed_paths(truth.HIDDEN, s, truth._pd.PROBLEM)
    other = dataclasses.replace(s, seed=99)
    meta2, tensors2 = truth._committed_paths(truth.HIDDEN, other, truth._pd.PROBLEM, tmp_path)
    shutil.copy(meta, meta2)
    shutil.copy(tensors, tensors2)
    with pytest.raises(ValueError, match="records the run .* recompute it"):
        truth.committed(truth.HIDDEN, other, root=tmp_path)
    assert truth.committed(truth.HIDDEN, dataclasses.replace(s, seed=98), root=tmp_path) is None


def test_without_a_committed_reference_nothing_is_sampled_when_asked_not_to(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m symlib.paper.truth --hidden 3 --seeds 7"):
        truth.reference("cpu", (3,), seed=7, sample=False)


def test_the_command_commits_what_it_sampled_and_says_when_it_did_not_certify(tmp_path, monkeypatch, capsys):
    """`python -m symlib.paper.truth` on settings too short to certify: the run is committed as such
    (draws, checks, replay), the exit status is 1, and the committed reference loads back unchanged."""
    tiny = truth.REFERENCE["tiny"]
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(truth.REFERENCE, "cpu", tiny)
    assert truth.main(["--hidden", "2", "--seeds", "3", "--root", str(tmp_path / "out"),
                       "--budget", str(tiny.budget)]) == 1
    assert "NOT certified" in capsys.readouterr().out
    s = dataclasses.replace(tiny, seed=3)
    ref = truth.committed((2,), s, root=tmp_path / "out")
    assert ref is not None and not ref.certified and ref.source == "committed"
    run = frontier.Run((2,), s, tmp_path / "cache" / "true-posterior" / frontier.name((2,), s))
    torch.testing.assert_close(ref.samples, run.draws()["draws"].float().double())
    meta, _ = truth._committed_paths((2,), s, truth._pd.PROBLEM, tmp_path / "out")
    doc = json.loads(meta.read_text())
    assert doc["certified"] is False and doc["settings"]["seed"] == 3 and len(doc["replay"]) == s.n_chains


def test_commit_thins_the_draws_to_stay_under_its_size(tmp_path, monkeypatch):
    """A run whose float32 draws exceed max_bytes is stored every thin-th draw (the smallest thin that fits),
    and the record says so."""
    tiny = truth.REFERENCE["tiny"]
    run = frontier.Run((2,), tiny, tmp_path / "run")
    run.advance()
    full = run.draws()["draws"]
    budget = full.numel() * 4 // 3 + 8  # fits a third of the draws, not a half: thin = 3
    meta = truth.commit(run, tmp_path / "out", command="test", max_bytes=budget)
    ref = truth.committed((2,), tiny, root=tmp_path / "out")
    assert ref.thin == 3 and json.loads(meta.read_text())["thin"] == 3
    torch.testing.assert_close(ref.samples, full[:, 2::3].float().double())
    assert ref.samples.numel() * 4 <= budget
