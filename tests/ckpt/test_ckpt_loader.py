"""symlib.load_checkpoints on torch.save and safetensors files: every layout a training loop writes, read
equal to what was saved; every bad input a clear error naming the file."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ckpt_nets import INPUT_SHAPE, SmallNet, Tied, trained
from safetensors.torch import save_file, save_model

import symlib
from symlib.ckpt import CheckpointError, lazy, loader, state, torchfile


def _equal(params, states):
    assert set(params) == set(states[0])
    for k in params:
        assert params[k].shape == (len(states), *states[0][k].shape), k
        for i, s in enumerate(states):
            assert torch.equal(params[k][i], s[k]), (k, i)


@pytest.fixture(scope="module")
def states():
    return [trained(seed) for seed in range(5)]


def test_plain_state_dicts_load_in_natural_order(tmp_path, states):
    # seed10 after seed2: natural order, not the strings' order
    names = ["seed0.pt", "seed1.pth", "seed2.pt", "seed10.pt", "seed3.pt"]
    order = [0, 1, 2, 4, 3]
    for name, i in zip(names, range(5), strict=True):
        torch.save(states[i], tmp_path / name)
    want = [states[i] for i in order]
    _equal(symlib.load_checkpoints(tmp_path), want)
    _equal(symlib.load_checkpoints(str(tmp_path / "seed*")), want)
    _equal(symlib.load_checkpoints([tmp_path / "seed3.pt", tmp_path / "seed0.pt"]), [states[4], states[0]])
    _equal(symlib.load_checkpoints(tmp_path, model=SmallNet()), want)
    _equal(symlib.load_checkpoints(tmp_path, model="ckpt_nets:SmallNet"), want)


def test_same_layout_files_differ_only_in_their_weights(tmp_path):
    """Files of one layout share a parsed directory and pickle: the values must still be each file's."""
    nets = [SmallNet().state_dict() for _ in range(30)]
    for i, sd in enumerate(nets):
        torch.save(sd, tmp_path / f"n{i:03d}.pt")  # equal-length names: identical archive layouts
    got = loader.read(tmp_path)
    _equal(got.params, nets)
    assert got.counts == [1] * 30 and got.prefix == "" and got.key == ""


def test_training_loop_dicts_wrappers_and_stacks(tmp_path, states):
    net = SmallNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, *INPUT_SHAPE)).sum().backward()
    opt.step()  # momentum buffers: tensors beside the weights
    for i, sd in enumerate(states[:3]):
        torch.save({"epoch": 3, "model_state_dict": sd, "optimizer_state_dict": opt.state_dict()},
                   tmp_path / f"loop{i}.pt")
    got = loader.read(sorted(tmp_path.glob("loop*.pt")))
    _equal(got.params, states[:3])
    assert got.key == "model_state_dict"
    # DataParallel / DDP and torch.compile prefixes
    dp = tmp_path / "dp"
    dp.mkdir()
    for i, sd in enumerate(states[:2]):
        torch.save({f"module.{k}": v for k, v in sd.items()}, dp / f"{i}.pt")
    got = loader.read(dp)
    assert got.prefix == "module."
    _equal(got.params, states[:2])
    compiled = torch.compile(SmallNet())
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    torch.save(compiled.state_dict(), tmp_path / "compiled.pt")
    assert loader.read(tmp_path / "compiled.pt", model=SmallNet()).prefix == "_orig_mod."
    # a file holding a stack of networks (samples saved at once), found with the architecture
    stack = symlib.params.stack(states[:4])
    torch.save(stack, tmp_path / "stack.pt")
    got = loader.read(tmp_path / "stack.pt", model=SmallNet())
    assert got.counts == [4]
    _equal(got.params, states[:4])


