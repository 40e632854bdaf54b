"""Zoo storage: round trips, resume, shards and merge, validation errors, cache."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import scenarios
import torch
from safetensors.torch import load_file, save_file

from symlib import store, zoo
from symlib import training as T


def small(**kw) -> zoo.ZooConfig:
    """The tiny MNIST preset, smaller still: 4 models in 4 files, 128 training digits, 1 epoch."""
    base = dict(
        n_models=4,
        chunk=1,
        n_train=128,
        n_test=64,
        recipe=zoo.preset("mnist-optunet", "tiny").recipe.scaled(1),
    )
    base.update(kw)
    return dataclasses.replace(zoo.preset("mnist-optunet", "tiny"), **base)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """One uninterrupted run of the small zoo, reused by several tests."""
    out = tmp_path_factory.mktemp("zoo") / "full"
    zoo.train(small(), out, progress=False)
    return out


def _files(path):
    return {p.name: load_file(p) for p in sorted(path.glob("chunk-*.safetensors"))}


def test_manifest_records_every_model(full):
    cfg = small()
    man = json.loads((full / "manifest.json").read_text())
    assert man["complete"] and man["config_hash"] == cfg.hash
    assert man["seeds"] == list(cfg.seeds) and [m["seed"] for m in man["models"]] == list(cfg.seeds)
    assert man["arch"] == "optunet" and man["recipe"]["lr"] == 0.04 and man["data"]["fingerprint"]
    assert man["data"]["n_train"] == 128 and man["data"]["n_test"] == 64
    assert man["symlib_version"] and "git_commit" in man
    for m in man["models"]:
        assert 0 <= m["test_acc"] <= 1 and m["train_loss"] > 0


def test_load_round_trip_is_bit_identical(full):
    """The loaded zoo equals, bit for bit, the models trained in memory with the same seeds."""
    cfg = small()
    stacked, man = zoo.load(full)
    d = zoo.load_data(cfg)
    for c in range(cfg.n_chunks):
        seeds = cfg.seeds[slice(*cfg.chunk_range(c))]
        ref = T.train_stacked(
            T.init_params(cfg.make_model, seeds), seeds, d.x, d.y, cfg.recipe, fill=d.fill[0]
        )
        for k, v in ref.items():
            assert torch.equal(stacked[k][c * cfg.chunk : (c + 1) * cfg.chunk], v)
    nets, _ = zoo.load(full, as_="models")
    assert len(nets) == cfg.n_models
    x = d.x_test[:16]
    logits = T.optunet_forward(stacked, x)
    for i, net in enumerate(nets):
        assert not net.training
        torch.testing.assert_close(net(x), logits[i], rtol=1e-5, atol=1e-6)
    acc, loss = T.evaluate_stacked(stacked, d.x_test, d.y_test)
    assert acc.tolist() == pytest.approx([m["test_acc"] for m in man["models"]])


def test_resume_skips_finished_chunks_and_adds_nothing_twice(full, tmp_path):
    out = tmp_path / "z"
    out.mkdir()
    for name in ("chunk-00000.safetensors", "chunk-00002.safetensors"):
        shutil.copy(full / name, out / name)
    stamp = {n: (out / n).stat().st_mtime_ns for n in ("chunk-00000.safetensors", "chunk-00002.safetensors")}
    man = zoo.train(small(), out, progress=False)
    assert man["complete"] and man["seeds"] == list(small().seeds)
    assert {n: (out / n).stat().st_mtime_ns for n in stamp} == stamp  # not retrained
    a, b = _files(full), _files(out)
    assert a.keys() == b.keys()
    for name in a:
        assert all(torch.equal(a[name][k], b[name][k]) for k in a[name])
    assert not list(out.glob(".*tmp"))


def test_shards_merge_into_the_same_zoo(full, tmp_path):
    cfg = small()
    shards = [tmp_path / f"s{k}" for k in range(3)]
    for k, d in enumerate(shards):
        man = zoo.train(cfg, d, shard=(k, 3), progress=False)
        assert man["shard"] == [k, 3] and man["complete"]
        assert [c["chunk"] for c in man["chunks"]] == list(range(k, cfg.n_chunks, 3))
    with pytest.raises(zoo.ZooError, match="missing"):
        zoo.merge(shards[:2], tmp_path / "partial")
    with pytest.raises(zoo.ZooError, match="both"):
        zoo.merge([shards[0], shards[0], shards[1], shards[2]], tmp_path / "dup")
    with pytest.raises(zoo.ZooError, match="incomplete"):
        zoo.load(shards[0])
    merged = zoo.merge(shards, tmp_path / "merged")
    assert merged["complete"] and merged["seeds"] == list(cfg.seeds)
    a, _ = zoo.load(full)
    b, man = zoo.load(tmp_path / "merged")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="0 <= k < n"):
        zoo.train(cfg, tmp_path / "bad", shard=(3, 3))


def test_bad_files_are_named(full, tmp_path):
    cfg = small()
    z = tmp_path / "z"
    shutil.copytree(full, z)
    bad = z / "chunk-00001.safetensors"
    # NaN weights
    t = load_file(bad)
    meta = {
        "format": zoo.FORMAT,
        "config_hash": cfg.hash,
        "chunk": "1",
        "arch": "optunet",
        "models": json.dumps(json.loads((z / "manifest.json").read_text())["models"][1:2]),
    }
    t["fc.bias"][0, 3] = float("nan")
    save_file(t, bad, metadata={**meta, "sha256": zoo.tensor_digest(t)})
    with pytest.raises(zoo.ZooError, match="chunk-00001.*NaN"):
        zoo.load(z)
    # another architecture (wrong shapes)
    t = {k: v.clone() for k, v in load_file(full / "chunk-00001.safetensors").items()}
    t["conv1.weight"] = torch.zeros(1, 3, 1, 4, 4)
    save_file(t, bad, metadata={**meta, "sha256": zoo.tensor_digest(t)})
    with pytest.raises(zoo.ZooError, match="chunk-00001.*conv1.weight.*shape"):
        zoo.load(z)
    # silently damaged weights: the file parses, its checksum does not match
    raw = bytearray((full / "chunk-00001.safetensors").read_bytes())
    raw[-8:] = bytes(b ^ 0xFF for b in raw[-8:])  # flip the last weights' bits
    bad.write_bytes(bytes(raw))
    with pytest.raises(zoo.ZooError, match="chunk-00001.*sha256.*corrupt"):
        zoo.load(z)
    # truncated file
    bad.write_bytes((full / "chunk-00001.safetensors").read_bytes()[:100])
    with pytest.raises(zoo.ZooError, match="chunk-00001.*cannot read"):
        zoo.load(z)
    # a run into this folder does not silently overwrite a damaged chunk
    with pytest.raises(zoo.ZooError, match="chunk-00001"):
        zoo.train(cfg, z, progress=False)
    # missing models
    bad.unlink()
    man = json.loads((z / "manifest.json").read_text())
    man["chunks"] = [c for c in man["chunks"] if c["chunk"] != 1]
    man["models"] = [m for m in man["models"] if m["seed"] != 1]  # as a run that lost chunk 1 writes it
    man["seeds"], man["complete"] = [m["seed"] for m in man["models"]], False
    (z / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(zoo.ZooError, match="missing 1 models.*seeds \\[1\\]"):
        zoo.load(z)
    # another config in the same folder
    with pytest.raises(zoo.ZooError, match="choose another --out"):
        zoo.train(small(seed=7), z, progress=False)
    (z / "manifest.json").write_text("{not json")
    with pytest.raises(zoo.ZooError, match="manifest.json.*corrupt"):
        zoo.load(z)
    with pytest.raises(zoo.ZooError, match="no zoo manifest"):
        zoo.load(tmp_path / "nowhere")


def test_load_or_train_caches(tmp_path, monkeypatch):
    cfg = small(n_models=2, chunk=2)
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path / "cache"))
    a, man = zoo.load_or_train(cfg, progress=False)
    path = zoo.cache_path(cfg)
    assert path.parent == tmp_path / "cache" and path.name.startswith("mnist-optunet-tiny-")
    assert (path / "manifest.json").exists()

    def boom(*args, **kwargs):
        raise AssertionError("a cached zoo must not be retrained")

    monkeypatch.setattr(zoo, "train", boom)
    b, _ = zoo.load_or_train(cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(AssertionError, match="retrained"):
        zoo.load_or_train(cfg, seed=3)  # another seed is another zoo


def test_presets():
    cpu = zoo.preset("mnist-optunet", "cpu")
    paper = zoo.preset("mnist-optunet", "paper")
    assert cpu.n_models >= 100 and paper.n_models == 1000 and paper.recipe == T.OPTUNET_MNIST
    assert (
        paper.recipe.milestones == (15, 30) and paper.recipe.gamma == 0.5 and paper.recipe.crop_padding == 4
    )
    assert zoo.preset("cifar100-resnet18", "paper").recipe.nesterov
    assert zoo.preset("tinyimagenet-resnet18", "paper").recipe.schedule == "cosine"
    assert len({zoo.preset("mnist-optunet", s).hash for s in ("tiny", "cpu", "paper")}) == 3
    assert zoo.ZooConfig.from_dict(json.loads(json.dumps(cpu.to_dict()))) == cpu
    with pytest.raises(ValueError, match="unknown preset"):
        zoo.preset("mnist-mlp", "cpu")
    with pytest.raises(ValueError, match="unknown scale"):
        zoo.preset("mnist-optunet", "huge")


@pytest.mark.parametrize("name", ["cifar100-resnet18", "tinyimagenet-resnet18"])
def test_resnet_zoo_on_synthetic_data(name, tmp_path):
    """The paper's ResNet-18 recipes through the whole zoo path, on random images of the right shape."""
    cfg = dataclasses.replace(zoo.preset(name, "tiny"), n_train=16, n_test=8)
    zoo.train(cfg, tmp_path, progress=False)
    nets, man = zoo.load(tmp_path, as_="models")
    assert len(nets) == 2 and man["data"]["source"] == "synthetic"
    x = torch.randn(2, 3, cfg.image_size, cfg.image_size)
    assert nets[0](x).shape == (2, cfg.num_classes)
    stacked, _ = zoo.load(tmp_path)
    assert stacked["bn1.running_var"].shape[0] == 2  # buffers are stored too


