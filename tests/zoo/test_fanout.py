"""Fan-out of a zoo with submitit: a tiny zoo as 4 local shards, one killed mid-run and resubmitted, merged
bit for bit into the unsharded zoo; failures reported, not resubmitted; status; SLURM parameters.

The tests marked ``processes`` start real submitit jobs (one Python process per shard) with the local
executor, the code path of ``--executor slurm`` without the cluster. On a loaded 2-core machine a
process needs tens of seconds just to import torch, hence the generous time limits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from symlib import zoo
from symlib.zoo import fanout

submitit = pytest.importorskip("submitit", reason="the fan-out needs submitit (pip install submitit)")

LIMIT_S = 900  # per test: generous, processes start slowly on a loaded machine


def tiny(**kw) -> zoo.ZooConfig:
    """The tiny preset in files of one model: 8 chunks, so each of 4 shards trains 2 chunks."""
    return dataclasses.replace(zoo.preset("mnist-optunet", "tiny"), chunk=1, **kw)


@pytest.fixture(scope="module")
def local_jobs(tmp_path_factory):
    """Skip (with the reason) only if submitit cannot start a local job on this machine."""
    ex = submitit.AutoExecutor(folder=tmp_path_factory.mktemp("probe"), cluster="local")
    ex.update_parameters(timeout_min=10)
    try:
        job = ex.submit(abs, -7)  # a builtin: the job's process cannot import this test module
        assert job.result() == 7
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"submitit cannot start local jobs here: {type(e).__name__}: {e}")


@pytest.mark.processes
@pytest.mark.slow
def test_four_local_shards_one_killed_merge_bit_identical(local_jobs, tmp_path):
    """4 shards of one job array; shard 1 is SIGKILLed after its first chunk; the watcher resubmits it, it
    resumes (its first chunk is kept, not retrained), and the merged zoo equals the unsharded run bit for
    bit."""
    t0 = time.monotonic()
    cfg = tiny()
    out = tmp_path / "zoo"
    fo = fanout.submit(cfg, out, 4, "local", wait=False, keep_shards=True,
                       resources=fanout.Resources(time_min=30, cpus_per_task=1))
    assert sorted(fo.jobs) == [0, 1, 2, 3]
    first = fo.work / "shard-001" / "chunk-00001.safetensors"  # shard 1 trains chunks 1 and 5
    while not first.exists() and time.monotonic() - t0 < LIMIT_S:
        time.sleep(0.01)
    state = json.loads((fo.work / "shard-001.json").read_text())
    os.kill(state["pid"], signal.SIGKILL)
    kept = first.stat().st_mtime_ns
    assert not (fo.work / "shard-001" / "chunk-00005.safetensors").exists(), "the kill came too late"
    assert state["state"] == "running" and state["job_id"] == fo.jobs[1].job_id

    seen = []
    man = fo.wait(poll_s=0.5, timeout_s=LIMIT_S, on_poll=lambda st: seen.append(st.counts()))
    assert any(c["failed"] or c["pending"] for c in seen) or fo.status().shards[1]["attempts"] == 2
    st = fanout.status(out)  # from the files alone, as `symlib zoo status` sees it
    assert st.merged and st.complete and st.counts()["done"] == 4
    assert [s["attempts"] for s in st.shards] == [1, 2, 1, 1]
    assert first.stat().st_mtime_ns == kept  # resumed from its last chunk, not retrained
    assert "4 done" in st.format() and "merged" in st.format()

    ref = tmp_path / "ref"
    zoo.train(cfg, ref, progress=False)
    a, _ = zoo.load(out)
    b, ref_man = zoo.load(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert man["seeds"] == ref_man["seeds"] == list(cfg.seeds) and man["complete"]
    # running it again finds the merged zoo: nothing is submitted
    again = fanout.submit(cfg, out, 4, "local")
    assert again.jobs == {} and again.manifest["complete"]
    print(f"\nfan-out test: {time.monotonic() - t0:.1f} s")


@pytest.mark.processes
def test_a_shard_that_raises_is_reported_not_resubmitted(local_jobs, tmp_path, monkeypatch):
    """Shards whose job raises (here: the dataset is missing) fail fast with their error and log, are not
    resubmitted, and nothing is merged."""
    monkeypatch.setenv("SYMLIB_DATA", str(tmp_path / "no-data"))  # inherited by the jobs
    cfg = tiny(source="torchvision", n_models=2)
    out = tmp_path / "zoo"
    with pytest.raises(zoo.ZooError, match=r"2 of 2 shards failed.*shard 0: FileNotFoundError.*mnist.*log"):
        fanout.submit(cfg, out, 2, "local", poll_s=0.5, timeout_s=LIMIT_S)
    st = fanout.status(out)
    assert [s["state"] for s in st.shards] == ["failed", "failed"]
    assert [s["attempts"] for s in st.shards] == [1, 1] and not st.merged
    assert "FileNotFoundError" in st.shards[0]["note"] and not (out / "manifest.json").exists()


def test_status_from_the_files(tmp_path):
    """Done, running, killed (its pid gone), pending (resubmitted, not started) and failed shards, read from
    the plan, the shard folders and the state files only."""
    cfg = tiny(n_models=5)
    work = tmp_path / "zoo" / "fanout"
    work.mkdir(parents=True)
    plan = {
        "format": fanout.PLAN_FORMAT, "config": cfg.to_dict(), "config_hash": cfg.hash, "n_shards": 5,
        "out": str(tmp_path / "zoo"), "executor": "local", "merged": False,
        "shards": [{"shard": k, "jobs": [str(100 + k)]} for k in range(5)],
    }
    plan["shards"][3]["jobs"].append("200")
    (work / "plan.json").write_text(json.dumps(plan))
    zoo.train(cfg, work / "shard-000", shard=(0, 5), progress=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = __import__("socket").gethostname()
    states = {
        1: {"state": "running", "pid": os.getpid(), "host": host, "job_id": "101"},
        2: {"state": "running", "pid": dead.pid, "host": host, "job_id": "102"},
        3: {"state": "failed", "error": "KeyboardInterrupt: ", "job_id": "103"},
        4: {"state": "failed", "error": "FloatingPointError: loss is nan", "job_id": "104"},
    }
    for k, s in states.items():
        (work / f"shard-{k:03d}.json").write_text(json.dumps(s))
    st = fanout.status(tmp_path / "zoo")
    got = [(s["state"], s["chunks"], s["of"], s["attempts"]) for s in st.shards]
    assert got == [("done", 1, 1, 1), ("running", 0, 1, 1), ("failed", 0, 1, 1), ("pending", 0, 1, 2),
                   ("failed", 0, 1, 1)]
    assert "pid" in st.shards[1]["note"] and "gone" in st.shards[2]["note"]
    assert "FloatingPointError" in st.shards[4]["note"]
    assert st.counts() == {"done": 1, "running": 1, "pending": 1, "failed": 2, "not started": 0}
    assert fanout.status(work).shards == st.shards  # the work folder itself works too
    with pytest.raises(zoo.ZooError, match="no fan-out here"):
        fanout.status(tmp_path / "elsewhere")


def test_bad_requests_are_refused_before_any_job(tmp_path):
    cfg = tiny()
    with pytest.raises(ValueError, match="at most 8 shards"):
        fanout.submit(cfg, tmp_path / "a", 9, "local")
    with pytest.raises(ValueError, match="unknown executor"):
        fanout.submit(cfg, tmp_path / "a", 2, "kubernetes")
    other = tmp_path / "other"
    zoo.train(dataclasses.replace(cfg, n_models=1), other, progress=False)
    with pytest.raises(zoo.ZooError, match="another checkpoint set"):
        fanout.submit(cfg, other, 2, "local")
    work = tmp_path / "b" / "fanout"
    work.mkdir(parents=True)
    (work / "plan.json").write_text(json.dumps({"format": fanout.PLAN_FORMAT, "config_hash": "abc",
                                                 "n_shards": 2}))
    with pytest.raises(zoo.ZooError, match="another zoo or shard count"):
        fanout.submit(cfg, tmp_path / "b", 2, "local")
    assert not (tmp_path / "a").exists() and not list((tmp_path / "b").glob("fanout/shard-*"))


def test_shard_job_holds_a_lock_and_checkpoints_itself(tmp_path):
    """Two jobs never train one shard; at a time limit or preemption the job resubmits itself."""
    import fcntl

    job = fanout.ShardJob(tiny().to_dict(), str(tmp_path), 1, 4)
    with open(tmp_path / "shard-001.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(zoo.ZooError, match="another job is training this shard"):
            job()
    assert not (tmp_path / "shard-001").exists()
    again = job.checkpoint()
    assert isinstance(again, submitit.helpers.DelayedSubmission) and again.function is job


def test_slurm_parameters_reach_the_sbatch_script(tmp_path, monkeypatch):
    """Partition, time, GPUs, CPUs, memory, array parallelism and setup lines as submitit writes them into
    the job array's sbatch script (a fake ``srun`` lets submitit's SLURM executor be built here)."""
    res = fanout.Resources(time_min=90, partition="gpu", gpus_per_task=1, cpus_per_task=8, mem_gb=32,
                           array_parallelism=4, setup=("source .venv/bin/activate",),
                           slurm_args=(("qos", "preemptible"),))
    params = fanout.executor_parameters("slurm", res)
    assert params["slurm_array_parallelism"] == 4 and params["timeout_min"] == 90
    local = fanout.executor_parameters("local", res)
    assert "slurm_partition" not in local and local["timeout_min"] == 90
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 0\n")
    (fake / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    ex = submitit.AutoExecutor(folder=tmp_path / "logs", cluster="slurm")
    ex.update_parameters(**params)
    text = ex._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")
    for line in ("--partition=gpu", "--time=90", "--gpus-per-node=1", "--cpus-per-task=8", "--mem=32GB",
                 "--qos=preemptible", "--signal=USR2", "source .venv/bin/activate"):
        assert line in text, line
    assert ex._executor.parameters["array_parallelism"] == 4


def _no_executor(monkeypatch):
    """Make building submitit's executor fail the test: refusals of --out must come first."""
    import symlib.zoo.fanout as package

    def boom(*a, **k):
        raise AssertionError("built the executor before refusing --out")

    monkeypatch.setattr(package, "make_executor", boom)


