"""Posterior sample sets fanned out with submitit (local executor): the independent trainings as a job array,
the set equal to the one ``symlib posterior sample`` writes in one process; methods without independent
modes refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from symlib import cli, zoo
from symlib.posteriors import fanout, io, sampling
from symlib.posteriors.seeds import base_seeds

submitit = pytest.importorskip("submitit", reason="the fan-out needs submitit (pip install submitit)")


def test_which_trainings_fan_out():
    setup = sampling.setup_for("mnist-optunet", "tiny")
    for method in ("swag", "laplace", "sghmc", "hmc"):  # the base models, exactly the zoo base_models caches
        assert fanout.independent_zoo(method, setup, 3, 5, seed=2) == sampling.base_zoo(setup, 3, 2)
    cfg = fanout.independent_zoo("ensemble", setup, 2, 5, seed=1, n_shards=4)
    assert cfg.seeds == tuple(base_seeds(10, 1)) and cfg.n_chunks >= 4
    assert dataclasses.replace(cfg, seed=0, n_models=8, chunk=2) == zoo.preset("mnist-optunet", "tiny")
    for method in ("vi", "dropout"):
        with pytest.raises(ValueError, match="no per-mode job to fan out"):
            fanout.independent_zoo(method, setup, 2, 5)


@pytest.mark.processes
@pytest.mark.slow
def test_ensemble_fanned_out_equals_the_one_process_set(tmp_path, capsys):
    """`symlib posterior sample --executor local`: 4 members in 2 shards; the set is the one-process set, bit
    for bit, with the same identity hash."""
    argv = ["posterior", "sample", "--method", "ensemble", "--preset", "mnist-optunet", "--scale", "tiny",
            "--modes", "2", "--samples", "4", "--out", str(tmp_path / "fan"),
            "--cache", str(tmp_path / "cache"), "--executor", "local", "--shards", "2", "--poll", "0.5",
            "--no-progress"]
    assert cli.main(argv) == 0
    assert "complete (trainings fanned out on local)" in capsys.readouterr().out
    setup = sampling.setup_for("mnist-optunet", "tiny")
    ref = sampling.run("ensemble", setup, 2, 2, 0, tmp_path / "ref", progress=False)
    got, man = io.load_params(tmp_path / "fan")
    ref_man = io.read_manifest(tmp_path / "ref")
    assert man["set_hash"] == ref_man["set_hash"] and man["hyper"] == ref_man["hyper"]
    assert all(torch.equal(got[k], ref.params[k]) for k in ref.params)
    assert cli.main(["posterior", "status", str(tmp_path / "fan")]) == 0
    assert "2 shards on local: 2 done" in capsys.readouterr().out


@pytest.mark.processes
def test_swag_base_models_come_from_the_fan_out(tmp_path, monkeypatch):
    """The base models are trained by the shard jobs, not where submit runs (training there is patched to
    fail), and the set equals sampling.run's on the same cache."""
    def no_training(*args, **kwargs):
        raise AssertionError("the base models must come from the fan-out")

    monkeypatch.setattr(zoo, "train", no_training)  # this process only; the jobs are other processes
    got = fanout.submit("swag", "mnist-optunet", "tiny", 2, 2, tmp_path / "fan", 4, "local",
                        cache_dir=tmp_path / "cache", poll_s=0.5, progress=False)
    ref = sampling.run("swag", sampling.setup_for("mnist-optunet", "tiny"), 2, 2, 0, tmp_path / "ref",
                       cache_dir=tmp_path / "cache", progress=False)
    assert all(torch.equal(got.params[k], ref.params[k]) for k in ref.params)
    assert io.read_manifest(tmp_path / "fan")["set_hash"] == io.read_manifest(tmp_path / "ref")["set_hash"]
    st = zoo.status(tmp_path / "fan")
    assert st.merged and len(st.shards) == 1  # OptuNet base models are one chunk: one shard
