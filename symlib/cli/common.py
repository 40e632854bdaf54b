"""Pieces shared by the command groups: argument types, the fan-out options and their progress lines."""

from __future__ import annotations

import argparse
import sys


def shard(text: str) -> tuple[int, int]:
    """``K/N`` of ``--shard``, with ``0 <= K < N``."""
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shard takes K/N with integers (e.g. 3/8), got {text!r}"
        ) from None
    if not (n >= 1 and 0 <= k < n):
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N (K counts from 0), got {text!r}")
    return k, n


def _number(kind, low: float, strict: bool, what: str):
    """An argparse type: a number of ``kind`` above ``low`` (``strict``) or at least ``low``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value != value or value in (float("inf"), float("-inf")) or (
                value <= low if strict else value < low):
            raise argparse.ArgumentTypeError(f"takes {what}, got {text!r}")
        return value

    parse.__doc__ = f"An option's value: {what} (argparse type)."
    return parse


count = _number(int, 0, False, "an integer >= 0")
positive_int = _number(int, 0, True, "an integer >= 1")
positive = _number(float, 0.0, True, "a positive number")


def hyper(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` of ``--hyper``; the value is read as JSON when it parses, else kept as a string."""
    import json

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--hyper takes NAME=VALUE (e.g. scale=0.1), got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def fanout_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``--executor`` (:mod:`symlib.zoo.fanout`), on ``zoo train`` and ``posterior sample``."""
    g = p.add_argument_group(
        "fan-out with submitit",
        "--executor submits the shards as one job array, watches them, resubmits the ones killed or "
        "preempted (they resume from their last chunk) and merges them when all are done; rerunning the "
        "same command reattaches. `symlib zoo status OUT` shows where the shards stand.",
    )
    g.add_argument("--executor", choices=("local", "slurm"), default=None,
                   help="slurm: one SLURM job array; local: processes on this machine (same code path)")
    g.add_argument("--shards", type=positive_int, default=None,
                   help="number of shards (default: min(8, chunks))")
    g.add_argument("--partition", default=None, help="SLURM partition")
    g.add_argument("--time", type=positive_int, default=240, metavar="MIN", help="time limit per shard in "
                   "minutes (default 240; a shard that reaches it is requeued and resumes)")
    g.add_argument("--gpus-per-task", type=count, default=0, help="GPUs per shard (default 0)")
    g.add_argument("--cpus-per-task", type=positive_int, default=None, help="CPU cores per shard")
    g.add_argument("--mem-gb", type=positive, default=None, help="memory per shard in GB")
    g.add_argument("--array-parallelism", type=positive_int, default=None, metavar="N",
                   help="at most N shards at once (slurm_array_parallelism)")
    g.add_argument("--setup", action="append", default=[], metavar="CMD",
                   help="shell line run before each shard, e.g. 'source .venv/bin/activate'; repeatable")
    g.add_argument("--max-retries", type=count, default=2, metavar="N",
                   help="resubmissions of a killed shard (default 2; 0: none)")
    g.add_argument("--poll", type=positive, default=30.0, metavar="S",
                   help="seconds between looks (default 30)")
    g.add_argument("--keep-shards", action="store_true", help="keep the shard folders after the merge")


def resources(args):
    """The :class:`symlib.zoo.fanout.plan.Resources` that the fan-out options ask for."""
    from symlib.zoo import fanout

    return fanout.Resources(time_min=args.time, partition=args.partition, gpus_per_task=args.gpus_per_task,
                            cpus_per_task=args.cpus_per_task, mem_gb=args.mem_gb,
                            array_parallelism=args.array_parallelism, setup=tuple(args.setup))


def reporter():
    """A fan-out's ``on_poll``: one line on stderr whenever the shards' counts change."""
    last = {}

    def report(st) -> None:
        c = st.counts()
        if c != last:
            last.clear()
            last.update(c)
            print(f"shards: {c['done']} done, {c['running']} running, {c['pending']} pending, {c['failed']} "
                  f"failed", file=sys.stderr, flush=True)

    return report
