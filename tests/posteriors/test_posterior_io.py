"""Posterior sample sets on disk: the zoo format round trip, resuming, runs that do not recompute, the CLI."""

from __future__ import annotations

import json
import re

import pytest
import torch

import symlib
from symlib import cli, store, zoo
from symlib import params as params_mod
from symlib.posteriors import SampleSet, io, sampling, seeds
from symlib.store import sets


def _set(n_modes=2, n_per_mode=3, seed=0, dtype=torch.float64) -> SampleSet:
    g = torch.Generator().manual_seed(seed)
    s = n_modes * n_per_mode
    shapes = {
        "conv1.weight": (2, 1, 4, 4),
        "conv2.weight": (10, 1, 5, 5),
        "fc.weight": (10, 10),
        "fc.bias": (10,),
    }
    params = {k: torch.randn(s, *v, generator=g, dtype=dtype) for k, v in shapes.items()}
    return SampleSet(
        params,
        "swag",
        n_modes,
        n_per_mode,
        hyper={"scale": 0.1, "milestones": (1, 2)},
        base_seeds=[7, 8][:n_modes],
        diagnostics={"loss": [1.0, 2.0]},
    )


@pytest.fixture(scope="module")
def tiny():
    return sampling.setup_for("mnist-optunet", "tiny")


def test_round_trip_through_symlib_load(tmp_path, tiny):
    """save -> io.load and symlib.load give back the same tensors (bit for bit, float64), mode-major, with a
    manifest recording method, hyper-parameters, base seeds, sizes and diagnostics."""
    a = _set()
    man = io.save(a, tmp_path / "p", setup=tiny, seed=3, base={"zoo_path": "somewhere"})
    assert man["complete"] and man["kind"] == "posterior" and man["format"] == zoo.FORMAT
    assert len(man["chunks"]) == 2 and man["chunk"] == 3  # one mode per file by default
    b = io.load(tmp_path / "p")
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    assert (b.method, b.n_modes, b.n_per_mode, b.base_seeds) == ("swag", 2, 3, [7, 8])
    assert b.hyper == {"scale": 0.1, "milestones": [1, 2]} and b.diagnostics == {"loss": [1.0, 2.0]}
    params, zman = symlib.load(tmp_path / "p")
    assert all(torch.equal(a.params[k], params[k]) for k in a.params)
    assert zman["method"] == "swag" and zman["base"]["zoo_path"] == "somewhere" and zman["seed"] == 3
    assert zman["setup"]["prior_precision"] == pytest.approx(tiny.prior_precision)
    models, _ = symlib.load(tmp_path / "p", as_="models")
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    ref = torch.func.functional_call(models[4], params_mod.unstack(a.params, 4), (x,))
    assert len(models) == 6 and torch.equal(models[4].double()(x), ref)
    assert "swag" in symlib.info(tmp_path / "p") and "2 modes x 3 samples" in io.info(tmp_path / "p")


def test_resume_rewrites_only_missing_or_damaged_chunks(tmp_path, monkeypatch):
    a = _set(n_modes=3, n_per_mode=2)
    io.save(a, tmp_path, chunk=2)
    raw = bytearray((tmp_path / "chunk-00002.safetensors").read_bytes())
    raw[-5] ^= 0xFF  # a flipped bit in the weights: the sha256 check catches it
    (tmp_path / "chunk-00002.safetensors").write_bytes(bytes(raw))
    with pytest.raises(zoo.ZooError, match="sha256"):
        io.load(tmp_path)
    (tmp_path / "chunk-00001.safetensors").unlink()  # an interrupted run, or a lost file
    with pytest.raises(zoo.ZooError, match="chunk-00001.*missing"):
        io.load(tmp_path)
    written = []
    real = sets.atomic_save
    monkeypatch.setattr(sets, "atomic_save", lambda t, p, m: (written.append(p.name), real(t, p, m)))
    io.save(a, tmp_path, chunk=2)
    assert written == ["chunk-00001.safetensors", "chunk-00002.safetensors"]
    b = io.load(tmp_path)
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)


