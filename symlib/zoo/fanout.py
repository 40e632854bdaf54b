r"""Fan a zoo out over many processes or machines with submitit: submit, watch, resubmit, merge (book:
"Checkpoint zoos").

A zoo splits into shards (``shard=(k, n)`` of :func:`symlib.zoo.train`: chunks ``k, k + n, ...``).
:func:`submit` sends the ``n`` shards as **one job array** to an executor of ``submitit`` (the usual tool
of the research community for this), watches them, resubmits the shards whose job died without
finishing (killed, preempted, node failure: they resume from their last chunk, since a shard folder
resumes like any zoo), and merges the shards into the zoo when all are done (:func:`symlib.zoo.merge`).
Shards whose job raised an exception are not resubmitted (a bug or a missing dataset would fail again):
the error and its log are reported, and running :func:`submit` again retries them.

* ``executor="slurm"``: a SLURM job array (``sbatch --array``); partition, time, GPUs and CPUs per task,
  memory and ``array_parallelism`` are :class:`Resources`. A shard that reaches its time limit or is
  preempted is checkpointed and requeued by submitit itself (:meth:`ShardJob.checkpoint`).
* ``executor="local"``: the same code path with submitit's local executor, processes on this machine
  (what the tests use).

The work folder (``OUT/fanout/`` by default) holds what the jobs and ``symlib zoo status`` need::

    OUT/fanout/plan.json         what was submitted: configuration, shards, executor, resources, job ids
    OUT/fanout/shard-000/ ...    each shard's zoo (removed once merged, unless keep_shards)
    OUT/fanout/shard-000.json    the shard's state, written by its job: running / done / failed, host, pid
    OUT/fanout/shard-000.lock    held while a job trains the shard (two jobs never write one shard)
    OUT/fanout/logs/             submitit's pickles and each job's stdout and stderr

:func:`status` (``symlib zoo status OUT``) reads them: shards done, running, pending and failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symlib import store
from symlib.store import MANIFEST
from symlib.zoo.chunks import ZooError
from symlib.zoo.config import ZooConfig

WORK = "fanout"
PLAN = "plan.json"
PLAN_FORMAT = "symlib-fanout/1"
EXECUTORS = ("local", "slurm")

__all__ = [
    "EXECUTORS",
    "Fanout",
    "Resources",
    "ShardJob",
    "Status",
    "executor_parameters",
    "status",
    "submit",
    "work_dir",
]


@dataclasses.dataclass(frozen=True)
class Resources:
    """What every shard's job asks for.

    Attributes:
        time_min: wall-clock limit of one job in minutes (SLURM's ``--time``; submitit's local executor
            enforces it too). A shard that hits it is checkpointed and requeued: it resumes from its
            last chunk.
        partition: SLURM partition (``None``: the cluster's default).
        gpus_per_task: GPUs per shard (``--gpus-per-node`` of a one-task job).
        cpus_per_task: CPU cores per shard.
        mem_gb: memory per shard.
        array_parallelism: at most this many shards run at once (SLURM's ``--array=...%N``).
        setup: shell lines run before each job (e.g. ``"source .venv/bin/activate"``, ``"module load cuda"``).
        slurm_args: further ``#SBATCH`` options, e.g. ``{"account": "abc", "qos": "preemptible"}``.
    """

    time_min: int = 240
    partition: str | None = None
    gpus_per_task: int = 0
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    array_parallelism: int | None = None
    setup: tuple[str, ...] = ()
    slurm_args: tuple[tuple[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["setup"], d["slurm_args"] = list(self.setup), dict(self.slurm_args)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Resources:
        d = dict(d)
        d["setup"] = tuple(d.get("setup") or ())
        d["slurm_args"] = tuple(sorted((d.get("slurm_args") or {}).items()))
        return Resources(**d)


def executor_parameters(executor: str, res: Resources, name: str = "symlib-zoo") -> dict[str, Any]:
    """The parameters of ``submitit.AutoExecutor.update_parameters`` for ``executor`` and ``res``."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose one of {EXECUTORS}")
    p: dict[str, Any] = {"name": name, "timeout_min": int(res.time_min), "tasks_per_node": 1, "nodes": 1}
    if res.gpus_per_task:
        p["gpus_per_node"] = int(res.gpus_per_task)
    if res.cpus_per_task:
        p["cpus_per_task"] = int(res.cpus_per_task)
    if res.mem_gb:
        p["mem_gb"] = float(res.mem_gb)
    if executor == "slurm":
        if res.partition:
            p["slurm_partition"] = res.partition
        if res.array_parallelism:
            p["slurm_array_parallelism"] = int(res.array_parallelism)
        if res.setup:
            p["slurm_setup"] = list(res.setup)
        if res.slurm_args:
            p["slurm_additional_parameters"] = dict(res.slurm_args)
    elif res.setup:
        p["local_setup"] = list(res.setup)
    return p


def work_dir(out: str | os.PathLike) -> Path:
    """The default work folder of a fan-out into ``out``: ``out/fanout``."""
    return Path(out) / WORK


def _shard_name(k: int) -> str:
    return f"shard-{k:03d}"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    store.atomic_write_bytes(path, json.dumps(obj, indent=1).encode())


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


# ----------------------------------------------------------------------------- the job


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
        name = _shard_name(self.k)
        state_file = work / f"{name}.json"
        state = {"shard": self.k, "host": socket.gethostname(), "pid": os.getpid(), "job_id": _job_id(),
                 "started": _now()}
        with open(work / f"{name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise ZooError(
                    f"{work / name}: another job is training this shard right now; not starting a second one"
                ) from None
            _write_json(state_file, {**state, "state": "running"})
            try:
                cfg = ZooConfig.from_dict(self.config)
                man = train(cfg, work / name, shard=(self.k, self.n), device=self.device, progress=False)
            except BaseException as e:
                _write_json(state_file, {**state, "state": "failed", "finished": _now(),
                                         "error": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc()})
                raise
            _write_json(state_file, {**state, "state": "done", "finished": _now()})
        return {"shard": self.k, "models": len(man["models"]), "complete": man["complete"]}

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Called by submitit before a time limit or a preemption: resubmit this very job (the shard
        resumes from the chunks already on disk)."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


def _job_id() -> str | None:
    for var in ("SLURM_ARRAY_JOB_ID", "SUBMITIT_LOCAL_JOB_ID", "SLURM_JOB_ID"):
        if os.environ.get(var):
            if var == "SLURM_ARRAY_JOB_ID" and os.environ.get("SLURM_ARRAY_TASK_ID"):
                return f"{os.environ[var]}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            return os.environ[var]
    return None


# ----------------------------------------------------------------------------- status


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


def _read_plan(work: Path) -> dict[str, Any]:
    file = work / PLAN
    plan = _read_json(file)
    if plan is None:
        if file.exists():
            raise ZooError(f"{file}: corrupt fan-out plan; remove the folder {work} and submit again")
        raise ZooError(
            f"{work}: no fan-out here (no {PLAN}); start one with `symlib zoo train ... --executor "
            f"local|slurm --out {work.parent}`"
        )
    if plan.get("format") != PLAN_FORMAT:
        raise ZooError(f"{file}: format {plan.get('format')!r}, expected {PLAN_FORMAT!r}")
    return plan


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (an exited child not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _shard_progress(work: Path, k: int, cfg: ZooConfig, n: int) -> tuple[int, int, bool]:
    mine = len(range(k, cfg.n_chunks, n))
    man = _read_json(work / _shard_name(k) / MANIFEST)
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
        jobs: the submitit jobs of the shards, when the caller holds them (:class:`Fanout`).

    Raises:
        ZooError: no fan-out there.
    """
    path = Path(path)
    work = path if (path / PLAN).exists() else work_dir(path)
    plan = _read_plan(work)
    cfg = ZooConfig.from_dict(plan["config"])
    out = Path(plan["out"])
    n = int(plan["n_shards"])
    merged_man = _read_json(out / MANIFEST)
    merged = bool(plan.get("merged")) and bool(merged_man and merged_man.get("complete"))
    rows = []
    for sh in plan["shards"]:
        k = int(sh["shard"])
        done, of, complete = _shard_progress(work, k, cfg, n)
        st = _read_json(work / f"{_shard_name(k)}.json") or {}
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
            elif plan["executor"] == "local" and st.get("host") == socket.gethostname() and not _alive(
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


# ----------------------------------------------------------------------------- submit and watch


class Fanout:
    """A submitted fan-out: its jobs, :meth:`status`, :meth:`wait` (resubmit, merge).

    Attributes:
        cfg: the zoo; ``out``: where it is merged; ``work``: the work folder; ``executor``: ``"local"``
            or ``"slurm"``; ``jobs``: ``{shard: submitit job}`` of the latest submission of each shard.
        manifest: the merged zoo's manifest, once :meth:`wait` has merged it.
    """

    def __init__(self, cfg: ZooConfig, out: Path, work: Path, n_shards: int, executor: str, res: Resources,
                 device: str, max_retries: int, keep_shards: bool):
        self.cfg, self.out, self.work, self.n_shards = cfg, out, work, n_shards
        self.executor, self.resources, self.device = executor, res, device
        self.max_retries, self.keep_shards = max_retries, keep_shards
        self.jobs: dict[int, Any] = {}
        self.manifest: dict[str, Any] | None = None
        self._submitit = None

    # -- plan
    def _plan(self) -> dict[str, Any]:
        return _read_plan(self.work)

    def _save_plan(self, plan: dict[str, Any]) -> None:
        plan["updated"] = _now()
        _write_json(self.work / PLAN, plan)

    def _executor(self):
        if self._submitit is None:
            try:
                import submitit
            except ImportError:
                raise ImportError(
                    "fanning a zoo out needs submitit (pip install submitit, or symlib's `zoo` extra: "
                    "pip install 'symlib[zoo]'); without it, train shards by hand with `symlib zoo train "
                    "--shard K/N`"
                ) from None
            ex = submitit.AutoExecutor(folder=self.work / "logs", cluster=self.executor)
            ex.update_parameters(**executor_parameters(self.executor, self.resources,
                                                       f"zoo-{self.cfg.preset}-{self.cfg.scale}"))
            self._submitit = ex
        return self._submitit

    def _job(self, k: int) -> ShardJob:
        return ShardJob(self.cfg.to_dict(), str(self.work), k, self.n_shards, self.device,
                        self.resources.cpus_per_task)

    def _submit(self, shards: list[int]) -> None:
        if not shards:
            return
        ex = self._executor()
        jobs = ex.submit_array([self._job(k) for k in shards])  # one job array
        plan = self._plan()
        for k, job in zip(shards, jobs, strict=True):
            self.jobs[k] = job
            plan["shards"][k].setdefault("jobs", []).append(str(job.job_id))
        self._save_plan(plan)

    def status(self) -> Status:
        """:func:`status` of this fan-out, with the jobs held here."""
        return status(self.work, self.jobs)

    def _error(self, k: int) -> str:
        job = self.jobs.get(k)
        st = _read_json(self.work / f"{_shard_name(k)}.json") or {}
        log = ""
        if job is not None:
            try:
                log = f" (log: {job.paths.stderr})"
            except Exception:
                log = ""
        return f"shard {k}: {st.get('error') or 'the job ended without finishing the shard'}{log}"

    def wait(self, poll_s: float = 10.0, timeout_s: float | None = None,
             on_poll: Callable[[Status], None] | None = None) -> dict[str, Any]:
        """Watch the shards until all are done, resubmitting those whose job died without finishing them
        (at most ``max_retries`` times each; a shard whose job raised an exception is not resubmitted),
        then merge them into ``out``.

        Args:
            poll_s: seconds between two looks at the jobs.
            timeout_s: give up after this long (the jobs keep running; :func:`submit` again reattaches).
            on_poll: called with the :class:`Status` after every look (progress reports).

        Returns:
            The merged zoo's manifest.

        Raises:
            ZooError: shards failed (naming each, its error and log), or the timeout passed.
        """
        start = time.monotonic()
        while True:
            st = self.status()
            if on_poll is not None:
                on_poll(st)
            if st.merged:
                break
            failed = [s for s in st.shards if s["state"] == "failed"]
            retry, final = [], []
            for s in failed:
                st_file = _read_json(self.work / f"{_shard_name(s['shard'])}.json") or {}
                raised = st_file.get("state") == "failed"  # an exception, not a kill: it would fail again
                if not raised and s["attempts"] <= self.max_retries:
                    retry.append(s["shard"])
                else:
                    final.append(s["shard"])
            retry += [s["shard"] for s in st.shards if s["state"] == "not started"]  # a submission was lost
            self._submit(retry)
            busy = [s for s in st.shards if s["state"] in ("running", "pending")]
            if final and not busy and not retry:
                raise ZooError(
                    f"{len(final)} of {self.n_shards} shards failed; the others are done and kept. "
                    + "; ".join(self._error(k) for k in final)
                    + f". Fix the cause and run the same command again: it resubmits only these shards "
                    f"(`symlib zoo status {self.out}` shows where each stands)"
                )
            if st.complete:
                self._merge()
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise ZooError(
                    f"gave up waiting after {timeout_s:.0f} s: {st.counts()}; the jobs keep running, run the "
                    f"same command again to reattach (`symlib zoo status {self.out}`)"
                )
            time.sleep(poll_s)
        self.manifest = store.read_manifest(self.out)
        return self.manifest

    def _merge(self) -> None:
        from symlib.zoo.cache import merge

        shards = [self.work / _shard_name(k) for k in range(self.n_shards)]
        self.manifest = merge(shards, self.out)
        plan = self._plan()
        plan["merged"] = True
        self._save_plan(plan)
        if not self.keep_shards:
            for d in shards:
                shutil.rmtree(d, ignore_errors=True)


def _attached(work: Path, plan: dict[str, Any], k: int):
    """A stand-in for the job of shard ``k`` submitted by an earlier driver, or ``None`` if none runs."""
    st = _read_json(work / f"{_shard_name(k)}.json") or {}
    jobs = plan["shards"][k].get("jobs") or []
    if not jobs:
        return None
    if plan["executor"] == "local":
        if st.get("state") == "running" and st.get("host") == socket.gethostname() and _alive(int(st["pid"])):
            return _PidJob(str(jobs[-1]), int(st["pid"]))
        return None
    try:
        import submitit

        job = submitit.SlurmJob(folder=work / "logs", job_id=str(jobs[-1]))
        return None if job.done() else job
    except Exception:
        return None


class _PidJob:
    """A local job started by an earlier driver: watched through its task's pid."""

    def __init__(self, job_id: str, pid: int):
        self.job_id, self.pid = job_id, pid

    def done(self) -> bool:
        return not _alive(self.pid)


def submit(
    cfg: ZooConfig,
    out: str | os.PathLike,
    n_shards: int,
    executor: str = "local",
    *,
    resources: Resources | None = None,
    device: str = "cpu",
    work: str | os.PathLike | None = None,
    max_retries: int = 2,
    wait: bool = True,
    poll_s: float = 10.0,
    timeout_s: float | None = None,
    keep_shards: bool = False,
    on_poll: Callable[[Status], None] | None = None,
) -> Fanout:
    """Train the zoo ``cfg`` into ``out`` as ``n_shards`` shards of one submitit job array (module
    docstring): submit, watch, resubmit, merge.

    Running it again with the same arguments continues a fan-out: finished shards are kept, jobs still
    running are watched (not submitted twice), the others are submitted again and resume from their
    last chunk; a merged zoo is returned as it is.

    Args:
        cfg: the zoo (:func:`symlib.zoo.preset`).
        out: the zoo folder to merge into.
        n_shards: number of shards (at most ``cfg.n_chunks``; shard ``k`` trains chunks ``k, k + n, ...``).
        executor: ``"slurm"`` or ``"local"`` (processes on this machine, the same code path).
        resources: what each job asks for (:class:`Resources`).
        device: ``"cpu"`` or ``"cuda"`` for the training.
        work: the work folder (default ``out/fanout``).
        max_retries: resubmissions per shard whose job died without finishing it.
        wait: watch and merge before returning (else return at once; :meth:`Fanout.wait` later).
        poll_s, timeout_s, on_poll: see :meth:`Fanout.wait`.
        keep_shards: keep the shard folders after the merge (default: removed, the zoo holds every chunk).

    Returns:
        The :class:`Fanout` (``.manifest``: the merged zoo's manifest when ``wait``).

    Raises:
        ValueError: bad arguments; ZooError: ``out`` or the work folder holds another zoo, shards failed.
        ImportError: submitit is not installed.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose one of {EXECUTORS}")
    if not isinstance(n_shards, int) or isinstance(n_shards, bool) or n_shards < 1:
        raise ValueError(f"n_shards must be an integer >= 1, got {n_shards!r}")
    if n_shards > cfg.n_chunks:
        raise ValueError(
            f"{n_shards} shards for a zoo of {cfg.n_chunks} chunks ({cfg.n_models} models, {cfg.chunk} per "
            f"chunk): a shard is at least one chunk; use at most {cfg.n_chunks} shards"
        )
    res = resources or Resources()
    out = Path(out)
    work = Path(work) if work is not None else work_dir(out)
    if (out / MANIFEST).exists():
        man = store.read_manifest(out)
        if man.get("kind", "zoo") != "zoo" or man.get("config_hash") != cfg.hash:
            raise ZooError(f"{out / MANIFEST}: holds another checkpoint set; choose another --out")
    fo = Fanout(cfg, out, work, n_shards, executor, res, str(device), max_retries, keep_shards)
    if (work / PLAN).exists():
        plan = _read_plan(work)
        if plan["config_hash"] != cfg.hash or int(plan["n_shards"]) != n_shards:
            raise ZooError(
                f"{work / PLAN}: a fan-out of another zoo or shard count is here (config "
                f"{plan['config_hash']}, {plan['n_shards']} shards; asked: {cfg.hash}, {n_shards}); choose "
                f"another --out"
            )
        if plan.get("executor") != executor or plan.get("resources") != res.to_dict():
            plan["executor"], plan["resources"] = executor, res.to_dict()
            fo._save_plan(plan)
    else:
        work.mkdir(parents=True, exist_ok=True)
        plan = {
            "format": PLAN_FORMAT, "kind": "zoo", "config": cfg.to_dict(), "config_hash": cfg.hash,
            "preset": cfg.preset, "scale": cfg.scale, "n_shards": n_shards, "out": str(out.resolve()),
            "executor": executor, "resources": res.to_dict(), "device": str(device), "created": _now(),
            "merged": False, "shards": [{"shard": k, "folder": _shard_name(k), "jobs": []}
                                        for k in range(n_shards)],
            **store.provenance(),
        }
        fo._save_plan(plan)
    st = status(work)
    if st.merged:
        fo.manifest = store.read_manifest(out)
        return fo
    todo = []
    for s in st.shards:
        if s["state"] == "done":
            continue
        job = _attached(work, plan, s["shard"])
        if job is not None:
            fo.jobs[s["shard"]] = job
        else:
            todo.append(s["shard"])
    fo._submit(todo)
    if wait:
        fo.wait(poll_s=poll_s, timeout_s=timeout_s, on_poll=on_poll)
    return fo