# ----------------------------------------------------------------------------- bad input, repair
def _no_training(monkeypatch):
    """Make any training (or loading the training data) fail the test: refusals must come first."""
    from symlib.zoo import training

    def boom(*a, **k):
        raise AssertionError("trained (or loaded data) before refusing the folder")

    monkeypatch.setattr(training, "_train_chunk", boom)
    monkeypatch.setattr(training, "load_data", boom)


def _bad_out(case, full, tmp_path):
    """A bad --out for the small zoo, and the message that must name its problem and fix."""
    from symlib.posteriors import SampleSet, io

    if case == "file":
        (tmp_path / "f").write_text("a file")
        return tmp_path / "f", r"is a file, not a folder; choose another --out"
    if case == "under-file":
        (tmp_path / "f").write_text("a file")
        return tmp_path / "f" / "zoo", r"lies under .*f, which is a file, not a folder; choose another --out"
    if case == "read-only":
        ro = scenarios.readonly_folder(tmp_path)
        if ro is None:
            pytest.skip("no read-only folder on this machine")
        return ro / "zoo", r"is not writable .*choose a writable --out"
    if case == "posterior":
        io.save(SampleSet({"w": torch.ones(4, 2)}, "swag", 2, 2), tmp_path / "p")
        return tmp_path / "p", r"holds a posterior sample set, not a zoo; choose another --out"
    out = tmp_path / "z"
    shutil.copytree(full, out)  # the small zoo; the run asks for another one (seed 7)
    if case == "other-zoo":
        return out, r"holds zoo mnist-optunet/tiny .*choose another --out"
    (out / "manifest.json").write_text("{damaged")  # hides what the folder holds: the chunks tell
    return out, r"chunk-00000.safetensors: belongs to another zoo .*choose another --out \(nothing was"


