"""The caches the chapters share, filled as a step of their own (``make zoo``; book: "Checkpoint zoos").

Several chapters load the same expensive results from the zoo cache (``$SYMLIB_CACHE``): the 1,000-network
OptuNet zoo (min-mass, collapse, alignment, Table 1), Table 1's sample sets (twelve posterior
approximations and an HMC reference, with their base models), and the converged posterior of a small MLP
with its own Table 1 (chapter "Against the true posterior"). Filling them here, with progress bars,
before the chapters run means that no chapter cell, and so no nbval cell with its per-cell time-out,
carries minutes of training: the chapters then only load (and check) what is cached. A cache that is
already complete is checked and left alone; a damaged chunk is retrained (:func:`symlib.zoo.load_or_train`).

Run it as ``python -m symlib.paper.caches --scale cpu --device cpu``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence

from symlib import scales as _scales
from symlib import store, zoo

__all__ = ["fill", "main"]

PRESET = "mnist-optunet"
"""The zoo the chapters share (the paper's OptuNets on MNIST)."""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def fill(scale: str = "cpu", device: str = "cpu", seed: int = 0, table1: bool = True,
         progress: bool = True, true_posterior: bool | None = None) -> None:
    """Train (or check) the shared OptuNet zoo at ``scale`` and, with ``table1``, produce (or check)
    Table 1's sample sets exactly as the chapter asks for them (``notebooks/table1.md``: preset
    ``mnist-optunet``, every method one-mode and multi-mode, DE and the HMC reference, run seed ``seed``).

    Args:
        scale: the chapters' scale. device: where to train.
        seed: the chapters' ``seed`` parameter (0 in the book).
        table1: also the sample sets of Table 1.
        progress: progress bars (on stderr).
        true_posterior: also the reference posterior and the sample sets of chapter "Against the true
            posterior" (:func:`symlib.paper.truth.fill`); ``None``: as ``table1``.
    """
    _scales.check_scale(scale)
    cfg = zoo.preset(PRESET, scale)
    path = zoo.cache_path(cfg)
    try:
        cached = zoo.chunks.read_manifest(path).get("complete", False)
    except store.StoreError:
        cached = False
    state = "cached: checking it" if cached else "training it now"
    _say(f"== zoo {PRESET}/{scale}: {cfg.n_models} networks x {cfg.recipe.epochs} epochs in {path} ({state})")
    t0 = time.perf_counter()
    zoo.load_or_train(cfg, device=device, progress=progress)  # checks every chunk, repairs damage
    _say(f"   ready in {time.perf_counter() - t0:.0f} s")
    if table1:
        _table1_sets(scale, device, seed, cfg, progress)
    if table1 if true_posterior is None else true_posterior:
        from symlib.paper import truth

        _say(f"== the true posterior of a {truth.HIDDEN} MLP on projected digits and its Table 1 ({scale})")
        took = truth.fill(scale, device, seed, progress)
        _say("   ready in " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()))


def _table1_sets(scale: str, device: str, seed: int, cfg, progress: bool) -> None:
    from symlib.paper import table1 as _table1
    from symlib.posteriors import sampling

    setup = sampling.setup_for(PRESET, scale, device)
    rows = _table1.plan(scale, hmc=cfg.arch == "optunet")
    where = _table1.sets_dir(setup, seed)
    _say(f"== Table 1's {len(rows)} sample sets in {where}")
    timings: dict = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="VI starts from BLiTZ")  # as the chapter does
        _table1.produce(setup, rows, seed, progress=progress, timings=timings)
    _say(f"   ready in {sum(timings.values()):.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m symlib.paper.caches``: :func:`fill` from the command line; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m symlib.paper.caches", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="cpu", choices=_scales.SCALES, help="the chapters' scale")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="the chapters' seed parameter (default 0)")
    p.add_argument("--no-table1", action="store_true", help="only the zoo, not Table 1's sample sets")
    what = "the reference posterior and sample sets of chapter 'Against the true posterior'"
    p.add_argument("--true-posterior", action="store_true", default=None, dest="true_posterior",
                   help=f"{what} (default: with Table 1's sets)")
    p.add_argument("--no-true-posterior", action="store_false", dest="true_posterior", help=f"not {what}")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    try:
        fill(args.scale, args.device, args.seed, table1=not args.no_table1, progress=not args.no_progress,
             true_posterior=args.true_posterior)
    except (store.StoreError, ValueError, TypeError, RuntimeError, FloatingPointError) as e:
        print(f"symlib.paper.caches: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
