"""``symlib barrier A B``: the loss and accuracy barriers on the straight path between two networks, for
every alignment asked (:func:`symlib.barrier`)."""

from __future__ import annotations

import json

from symlib.cli import sources
from symlib.cli.merge import HOWS, add_matching_options


def add_parser(sub) -> None:
    """Add the ``barrier`` group to the subparsers ``sub`` of :func:`symlib.cli.parser`."""
    p = sub.add_parser(
        "barrier",
        help="loss and accuracy barriers between two networks, without and with neuron matching",
        description="Walk the straight path (1-t) A + t B between two networks, with B's neurons first "
        "matched to A's as --how asks, and print the largest bump of the cross-entropy over its chord "
        "(the loss barrier) and the largest dip of the accuracy under its chord (the accuracy barrier), on "
        "the embedded MNIST test digits (1,000 images, no download). A and B are checkpoint files or "
        "folders holding one network each, of one architecture.",
    )
    p.add_argument("a", help="the first network (a checkpoint file or folder)")
    p.add_argument("b", help="the second network")
    p.add_argument("--how", default="none,weights", metavar="LIST",
                   help="comma-separated alignments, each measured: none, weights, activations (activation "
                        "matching on the embedded MNIST training digits); default none,weights")
    p.add_argument("--points", type=int, default=11, metavar="N",
                   help="evenly spaced t from 0 to 1, the ends included (default 11)")
    add_matching_options(p)
    p.add_argument("--json", action="store_true", help="print the numbers (every t too) as JSON")
    sources.add_arguments(p)


def run(args) -> None:
    """Carry out a parsed ``symlib barrier ...`` command (:func:`symlib.cli.main` reports its errors)."""
    from symlib.cli.merge import matching_batch, read_pair
    from symlib.stats import barrier

    hows = [h.strip() for h in args.how.split(",") if h.strip()]
    bad = [h for h in hows if h not in HOWS]
    if not hows or bad:
        raise ValueError(f"--how {args.how!r}: pass a comma-separated list among {list(HOWS)}, e.g. "
                         f"none,weights")
    a, b, recipe, spec, model = read_pair(args)
    if spec.vocab is not None:
        raise ValueError(f"{recipe.name} reads token ids: symlib barrier measures the loss and accuracy on "
                         f"the embedded MNIST test digits, which a text model cannot read; call "
                         f"symlib.barrier(a, b, model, data=(tokens, targets)) in Python with data of your "
                         f"task (symlib merge --how activations works on text models)")
    data = barrier.default_data()
    batch = matching_batch(spec) if "activations" in hows else None
    results = [barrier.barrier(a, b, model, data, spec, align=h, n_points=args.points,
                               orthogonal=args.orthogonal, batch=batch, seed=args.seed) for h in hows]
    if args.json:
        print(json.dumps({"a": str(args.a), "b": str(args.b), "arch": recipe.name,
                          "data": "embedded MNIST test digits", "results": [r.to_dict() for r in results]},
                         indent=1))
        return
    print(f"A: {args.a}\nB: {args.b}\n{recipe.name}, embedded MNIST test digits ({results[0].n} images), "
          f"{args.points} points on the path")
    print(f"{'alignment':22s} {'loss A':>8s} {'loss B':>8s} {'loss barrier':>13s} {'acc A':>7s} "
          f"{'acc B':>7s} {'acc barrier':>12s}")
    for r in results:
        print(f"{r.align:22s} {r.loss[0]:8.4f} {r.loss[-1]:8.4f} {r.loss_barrier:13.4f} {r.accuracy[0]:7.3f} "
              f"{r.accuracy[-1]:7.3f} {r.accuracy_barrier:12.3f}")
