"""``symlib compare A B``: the paper's MMD between two checkpoint folders (:mod:`symlib.comparison`)."""

from __future__ import annotations

from symlib.cli import sources


def add_parser(sub) -> None:
    """Add the ``compare`` group to the subparsers ``sub`` of :func:`symlib.cli.parser`."""
    c = sub.add_parser(
        "compare",
        help="the paper's MMD between two checkpoint sets, per layer, with intervals and p-values",
        description="Compare two zoos, posterior sample sets or exported datasets (hf://owner/name too), or "
        "checkpoint files, folders or globs of one's own network (with --model where they do not say it), "
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
    sources.add_arguments(c)


def run(args) -> None:
    """Carry out a parsed ``symlib compare ...`` command (:func:`symlib.cli.main` reports its errors)."""
    from symlib import comparison

    syms = [s.strip() for s in args.symmetries.split(",") if s.strip()]
    if args.json is not None:
        comparison.check_json(args.json)  # before the comparison: never after minutes of work
    res = comparison.compare(args.a, args.b, syms, n_permutations=args.permutations,
                             n_bootstrap=args.bootstrap, seed=args.seed, device=args.device,
                             **sources.options(args), **sources.trace_options(args))
    if args.json != "-":
        print(res.format())
    if args.json is not None:
        comparison.write_json(res, args.json)