@pytest.mark.parametrize("case", ["file", "under-file", "read-only", "foreign-chunks", "sample-set"])
def test_out_is_checked_before_any_work(case, tmp_path, monkeypatch, capsys):
    """--executor checks --out as the plain path does: a file, a path under a file, a read-only folder,
    chunks of another zoo, a sample set are refused before anything is written or submitted."""
    import scenarios

    from symlib import cli
    from symlib.posteriors import SampleSet, io

    if case == "file":
        (tmp_path / "f").write_text("a file")
        out, msg = tmp_path / "f", r"is a file, not a folder; choose another --out"
    elif case == "under-file":
        (tmp_path / "f").write_text("a file")
        out, msg = tmp_path / "f" / "zoo", r"lies under .*f, which is a file, not a folder; choose another"
    elif case == "read-only":
        ro = scenarios.readonly_folder(tmp_path)
        if ro is None:
            pytest.skip("no read-only folder on this machine")
        out, msg = ro / "zoo", r"is not writable .*choose a writable --out"
    elif case == "foreign-chunks":
        out = tmp_path / "zoo"
        zoo.train(tiny(n_models=1, seed=50), out, progress=False)
        (out / "manifest.json").unlink()  # what the folder holds is told by its chunks
        msg = r"chunk-00000.safetensors: belongs to another zoo .*do not mix sets"
    else:
        out = tmp_path / "set"
        io.save(SampleSet({"w": torch.ones(4, 2)}, "swag", 2, 2), out)
        msg = r"holds a posterior sample set, not a zoo; choose another --out"
    before = scenarios.snapshot(tmp_path)
    _no_executor(monkeypatch)
    with pytest.raises(zoo.ZooError, match=msg):
        fanout.submit(tiny(), out, 2, "local")
    argv = ["zoo", "train", "--preset", "mnist-optunet", "--scale", "tiny", "--out", str(out), "--executor",
            "local", "--no-progress"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("symlib: error: ") and "Traceback" not in err and re.search(msg, err), err
    assert scenarios.snapshot(tmp_path) == before and not (out / "fanout").exists()


def test_slurm_without_slurm_writes_nothing(tmp_path, monkeypatch):
    """Where SLURM cannot be reached, the fan-out says so and leaves no plan behind."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no srun, no sbatch
    with pytest.raises(zoo.ZooError, match=r"--executor slurm: submitit cannot reach SLURM .*use --executor "
                       r"local; nothing was written"):
        fanout.submit(tiny(), tmp_path / "zoo", 2, "slurm")
    assert not (tmp_path / "zoo").exists()


def test_retries_and_poll_are_checked(tmp_path, capsys):
    from symlib import cli

    for kw, msg in (({"max_retries": -1}, "max_retries"), ({"poll_s": 0}, "poll_s must be a positive"),
                    ({"timeout_s": float("nan")}, "timeout_s")):
        with pytest.raises(ValueError, match=msg):
            fanout.submit(tiny(), tmp_path / "zoo", 2, "local", **kw)
    base = ["zoo", "train", "--preset", "mnist-optunet", "--scale", "tiny", "--out", str(tmp_path / "zoo"),
            "--executor", "local"]
    for opt, value, msg in (("--max-retries", "-1", "takes an integer >= 0"),
                            ("--poll", "0", "takes a positive"), ("--time", "0", "takes an integer >= 1")):
        with pytest.raises(SystemExit) as e:
            cli.main([*base, opt, value])
        assert e.value.code == 2 and f"argument {opt}: {msg}" in capsys.readouterr().err
    assert not (tmp_path / "zoo").exists()
