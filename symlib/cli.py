"""Command line: ``symlib zoo train | repair | merge | info | list-presets`` (book: "Checkpoint zoos") and
``symlib posterior sample | info`` (book: "Table 1").

Examples::

    python -m symlib zoo list-presets
    python -m symlib zoo train --preset mnist-optunet --scale cpu --out zoo/
    python -m symlib zoo train --preset mnist-optunet --scale paper --shard 3/8 --out shards/3 --device cuda
    python -m symlib zoo merge shards/* --out zoo/
    python -m symlib zoo repair zoo/       # retrain exactly the damaged or missing chunks
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
    """The ``symlib`` command's parser, every group and subcommand with its options (the API reference's
    command-line page is rendered from it)."""
    from symlib import zoo

    p = argparse.ArgumentParser(
        prog="symlib", description="symlib: weight-space symmetries of neural networks."
    )
    sub = p.add_subparsers(dest="group", required=True, metavar="{zoo,posterior,compare}")
    zp = sub.add_parser(
        "zoo",
        help="train, merge and inspect checkpoint zoos",
        description="Checkpoint zoos: many independently trained networks in one folder.",
    )
    zsub = zp.add_subparsers(
        dest="command", required=True, metavar="{train,repair,merge,info,status,export,list-presets}"
    )

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
    t.add_argument(
        "--repair",
        action="store_true",
        help="retrain chunks found damaged (checksum, unreadable) and rebuild a damaged manifest from the "
        "valid chunks, instead of refusing them",
    )

    r = zsub.add_parser(
        "repair",
        help="retrain exactly the damaged or missing chunks of a zoo",
        description="Check every chunk of a zoo (or shard) in full and retrain exactly the damaged or "
        "missing ones, from the configuration its manifest records (the same seeds give the same "
        "weights, bit for bit); valid chunks are not touched.",
    )
    r.add_argument("path", help="zoo directory")
    r.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")

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
    _fanout_arguments(t)
    _zoo_dataset_parsers(zsub)
    _posterior_parser(sub)
    _compare_parser(sub)
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
    psub = pp.add_subparsers(dest="command", required=True, metavar="{sample,info,status}")
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
    _fanout_arguments(s)
    st = psub.add_parser("status", help="shards done / running / failed of a `sample --executor` run")
    st.add_argument("path", help="sample set directory")


def _posterior_main(args) -> None:
    from symlib.posteriors import io, sampling

    if args.command == "status" or getattr(args, "executor", None):
        _posterior_fanout_main(args)
        return

    if args.command == "info":
        if args.check:
            io.load_params(args.path)
        print(io.info(args.path))
        return
    from symlib import store

    sampling.method(args.method).check_hyper(dict(args.hyper))  # before loading anything
    if not io.is_posterior(args.out):  # a file, under a file, read-only, a zoo: refused before any work
        store.check_out(args.out, io.KIND)  # (a sample set there is checked by sampling.run)
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


# ----------------------------------------------------------------------------- fan-out, datasets, compare


def _fanout_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``--executor`` (:mod:`symlib.zoo.fanout`), on ``zoo train`` and ``posterior sample``."""
    g = p.add_argument_group(
        "fan-out with submitit",
        "--executor submits the shards as one job array, watches them, resubmits the ones killed or "
        "preempted (they resume from their last chunk) and merges them when all are done; rerunning the "
        "same command reattaches. `symlib zoo status OUT` shows where the shards stand.",
    )
    g.add_argument("--executor", choices=("local", "slurm"), default=None,
                   help="slurm: one SLURM job array; local: processes on this machine (same code path)")
    g.add_argument("--shards", type=int, default=None, help="number of shards (default: min(8, chunks))")
    g.add_argument("--partition", default=None, help="SLURM partition")
    g.add_argument("--time", type=int, default=240, metavar="MIN", help="time limit per shard in minutes "
                   "(default 240; a shard that reaches it is requeued and resumes)")
    g.add_argument("--gpus-per-task", type=int, default=0, help="GPUs per shard (default 0)")
    g.add_argument("--cpus-per-task", type=int, default=None, help="CPU cores per shard")
    g.add_argument("--mem-gb", type=float, default=None, help="memory per shard in GB")
    g.add_argument("--array-parallelism", type=int, default=None, metavar="N",
                   help="at most N shards at once (slurm_array_parallelism)")
    g.add_argument("--setup", action="append", default=[], metavar="CMD",
                   help="shell line run before each shard, e.g. 'source .venv/bin/activate'; repeatable")
    g.add_argument("--max-retries", type=int, default=2, help="resubmissions of a killed shard (default 2)")
    g.add_argument("--poll", type=float, default=30.0, metavar="S", help="seconds between looks (default 30)")
    g.add_argument("--keep-shards", action="store_true", help="keep the shard folders after the merge")


