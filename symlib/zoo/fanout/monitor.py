r"""Where a fan-out stands, from its files alone (``symlib zoo status OUT``; book: "Checkpoint zoos").

Per shard: the chunks done (its folder's manifest), its state (``running``, ``done`` or ``failed`` with
the error, written by its job; ``pending`` while a resubmission has not started), the attempts and the
latest job id, and whether the merged zoo is complete. A job that died without saying so (killed, node
failure) is found through its pid (local) or SLURM's accounting (``sacct``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

from symlib.store import MANIFEST
from symlib.zoo.config import ZooConfig
from symlib.zoo.fanout.executor import alive
from symlib.zoo.fanout.plan import PLAN, read_json, read_plan, shard_name, work_dir

__all__ = ["Status", "status"]


@dataclasses.dataclass(frozen=True)
class Status:
    """Where a fan-out stands (:func:`status`).

    Attributes:
        work: the work folder; ``out``: the zoo it merges into; ``executor``; ``config_hash``.
        shards: one dict per shard: ``shard``, ``state`` (``"done"``, ``"running"``, ``"pending"``,
            ``"failed"`` or ``"not started"``), ``chunks`` done and ``of``, ``attempts``, ``job_id``,
            ``note`` (host and pid, or the error).
        merged: whether the zoo in ``out`` is complete.
    """

    work: Path
    out: Path
    executor: str
    config_hash: str
    preset: str
    scale: str
    shards: list[dict[str, Any]]
    merged: bool

    def counts(self) -> dict[str, int]:
        """How many shards are in each state."""
        out = {s: 0 for s in ("done", "running", "pending", "failed", "not started")}
        for s in self.shards:
            out[s["state"]] += 1
        return out

    @property
    def complete(self) -> bool:
        return all(s["state"] == "done" for s in self.shards)

    def format(self) -> str:
        """A plain-text table (``symlib zoo status``)."""
        c = self.counts()
        lines = [
            f"fan-out of zoo {self.out} ({self.preset}/{self.scale}, config {self.config_hash}): "
            f"{len(self.shards)} shards on {self.executor}: {c['done']} done, {c['running']} running, "
            f"{c['pending']} pending, {c['failed']} failed"
            + (f", {c['not started']} not started" if c["not started"] else "")
            + ("; merged: the zoo is complete" if self.merged else "; not merged yet"),
            f"  {'shard':>5s} {'chunks':>9s} {'state':12s} {'attempts':>8s} {'job':>14s}  note",
        ]
        for s in self.shards:
            lines.append(f"  {s['shard']:5d} {str(s['chunks']) + '/' + str(s['of']):>9s} {s['state']:12s} "
                         f"{s['attempts']:8d} {str(s['job_id'] or '-'):>14s}  {s['note']}")
        return "\n".join(lines)


def _shard_progress(work: Path, k: int, cfg: ZooConfig, n: int) -> tuple[int, int, bool]:
    mine = len(range(k, cfg.n_chunks, n))
    man = read_json(work / shard_name(k) / MANIFEST)
    if man is None:
        return 0, mine, False
    return len(man.get("chunks", [])), mine, bool(man.get("complete"))


def _slurm_state(logs: Path, job_id: str) -> str | None:
    try:
        import submitit

        return str(submitit.SlurmJob(folder=logs, job_id=job_id).state)
    except Exception:  # no submitit, no sacct, unknown job
        return None


def status(path: str | os.PathLike, jobs: dict[int, Any] | None = None) -> Status:
    """Where the fan-out of ``path`` stands (``symlib zoo status``): per shard, chunks done, state,
    attempts, job id, and the host and pid (running) or the error (failed).

    Args:
        path: the zoo folder the fan-out merges into (its work folder ``path/fanout``), or the work
            folder itself.
        jobs: the submitit jobs of the shards, when the caller holds them
            (:class:`symlib.zoo.fanout.Fanout`).

    Raises:
        symlib.store.files.StoreError: no fan-out there.
    """
    path = Path(path)
    work = path if (path / PLAN).exists() else work_dir(path)
    plan = read_plan(work)
    cfg = ZooConfig.from_dict(plan["config"])
    out = Path(plan["out"])
    n = int(plan["n_shards"])
    merged_man = read_json(out / MANIFEST)
    merged = bool(plan.get("merged")) and bool(merged_man and merged_man.get("complete"))
    rows = []
    for sh in plan["shards"]:
        k = int(sh["shard"])
        done, of, complete = _shard_progress(work, k, cfg, n)
        st = read_json(work / f"{shard_name(k)}.json") or {}
        job_id = (sh.get("jobs") or [None])[-1]
        note = ""
        if merged or complete:
            state, done = "done", (of if merged else done)
        elif not sh.get("jobs"):
            state = "not started"
        elif st.get("job_id") is not None and str(st["job_id"]) != str(job_id):
            state, note = "pending", "resubmitted, not started yet"  # the state is an earlier attempt's
        elif st.get("state") == "failed":
            state, note = "failed", st.get("error", "")[:160]
        elif st.get("state") == "running":
            state, note = "running", f"host {st.get('host')} pid {st.get('pid')} since {st.get('started')}"
            job = (jobs or {}).get(k)
            if job is not None and job.done():
                state, note = "failed", "the job ended without finishing the shard (killed?)"
            elif plan["executor"] == "local" and st.get("host") == socket.gethostname() and not alive(
                    int(st.get("pid", 0))):
                state, note = "failed", f"pid {st.get('pid')} is gone (killed?)"
            elif plan["executor"] == "slurm" and job is None:
                s = _slurm_state(work / "logs", str(job_id))
                if s in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                         "DEADLINE", "COMPLETED"):
                    state, note = "failed", f"SLURM state {s}"
        else:
            job = (jobs or {}).get(k)
            if job is not None and job.done():
                state, note = "failed", "the job ended before it started training (see its log)"
            else:
                state, note = "pending", "submitted, not started yet"
        rows.append({"shard": k, "state": state, "chunks": done, "of": of,
                     "attempts": len(sh.get("jobs", [])), "job_id": job_id, "note": note})
    return Status(work, out, plan["executor"], plan["config_hash"], cfg.preset, cfg.scale, rows, merged)