def test_interrupted_write_then_incomplete_then_resumed(tmp_path, monkeypatch):
    a = _set()
    real = sets.atomic_save

    def killed_after_first(t, p, m):
        if p.name != "chunk-00000.safetensors":
            raise KeyboardInterrupt
        real(t, p, m)

    monkeypatch.setattr(sets, "atomic_save", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        io.save(a, tmp_path)
    monkeypatch.setattr(sets, "atomic_save", real)
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert not man["complete"] and [c["chunk"] for c in man["chunks"]] == [0]
    assert not list(tmp_path.glob(".*.tmp"))  # atomic: no partial file left behind
    with pytest.raises(zoo.ZooError, match="incomplete"):
        symlib.load(tmp_path)
    io.save(a, tmp_path)
    assert all(torch.equal(a.params[k], v) for k, v in symlib.load(tmp_path)[0].items())


def test_folder_conflicts_and_bad_sets(tmp_path):
    io.save(_set(), tmp_path / "p")
    with pytest.raises(zoo.ZooError, match="another sample set"):
        io.save(_set(seed=1, n_per_mode=2), tmp_path / "p")
    with pytest.raises(zoo.ZooError, match="no posterior sample set manifest"):
        io.load(tmp_path / "nothing")
    bad = _set()
    bad.params["fc.bias"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        io.save(bad, tmp_path / "q")
    with pytest.raises(ValueError, match="n_modes \\* n_per_mode"):
        SampleSet({"w": torch.zeros(5, 2)}, "swag", 2, 3)


def test_run_resumes_and_never_recomputes(tmp_path, tiny, monkeypatch):
    """run(): base models land in the zoo cache (a second method reuses them: no retraining), the set is
    written, a finished set is loaded instead of recomputed, and a set with a lost chunk is finished by
    rewriting that chunk with the same values."""
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path / "cache"))
    kw = dict(progress=False, epochs=1, n_snapshots=4, rank=4)
    a = sampling.run("swag", tiny, 2, 2, 0, tmp_path / "swag", **kw)
    base_dir = next((tmp_path / "cache").iterdir())
    assert symlib.load(base_dir)[1]["seeds"] == seeds.base_seeds(2, 0)

    def boom(*args, **kwargs):
        raise AssertionError("recomputed")

    monkeypatch.setattr(zoo, "train", boom)  # the base models must come from the cache from now on
    from symlib.posteriors import swag

    real_sample = swag.sample
    monkeypatch.setattr(swag, "sample", boom)
    b = sampling.run("swag", tiny, 2, 2, 0, tmp_path / "swag", **kw)  # finished: loaded
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)
    monkeypatch.setattr(swag, "sample", real_sample)
    (tmp_path / "swag" / "chunk-00001.safetensors").unlink()
    c = sampling.run("swag", tiny, 2, 2, 0, tmp_path / "swag", **kw)  # deterministic recompute
    assert all(torch.equal(a.params[k], c.params[k]) for k in a.params)
    assert all(torch.equal(a.params[k], v) for k, v in symlib.load(tmp_path / "swag")[0].items())
    d = sampling.run("sghmc", tiny, 2, 1, 0, tmp_path / "sghmc", progress=False, burn_in=0)  # same base
    assert d.base_seeds == seeds.base_seeds(2, 0) and d.n_samples == 2
    with pytest.raises(ValueError, match="unknown posterior method"):
        sampling.run("mcmc", tiny, 1, 1)


def test_seed_ranges_are_disjoint_from_the_zoo():
    zoo_seeds = set(zoo.preset("mnist-optunet", "paper").seeds)
    assert not zoo_seeds & set(seeds.base_seeds(100, 0)) and not zoo_seeds & set(
        seeds.base_seeds(10, 5)
    )
    assert seeds.base_seeds(10, 0) == seeds.base_seeds(100, 0)[:10]  # multi-mode bases = DE members
    assert min(seeds.stream_seeds(50, 0, "swag")) >= 2**40
    assert seeds.stream_seeds(3, 0, "swag") != seeds.stream_seeds(3, 0, "sghmc")


def test_cli_posterior_sample_and_info(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path / "cache"))
    argv = ["posterior", "sample", "--method", "dropout", "--preset", "mnist-optunet", "--scale", "tiny"]
    out = str(tmp_path / "d")
    assert cli.main([*argv, "--modes", "2", "--samples", "4", "--out", out, "--no-progress"]) == 0
    assert "2 modes x 2 samples" in capsys.readouterr().out
    assert cli.main(["posterior", "info", out, "--check"]) == 0
    assert "dropout on mnist-optunet" in capsys.readouterr().out
    assert cli.main([*argv, "--modes", "3", "--samples", "4", "--out", out]) == 2
    assert "multiple of --modes" in capsys.readouterr().err
    assert cli.main([*argv, "--samples", "2", "--out", out + "-p", "--hyper", "p=1.5"]) == 2
    assert "(0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["posterior", "sample", "--help"])
    assert e.value.code == 0 and "TOTAL number of samples" in capsys.readouterr().out
    assert store.FORMAT == zoo.FORMAT


# ----------------------------------------------------------------------------- bad input
def _no_work(monkeypatch):
    """Training base models or drawing samples fails the test: refusals must come before any work."""
    from symlib.posteriors import swag

    def boom(*a, **k):
        raise AssertionError("worked before refusing the input")

    monkeypatch.setattr(zoo, "train", boom)
    monkeypatch.setattr(sampling, "base_models", boom)
    monkeypatch.setattr(swag.METHOD, "draw", boom)


