"""No command writes into what it did not make, and every write is deterministic: an exported dataset and
a folder holding files of others are refused by every writer (nothing written, checked by the sha256 of
every file), ``--executor`` on a complete zoo does nothing, ``zoo repair`` restores a zoo bit for bit
(every file's sha256), a flipped byte in a chunk header's config hash is damage, ``info --check`` names an
edited data fingerprint, card or Croissant description, leftovers of a killed ``import`` are removed, and
a full disk is one clear line."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_nets import trained
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

import symlib.cli.zoo as cli_zoo
from symlib import cli, store, zoo
from symlib.zoo import dataset, fanout, training

NETS = str(Path(__file__).resolve().parents[1] / "ckpt_nets.py")
MODEL = ["--model", f"{NETS}:SmallNet", "--input-shape", "1,8,8"]


def small(**kw) -> zoo.ZooConfig:
    """The tiny MNIST preset, smaller still: 4 models in 4 files, 128 training digits, 1 epoch."""
    base = dict(n_models=4, chunk=1, n_train=128, n_test=64,
                recipe=zoo.preset("mnist-optunet", "tiny").recipe.scaled(1))
    base.update(kw)
    return dataclasses.replace(zoo.preset("mnist-optunet", "tiny"), **base)


SMALL = ["--preset", "mnist-optunet", "--scale", "tiny", "--no-progress"]
"""The command-line arguments of the `tiny` preset (the exported zoo below)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """The `tiny` preset zoo (8 OptuNets in 4 chunks) and the dataset `symlib zoo export` makes of it."""
    root = tmp_path_factory.mktemp("tiny")
    zoo.train(zoo.preset("mnist-optunet", "tiny"), root / "zoo", progress=False)
    return root / "zoo", dataset.export(root / "zoo", root / "tiny-zoo", validate=False)


@pytest.fixture(scope="module")
def tiny_zoo(tiny) -> Path:
    return tiny[0]


