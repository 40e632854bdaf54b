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