BAD_OUTS = ["file", "under-file", "read-only", "posterior", "other-zoo", "foreign-chunks"]


@pytest.mark.parametrize("case", BAD_OUTS)
def test_bad_out_folders_are_refused_before_training(case, full, tmp_path, monkeypatch):
    """A file, a path under a file, a read-only folder, a sample set, another zoo, chunks of another zoo
    behind a damaged manifest: refused before any training or data loading, naming the fix, and nothing
    on disk is lost or changed."""
    out, msg = _bad_out(case, full, tmp_path)
    before = scenarios.snapshot(tmp_path)
    _no_training(monkeypatch)
    with pytest.raises(zoo.ZooError, match=msg):
        zoo.train(small(seed=7), out, progress=False, repair=True)
    assert scenarios.snapshot(tmp_path) == before and not (out.parent / "zoo").exists()


@pytest.mark.parametrize("case", ["file", "under-file", "posterior"])
def test_cli_zoo_train_refuses_bad_out_before_training(case, full, tmp_path, monkeypatch, capsys):
    from symlib import cli

    out, msg = _bad_out(case, full, tmp_path)
    before = scenarios.snapshot(tmp_path)
    _no_training(monkeypatch)
    argv = ["zoo", "train", "--preset", "mnist-optunet", "--scale", "tiny", "--out", str(out)]
    assert cli.main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("symlib: error: ") and "Traceback" not in err
    assert re.search(msg, err), err
    assert scenarios.snapshot(tmp_path) == before


