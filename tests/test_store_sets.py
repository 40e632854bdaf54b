"""symlib.store.sets: stacked sets on disk round-trip, resume a partial write chunk by chunk, and refuse
another set's folder."""

from __future__ import annotations

import json
import os

import pytest
import torch

import symlib
from symlib import store
from symlib.store import sets


def _params(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(n, 3, 2, generator=g), "b": torch.randn(n, 3, generator=g).double(),
            "steps": torch.arange(n)}


def _write(path, params, **kw):
    args = {"method": "test", "set_hash": "0123456789abcdef", "n_modes": 3, "n_per_mode": 2, "chunk": 4}
    return sets.write(params, path, **{**args, **kw})


def test_ranges_cover_every_network_once():
    for n in range(1, 12):
        for chunk in range(1, 13):
            spans = sets.ranges(n, chunk)
            assert [i for s, e in spans for i in range(s, e)] == list(range(n))
            assert len(spans) == -(-n // chunk) and all(e - s == chunk for s, e in spans[:-1])


def test_round_trip_keeps_every_tensor_dtype_and_the_writer_fields(tmp_path):
    params = _params()
    man = _write(tmp_path / "set", params, fields={"note": {"a": 1}})
    assert man["kind"] == sets.KIND == "posterior" and man["complete"]
    assert [ch["chunk"] for ch in man["chunks"]] == [0, 1] and man["n_samples"] == 6
    assert man["note"] == {"a": 1} and list(man).index("note") == list(man).index("n_samples") + 1
    assert man["dtypes"] == {"w": "float32", "b": "float64", "steps": "int64"}
    got, man2 = sets.load_params(tmp_path / "set")
    assert man2 == man
    assert set(got) == set(params) and all(torch.equal(got[k], params[k]) and got[k].dtype == params[k].dtype
                                           for k in params)
    # the chunks' headers: this set, mode-major sample records (network i of mode i // n_per_mode)
    modes = []
    for c in range(2):
        _, meta = store.read_chunk(tmp_path / "set" / store.chunk_name(c), {"set_hash": man["set_hash"]}, "")
        modes += [r["mode"] for r in json.loads(meta["samples"])]
    assert modes == [i // 2 for i in range(6)]
    # every reader of the kind reads it: symlib.load and symlib.info
    back, _ = symlib.load(tmp_path / "set")
    assert all(torch.equal(back[k], params[k]) for k in params)


def test_a_deleted_chunk_is_rewritten_and_the_others_kept(tmp_path):
    params, out = _params(), tmp_path / "set"
    _write(out, params, chunk=2)
    files = [out / store.chunk_name(c) for c in range(3)]
    before = {f: f.read_bytes() for f in files}
    files[1].unlink()
    with pytest.raises(store.StoreError, match="chunk-00001.safetensors: missing"):
        sets.load_params(out)
    for f in (files[0], files[2]):
        os.utime(f, ns=(1, 1))  # a kept chunk keeps this time; a rewritten one is a new file
    man = _write(out, params, chunk=2)
    assert man["complete"] and [ch["chunk"] for ch in man["chunks"]] == [0, 1, 2]
    assert files[0].stat().st_mtime_ns == 1 and files[2].stat().st_mtime_ns == 1
    assert files[1].stat().st_mtime_ns != 1
    assert all(f.read_bytes() == before[f] for f in files)  # the same bytes as the first write
    got, _ = sets.load_params(out)
    assert all(torch.equal(got[k], params[k]) for k in params)


def test_an_interrupted_write_is_incomplete_and_resumes(tmp_path, monkeypatch):
    params, out = _params(), tmp_path / "set"
    real = sets.atomic_save

    def killed(tensors, path, meta):
        if meta["chunk"] == "1":
            raise KeyboardInterrupt
        real(tensors, path, meta)

    monkeypatch.setattr(sets, "atomic_save", killed)
    with pytest.raises(KeyboardInterrupt):
        _write(out, params, chunk=2)
    man = json.loads((out / store.MANIFEST).read_text())
    assert not man["complete"] and [ch["chunk"] for ch in man["chunks"]] == [0]
    with pytest.raises(store.StoreError, match=r"incomplete \(chunks \[1, 2\] missing\)"):
        sets.load_params(out)
    monkeypatch.setattr(sets, "atomic_save", real)
    os.utime(out / store.chunk_name(0), ns=(1, 1))
    assert _write(out, params, chunk=2)["complete"]
    assert (out / store.chunk_name(0)).stat().st_mtime_ns == 1
    got, _ = sets.load_params(out)
    assert all(torch.equal(got[k], params[k]) for k in params)


def test_a_damaged_chunk_is_named_and_rewritten(tmp_path):
    params, out = _params(), tmp_path / "set"
    _write(out, params, chunk=2)
    f = out / store.chunk_name(2)
    good = f.read_bytes()
    raw = bytearray(good)
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(store.StoreError, match="do not match the sha256"):
        sets.load_params(out)
    _write(out, params, chunk=2)
    assert f.read_bytes() == good


def test_another_set_and_bad_writes_are_refused_before_anything_is_written(tmp_path):
    params, out = _params(), tmp_path / "set"
    _write(out, params)
    man = (out / store.MANIFEST).read_bytes()
    with pytest.raises(store.StoreError, match="holds another sample set"):
        _write(out, params, set_hash="fedcba9876543210")
    assert (out / store.MANIFEST).read_bytes() == man
    bad = {**params, "w": params["w"].clone()}
    bad["w"][4, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"'w' holds NaN .*samples \[4\].*nothing written: lower the step"):
        _write(tmp_path / "nan", bad, fix="lower the step")
    with pytest.raises(ValueError, match="3 x 2 networks"):
        _write(tmp_path / "short", {k: v[:5] for k, v in params.items()})
    assert not (tmp_path / "nan").exists() and not (tmp_path / "short").exists()


def test_a_manifest_without_a_core_field_is_named(tmp_path):
    out = tmp_path / "set"
    _write(out, _params())
    man = json.loads((out / store.MANIFEST).read_text())
    for key in sets.FIELDS:
        broken = {k: v for k, v in man.items() if k != key}
        (out / store.MANIFEST).write_text(json.dumps(broken))
        with pytest.raises(store.StoreError, match=f"field '{key}' should be a"):
            sets.read_manifest(out)
