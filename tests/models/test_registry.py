"""The registry of networks and the recipe every manifest records: a network registered here, in the
test, works through ``zoo train``, ``symlib import``, ``symlib compare``, ``symlib.load(as_="models")`` and
``symlib count`` with no other edit; every manifest symlib writes carries a recipe its reader accepts; old
manifests without one still read through the adapter."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symlib
from symlib import cli, models, store, zoo
from symlib.ckpt import convert
from symlib.errors import CheckpointError
from symlib.posteriors import SampleSet, io


class TinyNet(nn.Module):
    """A convolution, ReLU, global average pool and a linear head: a network symlib has never seen."""

    def __init__(self, num_classes: int = 10, width: int = 3, in_channels: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, width, 3, padding=1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc(F.relu(self.conv(x)).mean((2, 3)))


def _args(shapes):
    return {"num_classes": int(shapes["fc.weight"][0]), "width": int(shapes["conv.weight"][0]),
            "in_channels": int(shapes["conv.weight"][1])}


@pytest.fixture(scope="module")
def tinynet():
    """``"tinynet"`` in the registry for this module's tests (one ``register`` call, nothing else)."""
    net = models.register("tinynet", TinyNet, _args, lambda a: (a.get("in_channels", 1), 12, 12))
    yield net
    models.unregister("tinynet")


def _config(seed=0, n_models=4):
    return zoo.ZooConfig("tinynet-synthetic", "tiny", "tinynet", "mnist", "synthetic",
                         symlib.training.OPTUNET_MNIST.scaled(1), n_models=n_models, seed=seed, n_train=64,
                         n_test=32, chunk=2, width=3, num_classes=4, image_size=12, channels=1)


@pytest.fixture(scope="module")
def trained(tinynet, tmp_path_factory):
    """Two zoos of TinyNets (seeds 0-3 and 10-13), trained by symlib.zoo.train."""
    root = tmp_path_factory.mktemp("tiny")
    for name, seed in (("a", 0), ("b", 10)):
        zoo.train(_config(seed), root / name, progress=False)
    return root


def _same_networks(nets, params):
    assert len(nets) == next(iter(params.values())).shape[0]
    for i, net in enumerate(nets):
        assert isinstance(net, TinyNet) and not net.training
        assert all(torch.equal(v, params[k][i]) for k, v in net.state_dict().items())


def test_a_registered_network_through_every_tool(trained, tmp_path, capsys):
    root = trained
    params_a, man = symlib.load(root / "a")
    assert man["architecture"] == {"builder": "symlib", "target": "tinynet",
                                   "args": {"num_classes": 4, "width": 3, "in_channels": 1},
                                   "input_shape": [1, 12, 12]}
    nets, _ = symlib.load(root / "a", as_="models")  # the zoo's networks, rebuilt from the registry
    _same_networks(nets, params_a)
    # checkpoint files of one's own training loop, named by the registry's key
    files = tmp_path / "files"
    files.mkdir()
    params_b, _ = symlib.load(root / "b")
    for i in range(4):
        torch.save({k: v[i].clone() for k, v in params_b.items()}, files / f"net{i}.pt")
    assert cli.main(["import", str(files), "--to", str(tmp_path / "imported"), "--model", "tinynet",
                     "--model-args", '{"num_classes": 4, "width": 3}']) == 0, capsys.readouterr().err
    imported, _ = symlib.load(tmp_path / "imported", as_="models")
    _same_networks(imported, params_b)
    # compare: the zoo against the imported files, equal to the in-memory MMD on the traced spec
    out = tmp_path / "cmp.json"
    assert cli.main(["compare", str(root / "a"), str(tmp_path / "imported"), "--symmetries", "raw,ns",
                     "--permutations", "20", "--bootstrap", "0", "--seed", "1", "--json", str(out)]) == 0
    rows = {(r["symmetries"], r["layer"]): r["mmd"] for r in json.loads(out.read_text())["rows"]}
    spec = symlib.spec_of(TinyNet(4, 3).double(), (1, 12, 12))
    for sym in ("raw", "ns"):
        want = symlib.mmd(params_a, params_b, spec=spec, symmetries=sym, n_permutations=20, seed=1)
        assert rows[(sym, "all")] == pytest.approx(100 * float(want.value()), rel=1e-9)
    # count: by name and by folder, the same table as symlib.count on the traced spec
    capsys.readouterr()
    assert cli.main(["count", "--model", "tinynet", "--model-args", '{"num_classes": 4, "width": 3}']) == 0
    by_name = capsys.readouterr().out
    assert cli.main(["count", str(root / "a")]) == 0
    by_folder = capsys.readouterr().out
    assert "input shape (1, 12, 12)" in by_name and by_name.splitlines()[1:] == by_folder.splitlines()[1:]
    table = symlib.count(spec)  # one label of 3 channels: 3! permutations, 3 scaling degrees of freedom
    assert list(table["label"]) == ["conv", "total"] and list(table["permutations"]) == [6, 6]
    assert "conv" in by_name.splitlines()[2] and by_name.splitlines()[2].split()[-3] == "6"