def test_non_contiguous_and_other_dtypes_and_the_legacy_format(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    sd = {"t": base.t(), "s": base[:, 1], "h": torch.randn(3, 2).half(), "b": torch.randn(2).bfloat16(),
          "i": torch.tensor(7), "m": torch.tensor([True, False])}
    torch.save(sd, tmp_path / "a.pt")
    torch.save(sd, tmp_path / "b.pt", _use_new_zipfile_serialization=False)  # read by torch.load
    # one network in two formats: identical, so kept only on request (tests/ckpt/test_duplicates.py)
    got = symlib.load_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"], allow_duplicates=True)
    for k, v in sd.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k][0], v) and torch.equal(got[k][1], v), k


def test_safetensors_files_and_tied_weights(tmp_path, states):
    for i, sd in enumerate(states[:3]):
        save_file(sd, tmp_path / f"s{i}.safetensors", metadata={"epoch": "3"})
    _equal(symlib.load_checkpoints(tmp_path), states[:3])
    torch.manual_seed(0)
    tied = [Tied() for _ in range(2)]
    for i, m in enumerate(tied):
        save_model(m, tmp_path / f"tied{i}.safetensors")  # keeps one name of the tied pair
    got = symlib.load_checkpoints(sorted(tmp_path.glob("tied*")), model=Tied())
    assert set(got) == {"enc.weight", "dec.weight"}
    for i, m in enumerate(tied):
        assert torch.equal(got["enc.weight"][i], m.enc.weight)
        assert torch.equal(got["dec.weight"][i], m.enc.weight)


def test_the_parallel_copy_equals_the_sequential_one(tmp_path, states, monkeypatch):
    for i, sd in enumerate(states):
        torch.save(sd, tmp_path / f"{i}.pt")
    monkeypatch.setattr(loader, "PARALLEL_ABOVE", 0)  # threads for any size
    monkeypatch.setattr(loader, "MAX_WORKERS", 3)
    monkeypatch.setattr(lazy, "MMAP_ABOVE", 0)  # and memory-mapped files
    _equal(symlib.load_checkpoints(tmp_path), states)


def test_a_pickle_that_needs_code_is_refused_unless_trusted(tmp_path):
    torch.save(SmallNet(), tmp_path / "whole.pt")  # a pickled module: unpickling imports and runs code
    with pytest.raises(CheckpointError, match=r"weights_only=True\) failed.*needs code.*trust_pickle=True.*"
                                              r"--trust-pickle"):
        symlib.load_checkpoints(tmp_path / "whole.pt")
    got = symlib.load_checkpoints(tmp_path / "whole.pt", trust_pickle=True)
    assert set(got) == set(SmallNet().state_dict())
    # the weights-only reader names nothing outside its list: an unknown global stops it before any call
    payload = b"\x80\x02cos\nsystem\nq\x00X\x04\x00\x00\x00trueq\x01\x85q\x02Rq\x03."
    with pytest.raises(torchfile._NeedsMore, match="os.system"):
        torchfile.unpickle(payload)


def test_different_architectures_and_shapes_name_the_tensor_and_the_file(tmp_path, states):
    torch.save(states[0], tmp_path / "a.pt")
    torch.save(trained(1, width=5), tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match=r"b\.pt: tensor 'conv1\.weight' has shape \(5, 1, 3, 3\), but "
                                              r"\(4, 1, 3, 3\) in .*a\.pt"):
        symlib.load_checkpoints(tmp_path)
    torch.save({k: v for k, v in states[1].items() if k != "head.bias"}, tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match=r"b\.pt: another architecture than .*a\.pt: tensor "
                                              r"'head\.bias'"):
        symlib.load_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match=r"b\.pt: the tensors of SmallNet .* are not all in"):
        symlib.load_checkpoints(tmp_path, model=SmallNet())
    with pytest.raises(CheckpointError, match=r"a\.pt: tensor 'conv1\.weight' has shape \(4, 1, 3, 3\), but "
                                              r"SmallNet has \(5, 1, 3, 3\)"):
        symlib.load_checkpoints(tmp_path / "a.pt", model=SmallNet(width=5))


