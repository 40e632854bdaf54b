"""What a zoo says about its networks is checked against the chunks that hold them: chunk files swapped,
a manifest edited, a damaged chunk header, a chunk of another zoo, zoos of the previous format, an
interrupted merge, and the files' mode. Every damage is named with its fix, and `symlib zoo repair` mends
what can be recomputed without losing anything else."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import symlib
from symlib import cli, store, zoo
from symlib.zoo import training


def small(**kw) -> zoo.ZooConfig:
    """The tiny MNIST preset, smaller still: 4 models in 4 files, 128 training digits, 1 epoch."""
    base = dict(n_models=4, chunk=1, n_train=128, n_test=64,
                recipe=zoo.preset("mnist-optunet", "tiny").recipe.scaled(1))
    base.update(kw)
    return dataclasses.replace(zoo.preset("mnist-optunet", "tiny"), **base)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "full"
    zoo.train(small(), out, progress=False)
    return out


@pytest.fixture
def z(full, tmp_path):
    """A copy of the small zoo to damage."""
    out = tmp_path / "z"
    shutil.copytree(full, out)
    return out


def _chunk(path, c):
    return path / store.chunk_name(c)


def _flip_in_header(file, needle: bytes) -> None:
    """Flip one bit of the first ``needle`` in the file's header (its metadata): the file still parses."""
    raw = bytearray(file.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    i = raw.index(needle, 8, 8 + n)
    raw[i + 1] ^= 0x01
    file.write_bytes(bytes(raw))


def _record_training(monkeypatch) -> list:
    trained = []
    real = training._train_chunk
    monkeypatch.setattr(training, "_train_chunk", lambda cfg, seeds, *a: (trained.append(list(seeds)),
                                                                          real(cfg, seeds, *a))[1])
    return trained


def _stamps(path, but=()):
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.glob("chunk-*") if p.name not in but}


def test_swapped_chunk_files_are_named_and_repaired(z, monkeypatch, capsys):
    """Two chunk files swapped: named (which chunk each holds, and the fix), not loaded with networks
    attached to the wrong seeds; `zoo repair` retrains exactly them and the zoo is the same again."""
    ref, ref_man = zoo.load(z)
    a, b = _chunk(z, 0), _chunk(z, 1)
    first = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(first)
    repair = re.escape(f"`symlib zoo repair {z}`")
    msg = (r"chunk-00000.safetensors: holds chunk 1 of this zoo \(seeds \[1\]\), not chunk 0 \(seeds "
           rf"\[0\]\): chunk files were swapped.*chunk-00001.*{repair}")
    with pytest.raises(store.DamagedError, match=msg):
        zoo.load(z)
    assert cli.main(["zoo", "info", str(z), "--check"]) == 2
    err = capsys.readouterr().err
    assert "swapped or renamed" in err and "Traceback" not in err
    trained = _record_training(monkeypatch)
    assert cli.main(["zoo", "repair", str(z), "--no-progress"]) == 0
    assert sorted(trained) == [[0], [1]]
    got, man = zoo.load(z)
    assert all(torch.equal(got[k], ref[k]) for k in ref) and man["models"] == ref_man["models"]