@pytest.fixture(scope="module")
def exported(tiny) -> Path:
    return tiny[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "z"
    zoo.train(small(), out, progress=False)
    return out


def sha256s(root: Path) -> dict[str, str]:
    """The sha256 of every file under ``root`` (hidden ones too), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    got = capsys.readouterr()
    return rc, got.out, got.err


def _no_jobs(monkeypatch):
    """Make building submitit's executor fail the test: nothing may be submitted."""
    import symlib.zoo.fanout as package

    def boom(*a, **k):
        raise AssertionError("built the executor: a job would have been submitted")

    monkeypatch.setattr(package, "make_executor", boom)


def _flip(file: Path, needle: bytes, offset: int = 1) -> None:
    """Flip one bit of the byte ``offset`` after the first ``needle`` in the file's header."""
    raw = bytearray(file.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    i = raw.index(needle, 8, 8 + n)
    raw[i + offset] ^= 0x01
    file.write_bytes(bytes(raw))


# -- an exported dataset is never written into


@pytest.mark.parametrize("command", ["train", "train-repair", "repair", "executor", "merge", "import",
                                     "canonicalize", "export"])
def test_no_command_writes_into_an_exported_dataset(command, tiny_zoo, exported, tmp_path, monkeypatch,
                                                    capsys):
    """`zoo train` (plain, --repair, --executor), `zoo repair`, `zoo merge`, `import`, `canonicalize` and
    `export` refuse an exported dataset as their output, in one line naming it and the fix; not a byte of
    it changes, and the dataset still passes its own check."""
    ds = tmp_path / "ds"
    shutil.copytree(exported, ds)
    argv = {
        "train": ["zoo", "train", *SMALL, "--out", ds],
        "train-repair": ["zoo", "train", *SMALL, "--out", ds, "--repair"],
        "repair": ["zoo", "repair", ds, "--no-progress"],
        "executor": ["zoo", "train", *SMALL, "--out", ds, "--executor", "local", "--shards", "2"],
        "merge": ["zoo", "merge", tiny_zoo, "--out", ds],
        "import": ["import", tiny_zoo, "--to", ds],
        "canonicalize": ["canonicalize", tiny_zoo, "--to", ds],
        "export": ["zoo", "export", tiny_zoo, "--to", ds, "--no-validate"],
    }[command]
    msg = {"import": r"already exists \(an exported dataset", "canonicalize": r"already exists \(an exported",
           "export": r"already exists \(an exported dataset\); an export never overwrites anything"}.get(
        command, r"is an exported dataset \(`symlib zoo export`\); no command writes into one.*write into a "
                 r"new folder.*or repair the zoo it was exported from and export that again")
    before = sha256s(tmp_path)
    _no_jobs(monkeypatch)
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and err.startswith(f"symlib: error: {ds}") and len(err.splitlines()) == 2, err
    assert re.search(msg, err) and "Traceback" not in err, err
    assert sha256s(tmp_path) == before
    assert dataset.verify(ds)


# -- nor beside files of others


@pytest.mark.parametrize("held", ["notes.txt", ".git", "fanout-of-mine"])
@pytest.mark.parametrize("command", ["train", "executor", "merge", "posterior"])
def test_a_folder_holding_files_of_others_is_refused(held, command, reference, tmp_path, monkeypatch, capsys):
    """A folder holding only ``notes.txt``, only ``.git/``, or a ``fanout/`` folder that is no fan-out's is
    refused by `zoo train`, the fan-out, `zoo merge` and a posterior sample set: nothing is written beside
    them."""
    from symlib.posteriors import SampleSet, io

    out = tmp_path / "out"
    out.mkdir()
    if held == "notes.txt":
        (out / "notes.txt").write_text("my notes")
    elif held == ".git":
        (out / ".git").mkdir()
        (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    else:
        (out / "fanout").mkdir()
        (out / "fanout" / "results.csv").write_text("a,b\n")
    name = "fanout" if held == "fanout-of-mine" else held
    before = sha256s(tmp_path)
    _no_jobs(monkeypatch)
    msg = rf"{re.escape(str(out))}: holds {re.escape(name)}, which symlib did not write there"
    with pytest.raises(store.StoreError, match=msg + r".*choose another --out, or move those files out"):
        if command == "train":
            zoo.train(small(), out, progress=False)
        elif command == "executor":
            fanout.submit(small(), out, 2, "local")
        elif command == "merge":
            zoo.merge([reference], out)
        else:
            io.save(SampleSet({"w": torch.ones(4, 2)}, "swag", 2, 2), out)
    if command in ("train", "executor"):
        argv = ["zoo", "train", "--preset", "mnist-optunet", "--scale", "tiny", "--out", out, "--no-progress"]
        rc, _, err = _run([*argv, *(["--executor", "local"] if command == "executor" else [])], capsys)
        assert rc == 2 and re.search(msg, err) and "Traceback" not in err, err
    assert sha256s(tmp_path) == before


def test_what_symlib_wrote_is_not_foreign(reference, tmp_path):
    """A zoo folder with its manifest, chunks, the temporary file of a killed run and an empty fan-out
    work folder (a fan-out killed before its plan) is one's own: training resumes there."""
    z = tmp_path / "z"
    shutil.copytree(reference, z)
    (z / store.chunk_name(3)).unlink()
    (z / ".chunk-00003.safetensors.k1ll3d.tmp").write_bytes(b"half")
    (z / "fanout").mkdir()
    assert store.foreign(z) == []
    zoo.train(small(), z, progress=False)
    assert not (z / ".chunk-00003.safetensors.k1ll3d.tmp").exists()
    assert sha256s(z) == sha256s(reference)


# -- a complete zoo: nothing to do, nothing written


def test_executor_on_a_complete_zoo_does_nothing(reference, tiny_zoo, tmp_path, monkeypatch, capsys):
    """Like plain `zoo train`, `--executor` on a complete zoo checks it and writes nothing (no plan, no
    job, no chunk trained again): not a file's bytes or time stamp change."""
    z = tmp_path / "z"
    shutil.copytree(reference, z)
    stamps = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in z.iterdir()}
    _no_jobs(monkeypatch)
    monkeypatch.setattr(training, "_train_chunk", lambda *a: pytest.fail("trained a chunk"))
    fo = fanout.submit(small(), z, 2, "local")
    assert fo.jobs == {} and fo.manifest["complete"] and fo.manifest["seeds"] == [0, 1, 2, 3]
    zoo.train(small(), z, progress=False)  # plain train: the same
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in z.iterdir()} == stamps
    tiny = tmp_path / "tiny"
    shutil.copytree(tiny_zoo, tiny)
    before = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    argv = ["zoo", "train", *SMALL, "--out", tiny, "--executor", "local", "--shards", "2"]
    rc, out, err = _run(argv, capsys)
    assert rc == 0 and "8 models, complete" in out, err
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == before


# -- every write deterministic: repair restores the bytes


def test_safetensors_files_are_written_byte_for_byte_the_same():
    """safetensors writes a header's metadata in a random order; store.serialize sorts it, keeps the
    library's layout of the tensors (mixed dtypes stay aligned), and any safetensors reader reads it."""
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=g), "b": torch.randn(3, generator=g).double(),
               "n": torch.arange(7, dtype=torch.int16), "e": torch.zeros(0, 2)}
    meta = {k: str(i) for i, k in enumerate("qwertyuiopasdfgh")}
    blobs = {store.serialize(tensors, meta) for _ in range(8)}
    blobs.add(store.serialize(dict(reversed(tensors.items())), dict(reversed(meta.items()))))
    assert len(blobs) == 1
    blob = blobs.pop()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8: 8 + n])
    assert list(header["__metadata__"]) == sorted(meta) and n % 8 == 0
    got = safetensors_load(blob)
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("damage", ["weights", "header", "lost", "manifest"])
def test_repair_restores_every_file_bit_for_bit(damage, reference, tmp_path, monkeypatch, capsys):
    """Train a zoo, record every file's sha256, damage it (a flipped weight, a flipped header byte, a lost
    chunk, a corrupt manifest), repair: every sha256 is the original's (docs/zoo.md: bit-identical), so
    that any sha256 recorded elsewhere stays true."""
    z = tmp_path / "z"
    shutil.copytree(reference, z)
    want = sha256s(z)
    chunk = z / store.chunk_name(2)
    argv = ["zoo", "repair", z, "--no-progress"]
    if damage == "weights":
        raw = bytearray(chunk.read_bytes())
        raw[-5] ^= 0x10
        chunk.write_bytes(bytes(raw))
    elif damage == "header":
        _flip(chunk, b"test_acc")
    elif damage == "lost":
        chunk.unlink()
    else:  # rebuilt by `zoo train ... --repair` with the arguments that trained it
        (z / "manifest.json").write_text("{damaged")
        argv = ["zoo", "train", *SMALL, "--out", z, "--repair"]
        monkeypatch.setattr(cli_zoo, "_config", lambda args: small())
    assert sha256s(z) != want
    rc, _, err = _run(argv, capsys)
    assert rc == 0, err
    assert sha256s(z) == want


