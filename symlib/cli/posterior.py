"""``symlib posterior sample | info | status``: posterior sample sets in the zoo format (book: "Table 1")."""

from __future__ import annotations

from symlib.cli import common
from symlib.scales import SCALES


def add_parser(sub) -> None:
    """Add the ``posterior`` group to the subparsers ``sub`` of :func:`symlib.cli.parser`."""
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
        type=common.hyper,
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
    common.fanout_arguments(s)
    st = psub.add_parser("status", help="shards done / running / failed of a `sample --executor` run")
    st.add_argument("path", help="sample set directory")


def _check_counts(args) -> None:
    if args.modes < 1 or args.samples < 1 or args.samples % args.modes:
        raise ValueError(
            f"--samples is the total number of samples and must be a positive multiple of --modes; "
            f"got --samples {args.samples} --modes {args.modes}"
        )


def _check_hyper(args) -> None:
    """``--hyper``: known names and values the method accepts, before any data is loaded or trained."""
    from symlib.posteriors import sampling

    try:
        sampling.method(args.method).check_hyper(dict(args.hyper))
    except ValueError as e:
        raise ValueError(f"--hyper: {e}") from None


def _check_cache(cache) -> None:
    """``--cache``: a folder, or a path where one can be created (before any work). A read-only folder is
    accepted: it may hold the base models already (the zoo cache says so when it must train them)."""
    import os
    from pathlib import Path

    from symlib import store

    if cache is None:
        return
    path = Path(cache)
    if not (path.is_dir() and not os.access(path, os.W_OK)):
        store.check_folder(path, "base models' zoo", "--cache")


def run(args) -> None:
    """Carry out a parsed ``symlib posterior ...`` command (:func:`symlib.cli.main` reports its errors)."""
    from symlib.posteriors import io, sampling

    if args.command == "status" or getattr(args, "executor", None):
        _fanout(args)
        return

    if args.command == "info":
        if args.check:
            io.load_params(args.path)
        print(io.info(args.path))
        return
    from symlib import store

    _check_hyper(args)  # names and values, before loading anything
    _check_cache(args.cache)
    if not io.is_posterior(args.out):  # a file, under a file, read-only, a zoo: refused before any work
        store.check_out(args.out, io.KIND)  # (a sample set there is checked by sampling.run)
    _check_counts(args)
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


def _fanout(args) -> None:
    from symlib import zoo
    from symlib.posteriors import fanout

    if args.command == "status":
        print(zoo.status(args.path).format())
        return
    _check_hyper(args)
    _check_counts(args)
    _check_cache(args.cache)
    per_mode = args.samples // args.modes
    sset = fanout.submit(args.method, args.preset, args.scale, args.modes, per_mode, args.out,
                         args.shards or 8, args.executor, seed=args.seed, hyper=dict(args.hyper),
                         device=args.device, cache_dir=args.cache, resources=common.resources(args),
                         max_retries=args.max_retries, poll_s=args.poll, progress=not args.no_progress,
                         on_poll=None if args.no_progress else common.reporter())
    print(f"{args.out}: {args.method}, {sset.n_modes} modes x {sset.n_per_mode} samples, complete "
          f"(trainings fanned out on {args.executor})")