def test_missing_and_ambiguous_prefixes_list_the_candidates(tmp_path, states):
    sd = states[0]
    both = {**{f"student.{k}": v for k, v in sd.items()}, **{f"teacher.{k}": v for k, v in sd.items()}}
    torch.save({"state_dict": both, "epoch": 1, "pytorch-lightning_version": "2.6.6"}, tmp_path / "kd.ckpt")
    with pytest.raises(CheckpointError, match=r"under several prefixes: \['student\.', 'teacher\.'\]; choose "
                                              r"one with prefix="):
        symlib.load_checkpoints(tmp_path / "kd.ckpt", model=SmallNet())
    _equal(symlib.load_checkpoints(tmp_path / "kd.ckpt", model=SmallNet(), prefix="teacher."), [sd])
    with pytest.raises(CheckpointError, match=r"no tensor of its state dict 'state_dict' starts with prefix "
                                              r"'model\.'; its names start with: 'student\.' \(10 tensors\), "
                                              r"'teacher\.' \(10 tensors\)"):
        symlib.load_checkpoints(tmp_path / "kd.ckpt", prefix="model.")
    torch.save({"model": sd, "ema": sd}, tmp_path / "two.pt")
    with pytest.raises(CheckpointError, match=r"holds several state dicts: 'model' \(10 tensors\); 'ema' "
                                              r"\(10 tensors\); choose one with key="):
        symlib.load_checkpoints(tmp_path / "two.pt")
    _equal(symlib.load_checkpoints(tmp_path / "two.pt", key="ema"), [sd])
    with pytest.raises(CheckpointError, match=r"several state dicts hold the tensors of SmallNet: 'model', "
                                              r"'ema'"):
        symlib.load_checkpoints(tmp_path / "two.pt", model=SmallNet())
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "none.pt")
    with pytest.raises(CheckpointError, match=r"none\.pt: holds no state dict .* \['epoch', 'lr'\]"):
        symlib.load_checkpoints(tmp_path / "none.pt")


def test_non_finite_weights_name_the_file(tmp_path, states):
    torch.save(states[0], tmp_path / "ok.pt")
    bad = dict(states[1])
    bad["conv2.bias"] = bad["conv2.bias"].clone()
    bad["conv2.bias"][0] = float("nan")
    torch.save(bad, tmp_path / "diverged.pt")
    with pytest.raises(CheckpointError, match=r"diverged\.pt: tensor 'conv2\.bias' holds NaN or infinite "
                                              r"weights"):
        symlib.load_checkpoints(tmp_path)


def test_empty_globs_missing_paths_and_damaged_files(tmp_path):
    with pytest.raises(CheckpointError, match=r"runs/\*\.pt: the pattern matches no file"):
        symlib.load_checkpoints(str(tmp_path / "runs" / "*.pt"))
    with pytest.raises(CheckpointError, match="no such file or folder"):
        symlib.load_checkpoints(tmp_path / "nope.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: no checkpoint files in this folder"):
        symlib.load_checkpoints(tmp_path / "empty")
    save_file({"w": torch.randn(4, 4)}, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=r"t\.safetensors: not a valid safetensors file .*truncated"):
        symlib.load_checkpoints(tmp_path / "t.safetensors")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"junk\.pt: (not a file torch\.load can read|.*failed)"):
        symlib.load_checkpoints(tmp_path / "junk.pt")


def test_selection_records_where_the_weights_were(tmp_path, states):
    ckpt = {"state_dict": {f"model.{k}": v for k, v in states[0].items()}, "epoch": 2,
            "pytorch-lightning_version": "2.6.6", "optimizer_states": [{"state": {}}]}
    torch.save(ckpt, tmp_path / "x.ckpt")
    parsed = torchfile.read(lazy.open_bytes(tmp_path / "x.ckpt"))
    sel = state.select(parsed)
    assert (sel.key, sel.prefix, parsed.kind) == ("state_dict", "model.", "lightning")
    ref = state.Reference.of(SmallNet())
    assert dataclasses.replace(state.select(parsed, ref), names={}) == dataclasses.replace(sel, names={})