def test_a_flipped_byte_in_the_config_hash_is_damage_and_repaired(reference, tmp_path, capsys):
    """One flipped bit in a chunk header's config hash: the header's own sha256 shows damage, so the chunk
    is named damaged (with `symlib zoo repair`), not as another zoo's; the repair restores its bytes."""
    z = tmp_path / "z"
    shutil.copytree(reference, z)
    want = sha256s(z)
    chunk = z / store.chunk_name(1)
    _flip(chunk, small().hash.encode(), offset=3)
    with pytest.raises(store.DamagedError, match=rf"chunk-00001.safetensors: its header .*does not match the "
                       rf"sha256.*{re.escape(f'symlib zoo repair {z}')}"):
        zoo.load(z)
    rc, _, err = _run(["zoo", "info", z, "--check"], capsys)
    assert rc == 2 and "belongs to" not in err and "its header" in err, err
    rc, _, err = _run(["zoo", "repair", z, "--no-progress"], capsys)
    assert rc == 0, err
    assert sha256s(z) == want


# -- info --check names what was edited


def test_an_edited_data_fingerprint_is_named_and_rebuilt(reference, tmp_path, monkeypatch, capsys):
    """Every chunk records the data it was trained on (the manifest's data record, vouched for by the
    header's sha256): an edited `data.fingerprint` in the manifest is named by `info --check` without
    loading the data, and `zoo repair` rebuilds the manifest from the chunks (no training, every sha256 the
    original's)."""
    z = tmp_path / "z"
    shutil.copytree(reference, z)
    want = sha256s(z)
    with safe_open(str(z / store.chunk_name(0)), framework="pt") as f:
        assert json.loads(f.metadata()["data"]) == json.loads((z / "manifest.json").read_text())["data"]
    man = json.loads((z / "manifest.json").read_text())
    real = man["data"]["fingerprint"]
    man["data"]["fingerprint"] = "f" * 64
    (z / "manifest.json").write_text(json.dumps(man, indent=1))
    monkeypatch.setattr(training, "load_data", lambda *a, **k: pytest.fail("loaded the data"))
    rc, _, err = _run(["zoo", "info", z, "--check"], capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert re.search(rf"manifest.json: records data fingerprint '{'f' * 64}', but chunk-00000.safetensors "
                     rf"was trained on data fingerprint '{real}'.*symlib zoo repair", err), err
    monkeypatch.setattr(training, "_train_chunk", lambda *a: pytest.fail("trained a chunk"))
    rc, _, err = _run(["zoo", "repair", z, "--no-progress"], capsys)
    assert rc == 0, err
    assert sha256s(z) == want


@pytest.mark.parametrize("edit", ["card", "croissant", "fingerprint", "croissant-manifest-sha"])
def test_an_edited_dataset_file_is_named(edit, exported, tmp_path, capsys):
    """The card and the Croissant description are checked against the sha256 the manifest's export record
    holds, and every file (the manifest too) against the sha256 the description holds: an edited card,
    description or data fingerprint is named by `info --check` (and `load`), not reported as verified."""
    ds = tmp_path / "ds"
    shutil.copytree(exported, ds)
    rec = json.loads((ds / "manifest.json").read_text())["export"]["sha256"]
    assert rec[dataset.CARD] == dataset.file_sha256(ds / dataset.CARD)
    if edit == "card":
        text = (ds / dataset.CARD).read_text()
        (ds / dataset.CARD).write_text(text.replace("independently trained", "independantly trained", 1))
        msg = r"README.md: sha256 .* recorded in manifest.json at the export: the file was edited"
    elif edit == "croissant":
        cr = json.loads((ds / dataset.CROISSANT).read_text())
        cr["description"] = "something else"
        (ds / dataset.CROISSANT).write_text(json.dumps(cr, indent=1))
        msg = r"croissant.json: sha256 .* recorded in manifest.json \(its own sha256 zeroed\) at the export"
    elif edit == "fingerprint":
        man = json.loads((ds / "manifest.json").read_text())
        man["data"]["fingerprint"] = "0" * 64
        (ds / "manifest.json").write_text(json.dumps(man, indent=1))
        msg = r"manifest.json: records data fingerprint '0{64}', but chunk-00000.safetensors was trained on"
    else:  # only the manifest's sha256 in the description
        raw = (ds / dataset.CROISSANT).read_text()
        old = next(d["sha256"] for d in json.loads(raw)["distribution"] if d["contentUrl"] == "manifest.json")
        (ds / dataset.CROISSANT).write_text(raw.replace(old, "1" * 64))
        msg = r"manifest.json: sha256 .* does not match 1111111111111111..., recorded in croissant.json"
    rc, _, err = _run(["zoo", "info", ds, "--check"], capsys)
    assert rc == 2 and re.search(msg, err) and "verified" not in err and "Traceback" not in err, err
    with pytest.raises(store.StoreError, match=msg):
        dataset.verify(ds)


def test_an_edited_manifest_of_an_older_export_is_named_by_croissant(exported, tmp_path):
    """An export whose chunks carry no data record and whose manifest records no sha256 of the card and
    description (written before they did): the description's sha256 of the manifest still names an
    edited manifest."""
    ds = tmp_path / "ds"
    shutil.copytree(exported, ds)
    man = json.loads((ds / "manifest.json").read_text())
    del man["export"]["sha256"]
    man["data"]["n_train"] = 60000
    (ds / "manifest.json").write_text(json.dumps(man, indent=1))
    with pytest.raises(store.StoreError, match=r"manifest.json: records data n_train 60000, but chunk-00000"):
        dataset.verify(ds)  # the chunks say it first
    for c in range(4):  # as chunks written before they recorded their data
        f = ds / store.chunk_name(c)
        with safe_open(str(f), framework="pt") as h:
            meta = dict(h.metadata())
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        del meta["data"], meta[store.HEADER]
        meta[store.HEADER] = store.header_digest(meta)
        f.write_bytes(store.serialize(tensors, meta))
    cr = json.loads((ds / dataset.CROISSANT).read_text())
    rows = (ds / dataset.TABLE).read_text()
    for d in cr["distribution"]:
        if d["contentUrl"].startswith("chunk-"):
            new = dataset.file_sha256(ds / d["contentUrl"])
            rows, d["sha256"] = rows.replace(d["sha256"], new), new
    (ds / dataset.TABLE).write_text(rows)
    next(d for d in cr["distribution"] if d["contentUrl"] == dataset.TABLE)["sha256"] = dataset.file_sha256(
        ds / dataset.TABLE)
    (ds / dataset.CROISSANT).write_text(json.dumps(cr, indent=1))
    with pytest.raises(store.StoreError, match=r"manifest.json: sha256 .* recorded in croissant.json"):
        dataset.verify(ds)


# -- leftovers of killed runs, full disks


def _leftovers(target: Path, tag: str) -> tuple[Path, Path]:
    """The temporary folders beside ``target`` of a killed run of ``tag`` (its process is gone) and of a
    run still going (this process's parent), each with half a chunk in it."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left, running = (target.parent / f".{target.name}.{tag}-{pid}.tmp" for pid in (gone.pid, os.getppid()))
    for folder in (left, running):
        folder.mkdir()
        (folder / store.chunk_name(0)).write_bytes(b"half a chunk")
    return left, running


def test_a_killed_import_leaves_nothing_the_next_one_keeps(tmp_path, capsys):
    """A killed `import` leaves `.NAME.import-PID.tmp` beside `--to`; the next import to it removes it (the
    temporary folder of an import still running is kept), as the next export does for exports."""
    src = tmp_path / "src"
    src.mkdir()
    for s in range(3):
        torch.save(trained(s), src / f"seed{s}.pt")
    left, running = _leftovers(tmp_path / "set", "import")
    rc, _, err = _run(["import", src, "--to", tmp_path / "set", *MODEL], capsys)
    assert rc == 0, err
    assert not left.exists() and running.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [running.name, "set", "src"]


@pytest.mark.parametrize("command", ["train", "import", "export"])
def test_a_full_disk_is_one_clear_line_and_damages_nothing(command, reference, tiny_zoo, tmp_path,
                                                           monkeypatch, capsys):
    """A full disk while `zoo train` resumes, `import` or `export` writes: one line naming the folder and
    what to do, the files already there unchanged, no temporary file left; once there is space, the same
    command finishes (a zoo as if never interrupted)."""
    if command == "train":
        out = tmp_path / "z"
        real = training._train_chunk

        def killed(cfg, seeds, *a):
            if seeds[0] == 2:
                raise KeyboardInterrupt  # a run cut short after chunks 0 and 1
            return real(cfg, seeds, *a)

        with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
            m.setattr(training, "_train_chunk", killed)
            zoo.train(small(), out, progress=False)
        argv = ["zoo", "train", *SMALL, "--out", out]
        monkeypatch.setattr(cli_zoo, "_config", lambda args: small())
    elif command == "import":
        src = tmp_path / "src"
        src.mkdir()
        for s in range(3):
            torch.save(trained(s), src / f"seed{s}.pt")
        out = tmp_path / "set"
        argv = ["import", src, "--to", out, *MODEL]
    else:
        out = tmp_path / "ds"
        argv = ["zoo", "export", tiny_zoo, "--to", out, "--no-validate"]
    before = sha256s(tmp_path)
    with monkeypatch.context() as m:  # every write runs out of space: an atomic write's sync, a copy
        m.setattr(os, "fsync", _full)
        m.setattr(shutil, "copyfile", _full)
        rc, _, err = _run(argv, capsys)
    assert rc == 2 and len(err.splitlines()) == 2 and "Traceback" not in err, err
    assert re.search(rf"symlib: error: {re.escape(str(out))}: no space left on the device .*(resumes|again)",
                     err), err
    assert sha256s(tmp_path) == before
    assert not [p for p in tmp_path.rglob("*.tmp")]
    rc, _, err = _run(argv, capsys)
    assert rc == 0, err
    if command == "train":
        assert sha256s(out) == sha256s(reference)


def _full(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_an_edited_data_fingerprint_of_a_sample_set_is_named(reference, tmp_path, capsys):
    """A posterior sample set records its data twice, in its training problem and beside it: an edit of
    the manifest's `data` fingerprint is named by `info --check`."""
    from symlib.posteriors import SampleSet, io, sampling

    setup = sampling.setup_for("mnist-optunet", "tiny")
    params, _ = zoo.load(reference)
    io.save(SampleSet(params, "ensemble", 4, 1), tmp_path / "set", setup=setup)
    man = json.loads((tmp_path / "set" / "manifest.json").read_text())
    man["data"]["fingerprint"] = "e" * 64
    (tmp_path / "set" / "manifest.json").write_text(json.dumps(man, indent=1))
    rc, _, err = _run(["zoo", "info", tmp_path / "set", "--check"], capsys)
    assert rc == 2 and re.search(r"manifest.json: records data fingerprint 'e{64}', its training problem "
                                 r"'[0-9a-f]{64}'", err), err
