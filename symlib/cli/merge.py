"""``symlib merge A B --to OUT``: the average of two networks after matching their neurons
(:func:`symlib.merge`), written as a symlib folder of one network."""

from __future__ import annotations

from symlib.cli import sources

HOWS = ("none", "weights", "activations")
"""The ways of matching, as ``symlib.symmetry.merge.HOWS`` (written out: parsing imports no torch)."""
HOW_HELP = ("none (the plain average), weights (weight matching) or activations (activation matching on "
            "the embedded MNIST training digits; on 256 random token sequences for a text model)")


def add_matching_options(p) -> None:
    """The options ``merge`` and ``barrier`` share: ``--orthogonal`` and ``--seed``."""
    p.add_argument("--orthogonal", action="store_true",
                   help="also rotate B's residual stream and each attention head onto A's (pre-norm "
                        "transformers; nothing to rotate otherwise)")
    p.add_argument("--seed", type=int, default=0, help="of the weight matching's visiting order")


def add_parser(sub) -> None:
    """Add the ``merge`` group to the subparsers ``sub`` of :func:`symlib.cli.parser`."""
    p = sub.add_parser(
        "merge",
        help="average two networks after matching their neurons (weight or activation matching)",
        description="Match the hidden neurons of network B to those of network A (symlib.merge: weight "
        "matching, or activation matching on the embedded MNIST digits; B's function is unchanged), "
        "average the two, and write the merged network as a symlib folder that symlib.load and every "
        "symlib command read. A and B are checkpoint files or folders holding one network each, of one "
        "architecture (named by a symlib folder, a config.json beside the weights, or --model).",
    )
    p.add_argument("a", help="the first network (a checkpoint file or folder; its neurons keep their order)")
    p.add_argument("b", help="the second network (matched to A before the average)")
    p.add_argument("--to", required=True, help="the folder to create (must not exist, or be empty)")
    p.add_argument("--how", choices=HOWS, default="weights", help=HOW_HELP)
    p.add_argument("--t", type=float, default=0.5, metavar="T",
                   help="weight of B in the average (default 0.5; 0: A, 1: B matched to A)")
    add_matching_options(p)
    sources.add_arguments(p)


def read_pair(args):
    """``(a, b, recipe, spec, model)``: the two networks of ``args.a`` and ``args.b`` (one each, unstacked),
    their architecture, its traced symmetries and a freshly built copy of the network."""
    from symlib.ckpt import loader
    from symlib.ckpt import recipe as recipes
    from symlib.ckpt.errors import CheckpointError
    from symlib.params import unstack

    opts = sources.options(args)
    model, prefix = opts.pop("model"), opts.pop("prefix")
    got = []
    for path in (args.a, args.b):
        one = loader.read(path, model, prefix, **opts)
        if one.n != 1:
            raise CheckpointError(f"{path}: holds {one.n} networks; {args.group} takes one network per side "
                                  f"(a checkpoint file, or a folder holding one)")
        got.append(one)
    ga, gb = got
    recipe = ga.recipe or gb.recipe
    if recipe is None:
        raise CheckpointError("the architecture of these checkpoints is unknown: pass --model "
                              "MODULE:CALLABLE (with --model-args JSON and --input-shape C,H,W), or keep the "
                              "Hugging Face or timm config.json beside the weights")
    a, b = unstack(ga.params, 0), unstack(gb.params, 0)
    if set(a) != set(b) or any(a[k].shape != b[k].shape for k in a):
        k = next((k for k in sorted(set(a) ^ set(b))), None) or next(k for k in a if a[k].shape != b[k].shape)
        raise CheckpointError(f"{args.a} and {args.b} hold different architectures (tensor {k!r} differs); "
                              f"{args.group} takes two networks of one architecture")
    origin = "--input-shape" if args.input_shape is not None else f"recorded for {args.a}"
    spec = recipes.spec(recipe, origin=origin, **sources.trace_options(args))
    return a, b, recipe.with_shape(spec.input_shape), spec, recipe.build()


MATCHING_TOKENS = 256
"""Sequences of token ids activation matching reads on the command line for a network that reads tokens."""


def matching_batch(spec):
    """The inputs activation matching reads on the command line: the embedded MNIST training digits, in
    the network's input shape; for a network that reads token ids (``spec.vocab``, a text model),
    :data:`MATCHING_TOKENS` sequences of the traced length drawn uniformly from the vocabulary (seed 0):
    matching compares how two networks' features respond to the same inputs, which any tokens exercise."""
    import torch

    from symlib import data
    from symlib.stats.barrier import fit_inputs

    if spec.vocab is not None:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(0, spec.vocab, (MATCHING_TOKENS, *spec.input_shape), generator=gen)
    return fit_inputs(spec.input_shape, data.load("mnist", "train").x)


def run(args) -> None:
    """Carry out a parsed ``symlib merge ...`` command (:func:`symlib.cli.main` reports its errors)."""
    from symlib.ckpt import convert
    from symlib.params import stack
    from symlib.symmetry.merge import merge

    convert.check_out(args.to)  # before any work
    a, b, recipe, spec, model = read_pair(args)
    batch = matching_batch(spec) if args.how == "activations" else None
    merged = merge(a, b, spec, how=args.how, batch=batch, t=args.t, orthogonal=args.orthogonal, model=model,
                   seed=args.seed)
    source = {"from": [str(args.a), str(args.b)], "how": args.how, "orthogonal": args.orthogonal,
              "t": args.t, "seed": args.seed}
    man = convert.write(stack([merged]), args.to, recipe, method="merge", source=source)
    print(f"{args.to}: {man['arch']} merged from {args.a} and {args.b} (how={args.how}"
          f"{', orthogonal' if args.orthogonal else ''}, t={args.t:g})")
