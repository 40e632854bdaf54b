"""The caches the chapters share, filled as a step of their own (``make zoo``; book: "Checkpoint zoos").

Several chapters load the same expensive results from the zoo cache (``$SYMLIB_CACHE``): the 1,000-network
OptuNet zoo (min-mass, collapse, alignment, Table 1), Table 1's sample sets (twelve posterior
approximations and an HMC reference, with their base models), and the replicated sample sets of a small
MLP's own Table 1 with its certified posteriors (chapter "Against the true posterior"; at the ``cpu``
scale the posteriors are committed and only checked here). Filling them here, with progress bars,
before the chapters run means that no chapter cell, and so no nbval cell with its per-cell time-out,
carries minutes of training: the chapters then only load (and check) what is cached. A cache that is
already complete is checked and left alone; a damaged chunk is retrained (:func:`symlib.zoo.load_or_train`).

Run it as ``python -m symlib.paper.caches --scale cpu --device cpu``.
"""

from __future__ import annotations

import argparse
import os
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
    truth_too = table1 if true_posterior is None else true_posterior
    beside = None
    if table1 and truth_too and scale != "cpu":  # the references' one thread beside the sets (cpu: committed)
        _say("== the true posterior's references: sampled in a process of its own, beside Table 1's sets")
        beside = _Beside(scale)
    try:
        if table1:
            _table1_sets(scale, device, seed, cfg, progress)
        if truth_too:
            from symlib.paper import truth

            _say(f"== the true posterior of {truth.HIDDEN} and {truth.HIDDEN_LARGE} MLPs on projected digits "
                 f"and their Table 1 ({scale})")
            alongside = beside.wait() if beside is not None else None
            took = truth.fill(scale, device, seed, progress)
            if alongside is not None:
                took["references"] = alongside
            _say("   ready in " + ", ".join(f"{k} {v:.0f} s" for k, v in took.items())
                 + (" (the references sampled beside Table 1's sets)" if alongside is not None else
                    " (the committed references checked)" if scale == "cpu" else ""))
    finally:
        if beside is not None:
            beside.stop()


def _orphan_watch(parent: int, every: float = 1.0, exit=os._exit) -> None:
    """Exit (status 3) once the process that started this one is gone: a ``make zoo`` killed outright must
    not leave its reference writing on beside the next run (one writer per folder)."""
    while os.getppid() == parent:
        time.sleep(every)
    exit(3)


def _reference_job(scale: str, conn, parent: int) -> None:
    """The child process of :class:`_Beside`: sample (or load) the true posterior's reference."""
    import threading

    threading.Thread(target=_orphan_watch, args=(parent,), daemon=True).start()
    try:
        from symlib.paper import truth

        t0 = time.perf_counter()
        for hidden in (truth.HIDDEN, truth.HIDDEN_LARGE):
            for k in truth.REFERENCE_SEEDS:
                truth.reference(scale, hidden, seed=k)
        conn.send(("ok", time.perf_counter() - t0))
    except BaseException as e:  # sent to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


class _Beside:
    """The true posterior's reference sampled in a process of its own while Table 1's sets are produced.

    The reference runs on one thread (:func:`symlib.paper.truth.reference`), and several of Table 1's rows
    train one network at a time: side by side they keep both cores of a laptop busy, where one after the
    other each left a core idle. The reference is resumable, so stopping it (an error, Ctrl-C) loses at
    most the segment in progress.
    """

    def __init__(self, scale: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's threads
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_reference_job, args=(scale, send, os.getpid()),
                                 name="symlib-true-posterior", daemon=True)
        self._proc.start()
        send.close()

    def wait(self) -> float:
        """Seconds the reference took (in its process); raises its error if it failed."""
        try:
            status, value = self._recv.recv()
        except EOFError:
            self._proc.join()
            raise RuntimeError(
                f"the process sampling the true posterior's reference ended without a result (exit code "
                f"{self._proc.exitcode}: killed, or out of memory?); rerun `make zoo`: it resumes the run"
            ) from None
        self._proc.join()
        if status != "ok":
            raise RuntimeError(f"the true posterior's reference failed: {value}")
        return float(value)

    def stop(self) -> None:
        """End the process if it still runs (after an error in the parent)."""
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join()
        self._recv.close()


def _table1_sets(scale: str, device: str, seed: int, cfg, progress: bool) -> None:
    from symlib.paper import table1 as _table1
    from symlib.posteriors import sampling

    setup = sampling.setup_for(PRESET, scale, device)
    rows = _table1.plan(scale, hmc=cfg.arch == "optunet")
    where = _table1.sets_dir(setup, seed)
    _say(f"== Table 1's {len(rows)} sample sets in {where}")
    if any(e.method == "hmc" for e in rows):  # the committed reference, where one is (cpu scale)
        status, why = _table1.install(setup, seed)
        if status == "installed":
            _say(f"   the HMC reference and its base models: installed from {why}")
        elif status in ("stale", "conflict"):
            _say(f"   the HMC reference is sampled here: {why}")
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
    except (store.StoreError, ValueError, TypeError, RuntimeError, FloatingPointError,
            FileNotFoundError) as e:
        print(f"symlib.paper.caches: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