@pytest.mark.parametrize("edit", ["arch", "seeds", "models-seed", "test_acc", "preset"])
def test_an_edited_manifest_is_named_and_rebuilt_from_the_chunks(z, edit, monkeypatch, capsys):
    """What a manifest says about the networks (architecture, seeds, metrics, preset) is checked against
    the configuration its chunks carry and against the chunks' records; `zoo repair` rebuilds it from the
    chunks without training."""
    ref_man = json.loads((z / "manifest.json").read_text())
    man = json.loads((z / "manifest.json").read_text())
    if edit == "arch":
        man["arch"] = "resnet18"
        msg = r"records arch 'resnet18', but its configuration .* says 'optunet'"
    elif edit == "seeds":
        man["seeds"] = [3, 2, 1, 0]
        msg = r"records seeds \[3, 2, 1, 0\], but its models are those of seeds \[0, 1, 2, 3\]"
    elif edit == "models-seed":
        man["models"][1]["seed"] = 7
        man["seeds"][1] = 7
        msg = r"lists models of seeds \[0, 7, 2, 3\], but its chunks \[0, 1, 2, 3\] hold seeds \[0, 1, 2, 3\]"
    elif edit == "test_acc":
        man["models"][2]["test_acc"] = 0.999
        msg = r"records test_acc 0.999 for the model of seed 2, but chunk-00002.safetensors holds 0\.\d+"
    else:
        man["preset"] = "cifar100-resnet18"
        msg = r"records preset 'cifar100-resnet18'"
    (z / "manifest.json").write_text(json.dumps(man))
    fix = re.escape(f"rebuild it from the chunks with `symlib zoo repair {z}`")
    with pytest.raises(zoo.ZooError, match=rf"manifest.json: {msg}.*{fix}"):
        symlib.load(z)
    if edit != "test_acc":  # the manifest alone tells (info reads no chunk)
        with pytest.raises(zoo.ZooError, match=msg):
            zoo.info(z)
    with pytest.raises(zoo.ZooError, match=msg):  # nor does compare label the set with an edited value
        symlib.compare(z, z, ("raw",), n_permutations=0, n_bootstrap=0)
    trained = _record_training(monkeypatch)
    assert cli.main(["zoo", "repair", str(z), "--no-progress"]) == 0
    assert trained == []
    _, man = zoo.load(z)
    assert man["models"] == ref_man["models"] and man["arch"] == "optunet" and man["seeds"] == [0, 1, 2, 3]


def test_a_damaged_chunk_header_is_named_and_repaired(z, monkeypatch, capsys):
    """One flipped bit in a chunk's metadata: every reader names the chunk and `symlib zoo repair`, which
    retrains exactly that chunk."""
    ref, _ = zoo.load(z)
    bad = _chunk(z, 2)
    _flip_in_header(bad, b"seed")
    repair = re.escape(f"`symlib zoo repair {z}`")
    with pytest.raises(store.DamagedError, match=rf"chunk-00002.safetensors: its header .*damaged.*{repair}"):
        zoo.load(z)
    assert cli.main(["zoo", "info", str(z), "--check"]) == 2
    err = capsys.readouterr().err
    assert "chunk-00002.safetensors: its header" in err and "KeyError" not in err, err
    with pytest.raises(store.DamagedError, match="chunk-00002.safetensors: its header"):
        symlib.compare(z, z, ("raw",), n_permutations=0, n_bootstrap=0)
    with pytest.raises(zoo.ZooError, match=r"chunk-00002.*header.*or rerun this command with --repair"):
        zoo.train(small(), z, progress=False)
    others = _stamps(z, but=(bad.name,))
    trained = _record_training(monkeypatch)
    assert cli.main(["zoo", "repair", str(z), "--no-progress"]) == 0
    assert trained == [[2]] and _stamps(z, but=(bad.name,)) == others
    got, _ = zoo.load(z)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_damaged_header_in_the_cache_is_retrained(tmp_path, monkeypatch):
    """The base models of a posterior run come from the zoo cache: a damaged chunk header there is
    retrained with a warning, not a KeyError."""
    cfg = small(n_models=2)
    a, _ = zoo.load_or_train(cfg, cache_dir=tmp_path, progress=False)
    _flip_in_header(zoo.cache_path(cfg, tmp_path) / "chunk-00001.safetensors", b"test_acc")
    trained = _record_training(monkeypatch)
    with pytest.warns(UserWarning, match="chunk-00001.*header.*retraining exactly the damaged chunks"):
        b, _ = zoo.load_or_train(cfg, cache_dir=tmp_path, progress=False)
    assert trained == [[1]] and all(torch.equal(a[k], b[k]) for k in a)


