"""The ``symlib`` command (also ``python -m symlib``): one module per group of subcommands.

* :mod:`symlib.cli.zoo`: ``symlib zoo train | repair | merge | info | status | export | list-presets``
  (book: "Checkpoint zoos");
* :mod:`symlib.cli.posterior`: ``symlib posterior sample | info | status`` (book: "Table 1");
* :mod:`symlib.cli.compare`: ``symlib compare A B``, the paper's MMD between two folders;
* :mod:`symlib.cli.importing`, :mod:`symlib.cli.canonical`, :mod:`symlib.cli.count`: ``symlib import SRC
  --to OUT``, ``symlib canonicalize SRC --to OUT`` and ``symlib count --model ...``, for checkpoint files
  of one's own network (:mod:`symlib.ckpt`; their shared options are in :mod:`symlib.cli.sources`);
* :mod:`symlib.cli.merge`, :mod:`symlib.cli.barrier`: ``symlib merge A B --to OUT`` (two networks averaged
  after matching their neurons, :func:`symlib.merge`) and ``symlib barrier A B`` (the loss and accuracy
  barriers on the path between them, :func:`symlib.barrier`).

Each group module has ``add_parser(subparsers)`` and ``run(args)``; :func:`parser` assembles them in the
order of :data:`GROUPS`. Examples::

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
import importlib
import os
import sys
from collections.abc import Sequence

#: The command groups, in the order ``symlib --help`` lists them: name -> module of :mod:`symlib.cli`.
GROUPS = {"zoo": "zoo", "posterior": "posterior", "compare": "compare", "import": "importing",
          "canonicalize": "canonical", "count": "count", "merge": "merge", "barrier": "barrier"}


def _group(name: str):
    return importlib.import_module(f"symlib.cli.{GROUPS[name]}")


def parser() -> argparse.ArgumentParser:
    """The ``symlib`` command's parser, every group and subcommand with its options (the API reference's
    command-line page is rendered from it)."""
    p = argparse.ArgumentParser(
        prog="symlib", description="symlib: weight-space symmetries of neural networks."
    )
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error (also SYMLIB_DEBUG=1)")
    sub = p.add_subparsers(dest="group", required=True, metavar="{" + ",".join(GROUPS) + "}")
    for name in GROUPS:
        _group(name).add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``symlib`` and ``python -m symlib``; returns the exit status.

    A user error (:data:`symlib.errors.USER_ERRORS`: the project's errors and input validation, a missing
    file or optional package, a diverged computation) prints one line, ``symlib: error: ...``, and exits
    with status 2. Anything else is a bug and raises with its traceback. ``--debug`` (or the environment
    variable ``SYMLIB_DEBUG=1``) shows the traceback of user errors too.
    """
    from symlib.errors import USER_ERRORS

    args = parser().parse_args(argv)
    try:
        _group(args.group).run(args)
    except USER_ERRORS as e:
        if args.debug or os.environ.get("SYMLIB_DEBUG", "") not in ("", "0"):
            raise
        print(f"symlib: error: {e}", file=sys.stderr)
        print("symlib: (rerun with --debug, or SYMLIB_DEBUG=1, for the traceback)", file=sys.stderr)
        return 2
    return 0
