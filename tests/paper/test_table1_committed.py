"""Table 1's committed HMC reference (symlib.paper.table1.committed): committed from a cache, installed into
an empty one identical to what was sampled, never installed when stale or beside other base models, and the
committed cpu-scale record is this code's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from symlib.paper import caches, table1
from symlib.paper.table1 import committed
from symlib.posteriors import io, sampling


@pytest.fixture(scope="module")
def produced(tmp_path_factory):
    """A cache holding the tiny scale's HMC row and its base models, and their committed copy."""
    cache = tmp_path_factory.mktemp("cache")
    root = tmp_path_factory.mktemp("committed")
    setup = sampling.setup_for("mnist-optunet", "tiny")
    (entry,) = [e for e in table1.plan("tiny", methods=()) if e.method == "hmc"]
    sets = table1.produce(setup, [entry], 0, root=cache / "posteriors", cache_dir=cache, progress=False)
    path = committed.commit(setup, 0, cache_dir=cache, root=root, seconds=1.5, command="test")
    return setup, cache, root, path, sets[entry.label]


def test_commit_copies_the_set_and_its_base_models_with_a_record(produced):
    setup, cache, root, path, _ = produced
    doc = committed.record(setup, 0, root)
    assert path == committed.folder(setup, 0, root) and path.name == table1.sets_dir(setup, 0).name
    assert doc["format"] == committed.FORMAT and doc["seconds"] == 1.5 and doc["command"] == "test"
    assert (path / "base" / "manifest.json").is_file() and io.is_posterior(path / "hmc")
    assert set(doc["files"]) == {str(p.relative_to(path)) for p in path.rglob("*")
                                 if p.is_file() and p.name != "record.json"}
    assert "cpu_capability" in doc["machine"]
    with pytest.raises(FileExistsError, match="git rm -r"):  # never replaced
        committed.commit(setup, 0, cache_dir=cache, root=root)


def test_commit_refuses_a_cache_without_the_set(produced, tmp_path):
    setup, *_ = produced
    with pytest.raises(ValueError, match="produce Table 1's sets first"):
        committed.commit(setup, 0, cache_dir=tmp_path / "empty", root=tmp_path / "root")


def test_install_into_an_empty_cache_gives_the_sampled_set(produced, tmp_path):
    setup, _, root, _, sampled = produced
    status, why = committed.install(setup, 0, cache_dir=tmp_path, root=root)
    assert status == "installed", why
    (entry,) = [e for e in table1.plan("tiny", methods=()) if e.method == "hmc"]
    # Table 1's own loader finds it complete and samples nothing
    got = table1.produce(setup, [entry], 0, root=tmp_path / "posteriors", cache_dir=tmp_path, progress=False)
    for k, v in sampled.params.items():
        assert torch.equal(got[entry.label].params[k], v)
    base, _, _ = sampling.base_models(setup, entry.n_modes, 0, cache_dir=tmp_path, progress=False)
    assert all(torch.isfinite(v).all() for v in base.values())
    assert committed.install(setup, 0, cache_dir=tmp_path, root=root)[0] == "cached"


def test_a_stale_or_edited_record_is_never_installed(produced, tmp_path):
    setup, _, root, path, _ = produced
    edited = tmp_path / "root"
    shutil.copytree(root, edited)
    where = edited / path.name
    doc = json.loads((where / "record.json").read_text())
    (where / "record.json").write_text(json.dumps({**doc, "set_hash": "0" * 16}))
    status, why = committed.install(setup, 0, cache_dir=tmp_path / "a", root=edited)
    assert status == "stale" and "set_hash" in why and "python -m symlib.paper.table1" in why
    (where / "record.json").write_text(json.dumps(doc))
    chunk = next((where / "hmc").glob("chunk-*.safetensors"))
    chunk.write_bytes(chunk.read_bytes()[:-1] + b" ")
    status, why = committed.install(setup, 0, cache_dir=tmp_path / "b", root=edited)
    assert status == "stale" and chunk.name in why
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written
    assert committed.install(setup, 1, cache_dir=tmp_path / "c", root=root)[0] == "absent"


def test_other_base_models_in_the_cache_are_kept_and_the_reference_sampled(produced, tmp_path):
    """Base models trained here that differ from the committed ones (another instruction set) stay, and the
    reference is not installed beside them; a partly written set is left to resume."""
    setup, cache, root, _, _ = produced
    parts = committed._parts(setup, 0, tmp_path)
    shutil.copytree(committed._parts(setup, 0, cache)["base"], parts["base"])
    chunk = next(parts["base"].glob("chunk-*.safetensors"))
    from safetensors import safe_open

    with safe_open(str(chunk), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(chunk))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(chunk), metadata=meta)
    before = chunk.read_bytes()
    status, why = committed.install(setup, 0, cache_dir=tmp_path, root=root)
    assert status == "conflict" and "trained here" in why
    assert chunk.read_bytes() == before and not parts["set"].exists()
    partial = tmp_path / "partial"
    committed._parts(setup, 0, partial)["set"].mkdir(parents=True)
    status, why = committed.install(setup, 0, cache_dir=partial, root=root)
    assert status == "conflict" and "partly written" in why
    damaged = tmp_path / "damaged"  # a damaged manifest is left to make zoo's repair, not raised here
    base = committed._parts(setup, 0, damaged)["base"]
    shutil.copytree(committed._parts(setup, 0, cache)["base"], base)
    (base / "manifest.json").write_text("{not json")
    status, why = committed.install(setup, 0, cache_dir=damaged, root=root)
    assert status == "conflict" and (base / "manifest.json").read_text() == "{not json"


def test_the_committed_cpu_reference_is_this_codes():
    """The committed record of the book's Table 1 (cpu scale, run seed 0) is what this code would sample:
    the same base zoo, the same set identity (method, sizes, the HMC preset, the training problem and its
    data, seeds), its files intact. A change to any of them fails here: commit again with `python -m
    symlib.paper.table1` (about two minutes)."""
    setup = sampling.setup_for(caches.PRESET, "cpu")
    doc = committed.record(setup, 0)
    assert doc is not None, f"nothing committed in {committed.folder(setup, 0)}"
    parts = committed._parts(setup, 0, None)
    assert doc["base_config_hash"] == parts["base_cfg"].hash
    assert doc["set_hash"] == parts["set_hash"] and doc["set_folder"] == parts["set"].name
    assert committed._files(committed.folder(setup, 0)) == doc["files"]
    man = io.read_manifest(committed.folder(setup, 0) / "hmc")
    assert man["set_hash"] == doc["set_hash"] and man["complete"]
    assert man["n_modes"] * man["n_per_mode"] == 100


def test_make_zoo_installs_the_committed_reference_before_the_rows(tmp_path, monkeypatch, capsys):
    """`make zoo` at the cpu scale: the committed reference is installed before Table 1's rows are produced,
    so the HMC row only loads it."""
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(table1, "install", lambda setup, seed: calls.append(("install", setup.scale))
                        or ("installed", "a record"))
    monkeypatch.setattr(table1, "produce", lambda *a, **k: calls.append(("produce",)))
    cfg = caches.zoo.preset(caches.PRESET, "cpu")
    caches._table1_sets("cpu", "cpu", 0, cfg, progress=False)
    assert calls == [("install", "cpu"), ("produce",)]
    assert "installed from a record" in capsys.readouterr().err
