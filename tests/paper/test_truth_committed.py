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


def _settings(seed: int) -> frontier.Settings:
    return dataclasses.replace(truth.REFERENCE["cpu"], seed=seed)


@pytest.fixture(scope="module", params=SEEDS, ids=lambda k: f"seed{k}")
def committed(request):
    ref = truth.committed(truth.HIDDEN, _settings(request.param))
    assert ref is not None, (f"no committed reference for seed {request.param}: run `python -m "
                             f"symlib.paper.truth --seeds {request.param}`")
    return ref


def test_two_independent_references_are_committed():
    refs = [truth.committed(truth.HIDDEN, _settings(k)) for k in SEEDS]
    assert len(SEEDS) >= 2 and all(r is not None for r in refs)
    assert not torch.equal(refs[0].samples[:, :10], refs[1].samples[:, :10])


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
        # the same diagnostics as the run's last check, up to the float32 storage of the draws
        assert float(rep[sc].rhat.max()) == pytest.approx(checks[-1][sc]["rhat_max"], abs=2e-3)
    assert max(ref.halves()) < frontier.RHAT
    per_level, n = ref.stats["divergences_per_level"], ref.stats["trajectories_per_level"]
    assert n > 0 and per_level[0] / n <= ref.settings.max_divergent


def test_a_fresh_start_replays_the_recorded_first_rounds(committed):
    """This code and these settings start the committed chains: the first rounds of a fresh run (one
    thread, float64) equal the ones the reference recorded when it was committed."""
    meta, _ = truth._committed_paths(truth.HIDDEN, committed.settings, committed.problem)
    recorded = torch.tensor(json.loads(meta.read_text())["replay"], dtype=torch.float64)
    again = truth.replay(truth.HIDDEN, committed.settings, committed.problem)
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
