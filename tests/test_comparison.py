"""``symlib compare``: two checkpoint folders (zoos, sample sets, exported datasets) compared with the paper's
MMD, per layer and aggregated, equal to :func:`symlib.stats.mmd.two_sample` on the loaded sets; mismatched
architectures and layer shapes are clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import symlib
from symlib import cli, comparison, zoo
from symlib.stats import mmd
from symlib.symmetry import trace

N_PERM, N_BOOT = 50, 40


@pytest.fixture(scope="module")
def zoos(tmp_path_factory):
    """Two tiny OptuNet zoos of other seeds (8 networks each) and the first one exported as a dataset."""
    root = tmp_path_factory.mktemp("cmp")
    cfg = zoo.preset("mnist-optunet", "tiny")
    zoo.train(cfg, root / "a", progress=False)
    zoo.train(dataclasses.replace(cfg, seed=100), root / "b", progress=False)
    zoo.export(root / "a", root / "a-dataset", validate=False)
    return root


def test_compare_is_the_paper_mmd_of_the_loaded_sets(zoos):
    res = symlib.compare(zoos / "a", zoos / "b", ("raw", "ns"), n_permutations=N_PERM, n_bootstrap=N_BOOT)
    a, _ = symlib.load(zoos / "a")
    b, _ = symlib.load(zoos / "b")
    spec = trace.spec_of(zoo.preset("mnist-optunet", "tiny").make_model().double(), (1, 28, 28))
    for sym in ("raw", "ns"):
        ref = mmd.two_sample(a, b, spec=spec, symmetries=sym, n_permutations=N_PERM, n_bootstrap=N_BOOT)
        got = res.results[sym]
        assert torch.equal(got.values, ref.values) and torch.equal(got.boot, ref.boot)
        assert float(got.p_value()) == float(ref.p_value())
        rows = [r for r in res.rows() if r["symmetries"] == sym]
        assert [r["layer"] for r in rows] == ["conv1", "conv2", "fc", "all"]
        assert [r["params"] for r in rows] == [32, 250, 110, 392]
        assert rows[-1]["mmd"] == pytest.approx(100 * float(ref.value()))
        assert (rows[-1]["lo"], rows[-1]["hi"]) == pytest.approx((100 * ref.interval()).tolist())
        assert [r["p"] for r in rows[:3]] == pytest.approx(ref.p_value(layers=None).tolist())
        assert all(0 < r["p"] <= 1 for r in rows)


def test_an_exported_dataset_compares_like_its_zoo(zoos):
    via_zoo = comparison.compare(zoos / "a", zoos / "b", ("ns",), n_permutations=N_PERM, n_bootstrap=0)
    via_dataset = comparison.compare(zoos / "a-dataset", zoos / "b", ("ns",), n_permutations=N_PERM,
                                     n_bootstrap=0)
    assert torch.equal(via_zoo.results["ns"].values, via_dataset.results["ns"].values)
    assert via_zoo.rows()[0]["lo"] is None  # no bootstrap asked


def test_a_sample_set_takes_its_architecture_from_its_manifest(zoos, tmp_path):
    """A posterior sample set (here zoo B's networks saved as an 'ensemble' set) compares like the zoo: its
    manifest's model record gives the spec."""
    from symlib.posteriors import SampleSet, io, sampling

    b, _ = symlib.load(zoos / "b")
    setup = sampling.setup_for("mnist-optunet", "tiny")
    io.save(SampleSet(b, "ensemble", 2, 4), tmp_path / "set", setup=setup)
    via_zoo = comparison.compare(zoos / "a", zoos / "b", ("ns",), n_permutations=0, n_bootstrap=0)
    via_set = comparison.compare(zoos / "a", tmp_path / "set", ("ns",), n_permutations=0, n_bootstrap=0)
    assert torch.equal(via_zoo.results["ns"].values, via_set.results["ns"].values)
    via_set_first = comparison.compare(tmp_path / "set", zoos / "a", ("ns",), n_permutations=0, n_bootstrap=0)
    assert via_set_first.arch == "optunet" and via_set_first.n_a == 8


def test_cli_prints_the_table_and_writes_json(zoos, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    argv = ["compare", str(zoos / "a"), str(zoos / "b"), "--symmetries", "raw,ns", "--permutations", "30",
            "--bootstrap", "20", "--json", str(out)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    for needle in ("raw", "ns", "conv1", "conv2", "fc", "all", "95% bootstrap interval (20 resamples)",
                   "permutation p-value (30 re-splits)"):
        assert needle in text, needle
    data = json.loads(out.read_text())
    assert data["n_a"] == data["n_b"] == 8 and data["n_permutations"] == 30 and data["arch"] == "optunet"
    assert [(r["symmetries"], r["layer"]) for r in data["rows"]] == [
        (s, layer) for s in ("raw", "ns") for layer in ("conv1", "conv2", "fc", "all")]
    ref = comparison.compare(zoos / "a", zoos / "b", ("raw", "ns"), n_permutations=30, n_bootstrap=20)
    assert data["rows"] == json.loads(json.dumps(ref.rows()))
    quiet = ["--symmetries", "raw", "--permutations", "0", "--bootstrap", "0", "--json", "-"]
    assert cli.main(argv[:3] + quiet) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["p"] is None


def _set(tmp_path, name, model):
    from symlib.posteriors import SampleSet, io

    state = model.state_dict()
    params = {k: torch.stack([v + 0.01 * i for i in range(3)]) for k, v in state.items()
              if v.is_floating_point()}
    io.save(SampleSet(params, "ensemble", 3, 1), tmp_path / name)
    return tmp_path / name


def test_mismatched_architectures_and_layer_shapes_are_clear_errors(zoos, tmp_path, capsys):
    from symlib import models

    torch.manual_seed(0)
    resnet = _set(tmp_path, "resnet", models.ResNet20(width=4))
    with pytest.raises(ValueError, match="different architectures.*tensors only in A"):
        comparison.compare(zoos / "a", resnet, ("raw",), n_permutations=0, n_bootstrap=0)
    narrow = _set(tmp_path, "narrow", models.OptuNet(num_classes=5))
    with pytest.raises(ValueError, match=r"'fc.bias' has shape \(10,\) in A and \(5,\) in B"):
        comparison.compare(zoos / "a", narrow, ("raw",), n_permutations=0, n_bootstrap=0)
    assert cli.main(["compare", str(zoos / "a"), str(narrow)]) == 2
    assert "one architecture" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown symmetry removal"):
        comparison.compare(zoos / "a", zoos / "b", ("sorted",))
    assert cli.main(["compare", str(zoos / "a"), str(tmp_path / "nothing")]) == 2
    assert "nothing: no such file or folder" in capsys.readouterr().err  # neither a set nor checkpoint files


def test_json_never_overwrites_another_file(zoos, tmp_path, capsys):
    """--json refuses, before comparing anything, a folder and any file that is not an earlier comparison
    (a zoo's manifest, say), and leaves it as it is; an earlier comparison is replaced."""
    import shutil

    z = tmp_path / "z"
    shutil.copytree(zoos / "a", z)
    manifest = (z / "manifest.json").read_bytes()
    base = ["compare", str(zoos / "a"), str(zoos / "b"), "--permutations", "0", "--bootstrap", "0"]
    for path, msg in ((z / "manifest.json", "is not the JSON of an earlier `symlib compare`; --json never "
                       "overwrites another file"), (z, "is a folder; --json takes a file path")):
        assert cli.main([*base, "--json", str(path)]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
        with pytest.raises(zoo.ZooError, match=msg.split(";")[0]):
            comparison.check_json(path)
    assert (z / "manifest.json").read_bytes() == manifest and zoo.load(z)[1]["complete"]
    res = comparison.compare(zoos / "a", zoos / "b", ("raw",), n_permutations=0, n_bootstrap=0)
    comparison.write_json(res, tmp_path / "out" / "cmp.json")
    comparison.write_json(res, tmp_path / "out" / "cmp.json")  # an earlier comparison: replaced
    assert json.loads((tmp_path / "out" / "cmp.json").read_text())["n_a"] == 8


def test_a_one_network_set_and_no_removal_are_named(zoos, tmp_path, capsys):
    one = tmp_path / "one"
    cfg = zoo.preset("mnist-optunet", "tiny")
    zoo.train(dataclasses.replace(cfg, n_models=1, n_train=32, recipe=cfg.recipe.scaled(1)), one,
              progress=False)
    with pytest.raises(ValueError, match=rf"B: {one} holds 1 checkpoint; the unbiased MMD needs at least 2"):
        comparison.compare(zoos / "a", one, ("raw",), n_permutations=0, n_bootstrap=0)
    with pytest.raises(ValueError, match=rf"A: {one} holds 1 checkpoint"):
        comparison.compare(one, zoos / "a", ("raw",), n_permutations=0, n_bootstrap=0)
    with pytest.raises(ValueError, match=r"no symmetry removal given \(an empty --symmetries\); pass"):
        comparison.compare(zoos / "a", zoos / "b", ())
