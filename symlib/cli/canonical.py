"""``symlib canonicalize SRC --to OUT``: the canonical forms of a set
(:func:`symlib.ckpt.convert.canonical`)."""

from __future__ import annotations

from symlib.cli import sources


def add_parser(sub) -> None:
    """Add the ``canonicalize`` group to the subparsers ``sub`` of :func:`symlib.cli.parser`."""
    p = sub.add_parser(
        "canonicalize",
        help="write the canonical forms of a set (unit-norm neurons, sorted) as a symlib folder",
        description="Compute the canonical form of every network of a set (symlib.canonicalize: every "
        "neuron rescaled to unit-norm incoming weights, then sorted; the function of every network "
        "checked unchanged) and write them as a symlib folder. SRC is a symlib folder or checkpoint files "
        "(as for symlib import); the architecture and input shape come from the folder or the options.",
    )
    p.add_argument("src", nargs="+", help="a symlib folder, or checkpoint files, folders or globs")
    p.add_argument("--to", required=True, help="the folder to create (must not exist, or be empty)")
    sources.add_arguments(p)


def run(args) -> None:
    """Carry out a parsed ``symlib canonicalize ...`` command (:func:`symlib.cli.main` reports its errors)."""
    from symlib.ckpt import convert

    opts = sources.options(args)
    src = args.src[0] if len(args.src) == 1 else args.src
    man = convert.canonical(src, args.to, opts.pop("model"), opts.pop("prefix"), **opts,
                            **sources.trace_options(args))
    print(f"{args.to}: canonical forms of {man['n_samples']} networks of {man['arch']} (every function "
          f"checked)")
