"""``symlib import``, ``symlib compare`` on checkpoint files, ``symlib canonicalize`` and ``symlib count``:
the imported folder works with every tool, the numbers equal the in-memory path, and every bad input is a
clear error with nothing written."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest
import torch
from ckpt_nets import INPUT_SHAPE, SmallNet, trained

import symlib
from symlib import cli
from symlib.ckpt import convert

NETS = str(Path(__file__).resolve().parents[1] / "ckpt_nets.py")
MODEL = ["--model", f"{NETS}:SmallNet", "--input-shape", "1,8,8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Set A: plain ``.pt`` files; set B: Lightning-style ``.ckpt`` files (prefix ``model.``, optimizer
    state beside the weights)."""
    root = tmp_path_factory.mktemp("runs")
    a, b = [trained(s) for s in range(5)], [trained(s) for s in range(5, 10)]
    (root / "a").mkdir()
    (root / "b").mkdir()
    for i, sd in enumerate(a):
        torch.save(sd, root / "a" / f"seed{i}.pt")
    opt = torch.optim.SGD(SmallNet().parameters(), lr=0.1, momentum=0.9).state_dict()
    for i, sd in enumerate(b):
        torch.save({"epoch": 2, "global_step": 8, "pytorch-lightning_version": "2.6.6",
                    "state_dict": {f"model.{k}": v for k, v in sd.items()}, "optimizer_states": [opt],
                    "hyper_parameters": {"lr": 0.1}}, root / "b" / f"epoch=2-seed{i}.ckpt")
    return root, symlib.params.stack(a), symlib.params.stack(b)


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _same(p, q):
    return set(p) == set(q) and all(torch.equal(p[k], q[k]) for k in p)


def test_import_then_every_tool(runs, tmp_path, capsys):
    root, set_a, set_b = runs
    rc, out, err = _run(["import", root / "a", "--to", tmp_path / "a", *MODEL], capsys)
    assert rc == 0, err
    assert "5 networks of SmallNet from 5 checkpoints" in out
    rc, out, err = _run(["import", str(root / "b" / "*.ckpt"), "--to", tmp_path / "b", *MODEL], capsys)
    assert rc == 0 and "prefix 'model.' removed" in out, err
    params, man = symlib.load(tmp_path / "a")
    assert _same(params, set_a) and _same(symlib.load(tmp_path / "b")[0], set_b)
    src = man["source"]
    assert [f["sha256"] for f in src["files"]] == [hashlib.sha256(Path(f["path"]).read_bytes()).hexdigest()
                                                  for f in src["files"]]
    assert man["architecture"] == {"builder": "factory", "target": f"{NETS}:SmallNet", "args": {},
                                   "input_shape": [1, 8, 8],
                                   "file": {"relative": os.path.relpath(NETS, tmp_path / "a"),
                                            "sha256": hashlib.sha256(Path(NETS).read_bytes()).hexdigest()}}
    assert all(ch["sha256"] == hashlib.sha256((tmp_path / "a" / ch["file"]).read_bytes()).hexdigest()
               for ch in man["chunks"])
    rc, out, err = _run(["zoo", "info", "--check", tmp_path / "a"], capsys)
    assert rc == 0 and out.startswith(f"checkpoints {tmp_path / 'a'}: import") and "5 files" in out, err
    rc, out, err = _run(["zoo", "export", tmp_path / "a", "--to", tmp_path / "ds", "--no-validate"], capsys)
    assert rc == 0, err
    assert _same(symlib.load(tmp_path / "ds")[0], set_a)
    card = (tmp_path / "ds" / "README.md").read_text()
    assert f"5 checkpoints of `{NETS}:SmallNet`" in card and "seed0.pt" in card
    assert f"symlib import 'FILES' --to set --model {NETS}:SmallNet --input-shape 1,8,8" in card
    assert "posterior sample" not in card
    assert _same(symlib.load_checkpoints(tmp_path / "a"), set_a)
    nets = convert.networks(tmp_path / "a")
    loaded, _ = symlib.load(tmp_path / "a", as_="models")  # the user's own class, rebuilt by its recipe
    x = torch.randn(7, *INPUT_SHAPE, dtype=torch.float64)
    assert len(loaded) == len(nets) == 5
    for net, other in zip(nets, loaded, strict=True):
        assert type(other) is type(net) and not other.training
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in net.state_dict().items())
    for i, net in enumerate(nets):  # each network computes what its checkpoint's weights compute
        weights = {k: v[i].double() for k, v in set_a.items()}
        ref = torch.func.functional_call(SmallNet().double().eval(), weights, (x,))
        assert not net.training and torch.allclose(net.double()(x), ref, rtol=1e-12, atol=1e-12)


