r"""Fan a zoo out over many processes or machines with submitit: submit, watch, resubmit, merge (book:
"Checkpoint zoos").

A zoo splits into shards (``shard=(k, n)`` of :func:`symlib.zoo.train`: chunks ``k, k + n, ...``).
:func:`submit` sends the ``n`` shards as **one job array** to an executor of ``submitit`` (the usual tool
of the research community for this), watches them, resubmits the shards whose job died without
finishing (killed, preempted, node failure: they resume from their last chunk, since a shard folder
resumes like any zoo), and merges the shards into the zoo when all are done (:func:`symlib.zoo.merge`).
Shards whose job raised an exception are not resubmitted (a bug or a missing dataset would fail again):
the error and its log are reported, and running :func:`submit` again retries them.

The package splits the fan-out by concept: :mod:`~symlib.zoo.fanout.plan` (what every job asks for,
:class:`~symlib.zoo.fanout.plan.Resources`, and the work folder's files), :mod:`~symlib.zoo.fanout.executor`
(submitit's executor and the job each array task runs, :class:`~symlib.zoo.fanout.executor.ShardJob`),
:mod:`~symlib.zoo.fanout.monitor` (where the shards stand, :func:`~symlib.zoo.fanout.monitor.status`:
``symlib zoo status OUT``) and this module (submit, watch, resubmit and merge: :class:`Fanout`).

* ``executor="slurm"``: a SLURM job array (``sbatch --array``); partition, time, GPUs and CPUs per task,
  memory and ``array_parallelism`` are :class:`~symlib.zoo.fanout.plan.Resources`.
* ``executor="local"``: the same code path with submitit's local executor, processes on this machine
  (what the tests use).

The output folder and the work folder (``OUT/fanout/`` by default) are checked before anything is
written or submitted, as ``symlib zoo train`` without an executor checks ``--out`` (an exported dataset,
files symlib did not write, another set are refused); a zoo already complete there is checked and
nothing is written or submitted.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symlib import scales as _scales
from symlib import store
from symlib.store import MANIFEST
from symlib.zoo.chunks import ZooError
from symlib.zoo.config import ZooConfig
from symlib.zoo.fanout.executor import ShardJob, attached, make_executor
from symlib.zoo.fanout.monitor import Status, status
from symlib.zoo.fanout.plan import (
    EXECUTORS,
    PLAN,
    PLAN_FORMAT,
    WORK,
    Resources,
    executor_parameters,
    now,
    read_json,
    read_plan,
    shard_name,
    work_dir,
    write_json,
)

__all__ = [
    "EXECUTORS",
    "PLAN",
    "PLAN_FORMAT",
    "WORK",
    "Fanout",
    "Resources",
    "ShardJob",
    "Status",
    "executor_parameters",
    "status",
    "submit",
    "work_dir",
]


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
        return read_plan(self.work)

    def _save_plan(self, plan: dict[str, Any]) -> None:
        plan["updated"] = now()
        write_json(self.work / PLAN, plan)

    def _executor(self):
        if self._submitit is None:
            self._submitit = make_executor(self.executor, self.work / "logs", self.resources,
                                           f"zoo-{self.cfg.preset}-{self.cfg.scale}")
        return self._submitit

    def _job(self, k: int) -> ShardJob:
        return ShardJob(self.cfg.to_dict(), str(self.work), k, self.n_shards, self.device,
                        self.resources.cpus_per_task)

    def _submit(self, shards: list[int]) -> None:
        if not shards:
            return
        ex = self._executor()
        try:
            jobs = ex.submit_array([self._job(k) for k in shards])  # one job array
        except Exception as e:  # sbatch refused the array (a partition, a limit), or the local launcher
            raise ZooError(
                f"submitting shards {shards} to {self.executor} failed ({type(e).__name__}: {e}); fix the "
                f"cause (the resources asked for?) and run the same command again"
            ) from e
        plan = self._plan()
        for k, job in zip(shards, jobs, strict=True):
            self.jobs[k] = job
            plan["shards"][k].setdefault("jobs", []).append(str(job.job_id))
        self._save_plan(plan)

    def status(self) -> Status:
        """:func:`~symlib.zoo.fanout.monitor.status` of this fan-out, with the jobs held here."""
        return status(self.work, self.jobs)

    def _error(self, k: int) -> str:
        job = self.jobs.get(k)
        st = read_json(self.work / f"{shard_name(k)}.json") or {}
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
            on_poll: called with the :class:`~symlib.zoo.fanout.monitor.Status` after every look (progress
                reports).

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
                st_file = read_json(self.work / f"{shard_name(s['shard'])}.json") or {}
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

        shards = [self.work / shard_name(k) for k in range(self.n_shards)]
        self.manifest = merge(shards, self.out)
        plan = self._plan()
        plan["merged"] = True
        self._save_plan(plan)
        if not self.keep_shards:
            for d in shards:
                shutil.rmtree(d, ignore_errors=True)


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
    last chunk; a complete zoo in ``out`` (merged, or trained otherwise) is checked and returned as it is:
    nothing is written or submitted.

    Args:
        cfg: the zoo (:func:`symlib.zoo.preset`).
        out: the zoo folder to merge into.
        n_shards: number of shards (at most ``cfg.n_chunks``; shard ``k`` trains chunks ``k, k + n, ...``).
        executor: ``"slurm"`` or ``"local"`` (processes on this machine, the same code path).
        resources: what each job asks for (:class:`~symlib.zoo.fanout.plan.Resources`).
        device: ``"cpu"`` or ``"cuda"`` for the training.
        work: the work folder (default ``out/fanout``).
        max_retries: resubmissions per shard whose job died without finishing it.
        wait: watch and merge before returning (else return at once; :meth:`Fanout.wait` later).
        poll_s, timeout_s, on_poll: see :meth:`Fanout.wait`.
        keep_shards: keep the shard folders after the merge (default: removed, the zoo holds every chunk).

    Returns:
        The :class:`Fanout` (``.manifest``: the merged zoo's manifest when ``wait``).

    Raises:
        ValueError: bad arguments; ZooError: ``out`` is a file, lies under one, is not writable, is an
            exported dataset, holds files symlib did not write, another checkpoint set or chunks of another
            zoo, or the work folder another fan-out or other files (all checked before anything is written
            or submitted); SLURM cannot be reached; shards failed.
        ImportError: submitit is not installed.
    """
    _check_submit(cfg, n_shards, executor, max_retries, poll_s, timeout_s)
    res = resources or Resources()
    out = Path(out)
    work = Path(work) if work is not None else work_dir(out)
    old = _check_folders(cfg, out, work)  # before anything is written or submitted
    fo = Fanout(cfg, out, work, n_shards, executor, res, str(device), max_retries, keep_shards)
    if old is not None and old.get("complete") and not old.get("shard"):
        return _complete(fo)  # like `symlib zoo train`: checked, nothing written or submitted
    plan, created = _open_plan(fo) if (work / PLAN).exists() else _new_plan(fo)
    st = status(work)
    if st.merged:
        fo.manifest = store.read_manifest(out)
        return fo
    todo = []
    for s in st.shards:
        if s["state"] == "done":
            continue
        job = attached(work, plan, s["shard"])
        if job is not None:
            fo.jobs[s["shard"]] = job
        else:
            todo.append(s["shard"])
    try:
        fo._submit(todo)
    except BaseException:
        if created is not None and not fo.jobs:  # nothing was submitted: leave nothing behind
            shutil.rmtree(created, ignore_errors=True)
        raise
    if wait:
        fo.wait(poll_s=poll_s, timeout_s=timeout_s, on_poll=on_poll)
    return fo


