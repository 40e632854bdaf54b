"""Command line: ``symlib zoo train | merge | info | list-presets`` (book: "Checkpoint zoos") and
``symlib posterior sample | info`` (book: "Table 1").

Examples::

    python -m symlib zoo list-presets
    python -m symlib zoo train --preset mnist-optunet --scale cpu --out zoo/
    python -m symlib zoo train --preset mnist-optunet --scale paper --shard 3/8 --out shards/3 --device cuda
    python -m symlib zoo merge shards/* --out zoo/
    python -m symlib zoo info zoo/
    python -m symlib posterior sample --method swag --preset mnist-optunet --scale cpu \
        --modes 10 --samples 100 --out posteriors/swag-10x10
    python -m symlib posterior info posteriors/swag-10x10
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
    sub = p.add_subparsers(dest="group", required=True, metavar="{zoo,posterior}")
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
    _posterior_parser(sub)
    return p


def _hyper(text: str) -> tuple[str, object]:
    import json

    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--hyper takes NAME=VALUE (e.g. scale=0.1), got {text!r}")
    k, v = text.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def _posterior_parser(sub) -> None:
    from symlib import zoo
    from symlib.posteriors import METHODS

    pp = sub.add_parser(
        "posterior",
        help="produce and inspect posterior sample sets (Table 1)",
        description="Posterior approximations as sample sets in the zoo format.",
    )
    psub = pp.add_subparsers(dest="command", required=True, metavar="{sample,info}")
    s = psub.add_parser(
        "sample",
        help="produce a method's samples into --out, resuming what is already done",
        description="Apply a posterior method to --modes independently trained base models and write "
        "--samples samples in all (--samples / --modes per mode) into --out, in the zoo format. "
        "Base models are cached in the zoo cache; rerunning the same command resumes an interrupted "
        "run and a finished set is not recomputed.",
    )
    s.add_argument("--method", required=True, choices=METHODS, help="the posterior approximation")
    s.add_argument("--preset", required=True, choices=sorted(zoo.PRESETS), help="the training problem")
    s.add_argument(
        "--scale", default="cpu", choices=SCALES, help="tiny (seconds), cpu (the book), paper (GPU)"
    )
    s.add_argument("--modes", type=int, default=1, help="independently trained base models (default 1)")
    s.add_argument(
        "--samples",
        type=int,
        default=100,
        help="TOTAL number of samples, a multiple of --modes: --samples / --modes per mode "
        "(the paper: --modes 1 --samples 100 and --modes 10 --samples 100)",
    )
    s.add_argument("--out", required=True, help="output directory (created if needed)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    s.add_argument("--seed", type=int, default=0, help="run seed (base models and random streams)")
    s.add_argument(
        "--hyper",
        type=_hyper,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a method hyper-parameter (JSON value), e.g. --hyper scale=0.1; repeatable",
    )
    s.add_argument("--cache", default=None, help="zoo cache for the base models (default $SYMLIB_CACHE)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    i = psub.add_parser("info", help="summarise a posterior sample set")
    i.add_argument("path", help="sample set directory")
    i.add_argument("--check", action="store_true", help="also load and check every file")


def _posterior_main(args) -> None:
    from symlib.posteriors import io, sampling

    if args.command == "info":
        if args.check:
            io.load_params(args.path)
        print(io.info(args.path))
        return
    if args.modes < 1 or args.samples < 1 or args.samples % args.modes:
        raise ValueError(
            f"--samples is the total number of samples and must be a positive multiple of --modes; "
            f"got --samples {args.samples} --modes {args.modes}"
        )
    setup = sampling.setup_for(args.preset, args.scale, args.device)
    sset = sampling.run(
        args.method,
        setup,
        args.modes,
        args.samples // args.modes,
        args.seed,
        args.out,
        progress=not args.no_progress,
        cache_dir=args.cache,
        **dict(args.hyper),
    )
    print(f"{args.out}: {args.method}, {sset.n_modes} modes x {sset.n_per_mode} samples, complete")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``symlib`` and ``python -m symlib``; returns the exit status."""
    import dataclasses

    from symlib import zoo

    args = parser().parse_args(argv)
    try:
        if args.group == "posterior":
            _posterior_main(args)
        elif args.command == "train":
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
            from symlib import checkpoints

            if args.check:
                checkpoints.load(args.path)
            print(checkpoints.info(args.path))
        elif args.command == "list-presets":
            for name in sorted(zoo.PRESETS):
                for scale in SCALES:
                    c = zoo.preset(name, scale)
                    print(
                        f"{name:24s} {scale:6s} {c.arch:9s} {c.n_models:5d} models x "
                        f"{c.recipe.epochs:3d} epochs, "
                        f"{c.dataset} ({c.source}, n_train={c.n_train or 'all'})"
                    )
    except (zoo.ZooError, ValueError, TypeError, FileNotFoundError, RuntimeError, FloatingPointError) as e:
        print(f"symlib: error: {e}", file=sys.stderr)
        return 2
    return 0