def test_compare_and_canonicalize_give_the_in_memory_numbers(runs, tmp_path, capsys):
    root, set_a, set_b = runs
    for name in ("a", "b"):
        assert _run(["import", root / name, "--to", tmp_path / name, *MODEL], capsys)[0] == 0
    spec = symlib.spec_of(SmallNet().double(), INPUT_SHAPE)
    want = {sym: symlib.mmd(set_a, set_b, spec=spec, symmetries=sym, n_permutations=50, seed=3)
            for sym in ("raw", "ns")}
    common = ["--symmetries", "raw,ns", "--permutations", "50", "--bootstrap", "0", "--seed", "3"]
    for a, b, extra in ((tmp_path / "a", tmp_path / "b", []),  # imported folders
                        (root / "a", root / "b", MODEL)):  # the checkpoint files themselves
        out_json = tmp_path / f"cmp-{len(extra)}.json"
        rc, out, err = _run(["compare", a, b, *common, "--json", out_json, *extra], capsys)
        assert rc == 0, err
        rows = {r["symmetries"]: r for r in json.loads(out_json.read_text())["rows"] if r["layer"] == "all"}
        for sym, res in want.items():
            assert rows[sym]["mmd"] == pytest.approx(100 * float(res.value()), rel=1e-12, abs=1e-15)
            assert rows[sym]["p"] == pytest.approx(float(res.p_value()), rel=1e-12)
    rc, out, err = _run(["canonicalize", tmp_path / "a", "--to", tmp_path / "canon"], capsys)
    assert rc == 0 and "canonical forms of 5 networks" in out, err
    canon, man = symlib.load(tmp_path / "canon")
    assert _same(canon, symlib.canonicalize(set_a, spec)) and man["method"] == "canonical"
    rc, out, err = _run(["canonicalize", root / "b", "--to", tmp_path / "canon-b", *MODEL], capsys)
    assert rc == 0 and _same(symlib.load(tmp_path / "canon-b")[0], symlib.canonicalize(set_b, spec)), err


def test_count(tmp_path, runs, capsys):
    root = runs[0]
    table = symlib.count(symlib.spec_of(SmallNet().double(), INPUT_SHAPE)).to_string(index=False)
    rc, out, err = _run(["count", *MODEL, "--csv", tmp_path / "count.csv"], capsys)
    assert rc == 0 and table in out and (tmp_path / "count.csv").read_text().startswith("label"), err
    assert _run(["import", root / "a", "--to", tmp_path / "a", *MODEL], capsys)[0] == 0
    rc, out, err = _run(["count", tmp_path / "a"], capsys)
    assert rc == 0 and table in out, err
    rc, out, err = _run(["count"], capsys)
    assert rc == 2 and "needs a network" in err


def _nothing_written(tmp_path: Path, out: Path) -> None:
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


@pytest.mark.parametrize("case", ["architecture", "nan", "pickle", "glob", "unknown", "exists", "factory"])
def test_bad_inputs_are_clear_errors_and_write_nothing(case, runs, tmp_path, capsys):
    root = runs[0]
    src = tmp_path / "src"
    src.mkdir()
    for f in sorted((root / "a").iterdir())[:3]:
        (src / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "out"
    argv = ["import", src, "--to", out, *MODEL]
    if case == "architecture":
        torch.save(trained(7, width=5), src / "seed9.pt")
        match = r"seed9\.pt: tensor 'conv1\.weight' has shape \(5, 1, 3, 3\), but .*SmallNet\(\) has \(4,"
    elif case == "nan":
        bad = trained(7)
        bad["head.weight"][0, 0] = float("inf")
        torch.save(bad, src / "seed9.pt")
        match = r"seed9\.pt: tensor 'head\.weight' holds NaN or infinite weights"
    elif case == "pickle":
        torch.save(SmallNet(), src / "seed9.pt")
        match = r"seed9\.pt: torch\.load\(weights_only=True\) failed.*--trust-pickle"
    elif case == "glob":
        argv = ["import", str(src / "*.pth"), "--to", out, *MODEL]
        match = r"the pattern matches no file"
    elif case == "unknown":
        argv = ["import", src, "--to", out]
        match = r"the architecture of these checkpoints is unknown: pass it \(--model"
    elif case == "exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        match = r"out: already exists; nothing is overwritten"
    else:
        argv = ["import", src, "--to", out, "--model", "no_such_module:Net"]
        match = r"--model 'no_such_module:Net': cannot import it \(ModuleNotFoundError"
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and err.startswith("symlib: error:")
    assert re.search(match, err), err
    if case == "exists":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        _nothing_written(tmp_path, out)
    if case == "pickle":  # trusted on request
        assert _run([*argv, "--trust-pickle"], capsys)[0] == 0 and symlib.load(out)[1]["n_samples"] == 4


@pytest.mark.parametrize("group", ["import", "canonicalize", "count", "compare"])
def test_help(group, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([group, "--help"])
    assert e.value.code == 0 and "--model" in capsys.readouterr().out


def test_the_python_writer_records_a_rebuildable_architecture(runs, tmp_path):
    from symlib.ckpt import convert, recipe

    _, set_a, _ = runs
    man = convert.write(set_a, tmp_path / "set", recipe.Recipe.of(SmallNet, input_shape=INPUT_SHAPE),
                        method="laplace-torch", n_modes=1, n_per_mode=5)
    assert man["architecture"]["target"] == "ckpt_nets:SmallNet"
    assert (man["n_modes"], man["n_per_mode"], man["method"]) == (1, 5, "laplace-torch")
    assert _same(symlib.load(tmp_path / "set")[0], set_a)

    class Local(SmallNet):
        pass

    Local.__module__ = "__main__"  # as in a notebook
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"defined in a notebook or script \(__main__\)"):
        convert.write(set_a, tmp_path / "local", recipe.Recipe.of(Local()))
    with pytest.raises(symlib.ckpt.CheckpointError, match=r"does not rebuild these checkpoints: tensor "
                                                          r"'conv1\.weight' has shape \(4, 1, 3, 3\)"):
        convert.write(set_a, tmp_path / "wide", recipe.Recipe.of("ckpt_nets:SmallNet", {"width": 6}))
    assert not (tmp_path / "local").exists() and not (tmp_path / "wide").exists()
