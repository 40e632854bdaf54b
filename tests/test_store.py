"""symlib.params, symlib.store and symlib.checkpoints: one Params type, one on-disk format, one loader."""

from __future__ import annotations

import json

import pytest
import torch

import symlib
from symlib import params, store, zoo
from symlib.posteriors import SampleSet, io


def test_stack_unstack_flatten_round_trip():
    g = torch.Generator().manual_seed(0)
    nets = [{"w": torch.randn(3, 2, generator=g), "b": torch.randn(3, generator=g)} for _ in range(4)]
    st = params.stack(nets)
    assert params.n_stacked(st) == 4 and torch.equal(params.unstack(st, 2)["w"], nets[2]["w"])
    flat = params.flatten(st)
    assert flat.shape == (4, 9)
    back = params.unflatten(flat, {k: v.shape[1:] for k, v in st.items()})
    assert all(torch.equal(back[k], st[k]) for k in st)
    assert torch.equal(params.flatten(st, ["b"]), st["b"])
    with pytest.raises(ValueError, match="does not match"):
        params.unflatten(flat[:, :5], {k: v.shape[1:] for k, v in st.items()})
    with pytest.raises(ValueError, match="stack"):
        params.n_stacked({"a": torch.zeros(2, 3), "b": torch.zeros(3)})


def test_chunks_carry_a_checksum_and_their_owner(tmp_path):
    t = {"w": torch.arange(6.0).view(2, 3)}
    f = tmp_path / store.chunk_name(0)
    store.atomic_save(t, f, {"format": store.FORMAT, "set_hash": "abc"})
    got, meta = store.read_chunk(f, {"set_hash": "abc"}, "fix it")
    assert torch.equal(got["w"], t["w"]) and meta["sha256"] == store.tensor_digest(t)
    with pytest.raises(store.StoreError, match="belongs to set_hash abc, not xyz"):
        store.read_chunk(f, {"set_hash": "xyz"}, "fix it")
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # flip bits of the last weight
    f.write_bytes(bytes(raw))
    with pytest.raises(store.StoreError, match="sha256.*fix it"):
        store.read_chunk(f, {}, "fix it")
    with pytest.raises(store.StoreError, match="missing; fix it"):
        store.read_chunk(tmp_path / "none.safetensors", {}, "fix it")
    store.check_tensors(f, t, {"w": (3,)}, 2, "arch x")
    with pytest.raises(store.StoreError, match="seeds \\[8\\]"):
        store.check_tensors(f, {"w": torch.tensor([[0.0, 1, 2], [0, float("nan"), 0]])}, {"w": (3,)}, 2,
                            "arch x", labels=[7, 8])


def test_kinds_and_manifests(tmp_path):
    assert store.kind_of(tmp_path) is None
    store.write_manifest(tmp_path, {"format": store.FORMAT, "kind": "posterior"})
    assert store.kind_of(tmp_path) == "posterior"
    with pytest.raises(store.StoreError, match="holds a posterior sample set, not a zoo"):
        store.read_manifest(tmp_path, "zoo")
    (tmp_path / store.MANIFEST).write_text("{not json")
    with pytest.raises(store.StoreError, match="corrupt manifest.*chunk files beside it may still be valid"):
        store.read_manifest(tmp_path)
    (tmp_path / store.MANIFEST).write_text(json.dumps({"format": "other/9"}))
    assert store.kind_of(tmp_path) is None
    with pytest.raises(store.StoreError, match="format 'other/9'"):
        store.read_manifest(tmp_path)


def test_symlib_load_reads_zoos_and_sample_sets_alike(tmp_path):
    cfg = zoo.preset("mnist-optunet", "tiny")
    zoo.train(cfg, tmp_path / "zoo", progress=False)
    g = torch.Generator().manual_seed(1)
    sset = SampleSet({"w": torch.randn(6, 2, generator=g)}, "swag", n_modes=2, n_per_mode=3)
    io.save(sset, tmp_path / "post")
    zp, zman = symlib.load(tmp_path / "zoo")
    ref, _ = zoo.load(tmp_path / "zoo")
    assert zman.get("kind", "zoo") == "zoo" and all(torch.equal(zp[k], ref[k]) for k in ref)
    pp, pman = symlib.load(tmp_path / "post")
    assert pman["kind"] == "posterior" and torch.equal(pp["w"], sset.params["w"])
    assert "zoo" in symlib.info(tmp_path / "zoo") and "posterior" in symlib.info(tmp_path / "post")
    with pytest.raises(store.StoreError, match="a posterior sample set, not a zoo"):
        zoo.load(tmp_path / "post")
    with pytest.raises(store.StoreError, match="no zoo manifest here"):
        symlib.load(tmp_path / "nothing")


def test_check_out_names_every_bad_folder_and_changes_nothing(tmp_path):
    """store.check_out, run by every writer before any work: creates nothing, refuses what cannot hold
    the set, and reports a damaged manifest (the writer rebuilds it from the chunks) without refusing."""
    import scenarios

    assert store.check_out(tmp_path / "new" / "deeper", "zoo") == (None, False)
    assert not (tmp_path / "new").exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(store.StoreError, match="is a file, not a folder; choose another --out"):
        store.check_out(tmp_path / "f", "zoo")
    with pytest.raises(store.StoreError, match="lies under .*f, which is a file"):
        store.check_out(tmp_path / "f" / "a" / "b", "posterior")
    ro = scenarios.readonly_folder(tmp_path)
    if ro is not None:
        with pytest.raises(store.StoreError, match="its parent .* is not writable"):
            store.check_out(ro / "out", "zoo")
    d = tmp_path / "d"
    d.mkdir()
    store.write_manifest(d, {"format": store.FORMAT, "kind": "posterior", "set_hash": "abc"})
    man, damaged = store.check_out(d, "posterior")
    assert man["set_hash"] == "abc" and not damaged
    with pytest.raises(store.StoreError, match="holds a posterior sample set, not a zoo; choose another"):
        store.check_out(d, "zoo")
    (d / store.MANIFEST).write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(store.StoreError, match="format 'other/9'.*choose another --out"):
        store.check_out(d, "zoo")
    (d / store.MANIFEST).write_text("{damaged")
    assert store.check_out(d, "zoo") == (None, True)
    meta = {"format": store.FORMAT, "set_hash": "abc"}
    store.atomic_save({"w": torch.zeros(1)}, d / store.chunk_name(0), meta)
    store.check_owners(d, "set_hash", "abc", "sample set")
    with pytest.raises(store.StoreError, match="chunk-00000.safetensors: belongs to another sample set"):
        store.check_owners(d, "set_hash", "xyz", "sample set")
    assert sorted(p.name for p in d.iterdir()) == ["chunk-00000.safetensors", "manifest.json"]
