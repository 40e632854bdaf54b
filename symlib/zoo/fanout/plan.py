r"""What a fan-out asks for and where it keeps its state: the resources of every shard's job, the
executor's parameters and the work folder's files (book: "Checkpoint zoos").

The work folder (``OUT/fanout/`` by default) holds::

    OUT/fanout/plan.json         what was submitted: configuration, shards, executor, resources, job ids
    OUT/fanout/shard-000/ ...    each shard's zoo (removed once merged, unless keep_shards)
    OUT/fanout/shard-000.json    the shard's state, written by its job: running / done / failed, host, pid
    OUT/fanout/shard-000.lock    held while a job trains the shard (two jobs never write one shard)
    OUT/fanout/logs/             submitit's pickles and each job's stdout and stderr
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any

from symlib import store
from symlib.store import PLAN, WORK  # a set's folder may hold its fan-out's work folder (store.check_out)
from symlib.zoo.chunks import ZooError

PLAN_FORMAT = "symlib-fanout/1"
EXECUTORS = ("local", "slurm")

__all__ = [
    "EXECUTORS",
    "PLAN",
    "PLAN_FORMAT",
    "WORK",
    "Resources",
    "executor_parameters",
    "now",
    "read_json",
    "read_plan",
    "shard_name",
    "work_dir",
    "write_json",
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


def shard_name(k: int) -> str:
    """The name of shard ``k``'s folder and files in the work folder: ``shard-003``."""
    return f"shard-{k:03d}"


def now() -> str:
    """The current UTC time, as the plan and the state files record it."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, obj: dict[str, Any]) -> None:
    """Write a plan or state file atomically."""
    store.atomic_write_bytes(path, json.dumps(obj, indent=1).encode())


def read_json(path: Path) -> dict[str, Any] | None:
    """A plan or state file, or ``None`` if it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def read_plan(work: Path) -> dict[str, Any]:
    """The plan of the fan-out whose work folder is ``work``.

    Raises:
        ZooError: no plan there, a corrupt one, or another format.
    """
    file = work / PLAN
    plan = read_json(file)
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
