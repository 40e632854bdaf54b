"""The command line: help texts, errors, and a run killed mid-way and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from symlib import cli, zoo

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["zoo", "--help"],
        ["zoo", "train", "--help"],
        ["zoo", "merge", "--help"],
        ["zoo", "info", "--help"],
    ],
)
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    assert "usage: symlib" in capsys.readouterr().out


def test_bad_arguments_say_what_to_do(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["zoo", "train", "--preset", "mnist-optunet", "--shard", "8/8", "--out", str(tmp_path)])
    assert "0 <= K < N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["zoo", "train", "--preset", "nope", "--out", str(tmp_path)])
    assert cli.main(["zoo", "info", str(tmp_path / "none")]) == 2
    assert "no zoo manifest" in capsys.readouterr().err


def test_user_errors_are_one_line_and_debug_shows_the_traceback(capsys, tmp_path, monkeypatch):
    """A user error prints one line and exits 2; --debug or SYMLIB_DEBUG=1 raises it with its traceback;
    a bug (an error that is not a user error) is never hidden behind a one-line message."""
    monkeypatch.delenv("SYMLIB_DEBUG", raising=False)
    missing = ["zoo", "info", str(tmp_path / "none")]
    assert cli.main(missing) == 2
    err = capsys.readouterr().err
    assert err.startswith("symlib: error: ") and "--debug" in err and "Traceback" not in err
    with pytest.raises(zoo.ZooError, match="no zoo manifest"):
        cli.main(["--debug", *missing])
    monkeypatch.setenv("SYMLIB_DEBUG", "1")
    with pytest.raises(zoo.ZooError):
        cli.main(missing)
    monkeypatch.delenv("SYMLIB_DEBUG")

    def bug(args):
        raise RuntimeError("an index went wrong")

    monkeypatch.setattr(cli._group("zoo"), "run", bug)
    with pytest.raises(RuntimeError, match="an index went wrong"):
        cli.main(missing)
    monkeypatch.setattr(cli._group("zoo"), "run", lambda args: [].pop())
    with pytest.raises(IndexError):
        cli.main(missing)


def test_list_presets(capsys):
    assert cli.main(["zoo", "list-presets"]) == 0
    out = capsys.readouterr().out
    assert "mnist-optunet" in out and "cifar100-resnet18" in out and "1000 models" in out


def _train_cmd(out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "symlib",
        "zoo",
        "train",
        "--preset",
        "mnist-optunet",
        "--scale",
        "tiny",
        "--out",
        str(out),
        "--no-progress",
    ]


@pytest.mark.slow
def test_killed_run_resumes_without_loss_or_duplicates(tmp_path):
    """SIGKILL right after the first file is written; the restarted run finishes the zoo, and it equals an
    uninterrupted run bit for bit, every seed once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    cfg = zoo.preset("mnist-optunet", "tiny")
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(out), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    first = out / "chunk-00000.safetensors"
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    (out / ".chunk-00001.safetensors.abc.tmp").write_bytes(b"half a file")  # as if killed while writing
    done = sorted(p.name for p in out.glob("chunk-*.safetensors"))
    assert 1 <= len(done) < cfg.n_chunks, f"the kill came too late to test resuming: {done}"
    with pytest.raises(zoo.ZooError, match="incomplete"):
        zoo.load(out)

    subprocess.run(_train_cmd(out), env=env, cwd=ROOT, check=True, capture_output=True)
    ref = tmp_path / "ref"
    subprocess.run(_train_cmd(ref), env=env, cwd=ROOT, check=True, capture_output=True)
    a, man = zoo.load(out)
    b, _ = zoo.load(ref)
    assert man["seeds"] == list(cfg.seeds) and len(set(man["seeds"])) == cfg.n_models
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in ref.iterdir()
    )  # no temporaries left
    # info and merge through the CLI
    assert cli.main(["zoo", "info", str(out), "--check"]) == 0
    assert cli.main(["zoo", "merge", str(out), "--out", str(tmp_path / "merged")]) == 0
    merged = load_file(tmp_path / "merged" / "chunk-00003.safetensors")
    assert torch.equal(merged["fc.weight"], load_file(ref / "chunk-00003.safetensors")["fc.weight"])