def test_merge_refuses_sample_sets_and_bad_out(full, tmp_path, monkeypatch, capsys):
    from symlib import cli
    from symlib.posteriors import SampleSet, io

    for name in ("p", "q"):
        io.save(SampleSet({"w": torch.ones(4, 2) * len(name)}, "swag", 2, 2), tmp_path / name)
    (tmp_path / "f").write_text("a file")
    before = scenarios.snapshot(tmp_path)
    shards = [str(tmp_path / "p"), str(tmp_path / "q")]
    assert cli.main(["zoo", "merge", *shards, "--out", str(tmp_path / "m")]) == 2
    assert "holds a posterior sample set, not a zoo shard" in capsys.readouterr().err
    with pytest.raises(zoo.ZooError, match="is a file, not a folder"):
        zoo.merge([full], tmp_path / "f")
    with pytest.raises(zoo.ZooError, match="lies under"):
        zoo.merge([full], tmp_path / "f" / "m")
    assert scenarios.snapshot(tmp_path) == before and not (tmp_path / "m").exists()


def _corrupt_one_byte(file):
    raw = bytearray(file.read_bytes())
    raw[-3] ^= 0x01  # one bit of the last weights: the file parses, its checksum does not match
    file.write_bytes(bytes(raw))


def test_repair_retrains_exactly_the_damaged_chunk(full, tmp_path, monkeypatch, capsys):
    """A corrupt byte in one chunk: every message names `symlib zoo repair DIR`; running it retrains that
    chunk only, and the zoo loads bit-identical to before the damage."""
    from symlib import cli

    z = tmp_path / "z"
    shutil.copytree(full, z)
    ref, _ = zoo.load(z)
    bad = z / "chunk-00002.safetensors"
    _corrupt_one_byte(bad)
    repair = re.escape(f"`symlib zoo repair {z}`")
    with pytest.raises(store.DamagedError, match=rf"chunk-00002.*corrupt.*{repair}"):
        zoo.load(z)
    with pytest.raises(zoo.ZooError, match=rf"chunk-00002.*{repair}.*or rerun this command with --repair"):
        zoo.train(small(), z, progress=False)
    assert cli.main(["zoo", "info", str(z), "--check"]) == 2
    assert f"symlib zoo repair {z}" in capsys.readouterr().err
    others = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in z.glob("chunk-*") if p != bad}
    trained = []
    from symlib.zoo import training

    real = training._train_chunk
    monkeypatch.setattr(training, "_train_chunk", lambda cfg, seeds, *a: (trained.append(list(seeds)),
                                                                          real(cfg, seeds, *a))[1])
    assert cli.main(["zoo", "repair", str(z), "--no-progress"]) == 0
    assert trained == [[2]]  # exactly the damaged chunk (seed 2) was retrained
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in z.glob("chunk-*") if p != bad} == others
    got, man = zoo.load(z)
    assert man["complete"] and all(torch.equal(got[k], ref[k]) for k in ref)
    # a damaged manifest beside valid chunks: rebuilt by `zoo train --repair`, no chunk retrained
    (z / "manifest.json").write_text("{damaged")
    with pytest.raises(zoo.ZooError, match="corrupt manifest.*chunks beside it may still be valid.*--repair"):
        zoo.train(small(), z, progress=False)
    trained.clear()
    zoo.train(small(), z, progress=False, repair=True)
    assert trained == [] and all(torch.equal(zoo.load(z)[0][k], ref[k]) for k in ref)


def test_load_or_train_repairs_a_damaged_cache(tmp_path, monkeypatch):
    """A cached zoo with a damaged chunk: load_or_train warns, retrains that chunk and returns the same
    weights as before the damage."""
    from symlib.zoo import training

    cfg = small(n_models=3, chunk=1)
    a, _ = zoo.load_or_train(cfg, cache_dir=tmp_path, progress=False)
    path = zoo.cache_path(cfg, tmp_path)
    _corrupt_one_byte(path / "chunk-00001.safetensors")
    trained = []
    real = training._train_chunk
    monkeypatch.setattr(training, "_train_chunk", lambda cfg, seeds, *a: (trained.append(list(seeds)),
                                                                          real(cfg, seeds, *a))[1])
    with pytest.warns(UserWarning, match="chunk-00001.*retraining exactly the damaged chunks"):
        b, man = zoo.load_or_train(cfg, cache_dir=tmp_path, progress=False)
    assert trained == [[1]] and man["complete"] and all(torch.equal(a[k], b[k]) for k in a)


def test_diverged_networks_are_not_written(tmp_path, monkeypatch):
    from symlib.zoo import training

    real = training._train_chunk

    def diverged(cfg, seeds, *a):
        theta, recs = real(cfg, seeds, *a)
        theta["fc.bias"][0, 1] = float("nan")
        return theta, recs

    monkeypatch.setattr(training, "_train_chunk", diverged)
    with pytest.raises(FloatingPointError, match=r"seeds \[0\] diverged .*nothing was written.*learning"):
        zoo.train(small(n_models=1), tmp_path / "z", progress=False)
    assert not list((tmp_path / "z").glob("chunk-*"))