def _zoo_dataset_parsers(zsub) -> None:
    st = zsub.add_parser("status", help="shards done / running / pending / failed of a fan-out",
                         description="Where a `symlib zoo train --executor ...` fan-out stands.")
    st.add_argument("path", help="the zoo folder (--out of the fan-out)")
    e = zsub.add_parser(
        "export",
        help="write a zoo as a dataset folder for the Hugging Face Hub",
        description="Export a complete zoo (or posterior sample set) as a dataset folder: the safetensors "
        "chunks, a manifest table (checkpoints.csv, one row per checkpoint with the sha256 of its chunk), "
        "a dataset card (README.md) and a Croissant description (croissant.json, validated with "
        "mlcroissant when installed). Upload it with `hf upload OWNER/NAME OUT . --repo-type dataset`.",
    )
    e.add_argument("path", help="zoo or sample-set folder")
    e.add_argument("--to", required=True, help="the dataset folder to create (must not exist)")
    e.add_argument("--name", default=None, help="the dataset's name (default: the --to folder's name)")
    e.add_argument("--license", default="mit", help="license of the weights, a Hub identifier (default mit)")
    e.add_argument("--repo", default=None, metavar="OWNER/NAME", help="its Hub repository, for the card")
    e.add_argument("--no-validate", action="store_true", help="do not validate croissant.json")


def _compare_parser(sub) -> None:
    c = sub.add_parser(
        "compare",
        help="the paper's MMD between two checkpoint sets, per layer, with intervals and p-values",
        description="Compare two zoos, posterior sample sets or exported datasets (hf://owner/name too) "
        "with the paper's MMD (100 x MMD^2_u, median over 20 kernels per layer; 'all': mean over layers "
        "weighted by their sizes), raw and without symmetries, with bootstrap intervals and permutation "
        "p-values. A plays the paper's target (its distances set the bandwidths).",
    )
    c.add_argument("a", help="first set (the target)")
    c.add_argument("b", help="second set")
    c.add_argument("--symmetries", default="raw,ns", help="comma-separated removals: raw, ns (the paper's), "
                   "minmass, perm, scale (default raw,ns)")
    c.add_argument("--permutations", type=int, default=200, metavar="N", help="permutation test re-splits "
                   "(default 200; 0: none)")
    c.add_argument("--bootstrap", type=int, default=200, metavar="N",
                   help="bootstrap resamples (default 200)")
    c.add_argument("--seed", type=int, default=0, help="of the permutations and resamples")
    c.add_argument("--device", default="cpu", help="cpu or cuda")
    c.add_argument("--json", default=None, metavar="PATH",
                   help="also write the numbers as JSON ('-': stdout)")


def _resources(args):
    from symlib.zoo import fanout

    return fanout.Resources(time_min=args.time, partition=args.partition, gpus_per_task=args.gpus_per_task,
                            cpus_per_task=args.cpus_per_task, mem_gb=args.mem_gb,
                            array_parallelism=args.array_parallelism, setup=tuple(args.setup))


def _reporter():
    last = {}

    def report(st) -> None:
        c = st.counts()
        if c != last:
            last.clear()
            last.update(c)
            print(f"shards: {c['done']} done, {c['running']} running, {c['pending']} pending, {c['failed']} "
                  f"failed", file=sys.stderr, flush=True)

    return report