def _check_submit(cfg: ZooConfig, n_shards: int, executor: str, max_retries: int, poll_s: float,
                  timeout_s: float | None) -> None:
    """Refuse :func:`submit`'s arguments before anything is written or submitted: an unknown executor, a
    shard count that is not an integer from 1 to ``cfg.n_chunks``, a negative ``max_retries``, seconds
    that are not positive.

    Raises:
        ValueError: naming the argument.
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
    _scales.check_int("max_retries", max_retries, 0)
    _check_seconds("poll_s", poll_s)
    if timeout_s is not None:
        _check_seconds("timeout_s", timeout_s)


def _open_plan(fo: Fanout) -> tuple[dict[str, Any], None]:
    """The plan of the fan-out already in ``fo.work``, with ``fo``'s executor and resources (saved when
    they changed, once the new executor is reached); ``(plan, None)``: nothing was created.

    Raises:
        ZooError: the plan is another zoo's or has another shard count.
    """
    work, cfg, n_shards, executor = fo.work, fo.cfg, fo.n_shards, fo.executor
    plan = read_plan(work)
    if plan["config_hash"] != cfg.hash or int(plan["n_shards"]) != n_shards:
        raise ZooError(
            f"{work / PLAN}: a fan-out of another zoo or shard count is here (config "
            f"{plan['config_hash']}, {plan['n_shards']} shards; asked: {cfg.hash}, {n_shards}); choose "
            f"another --out"
        )
    if plan.get("executor") != executor or plan.get("resources") != fo.resources.to_dict():
        fo._executor()  # the new executor can be reached: only then is the plan changed
        plan["executor"], plan["resources"] = executor, fo.resources.to_dict()
        fo._save_plan(plan)
    return plan, None


def _new_plan(fo: Fanout) -> tuple[dict[str, Any], Path]:
    """A new fan-out's plan, written to ``fo.work`` once the executor is reached (every shard without a
    job yet); ``(plan, created)``, ``created`` the outermost folder this made (removed again when nothing
    could be submitted)."""
    work, cfg, n_shards = fo.work, fo.cfg, fo.n_shards
    fo._executor()  # submitit is there and the executor reachable: before anything is written
    created = work
    while not created.parent.exists():
        created = created.parent
    work.mkdir(parents=True, exist_ok=True)
    plan = {
        "format": PLAN_FORMAT, "kind": "zoo", "config": cfg.to_dict(), "config_hash": cfg.hash,
        "preset": cfg.preset, "scale": cfg.scale, "n_shards": n_shards, "out": str(fo.out.resolve()),
        "executor": fo.executor, "resources": fo.resources.to_dict(), "device": fo.device, "created": now(),
        "merged": False, "shards": [{"shard": k, "folder": shard_name(k), "jobs": []}
                                    for k in range(n_shards)],
        **store.provenance(),
    }
    fo._save_plan(plan)
    return plan, created


def _check_seconds(name: str, value: Any) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _complete(fo: Fanout) -> Fanout:
    """``fo`` for a zoo already complete in ``fo.out``: every file checked (:func:`symlib.zoo.load`; a
    damaged chunk is named with ``symlib zoo repair``), nothing written, nothing submitted."""
    from symlib.zoo.cache import load

    fo.manifest = load(fo.out)[1]
    return fo


def _check_folders(cfg: ZooConfig, out: Path, work: Path) -> dict[str, Any] | None:
    """What ``symlib zoo train`` checks of ``--out`` (:func:`symlib.store.check_out`: not an exported
    dataset, no files symlib did not write, no other set), and that the work folder can be written and
    holds nothing but a fan-out: refused before any work, nothing written.

    Returns:
        The manifest of ``out`` (``None`` if there is none).
    """
    old, damaged = store.check_out(out, "zoo")
    if damaged:
        raise ZooError(
            f"{out / MANIFEST}: corrupt manifest; the chunks beside it may still be valid: rebuild it with "
            f"`symlib zoo train ... --out {out} --repair` (without --executor), or choose another --out"
        )
    if old is not None and old.get("config_hash") != cfg.hash:
        raise ZooError(
            f"{out / MANIFEST}: holds another checkpoint set (zoo {old.get('preset')}/{old.get('scale')}, "
            f"config {old.get('config_hash')}), not {cfg.preset}/{cfg.scale} ({cfg.hash}); choose another "
            f"--out"
        )
    store.check_owners(out, "config_hash", cfg.hash, "zoo")
    option = "--out" if work == work_dir(out) else "work folder"
    store.check_folder(work, "fan-out's work folder", option)
    if work.is_dir() and any(work.iterdir()) and not (work / PLAN).is_file():
        raise ZooError(
            f"{work}: holds files but no fan-out ({PLAN}); a fan-out never writes beside files it did not "
            f"write: choose another {option}, or move them out (nothing was written)"
        )
    return old