def test_a_changed_config_hash_is_another_set_and_never_overwritten(z, monkeypatch, capsys):
    """A chunk whose header names another configuration belongs to another zoo: "do not mix sets", and
    `zoo repair` refuses it and leaves it as it is."""
    bad = _chunk(z, 1)
    raw = bad.read_bytes()
    bad.write_bytes(raw.replace(small().hash.encode(), b"0" * 12, 1))
    before = bad.read_bytes()
    msg = r"chunk-00001.safetensors: belongs to config_hash 000000000000, not \w+; do not mix sets in one"
    with pytest.raises(store.StoreError, match=msg) as e:
        zoo.load(z)
    assert not isinstance(e.value, store.DamagedError)
    trained = _record_training(monkeypatch)
    assert cli.main(["zoo", "repair", str(z), "--no-progress"]) == 2
    assert "belongs to another zoo (config_hash 000000000000" in capsys.readouterr().err
    assert trained == [] and bad.read_bytes() == before


def _as_previous_format(file, **changes) -> None:
    """Rewrite a chunk as the previous format wrote it (no header sha256), with metadata ``changes``."""
    with safe_open(str(file), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.pop(store.HEADER, None)
    meta.update(changes)
    save_file(tensors, file, metadata=meta)


def test_zoos_of_the_previous_format_still_load_and_are_checked(z, monkeypatch):
    """Chunks without a header sha256 load as before; their records are then checked against the
    manifest (two copies that must agree), and a header with other entries is a damaged one."""
    ref, _ = zoo.load(z)
    for c in range(4):
        _as_previous_format(_chunk(z, c))
    got, _ = zoo.load(z)
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    man = json.loads((z / "manifest.json").read_text())
    recs = [dict(man["models"][3], train_acc=0.5)]
    _as_previous_format(_chunk(z, 3), models=json.dumps(recs))  # no header sha256 to tell: the manifest does
    with pytest.raises(zoo.ZooError, match=r"records train_acc .* for the model of seed 3, but "
                       r"chunk-00003.safetensors holds 0.5"):
        zoo.load(z)
    _flip_in_header(_chunk(z, 2), b"models")
    msg = r"chunk-00002.safetensors: its header \(metadata\) holds the entries .*'mndels'.*not those symlib "
    with pytest.raises(store.DamagedError, match=msg + r"writes.*symlib zoo repair"):
        zoo.read_chunk(_chunk(z, 2), small())


def test_an_interrupted_merge_says_how_to_finish_and_leaves_no_temporaries(full, tmp_path, monkeypatch):
    cfg = small()
    shards = [tmp_path / f"s{k}" for k in range(2)]
    for k, d in enumerate(shards):
        zoo.train(cfg, d, shard=(k, 2), progress=False)
    out = tmp_path / "merged"
    real = store.atomic_write_bytes

    def killed(path, payload):
        if os.path.basename(path) == "chunk-00002.safetensors":  # killed while writing chunk 2
            (out / ".chunk-00002.safetensors.k1ll3d.tmp").write_bytes(payload[:100])
            raise KeyboardInterrupt
        return real(path, payload)

    monkeypatch.setattr(store, "atomic_write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        zoo.merge(shards, out)
    monkeypatch.setattr(store, "atomic_write_bytes", real)
    merge = re.escape(f"`symlib zoo merge {shards[0]} {shards[1]} --out {out}`")
    msg = (rf"incomplete.*a merge into this folder was interrupted: run it again \({merge}\), or train the "
           rf"missing chunks with `symlib zoo repair")
    with pytest.raises(zoo.ZooError, match=msg):
        zoo.load(out)
    zoo.merge(shards, out)
    assert not list(out.glob(".*tmp"))
    a, _ = zoo.load(full)
    b, man = zoo.load(out)
    assert all(torch.equal(a[k], b[k]) for k in a) and "merging" not in man


def test_files_are_written_with_the_mode_of_the_umask(tmp_path):
    """Chunks and manifests get the mode of any new file (0644 under umask 022), so that others in a
    shared group can read a published zoo."""
    old = os.umask(0o022)
    try:
        zoo.train(small(n_models=1), tmp_path / "z", progress=False)
        os.umask(0o027)
        store.atomic_write_bytes(tmp_path / "x", b"x")
    finally:
        os.umask(old)
    for p in [*(tmp_path / "z").glob("chunk-*"), tmp_path / "z" / "manifest.json"]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == 0o640