@pytest.mark.parametrize("case", ["file", "under-file", "read-only", "zoo", "other-set", "foreign-chunks"])
def test_bad_out_folders_are_refused_before_any_sampling(case, tmp_path, tiny, monkeypatch):
    """sampling.run checks --out before training base models or sampling (a full try once wasted 56 s
    before `io.save` refused the folder); nothing on disk is lost or changed."""
    import scenarios

    out, msg = tmp_path / "out", None
    if case == "file":
        out.write_text("a file")
        msg = "is a file, not a folder; choose another --out"
    elif case == "under-file":
        (tmp_path / "f").write_text("a file")
        out, msg = tmp_path / "f" / "out", "lies under .*f, which is a file"
    elif case == "read-only":
        ro = scenarios.readonly_folder(tmp_path)
        if ro is None:
            pytest.skip("no read-only folder on this machine")
        out, msg = ro / "out", "is not writable .*choose a writable --out"
    elif case == "zoo":
        zoo.train(_one_model_zoo(), out, progress=False)
        msg = "holds a zoo, not a posterior sample set; choose another --out"
    else:
        io.save(_set(), out)
        msg = "holds another sample set .*choose another --out"
        if case == "foreign-chunks":
            (out / "manifest.json").write_text("{damaged")
            msg = "chunk-00000.safetensors: belongs to another sample set .*nothing was written"
    before = scenarios.snapshot(tmp_path)
    _no_work(monkeypatch)
    with pytest.raises(store.StoreError, match=msg):
        sampling.run("swag", tiny, 2, 2, 0, out, progress=False)
    assert scenarios.snapshot(tmp_path) == before


def _one_model_zoo():
    import dataclasses

    tiny = zoo.preset("mnist-optunet", "tiny")
    return dataclasses.replace(tiny, n_models=1, n_train=32, n_test=16, recipe=tiny.recipe.scaled(1))


