"""`make zoo` (symlib.paper.caches): the shared zoo is trained as its own step, and a second run only
checks it (no cell of a chapter, and so no nbval cell, carries the training)."""

from __future__ import annotations

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
    for argv, expected in ((["--scale", "tiny"], 1), (["--scale", "tiny", "--no-true-posterior"], 0),
                           (["--scale", "tiny", "--no-table1"], 0),
                           (["--scale", "tiny", "--no-table1", "--true-posterior"], 1)):
        calls.clear()
        assert caches.main([*argv, "--no-progress"]) == 0
        assert calls == ["tiny"] * expected, argv