def _zoo_fanout_main(args) -> None:
    import dataclasses

    from symlib import zoo
    from symlib.zoo import fanout

    if args.command == "status":
        print(zoo.status(args.path).format())
        return
    if args.command == "export":
        to = zoo.export(args.path, args.to, name=args.name, license=args.license, repo=args.repo,
                        validate=False if args.no_validate else None)
        print(f"{to}: exported {args.path} as a dataset ({zoo.dataset.TABLE}, {zoo.dataset.CARD}, "
              f"{zoo.dataset.CROISSANT}); upload: hf upload OWNER/NAME {to} . --repo-type dataset")
        return
    if args.shard is not None:
        raise ValueError("--shard K/N trains one shard by hand; --executor submits all of them: pass one")
    cfg = zoo.preset(args.preset, args.scale)
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, seed=args.seed)
    n = args.shards if args.shards is not None else min(8, cfg.n_chunks)
    fo = fanout.submit(cfg, args.out, n, args.executor, resources=_resources(args), device=args.device,
                       max_retries=args.max_retries, poll_s=args.poll, keep_shards=args.keep_shards,
                       on_poll=None if args.no_progress else _reporter())
    n_models = len(fo.manifest["models"])
    print(f"{args.out}: {n_models} models, complete ({n} shards on {args.executor}, merged)")


def _posterior_fanout_main(args) -> None:
    from symlib import zoo
    from symlib.posteriors import fanout

    if args.command == "status":
        print(zoo.status(args.path).format())
        return
    if args.modes < 1 or args.samples < 1 or args.samples % args.modes:
        raise ValueError(
            f"--samples is the total number of samples and must be a positive multiple of --modes; "
            f"got --samples {args.samples} --modes {args.modes}"
        )
    per_mode = args.samples // args.modes
    sset = fanout.submit(args.method, args.preset, args.scale, args.modes, per_mode, args.out,
                         args.shards or 8, args.executor, seed=args.seed, hyper=dict(args.hyper),
                         device=args.device, cache_dir=args.cache, resources=_resources(args),
                         max_retries=args.max_retries, poll_s=args.poll, progress=not args.no_progress,
                         on_poll=None if args.no_progress else _reporter())
    print(f"{args.out}: {args.method}, {sset.n_modes} modes x {sset.n_per_mode} samples, complete "
          f"(trainings fanned out on {args.executor})")


def _compare_main(args) -> None:
    from symlib import comparison

    syms = [s.strip() for s in args.symmetries.split(",") if s.strip()]
    res = comparison.compare(args.a, args.b, syms, n_permutations=args.permutations,
                             n_bootstrap=args.bootstrap, seed=args.seed, device=args.device)
    if args.json != "-":
        print(res.format())
    if args.json is not None:
        comparison.write_json(res, args.json)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``symlib`` and ``python -m symlib``; returns the exit status."""
    import dataclasses

    from symlib import zoo

    args = parser().parse_args(argv)
    try:
        if args.group == "compare":
            _compare_main(args)
        elif args.group == "posterior":
            _posterior_main(args)
        elif args.command in ("status", "export") or getattr(args, "executor", None):
            _zoo_fanout_main(args)
        elif args.command == "train":
            cfg = zoo.preset(args.preset, args.scale)
            if args.seed is not None:
                cfg = dataclasses.replace(cfg, seed=args.seed)
            man = zoo.train(
                cfg,
                args.out,
                shard=args.shard,
                device=args.device,
                progress=not args.no_progress,
                repair=args.repair,
            )
            state = "complete" if man["complete"] else "incomplete"
            print(
                f"{args.out}: {len(man['models'])} models, {state}"
                + (f" (shard {args.shard[0]}/{args.shard[1]})" if args.shard else "")
            )
        elif args.command == "repair":
            man = zoo.repair(args.path, device=args.device, progress=not args.no_progress)
            state = "complete" if man["complete"] else "incomplete"
            print(f"{args.path}: repaired, {len(man['models'])} models, {state}")
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
    except (zoo.ZooError, ValueError, TypeError, FileNotFoundError, RuntimeError, FloatingPointError,
            ImportError) as e:
        print(f"symlib: error: {e}", file=sys.stderr)
        return 2
    return 0
