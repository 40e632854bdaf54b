"""No network is stacked twice silently: a checkpoint named twice (symbolic links resolved), two files that
hold one network (a ``.pt`` and its ``.safetensors`` copy, a Lightning ``last.ckpt``), and two compared sets
that share networks are refused with the list of repeats and the flag that keeps them; symlink loops and
unreadable files are clear errors."""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path

import pytest
import torch
from ckpt_nets import SmallNet, trained
from safetensors.torch import save_file

import symlib
from symlib import cli
from symlib.ckpt import CheckpointError, convert, loader

RAW = dict(symmetries=("raw",), n_permutations=20, n_bootstrap=20)


@pytest.fixture(scope="module")
def nets():
    return [trained(s) for s in range(6)]


def _rows(params, states):
    """Whether the stack holds exactly ``states``, in order."""
    return set(params) == set(states[0]) and all(
        params[k].shape[0] == len(states)
        and all(torch.equal(params[k][i], s[k]) for i, s in enumerate(states))
        for k in params)


def _save(folder: Path, states, first: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, sd in enumerate(states):
        torch.save(sd, folder / f"seed{first + i}.pt")
    return folder


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _error(err: str) -> str:
    """The one error line the command printed (no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("symlib: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_same_file_twice_or_through_a_link(tmp_path, nets):
    _save(tmp_path, nets[:2])
    (tmp_path / "link.pt").symlink_to(tmp_path / "seed0.pt")
    a, b, link = (str(tmp_path / n) for n in ("seed0.pt", "seed1.pt", "link.pt"))
    for given, spelled in (([a, b, a], f"{a}, {a}"), ([a, link, b], f"{link}, {a}")):  # shortest first
        with pytest.raises(CheckpointError, match=rf"the same checkpoint is named more than once: {a} 2 "
                                                  rf"times \(as {spelled}\); .*allow_duplicates=True "
                                                  rf"\(--allow-duplicates on the command line\)"):
            symlib.load_checkpoints(given)
        got = symlib.load_checkpoints(given, allow_duplicates=True)  # kept on request: 3 rows
        assert _rows(got, [nets[0], nets[1], nets[0]] if given[2] == a else [nets[0], nets[0], nets[1]])
    assert _rows(symlib.load_checkpoints([a, b]), nets[:2])


def test_pt_and_safetensors_copies_in_one_folder(tmp_path, nets):
    _save(tmp_path, nets[:3])
    save_file(nets[1], tmp_path / "seed1.safetensors")
    with pytest.raises(CheckpointError, match=r"identical networks in the set: \S*seed1\.safetensors repeats "
                                              r"\S*seed1\.pt \(1 of 4 networks is a copy of another\); .*"
                                              r"--allow-duplicates"):
        symlib.load_checkpoints(tmp_path)
    got = loader.read(tmp_path, allow_duplicates=True)
    assert got.n == 4 and _rows(got.params, [nets[0], nets[1], nets[1], nets[2]])
    assert got.row_digests is None  # nothing hashed when the repeats are kept
    assert len(set(got.digests())) == 3 and got.digests()[1] == got.digests()[2]


def test_a_lightning_last_ckpt_repeats_its_epoch_checkpoint(tmp_path, nets):
    """``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` beside ``epoch=...ckpt``: the same weights,
    other bytes (here another epoch field), so only the content hash finds it."""
    for r in range(3):
        folder = tmp_path / "runs" / f"version_{r}" / "checkpoints"
        folder.mkdir(parents=True)
        for name, epoch in ((f"epoch=2-step={8 + r}.ckpt", 2), ("last.ckpt", 3)):
            torch.save({"epoch": epoch, "global_step": 8 + r, "pytorch-lightning_version": "2.6.6",
                        "state_dict": {f"model.{k}": v for k, v in nets[r].items()},
                        "loops": {"epoch": epoch}, "hyper_parameters": {"lr": 0.1}}, folder / name)
    pattern = str(tmp_path / "runs" / "*" / "checkpoints" / "*.ckpt")
    with pytest.raises(CheckpointError) as e:
        symlib.load_checkpoints(pattern, model=SmallNet())
    msg = str(e.value)
    assert msg.startswith("identical networks in the set: ")
    assert "(3 of 6 networks are copies of another)" in msg
    for r in range(3):
        folder = tmp_path / "runs" / f"version_{r}" / "checkpoints"
        assert f"{folder / 'last.ckpt'} repeats {folder / f'epoch=2-step={8 + r}.ckpt'}" in msg
    assert "last.ckpt beside the epoch=...ckpt" in msg and "--allow-duplicates" in msg
    got = symlib.load_checkpoints(pattern, model=SmallNet(), allow_duplicates=True)
    assert _rows(got, [nets[0], nets[0], nets[1], nets[1], nets[2], nets[2]])  # today's 6 rows, on request
    epochs = str(tmp_path / "runs" / "*" / "checkpoints" / "epoch=*.ckpt")
    assert _rows(symlib.load_checkpoints(epochs, model=SmallNet()), nets[:3])


def test_a_stack_file_with_a_repeated_row(tmp_path, nets):
    torch.save(symlib.params.stack([nets[0], nets[1], nets[0]]), tmp_path / "stack.pt")
    with pytest.raises(CheckpointError, match=r"stack\.pt\[2\] repeats \S*stack\.pt\[0\] \(1 of 3 networks"):
        symlib.load_checkpoints(tmp_path / "stack.pt", model=SmallNet())
    assert _rows(symlib.load_checkpoints(tmp_path / "stack.pt", model=SmallNet(), allow_duplicates=True),
                 [nets[0], nets[1], nets[0]])


def test_a_glob_through_a_symlink_to_its_own_folder(tmp_path, nets):
    _save(tmp_path, nets[:2])
    (tmp_path / "self").symlink_to(".")
    pattern = str(tmp_path / "**" / "*.pt")
    hits = glob.glob(pattern, recursive=True)  # seed0.pt, self/seed0.pt, self/self/seed0.pt, ...
    times = len(hits) // 2
    assert times > 2 and len(hits) == 2 * times
    with pytest.raises(CheckpointError) as e:
        symlib.load_checkpoints(pattern)
    msg = str(e.value)
    for i in range(2):
        real = tmp_path / f"seed{i}.pt"
        assert (f"{real} {times} times (as {real}, {tmp_path / 'self' / f'seed{i}.pt'}, "
                f"{tmp_path / 'self' / 'self' / f'seed{i}.pt'}, and {times - 3} more)") in msg
    got = symlib.load_checkpoints(pattern, allow_duplicates=True)
    assert next(iter(got.values())).shape[0] == 2 * times
    assert _rows(symlib.load_checkpoints(str(tmp_path / "*.pt")), nets[:2])


def test_compare_a_set_with_itself_is_refused_then_warned(tmp_path, nets, capsys):
    z = _save(tmp_path / "z", nets[:5])
    with pytest.raises(CheckpointError, match=rf"cannot compare {z} .* with {z} .*: the sets share 5 "
                                              rf"networks \(both read {z / 'seed0.pt'} and 4 more\); the "
                                              rf"MMD's two-sample test assumes two independent sets.*"
                                              rf"allow_duplicates=True \(--allow-duplicates\)"):
        symlib.compare(z, z, **RAW)
    res = symlib.compare(z, z, **RAW, allow_duplicates=True)
    assert (res.n_a, res.n_b, res.shared) == (5, 5, 5)
    warning = ("warning: the sets overlap (5 shared networks): the two-sample test assumes independent sets, "
               "so the MMD, its intervals and p-values are biased")
    assert res.warning == warning and res.format().splitlines()[2] == warning
    assert res.to_dict()["shared"] == 5 and res.to_dict()["warning"] == warning
    plain = symlib.compare(z, _save(tmp_path / "other", nets[5:] + [trained(6)], 5), **RAW)
    assert plain.shared == 0 and plain.warning is None and "warning" not in plain.format()
    assert plain.to_dict()["warning"] is None and plain.to_dict()["shared"] == 0
    # the command line: one line naming the flag, then the table and the JSON with the warning
    argv = ["compare", z, z, "--symmetries", "raw", "--permutations", "10", "--bootstrap", "0"]
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and out == ""
    assert "the sets share 5 networks" in _error(err) and "--allow-duplicates" in _error(err)
    rc, out, err = _run([*argv, "--allow-duplicates", "--json", tmp_path / "cmp.json"], capsys)
    assert rc == 0 and warning in out.splitlines(), err
    saved = json.loads((tmp_path / "cmp.json").read_text())
    assert saved["shared"] == 5 and saved["warning"] == warning


def test_compare_finds_shared_networks_by_content(tmp_path, nets):
    """Sets that overlap without sharing a path: copies of two files, and a symlib folder imported from the
    files it is compared with."""
    a, b = _save(tmp_path / "a", nets[:4]), _save(tmp_path / "b", nets[2:6], 2)
    with pytest.raises(CheckpointError, match=r"the sets share 2 networks \(the same weights are in both\)"):
        symlib.compare(a, b, **RAW)
    assert symlib.compare(a, b, **RAW, allow_duplicates=True).shared == 2
    convert.import_checkpoints(a, tmp_path / "imported", SmallNet)
    with pytest.raises(CheckpointError, match=r"the sets share 4 networks \(the same weights are in both\)"):
        symlib.compare(tmp_path / "imported", a, **RAW)
    with pytest.raises(CheckpointError, match=rf"share 4 networks \(both read {tmp_path / 'imported'}\)"):
        symlib.compare(tmp_path / "imported", tmp_path / "imported", **RAW)


def test_a_symlib_sample_set_may_repeat_a_state(tmp_path, nets):
    """A posterior sample set may hold one state twice by right (an MCMC chain that rejected a move): its
    rows are read as they are; only sets compared with each other must not share one."""
    from symlib.ckpt import recipe

    chain = symlib.params.stack([nets[0], nets[1], nets[1], nets[2]])
    convert.write(chain, tmp_path / "chain", recipe.Recipe.of(SmallNet), method="mcmc", n_modes=1,
                  n_per_mode=4)
    got = symlib.load_checkpoints(tmp_path / "chain")
    assert _rows(got, [nets[0], nets[1], nets[1], nets[2]])
    other = _save(tmp_path / "other", nets[3:6], 3)
    res = symlib.compare(tmp_path / "chain", other, **RAW)
    assert (res.n_a, res.n_b, res.shared) == (4, 3, 0)
    with pytest.raises(CheckpointError, match=r"the sets share 2 networks"):
        symlib.compare(tmp_path / "chain", _save(tmp_path / "again", nets[1:3], 1), **RAW)


def test_import_refuses_duplicates_and_writes_nothing(tmp_path, nets, capsys):
    src = _save(tmp_path / "src", nets[:3])
    save_file(nets[0], src / "seed0.safetensors")
    out = tmp_path / "out"
    model = ["--model", "ckpt_nets:SmallNet", "--input-shape", "1,8,8"]
    rc, stdout, err = _run(["import", src, "--to", out, *model], capsys)
    line = _error(err)
    assert rc == 2 and stdout == ""
    assert line.startswith("symlib: error: identical networks in the set: ") and "--allow-duplicates" in line
    assert "seed0.safetensors repeats" in err and "(1 of 4 networks is a copy of another)" in err
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    rc, stdout, err = _run(["import", src / "seed1.pt", src / "seed1.pt", "--to", out, *model], capsys)
    assert rc == 2 and "the same checkpoint is named more than once" in err and not out.exists()
    rc, stdout, err = _run(["import", src, "--to", out, *model, "--allow-duplicates"], capsys)
    assert rc == 0 and "4 networks of SmallNet from 4 checkpoints" in stdout, err
    assert _rows(symlib.load(out)[0], [nets[0], nets[0], nets[1], nets[2]])


def test_a_symlink_loop_is_named(tmp_path, nets, capsys):
    _save(tmp_path / "runs", nets[:2])
    (tmp_path / "runs" / "a.pt").symlink_to(tmp_path / "runs" / "b.pt")
    (tmp_path / "runs" / "b.pt").symlink_to(tmp_path / "runs" / "a.pt")
    loop = tmp_path / "runs" / "a.pt"
    for given in (tmp_path / "runs", loop, str(tmp_path / "runs" / "*.pt")):
        with pytest.raises(CheckpointError, match=r"runs/[ab]\.pt: a symbolic link that leads back to "
                                                  r"itself.* \(a symlink loop\); fix or remove the link"):
            symlib.load_checkpoints(given)
    out = tmp_path / "out"
    rc, _, err = _run(["import", tmp_path / "runs", "--to", out, "--model", "ckpt_nets:SmallNet"], capsys)
    assert rc == 2 and "(a symlink loop)" in _error(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_or_folder_is_named(tmp_path, nets):
    runs = _save(tmp_path / "runs", nets[:2])
    locked = runs / "seed1.pt"
    locked.chmod(0)
    try:
        for given in (runs, locked, str(runs / "*.pt")):
            with pytest.raises(CheckpointError, match=rf"{locked}: permission denied, symlib cannot read it.*"
                                                      rf"chmod u\+r"):
                symlib.load_checkpoints(given)
    finally:
        locked.chmod(0o644)
    runs.chmod(0)
    try:
        with pytest.raises(CheckpointError, match=rf"{runs}: permission denied"):
            symlib.load_checkpoints(runs)
    finally:
        runs.chmod(0o755)


def test_the_content_hash(nets):
    """Equal for equal networks, different for one changed bit or another dtype, fast for many networks."""
    stack = symlib.params.stack([nets[0], nets[1], nets[0]])
    h = loader.digests(stack)
    assert len(h) == 3 and h[0] == h[2] != h[1] and all(len(d) == 16 for d in h)
    flipped = {k: v.clone() for k, v in stack.items()}
    flipped["head.bias"].view(torch.int32)[2, 0] ^= 1
    assert loader.digests(flipped)[2] != h[0]
    wide = {k: v.double() if v.is_floating_point() else v for k, v in stack.items()}
    assert loader.digests(wide)[0] != h[0]
    assert loader.digests({k: v for k, v in reversed(stack.items())}) == h  # the names' order does not matter
    many = symlib.params.stack([nets[i % 6] for i in range(1000)])
    start = time.perf_counter()
    hashes = loader.digests(many)
    assert time.perf_counter() - start < 0.5
    assert len(set(hashes)) == 6
