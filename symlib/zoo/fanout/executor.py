r"""The executor's side of a fan-out: submitit's executor, the job each array task runs
(:class:`ShardJob`), and whether a job submitted earlier still runs (book: "Checkpoint zoos").

* ``executor="slurm"``: a SLURM job array (``sbatch --array``); a shard that reaches its time limit or is
  preempted is checkpointed and requeued by submitit itself (:meth:`ShardJob.checkpoint`).
* ``executor="local"``: the same code path with submitit's local executor, processes on this machine
  (what the tests use).
"""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path
from typing import Any

from symlib.store import alive
from symlib.zoo.chunks import ZooError
from symlib.zoo.config import ZooConfig
from symlib.zoo.fanout.plan import Resources, executor_parameters, now, read_json, shard_name, write_json

__all__ = ["PidJob", "ShardJob", "alive", "attached", "job_id", "make_executor"]


def make_executor(executor: str, folder: Path, res: Resources, name: str):
    """A ``submitit.AutoExecutor`` for ``executor`` (``"local"`` or ``"slurm"``) with the parameters of
    ``res``, its pickles and logs in ``folder`` (not created here: submitit creates it when it submits).

    Raises:
        ImportError: submitit is not installed.
        ZooError: ``executor="slurm"`` where SLURM is not reachable (no ``srun``), naming the fixes.
    """
    try:
        import submitit
    except ImportError:
        raise ImportError(
            "fanning a zoo out needs submitit (pip install submitit, or symlib's `zoo` extra: pip install "
            "'symlib[zoo]'); without it, train shards by hand with `symlib zoo train --shard K/N`"
        ) from None
    try:
        ex = submitit.AutoExecutor(folder=folder, cluster=executor)
    except RuntimeError as e:  # submitit's "Could not detect srun"
        raise ZooError(
            f"--executor {executor}: submitit cannot reach SLURM from this machine ({e}); run the command on "
            f"a node of the cluster (where srun and sbatch are), or use --executor local; nothing was written"
        ) from None
    ex.update_parameters(**executor_parameters(executor, res, name))
    return ex


class ShardJob:
    """What one array task runs: train shard ``k`` of ``n`` into its folder, resuming (picklable).

    It holds the shard's lock while it trains, records its state (running, done or failed with the
    traceback) in ``shard-KKK.json`` and, called by submitit at a time limit or a preemption,
    checkpoints itself (:meth:`checkpoint`) so that submitit requeues it. With ``threads``, PyTorch and
    the stacked trainer use that many CPU threads (``cpus_per_task``; the weights do not depend on it).
    """

    def __init__(self, config: dict[str, Any], work: str, k: int, n: int, device: str = "cpu",
                 threads: int | None = None):
        self.config, self.work, self.k, self.n, self.device = config, str(work), int(k), int(n), device
        self.threads = threads

    def __call__(self) -> dict[str, Any]:
        import fcntl

        import torch

        from symlib.zoo.training import train

        if self.threads:
            torch.set_num_threads(int(self.threads))
        work = Path(self.work)
        name = shard_name(self.k)
        state_file = work / f"{name}.json"
        state = {"shard": self.k, "host": socket.gethostname(), "pid": os.getpid(), "job_id": job_id(),
                 "started": now()}
        with open(work / f"{name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise ZooError(
                    f"{work / name}: another job is training this shard right now; not starting a second one"
                ) from None
            write_json(state_file, {**state, "state": "running"})
            try:
                cfg = ZooConfig.from_dict(self.config)
                man = train(cfg, work / name, shard=(self.k, self.n), device=self.device, progress=False)
            except BaseException as e:
                write_json(state_file, {**state, "state": "failed", "finished": now(),
                                        "error": f"{type(e).__name__}: {e}",
                                        "traceback": traceback.format_exc()})
                raise
            write_json(state_file, {**state, "state": "done", "finished": now()})
        return {"shard": self.k, "models": len(man["models"]), "complete": man["complete"]}

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Called by submitit before a time limit or a preemption: resubmit this very job (the shard
        resumes from the chunks already on disk)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def job_id() -> str | None:
    """The id of the job this process runs in (SLURM's ``ARRAY_JOB_ID_TASK_ID``, or submitit's local
    id), ``None`` outside a job."""
    for var in ("SLURM_ARRAY_JOB_ID", "SUBMITIT_LOCAL_JOB_ID", "SLURM_JOB_ID"):
        if os.environ.get(var):
            if var == "SLURM_ARRAY_JOB_ID" and os.environ.get("SLURM_ARRAY_TASK_ID"):
                return f"{os.environ[var]}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            return os.environ[var]
    return None


class PidJob:
    """A local job started by an earlier driver: watched through its task's pid."""

    def __init__(self, job_id: str, pid: int):
        self.job_id, self.pid = job_id, pid

    def done(self) -> bool:
        """Whether the job's process has ended."""
        return not alive(self.pid)


def attached(work: Path, plan: dict[str, Any], k: int):
    """A stand-in for the job of shard ``k`` submitted by an earlier driver, or ``None`` if none runs."""
    st = read_json(work / f"{shard_name(k)}.json") or {}
    jobs = plan["shards"][k].get("jobs") or []
    if not jobs:
        return None
    if plan["executor"] == "local":
        if st.get("state") == "running" and st.get("host") == socket.gethostname() and alive(int(st["pid"])):
            return PidJob(str(jobs[-1]), int(st["pid"]))
        return None
    try:
        import submitit

        job = submitit.SlurmJob(folder=work / "logs", job_id=str(jobs[-1]))
        return None if job.done() else job
    except Exception:
        return None
