"""Zoos as published datasets: export, round trip, Croissant, the card, hf:// through the Hub's cache
(offline), and the bad inputs: damaged chunks, a card without its table, an export over an existing folder."""

from __future__ import annotations

import csv
import dataclasses
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

import symlib
from symlib import cli, store, zoo
from symlib.zoo import dataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory):
    """The `tiny` preset zoo (8 OptuNets in 4 chunks)."""
    out = tmp_path_factory.mktemp("zoo") / "tiny"
    zoo.train(zoo.preset("mnist-optunet", "tiny"), out, progress=False)
    return out


@pytest.fixture(scope="module")
def exported(tiny_zoo, tmp_path_factory):
    to = tmp_path_factory.mktemp("ds") / "tiny-zoo"
    dataset.export(tiny_zoo, to, repo="owner/tiny-zoo", validate=False)
    return to


def _tree(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_export_round_trip_is_bit_identical(tiny_zoo, exported):
    a, man = zoo.load(tiny_zoo)
    b, man_b = symlib.load(exported)  # checks every chunk against the table first
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert man_b["config_hash"] == man["config_hash"] and man_b["export"]["table"] == dataset.TABLE
    for p in tiny_zoo.glob("chunk-*.safetensors"):  # the chunks, byte for byte
        assert (exported / p.name).read_bytes() == p.read_bytes()
    nets, _ = symlib.load(exported, as_="models")
    assert len(nets) == 8


def test_manifest_table_has_one_row_per_checkpoint(tiny_zoo, exported):
    man = store.read_manifest(tiny_zoo)
    rows = list(csv.DictReader((exported / dataset.TABLE).open()))
    assert [int(r["index"]) for r in rows] == list(range(8))
    assert [int(r["seed"]) for r in rows] == man["seeds"]
    for r, m in zip(rows, man["models"], strict=True):
        assert float(r["test_acc"]) == m["test_acc"] and float(r["train_loss"]) == m["train_loss"]
        assert r["config_hash"] == man["config_hash"] and json.loads(r["recipe"]) == man["recipe"]
        assert r["chunk_sha256"] == hashlib.sha256((exported / r["chunk_file"]).read_bytes()).hexdigest()
    assert {r["chunk_file"] for r in rows} == {f"chunk-{c:05d}.safetensors" for c in range(4)}


def test_card_has_the_hub_metadata_and_the_citation(exported):
    import yaml

    text = (exported / dataset.CARD).read_text()
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    assert meta["license"] == "mit" and meta["task_categories"] == ["image-classification"]
    assert meta["size_categories"] == ["n<1K"] and "model-zoo" in meta["tags"]
    assert meta["configs"][0]["data_files"][0]["path"] == dataset.TABLE
    for needle in ("symlib zoo train --preset mnist-optunet --scale tiny", 'symlib.load("hf://owner/tiny-zoo")',
                   "@inproceedings{laurent2024symmetry", "hf upload"):
        assert needle in text, needle


def test_croissant_validates_with_mlcroissant(exported):
    pytest.importorskip("mlcroissant")
    assert dataset.validate_croissant(exported) == ""  # no errors, no warnings, 8 records read
    cr = json.loads((exported / dataset.CROISSANT).read_text())
    files = {d["contentUrl"]: d["sha256"] for d in cr["distribution"]}
    assert set(files) == {dataset.TABLE, "manifest.json", *(f"chunk-{c:05d}.safetensors" for c in range(4))}
    assert all(files[f] == dataset.file_sha256(exported / f) for f in files)
    # a broken description is refused
    bad = exported.parent / "bad"
    shutil.copytree(exported, bad)
    cr["recordSet"][0]["field"][0]["source"]["extract"]["column"] = "no_such_column"
    (bad / dataset.CROISSANT).write_text(json.dumps(cr))
    with pytest.raises(store.StoreError, match="croissant.json"):
        dataset.validate_croissant(bad)


def test_info_and_cli_read_a_dataset(tiny_zoo, exported, tmp_path, capsys):
    assert "dataset" in symlib.info(exported) and "8 rows" in symlib.info(exported)
    to = tmp_path / "via-cli"
    assert cli.main(["zoo", "export", str(tiny_zoo), "--to", str(to), "--no-validate"]) == 0
    assert cli.main(["zoo", "info", str(to), "--check"]) == 0
    out = capsys.readouterr().out
    assert "mnist-optunet at scale tiny" in out and "sha256 verified" in out


def test_damaged_or_replaced_chunk_is_refused(exported, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    # another valid chunk of the same zoo put in its place: its own checksum passes, the table's does not
    shutil.copy(bad / "chunk-00000.safetensors", bad / "chunk-00001.safetensors")
    with pytest.raises(store.StoreError, match=r"chunk-00001.*does not match.*checkpoints.csv"):
        symlib.load(bad)
    with pytest.raises(store.StoreError, match="chunk-00001"):
        symlib.info(bad)
    (bad / "chunk-00001.safetensors").unlink()
    with pytest.raises(store.StoreError, match="chunk-00001.*missing"):
        symlib.load(bad)


def test_card_without_its_table_is_refused(exported, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    (bad / dataset.TABLE).unlink()
    with pytest.raises(store.StoreError, match="no manifest table beside its dataset card"):
        symlib.load(bad)
    assert cli.main(["zoo", "info", str(bad)]) == 2
    only_card = tmp_path / "only-card"
    only_card.mkdir()
    shutil.copy(exported / dataset.CARD, only_card / dataset.CARD)
    with pytest.raises(store.StoreError, match="no manifest table"):
        symlib.load(only_card)
    # a README of one's own beside a zoo does not make it a dataset
    mine = tmp_path / "mine"
    shutil.copytree(exported, mine)
    for f in (dataset.TABLE, dataset.CROISSANT):
        (mine / f).unlink()
    man = json.loads((mine / "manifest.json").read_text())
    del man["export"]
    (mine / "manifest.json").write_text(json.dumps(man))
    (mine / dataset.CARD).write_text("# My zoo\n\nTrained on Tuesday.\n")
    assert not dataset.is_dataset(mine) and len(symlib.load(mine)[1]["models"]) == 8


def test_export_never_overwrites(tiny_zoo, exported, tmp_path):
    before = _tree(exported)
    with pytest.raises(store.StoreError, match="already exists.*never overwrites"):
        dataset.export(tiny_zoo, exported, validate=False)
    assert _tree(exported) == before
    file = tmp_path / "a-file"
    file.write_text("keep me")
    with pytest.raises(store.StoreError, match="already exists"):
        dataset.export(tiny_zoo, file, validate=False)
    assert file.read_text() == "keep me"
    # an incomplete zoo (a shard) is not exported, and nothing is left behind
    shard = tmp_path / "shard"
    zoo.train(dataclasses.replace(zoo.preset("mnist-optunet", "tiny"), n_models=4), shard, shard=(0, 2),
              progress=False)
    with pytest.raises(store.StoreError, match="incomplete"):
        dataset.export(shard, tmp_path / "out", validate=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.export-*"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert dataset.export(tiny_zoo, empty, validate=False) == empty and (empty / dataset.TABLE).exists()


def test_posterior_sample_set_exports_too(tmp_path):
    from symlib.posteriors import SampleSet, io

    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(6, 3, 2, generator=gen), "b": torch.randn(6, 3, generator=gen)}
    io.save(SampleSet(params, "swag", 2, 3, base_seeds=[10, 11]), tmp_path / "set", chunk=2)
    dataset.export(tmp_path / "set", tmp_path / "ds", validate=False)
    rows = dataset.verify(tmp_path / "ds")
    assert [(int(r["index"]), int(r["mode"]), r["base_seed"]) for r in rows] == [
        (0, 0, "10"), (1, 0, "10"), (2, 0, "10"), (3, 1, "11"), (4, 1, "11"), (5, 1, "11")]
    got, man = symlib.load(tmp_path / "ds")
    assert man["kind"] == "posterior" and all(torch.equal(got[k], params[k]) for k in params)


def _hub_cache(root: Path, repo: str, folder: Path, commit: str = "0" * 40) -> None:
    """A Hugging Face Hub cache holding ``folder`` as dataset ``repo`` (blobs + a snapshot of symlinks), as
    ``hf download`` leaves it."""
    base = root / f"datasets--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "blobs").mkdir()
    for f in folder.iterdir():
        blob = base / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))


def test_hf_address_resolves_through_the_hub_cache_offline(tiny_zoo, exported, tmp_path):
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    _hub_cache(cache, "owner/tiny-zoo", exported)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    code = ("import sys, torch, symlib; p, m = symlib.load('hf://owner/tiny-zoo'); "
            "torch.save(p, sys.argv[1]); print(symlib.info('hf://datasets/owner/tiny-zoo@main'))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "p.pt")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    got = torch.load(tmp_path / "p.pt")
    ref, _ = zoo.load(tiny_zoo)
    assert all(torch.equal(got[k], ref[k]) for k in ref) and "hf://datasets/owner/tiny-zoo" in done.stdout
    missing = subprocess.run([sys.executable, "-m", "symlib", "zoo", "info", "hf://owner/elsewhere"], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and "cannot resolve the dataset" in missing.stderr


def _rewrite_table(folder: Path, edit) -> None:
    rows = list(csv.DictReader((folder / dataset.TABLE).open()))
    edit(rows)
    with (folder / dataset.TABLE).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def test_swapped_chunks_with_matching_table_hashes_are_named(exported, tmp_path):
    """Two chunk files of an export swapped and the table's sha256 updated to match: the chunks say which
    chunk they hold, so nothing loads with networks attached to the wrong seeds."""
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    a, b = bad / "chunk-00000.safetensors", bad / "chunk-00001.safetensors"
    first = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(first)

    def rehash(rows):
        for r in rows:
            r["chunk_sha256"] = dataset.file_sha256(bad / r["chunk_file"])

    _rewrite_table(bad, rehash)
    with pytest.raises(store.DamagedError, match=r"chunk-00000.safetensors: holds chunk 1 .*swapped or"):
        symlib.load(bad)
    with pytest.raises(store.DamagedError, match="swapped or renamed"):
        symlib.info(bad)


@pytest.mark.parametrize("column, value", [("seed", "5"), ("test_acc", "0.99"), ("arch", "resnet18"),
                                           ("chunk_row", "0")])
def test_an_edited_table_is_named(exported, tmp_path, column, value, capsys):
    """Every cell of the manifest table is checked against the manifest and the chunk that holds the
    network: an edited seed or test accuracy is named, not reported as verified."""
    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    _rewrite_table(bad, lambda rows: rows[3].update({column: value}))
    msg = rf"checkpoints.csv: row 4 \(index 3\) says {column} '{value}', but chunk-00001.safetensors"
    with pytest.raises(store.StoreError, match=msg + r".*edited or damaged since the export"):
        dataset.verify(bad)
    assert cli.main(["zoo", "info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert re.search(msg, err) and "verified" not in err


def test_export_removes_what_a_killed_export_left(tiny_zoo, tmp_path):
    """A killed export leaves its temporary copy beside the target; the next export to it removes it (the
    copy of an export still running is kept)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f".ds.export-{gone.pid}.tmp"
    left.mkdir()
    (left / "chunk-00000.safetensors").write_bytes(b"half a copy")
    running = tmp_path / f".ds.export-{os.getppid()}.tmp"
    running.mkdir()
    dataset.export(tiny_zoo, tmp_path / "ds", validate=False)
    assert not left.exists() and running.exists() and dataset.verify(tmp_path / "ds")


def test_export_to_a_bad_place_or_license_is_refused_before_any_work(tiny_zoo, tmp_path, capsys):
    import scenarios

    (tmp_path / "f").write_text("a file")
    under = r"lies under .*f, which is a file, not a folder; choose another --to"
    cases = [(tmp_path / "f" / "ds", {}, under),
             (tmp_path / "ds", {"license": "MIT"}, r"unknown license 'MIT' \(did you mean 'mit'\?\)"),
             (tmp_path / "ds", {"license": "beerware"}, r"unknown license 'beerware'.*pass other")]
    ro = scenarios.readonly_folder(tmp_path)
    if ro is not None:
        cases.append((ro / "ds", {}, r"is not writable .*choose a writable --to"))
    before = scenarios.snapshot(tmp_path)
    for to, kw, msg in cases:
        with pytest.raises((store.StoreError, ValueError), match=msg):
            dataset.export(tiny_zoo, to, validate=False, **kw)
        argv = ["zoo", "export", str(tiny_zoo), "--to", str(to), "--no-validate"]
        argv += ["--license", kw["license"]] if kw else []
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert re.search(msg, err) and "Traceback" not in err, err
    assert scenarios.snapshot(tmp_path) == before and not (tmp_path / "ds").exists()
