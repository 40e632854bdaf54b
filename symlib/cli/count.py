"""``symlib count``: the symmetries of a network, counted layer by layer (:func:`symlib.count`)."""

from __future__ import annotations

from symlib.cli import sources


def add_parser(sub) -> None:
    """Add the ``count`` group to the subparsers ``sub`` of :func:`symlib.cli.parser`."""
    p = sub.add_parser(
        "count",
        help="count a network's permutation and scaling symmetries, layer by layer",
        description="Trace the symmetries of a network (symlib.spec_of) and print symlib.count's table: per "
        "permutation label the layers it ties, its channels and groups, its permutations and scaling "
        "degrees of freedom, and the total. The network is --model (with --model-args, --input-shape) or "
        "the architecture a symlib folder or a Hugging Face / timm folder records.",
    )
    p.add_argument("src", nargs="?", default=None, help="a symlib folder or checkpoint folder whose "
                   "architecture to count (optional with --model)")
    p.add_argument("--csv", default=None, metavar="PATH", help="also write the table as CSV")
    sources.add_arguments(p, files=False)


def run(args) -> None:
    """Carry out a parsed ``symlib count ...`` command (:func:`symlib.cli.main` reports its errors)."""
    from symlib.ckpt import recipe as recipes
    from symlib.ckpt.errors import CheckpointError
    from symlib.symmetry import counting

    if args.model is not None:
        recipe = recipes.Recipe.of(args.model, args.model_args, args.input_shape)
    elif args.src is not None:
        recipe = recipes.of_folder(args.src)
        if recipe is None:
            raise CheckpointError(f"{args.src}: records no architecture; pass --model MODULE:CALLABLE")
        recipe = recipe.with_shape(args.input_shape)
    else:
        raise CheckpointError("symlib count needs a network: --model MODULE:CALLABLE (with --input-shape), "
                              "or a folder that records its architecture")
    spec = recipes.spec(recipe, **sources.trace_options(args))
    table = counting.table(spec)
    print(f"{recipe.describe()}, input shape {tuple(spec.input_shape)}")
    print(table.to_string(index=False))
    if args.csv:
        table.to_csv(args.csv, index=False)
