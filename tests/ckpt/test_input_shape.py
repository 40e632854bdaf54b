"""A wrong input shape is refused when it is given, in one line naming the shape, where it came from and
what the first layer takes; a set that records a wrong shape (written before import checked it) makes
every later command fail in one line, with the tracer's traceback only under --debug."""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_nets import SmallNet, trained

import symlib
from symlib import cli
from symlib.ckpt import convert
from symlib.models import Recipe


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("shape")
    for s in range(3):
        torch.save(trained(s), root / f"seed{s}.pt")
    return root


def test_import_refuses_a_shape_the_network_cannot_run(files, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SYMLIB_DEBUG", raising=False)
    argv = ["import", str(files), "--to", str(tmp_path / "set"), "--model", "ckpt_nets:SmallNet"]
    assert cli.main([*argv, "--input-shape", "3,8,8"]) == 2  # SmallNet reads one channel
    err = capsys.readouterr().err
    assert "does not run on one input of shape 3,8,8 (--input-shape)" in err
    assert "its first layer, conv1, takes 1 channels" in err and "Traceback" not in err
    assert not (tmp_path / "set").exists()
    assert cli.main([*argv, "--input-shape", "1,8,8"]) == 0, capsys.readouterr().err


def test_a_recorded_wrong_shape_is_one_line_and_debug_shows_the_cause(files, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SYMLIB_DEBUG", raising=False)
    params = symlib.load_checkpoints(files, model="ckpt_nets:SmallNet")
    convert.write(params, tmp_path / "a", Recipe.of("ckpt_nets:SmallNet", input_shape=(1, 8, 8)))
    man = json.loads((tmp_path / "a" / "manifest.json").read_text())
    man["architecture"]["input_shape"] = [3, 8, 8]  # as an older import could record it
    (tmp_path / "a" / "manifest.json").write_text(json.dumps(man))
    argv = ["compare", str(tmp_path / "a"), str(files), "--model", "ckpt_nets:SmallNet", "--symmetries", "ns",
            "--permutations", "0", "--bootstrap", "0", "--allow-duplicates"]
    assert cli.main(argv[:3] + argv[5:]) == 2  # the recorded shape, no --model: one line
    err = capsys.readouterr().err
    assert f"shape 3,8,8 (recorded for {tmp_path / 'a'})" in err and err.count("\n") == 2, err
    assert cli.main(["count", str(tmp_path / "a")]) == 2
    assert "shape 3,8,8" in capsys.readouterr().err
    assert cli.main([*argv[:3], *argv[5:], "--input-shape", "1,8,8"]) == 0, capsys.readouterr().err
    with pytest.raises(symlib.errors.CheckpointError) as e:  # --debug: raised, the tracer's error chained
        cli.main(["--debug", *argv[:3], *argv[5:]])
    assert e.value.__cause__ is not None
    assert isinstance(SmallNet(), torch.nn.Module)


def test_a_full_disk_when_compare_writes_its_json_is_one_line(files, tmp_path, capsys, monkeypatch):
    import errno

    from symlib import store

    def full(path, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "atomic_write_bytes", full)
    monkeypatch.delenv("SYMLIB_DEBUG", raising=False)
    argv = ["compare", str(files), str(files), "--model", "ckpt_nets:SmallNet", "--input-shape", "1,8,8",
            "--symmetries", "raw", "--permutations", "0", "--bootstrap", "0", "--allow-duplicates",
            "--json", str(tmp_path / "out.json")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "Traceback" not in err
    assert not (tmp_path / "out.json").exists()
