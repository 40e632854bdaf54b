"""``symlib zoo train | repair | merge | info | status | export | list-presets`` (book: "Checkpoint zoos")."""

from __future__ import annotations

from symlib.cli import common
from symlib.scales import SCALES


def add_parser(sub) -> None:
    """Add the ``zoo`` group to the subparsers ``sub`` of :func:`symlib.cli.parser`."""
    from symlib import zoo

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
        type=common.shard,
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
    common.fanout_arguments(t)

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


def _config(args):
    import dataclasses

    from symlib import zoo

    cfg = zoo.preset(args.preset, args.scale)
    if args.seed is not None:
        cfg = dataclasses.replace(cfg, seed=args.seed)
    return cfg


def run(args) -> None:
    """Carry out a parsed ``symlib zoo ...`` command (:func:`symlib.cli.main` reports its errors)."""
    from symlib import zoo

    if args.command in ("status", "export") or getattr(args, "executor", None):
        _fanout_or_dataset(args)
    elif args.command == "train":
        man = zoo.train(
            _config(args),
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


def _fanout_or_dataset(args) -> None:
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
    cfg = _config(args)
    n = args.shards if args.shards is not None else min(8, cfg.n_chunks)
    fo = fanout.submit(cfg, args.out, n, args.executor, resources=common.resources(args), device=args.device,
                       max_retries=args.max_retries, poll_s=args.poll, keep_shards=args.keep_shards,
                       on_poll=None if args.no_progress else common.reporter())
    n_models = len(fo.manifest["models"])
    print(f"{args.out}: {n_models} models, complete ({n} shards on {args.executor}, merged)")