def test_cli_refuses_bad_hyper_and_bad_out_first(tmp_path, monkeypatch, capsys):
    """`--hyper bogus=1` fails before any data is loaded or model trained, listing the valid names; a bad
    --out likewise."""
    _no_work(monkeypatch)
    monkeypatch.setattr(sampling, "setup_for", lambda *a, **k: pytest.fail("loaded the training problem"))
    argv = ["posterior", "sample", "--method", "swag", "--preset", "mnist-optunet", "--scale", "tiny"]
    assert cli.main([*argv, "--out", str(tmp_path / "s"), "--hyper", "bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown swag hyper-parameter(s) ['bogus']; valid: [" in err and "'rank'" in err
    (tmp_path / "f").write_text("a file")
    assert cli.main([*argv, "--out", str(tmp_path / "f")]) == 2
    assert "is a file, not a folder; choose another --out" in capsys.readouterr().err
    assert not (tmp_path / "s").exists() and (tmp_path / "f").read_text() == "a file"


def test_nan_samples_leave_no_folder(tmp_path):
    bad = _set()
    bad.params["fc.weight"][4, 0, 1] = float("inf")
    with pytest.raises(ValueError, match=r"'fc.weight' holds NaN or infinite values \(samples \[4\]\)"):
        io.save(bad, tmp_path / "q")
    assert not (tmp_path / "q").exists()


def test_corrupt_manifest_is_rebuilt_from_the_valid_chunks(tmp_path, monkeypatch):
    """A damaged manifest beside valid chunks: a rerun keeps the chunks (none rewritten) and rewrites the
    manifest, instead of "choose another --out"."""
    a = _set()
    io.save(a, tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "symlib-zoo/1", "kind": "post')
    with pytest.raises(store.StoreError, match="corrupt manifest.*chunk files beside it may still be valid"):
        symlib.load(tmp_path)
    written = []
    real = sets.atomic_save
    monkeypatch.setattr(sets, "atomic_save", lambda t, p, m: (written.append(p.name), real(t, p, m)))
    man = io.save(a, tmp_path)
    assert written == [] and man["complete"]
    assert all(torch.equal(a.params[k], v) for k, v in symlib.load(tmp_path)[0].items())


def test_a_rerun_of_a_complete_set_removes_stale_temporaries(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path / "cache"))
    sampling.run("ensemble", tiny, 1, 2, 0, tmp_path / "e", progress=False)
    stale = tmp_path / "e" / ".chunk-00000.safetensors.x1y2.tmp"
    stale.write_bytes(b"half a file")
    _no_work(monkeypatch)
    sampling.run("ensemble", tiny, 1, 2, 0, tmp_path / "e", progress=False)  # complete: loaded, not redone
    assert not stale.exists()


@pytest.mark.parametrize("edit", ["num_classes", "arch", "arch-and-model"])
def test_an_edited_architecture_fails_info_check(edit, tmp_path, tiny, capsys):
    """A manifest whose architecture was changed used to pass `posterior info --check` and then fail in
    load_state_dict; the check names the mismatch and the fix."""
    io.save(_set(), tmp_path, setup=tiny)
    man = json.loads((tmp_path / "manifest.json").read_text())
    if edit == "num_classes":
        man["model"]["kwargs"]["num_classes"] = 100
        msg = "model .* does not match architecture 'optunet'"
    elif edit == "arch":
        man["arch"] = man["setup"]["arch"] = "resnet18"
        msg = "model .*OptuNet.* does not match architecture 'resnet18'"
    else:  # consistently, so that only the tensors can tell
        man["arch"] = man["setup"]["arch"] = "resnet20"
        man["model"] = io.model_spec("resnet20", {k: tuple(v) for k, v in man["shapes"].items()})
        msg = r"architecture 'resnet20' \(ResNet20, .*\) does not match the tensors it records"
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    assert cli.main(["posterior", "info", str(tmp_path), "--check"]) == 2
    err = capsys.readouterr().err
    assert re.search(msg, err) and "rerun `symlib posterior sample` with the same arguments" in err, err
    with pytest.raises(store.StoreError, match=msg):
        symlib.load(tmp_path, as_="models")


@pytest.mark.parametrize("extra", [[], ["--executor", "local"]])
def test_cli_refuses_bad_hyper_values_and_cache_before_any_work(extra, tmp_path, monkeypatch, capsys):
    """Hyper-parameter values the method refuses, and a --cache that cannot hold the base models, fail
    before any data is loaded or base model trained, naming the option."""
    _no_work(monkeypatch)
    monkeypatch.setattr(sampling, "setup_for", lambda *a, **k: pytest.fail("loaded the training problem"))
    argv = ["posterior", "sample", "--method", "swag", "--preset", "mnist-optunet", "--scale", "tiny",
            "--out", str(tmp_path / "s"), *extra]
    for hyper, msg in (("scale=-1", "scale must be a finite positive number, got -1"),
                       ("lr=abc", "lr must be a finite positive number, got 'abc'"),
                       ("rank=1", "rank must be an integer >= 2, got 1")):
        assert cli.main([*argv, "--hyper", hyper]) == 2
        assert f"symlib: error: --hyper: {msg}" in capsys.readouterr().err
    (tmp_path / "f").write_text("a file")
    for cache in (tmp_path / "f", tmp_path / "f" / "cache"):
        assert cli.main([*argv, "--cache", str(cache)]) == 2
        err = capsys.readouterr().err
        assert "choose another --cache" in err and "--out" not in err, err
    assert not (tmp_path / "s").exists() and (tmp_path / "f").read_text() == "a file"


def _flip_in_header(file, needle: bytes) -> None:
    raw = bytearray(file.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    i = raw.index(needle, 8, 8 + n)
    raw[i + 1] ^= 0x01
    file.write_bytes(bytes(raw))


def test_a_damaged_chunk_header_is_named_and_rewritten(tmp_path):
    """One flipped bit in a chunk's metadata: named as a damaged chunk (not a KeyError), and a rerun of
    the same write rewrites exactly that chunk."""
    a = _set()
    io.save(a, tmp_path)
    _flip_in_header(tmp_path / "chunk-00001.safetensors", b"index")
    msg = r"chunk-00001.safetensors: its header .*damaged.*rerun `symlib posterior sample`"
    with pytest.raises(store.DamagedError, match=msg):
        symlib.load(tmp_path)
    io.save(a, tmp_path)
    got, _ = symlib.load(tmp_path)
    assert all(torch.equal(a.params[k], got[k]) for k in got)


def test_sample_sets_of_the_previous_format_still_load(tmp_path):
    """Chunks written before headers carried their sha256 load as before; swapped ones are named."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    a = _set()
    io.save(a, tmp_path)
    for c in range(2):
        file = tmp_path / store.chunk_name(c)
        with safe_open(str(file), framework="pt") as f:
            meta = {k: v for k, v in f.metadata().items() if k != store.HEADER}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, file, metadata=meta)
    got, _ = symlib.load(tmp_path)
    assert all(torch.equal(a.params[k], got[k]) for k in got)
    first = (tmp_path / "chunk-00000.safetensors").read_bytes()
    (tmp_path / "chunk-00000.safetensors").write_bytes((tmp_path / "chunk-00001.safetensors").read_bytes())
    (tmp_path / "chunk-00001.safetensors").write_bytes(first)
    with pytest.raises(store.DamagedError, match=r"chunk-00000.safetensors: holds samples \[3, 4, 5\]\.\.\., "
                       r"expected 0..2: chunk files were swapped"):
        symlib.load(tmp_path)