def test_every_manifest_carries_a_recipe_its_reader_accepts(trained, tmp_path):
    """Zoo, sample set, imported set, canonical set, exported dataset: each manifest's ``"architecture"``
    is read by symlib.store.architecture and rebuilds networks that hold the folder's weights."""
    root = trained
    params, _ = symlib.load(root / "a")
    folders = {"zoo": root / "a"}
    folders["imported"] = tmp_path / "imported"
    convert.write(params, folders["imported"], models.Recipe.of("tinynet", {"num_classes": 4, "width": 3}))
    folders["canonical"] = tmp_path / "canonical"
    convert.canonical(root / "a", folders["canonical"])
    folders["export"] = tmp_path / "export"
    zoo.export(root / "a", folders["export"], validate=False)
    plain = tmp_path / "samples"  # a sample set of an architecture outside the registry records none
    io.save(SampleSet(params, "swag", 2, 2), plain)
    plain_man = store.read_manifest(plain)
    assert plain_man["architecture"] is None and store.architecture(plain_man) is None
    optunet = {k: torch.stack([v, v + 1]) for k, v in models.OptuNet().state_dict().items()}
    folders["sample set"] = tmp_path / "samples-optunet"
    io.save(SampleSet(optunet, "swag", 1, 2), folders["sample set"], setup=_setup())
    for kind, folder in folders.items():
        man = store.read_manifest(folder)
        assert isinstance(man.get("architecture"), dict), kind
        recipe = store.architecture(man, str(folder))
        assert recipe is not None and recipe.input_shape is not None, kind
        got, _ = symlib.load(folder)
        nets, _ = symlib.load(folder, as_="models")
        for i, net in enumerate(nets):
            assert all(torch.equal(v, got[k][i]) for k, v in net.state_dict().items()), kind


def _setup():
    from symlib.posteriors import sampling

    return sampling.setup_for("mnist-optunet", "tiny")


def test_old_manifests_read_through_the_adapter(trained):
    """A zoo manifest and a sample-set manifest written before manifests recorded a recipe."""
    man = store.read_manifest(trained / "a")
    old = {k: v for k, v in man.items() if k != "architecture"}
    assert store.adapt(old) == store.architecture(man) == _config().architecture
    sample = {"kind": "posterior", "arch": "resnet20",
              "model": {"class": "ResNet20", "kwargs": {"num_classes": 10, "width": 4, "in_channels": 3}}}
    recipe = store.architecture(sample)
    assert (recipe.builder, recipe.target, recipe.input_shape) == ("symlib", "resnet20", (3, 32, 32))
    assert isinstance(recipe.build(), models.ResNet20)
    assert store.architecture({"kind": "posterior", "model": {"class": None}}) is None
    with pytest.raises(store.StoreError, match="registry does not hold"):
        store.architecture({"kind": "posterior", "model": {"class": "NoSuchNet", "kwargs": {}}}, "here")


def test_registry_errors_name_the_fix(tinynet):
    with pytest.raises(CheckpointError, match=r"unknown network 'nope'.*'tinynet'.*symlib.models.register"):
        models.network("nope")
    with pytest.raises(ValueError, match="already registered"):
        models.register("tinynet", models.OptuNet, _args, (1, 28, 28))
    assert models.register("tinynet", TinyNet, _args, (1, 12, 12)).factory is TinyNet  # same factory: fine
    with pytest.raises(ValueError, match="unknown arch 'nope'"):
        dataclasses.replace(_config(), arch="nope")
