"""`make zoo` (symlib.paper.caches): the shared zoo is trained as its own step, and a second run only
checks it (no cell of a chapter, and so no nbval cell, carries the training)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from symlib import zoo
from symlib.paper import caches


def test_fill_trains_once_then_only_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path))
    caches.fill("tiny", table1=False, progress=False)
    path = zoo.cache_path(zoo.preset(caches.PRESET, "tiny"))
    assert zoo.load(path)[1]["complete"]
    assert "training it now" in capsys.readouterr().err

    def boom(*a, **k):
        raise AssertionError("a cached zoo must not be retrained")

    monkeypatch.setattr(zoo, "train", boom)
    assert caches.main(["--scale", "tiny", "--no-table1", "--no-progress"]) == 0
    assert "(cached: checking it)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        caches.main(["--scale", "huge"])


def test_the_true_posterior_caches_follow_their_flags(tmp_path, monkeypatch):
    """`make zoo` fills the caches of chapter "Against the true posterior" with Table 1's sets by default;
    --no-true-posterior and --true-posterior override that (make chapters passes them for the chapters it
    runs)."""
    from symlib.paper import truth

    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(truth, "fill", lambda scale, device, seed, progress: calls.append(scale) or {})
    monkeypatch.setattr(caches, "_table1_sets", lambda *a, **k: None)
    monkeypatch.setattr(zoo, "load_or_train", lambda *a, **k: None)
    monkeypatch.setattr(caches, "_Beside", lambda scale: SimpleNamespace(wait=lambda: 0.0, stop=lambda: None))
    for argv, expected in ((["--scale", "tiny"], 1), (["--scale", "tiny", "--no-true-posterior"], 0),
                           (["--scale", "tiny", "--no-table1"], 0),
                           (["--scale", "tiny", "--no-table1", "--true-posterior"], 1)):
        calls.clear()
        assert caches.main([*argv, "--no-progress"]) == 0
        assert calls == ["tiny"] * expected, argv


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_every_cache_fills_on_cuda(tmp_path, monkeypatch):
    """`make zoo DEVICE=cuda`: the zoo, Table 1's twelve sets (the HMC reference with its diagnostics on
    the host) and the true posterior's reference and sets, all produced on the GPU at the tiny scale, and
    the sets read back complete and finite."""
    import torch

    from symlib.paper import table1
    from symlib.posteriors import sampling

    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path))
    assert caches.main(["--scale", "tiny", "--device", "cuda", "--no-progress"]) == 0
    setup = sampling.setup_for(caches.PRESET, "tiny", "cuda")
    sets = table1.produce(setup, table1.plan("tiny", hmc=True), 0, progress=False)  # loads, trains nothing
    assert len(sets) == 12
    for label, s in sets.items():
        assert all(bool(torch.isfinite(v).all()) for v in s.params.values()), label


@pytest.mark.slow
def test_the_reference_is_sampled_beside_table1s_sets(tmp_path, monkeypatch, capsys):
    """`make zoo` samples the true posterior's references (one per seed) in a process of its own while
    Table 1's sets are produced; the chapter then loads them from the cache."""
    from symlib.paper import truth

    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(caches, "_table1_sets", lambda *a, **k: None)
    monkeypatch.setattr(truth, "produce", lambda *a, **k: None)  # the MLP's sets: tested elsewhere
    assert caches.main(["--scale", "tiny", "--no-progress"]) == 0
    assert "(the references sampled beside Table 1's sets)" in capsys.readouterr().err
    for k in truth.REFERENCE_SEEDS:  # loaded from what the child wrote, nothing sampled here
        ref = truth.reference("tiny", seed=k, sample=False)
        assert ref.manifest["done"] and ref.settings.seed == k and ref.source == "sampled"
    import torch

    first, second = (truth.reference("tiny", seed=k, sample=False).samples for k in truth.REFERENCE_SEEDS)
    assert not torch.equal(first, second)  # independent starts and streams


def test_make_zoo_at_cpu_checks_the_committed_references_and_samples_nothing(tmp_path, monkeypatch, capsys):
    """At the cpu scale the references are committed: `make zoo` loads them and never starts a sampler
    (neither beside Table 1's sets nor in its own process)."""
    from symlib.paper import frontier, truth

    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(caches, "_table1_sets", lambda *a, **k: None)
    monkeypatch.setattr(caches.zoo, "load_or_train", lambda *a, **k: None)
    monkeypatch.setattr(truth, "produce", lambda *a, **k: None)

    def no_sampling(*a, **k):
        raise AssertionError("make zoo sampled a reference at the cpu scale")

    monkeypatch.setattr(frontier, "run", no_sampling)
    monkeypatch.setattr(caches, "_Beside", no_sampling)
    assert caches.main(["--scale", "cpu", "--no-progress"]) == 0
    assert "(the committed references checked)" in capsys.readouterr().err


def test_the_reference_process_reports_its_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path))
    beside = caches._Beside("huge")
    with pytest.raises(RuntimeError, match="reference failed: ValueError: unknown scale 'huge'"):
        beside.wait()
    beside.stop()
    killed = caches._Beside("tiny")
    killed._proc.kill()
    with pytest.raises(RuntimeError, match="ended without a result .*rerun `make zoo`"):
        killed.wait()
    killed.stop()


def test_the_reference_process_ends_when_make_zoo_is_killed():
    """The child's watch exits as soon as its parent is no longer the process that started it (a killed
    `make zoo`), and not before."""
    import os

    exits = []
    caches._orphan_watch(os.getpid() + 10**6, every=0.01, exit=exits.append)  # not our parent: exits at once
    assert exits == [3]
    import threading

    t = threading.Thread(target=caches._orphan_watch, args=(os.getppid(), 0.01, exits.append), daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive() and exits == [3]  # still watching while the parent lives
