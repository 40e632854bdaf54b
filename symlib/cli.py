"""Command line: ``symlib zoo train | merge | info | list-presets`` (book: "Checkpoint zoos").

Examples::

    python -m symlib zoo list-presets
    python -m symlib zoo train --preset mnist-optunet --scale cpu --out zoo/
    python -m symlib zoo train --preset mnist-optunet --scale paper --shard 3/8 --out shards/3 --device cuda
    python -m symlib zoo merge shards/* --out zoo/
    python -m symlib zoo info zoo/
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from symlib.scales import SCALES


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shard takes K/N with integers (e.g. 3/8), got {text!r}"
        ) from None
    if not (n >= 1 and 0 <= k < n):
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N (K counts from 0), got {text!r}")
    return k, n


def parser() -> argparse.ArgumentParser:
    from symlib import zoo

    p = argparse.ArgumentParser(
        prog="symlib", description="symlib: weight-space symmetries of neural networks."
    )
    sub = p.add_subparsers(dest="group", required=True, metavar="{zoo}")
    zp = sub.add_parser(
        "zoo",
        help="train, merge and inspect checkpoint zoos",
        description="Checkpoint zoos: many independently trained networks in one folder.",
    )
    zsub = zp.add_subparsers(dest="command", required=True, metavar="{train,merge,info,list-presets}")

    t = zsub.add_parser(
        "train",
        help="train a zoo (or one shard of it), resuming what is already done",
        description="Train a zoo preset into --out. Rerunning the same command resumes an "
        "interrupted run; --shard K/N trains one disjoint slice of the seeds.",
    )
    t.add_argument("--preset", required=True, choices=sorted(zoo.PRESETS), help="which zoo")
    t.add_argument(
        "--scale", default="cpu", choices=SCALES, help="tiny (seconds), cpu (the book), paper (GPU)"
    )
    t.add_argument("--out", required=True, help="zoo directory (created if needed)")
    t.add_argument(
        "--shard",
        type=_shard,
        default=None,
        metavar="K/N",
        help="train only chunks c with c %% N == K (0 <= K < N), e.g. $SLURM_ARRAY_TASK_ID/8",
    )
    t.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    t.add_argument("--seed", type=int, default=None, help="seed of the first model (default: the preset's)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")

    m = zsub.add_parser(
        "merge",
        help="check shards of one zoo and combine them",
        description="Validate shard folders (same config and data, every chunk exactly "
        "once, no corrupt or NaN files) and combine them into --out.",
    )
    m.add_argument("shards", nargs="+", help="shard directories")
    m.add_argument("--out", required=True, help="merged zoo directory")

    i = zsub.add_parser("info", help="summarise a zoo directory")
    i.add_argument("path", help="zoo directory")
    i.add_argument("--check", action="store_true", help="also load and check every file")

    zsub.add_parser("list-presets", help="list zoo presets and their sizes at every scale")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``symlib`` and ``python -m symlib``; returns the exit status."""
    import dataclasses

    from symlib import zoo

    args = parser().parse_args(argv)
    try:
        if args.command == "train":
            cfg = zoo.preset(args.preset, args.scale)
            if args.seed is not None:
                cfg = dataclasses.replace(cfg, seed=args.seed)
            man = zoo.train(
                cfg, args.out, shard=args.shard, device=args.device, progress=not args.no_progress
            )
            state = "complete" if man["complete"] else "incomplete"
            print(
                f"{args.out}: {len(man['models'])} models, {state}"
                + (f" (shard {args.shard[0]}/{args.shard[1]})" if args.shard else "")
            )
        elif args.command == "merge":
            man = zoo.merge(args.shards, args.out)
            print(f"{args.out}: merged {len(args.shards)} shards, {len(man['models'])} models")
        elif args.command == "info":
            if args.check:
                zoo.load(args.path)
            print(zoo.info(args.path))
        elif args.command == "list-presets":
            for name in sorted(zoo.PRESETS):
                for scale in SCALES:
                    c = zoo.preset(name, scale)
                    print(
                        f"{name:24s} {scale:6s} {c.arch:9s} {c.n_models:5d} models x "
                        f"{c.recipe.epochs:3d} epochs, "
                        f"{c.dataset} ({c.source}, n_train={c.n_train or 'all'})"
                    )
    except (zoo.ZooError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"symlib: error: {e}", file=sys.stderr)
        return 2
    return 0
