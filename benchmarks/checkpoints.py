"""Reading checkpoint files: ``symlib.load_checkpoints`` on 1,000 OptuNet ``.pt`` files against
``symlib.load`` on the same networks stored as a zoo, and against a plain ``torch.load`` loop (book:
"symlib on your own network").

Workload: one in-memory stack of 1,000 OptuNets (default initialisations, float32, 392 parameters each),
written twice into a temporary folder: as a zoo (the chunks and manifest ``symlib zoo train`` writes:
32 networks per safetensors chunk, every chunk checked against its sha256 when read) and as 1,000 files
``torch.save(state_dict)``, one per network, as a training loop leaves them. Both read back equal to the
stack or the script fails. Timed, interleaved, best of ``--rounds``:

* ``zoo``: ``symlib.load(zoo)``;
* ``files``: ``symlib.load_checkpoints(folder)`` (weights-only parsing, one directory and pickle parse per
  layout, bytes copied straight into the stack);
* ``torch.load loop``: ``torch.load(f, weights_only=True)`` per file, then ``symlib.params.stack``.

The target is ``files`` within 2x of ``zoo``; ``speedup`` is the ``torch.load`` loop over ``files``.
``--large`` adds a second workload, 6 files of 32 MB (memory-mapped), copied on two threads and on one,
which sets :data:`symlib.ckpt.loader.MAX_WORKERS`. The last line is ``speedup: <x>x``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import symlib
from symlib import models, store, zoo
from symlib.ckpt import loader
from symlib.zoo import chunks


def write_zoo(stack: dict[str, torch.Tensor], out: Path) -> None:
    """``stack`` as the zoo ``mnist-optunet``/``cpu`` (its 1,000 networks), chunk by chunk, as
    ``symlib zoo train`` writes it."""
    cfg = zoo.preset("mnist-optunet", "cpu")
    out.mkdir()
    records = {}
    for c in range(cfg.n_chunks):
        start, stop = cfg.chunk_range(c)
        recs = [{"seed": cfg.seeds[i], "train_acc": 0.0, "train_loss": 0.0, "test_acc": 0.0, "test_loss": 0.0}
                for i in range(start, stop)]
        meta = {"format": store.FORMAT, "config_hash": cfg.hash, "chunk": str(c), "arch": cfg.arch,
                "models": json.dumps(recs)}
        store.atomic_save({k: v[start:stop] for k, v in stack.items()}, out / store.chunk_name(c), meta)
        records[c] = recs
    every = list(range(cfg.n_chunks))
    chunks.write_manifest(out, cfg, every, records, None, None, every)


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def large(tmp: Path, rounds: int) -> tuple[float, float]:
    """Six 32 MB files: the copy on two threads and on one."""
    folder = tmp / "large"
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        torch.save({"w": torch.randn(8, 1 << 20, generator=gen)}, folder / f"big{i}.pt")
    ref = symlib.load_checkpoints(folder)
    default = loader.PARALLEL_ABOVE, loader.MAX_WORKERS
    threads = one = float("inf")
    try:
        loader.PARALLEL_ABOVE = 0
        for _ in range(rounds):
            loader.MAX_WORKERS = 2
            threads = min(threads, _best(lambda: symlib.load_checkpoints(folder), 1))
            assert _same(symlib.load_checkpoints(folder), ref)
            loader.MAX_WORKERS = 1
            one = min(one, _best(lambda: symlib.load_checkpoints(folder), 1))
    finally:
        loader.PARALLEL_ABOVE, loader.MAX_WORKERS = default
    return threads, one


def main() -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1000, help="networks (default 1000; the zoo preset holds 1000)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, best kept (default 5)")
    p.add_argument("--large", action="store_true", help="also time large files with and without threads")
    args = p.parse_args()
    torch.manual_seed(0)
    stack = symlib.params.stack([models.OptuNet().state_dict() for _ in range(args.n)])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_zoo(stack, tmp / "zoo")
        (tmp / "files").mkdir()
        for i in range(args.n):
            # clones: a view would save the whole stack's storage into every file
            torch.save({k: v.clone() for k, v in symlib.params.unstack(stack, i).items()},
                       tmp / "files" / f"net-{i:04d}.pt")
        files = sorted((tmp / "files").glob("*.pt"))
        # both read back what was written (this also warms the page cache and the imports)
        assert _same(symlib.load(tmp / "zoo")[0], stack), "the zoo does not read back equal"
        assert _same(symlib.load_checkpoints(tmp / "files"), stack), "the files do not read back equal"
        print(f"workload: {args.n} OptuNets ({sum(v[0].numel() for v in stack.values())} parameters each): a "
              f"zoo of {len(list((tmp / 'zoo').glob('chunk-*')))} chunks, {args.n} .pt files of "
              f"{os.path.getsize(files[0])} bytes; best of {args.rounds} rounds; torch threads "
              f"{torch.get_num_threads()}, os.cpu_count() = {os.cpu_count()}")
        zoo_s = files_s = loop_s = float("inf")
        for _ in range(args.rounds):  # interleaved, so that the machine's load hits all alike
            zoo_s = min(zoo_s, _best(lambda: symlib.load(tmp / "zoo"), 1))
            files_s = min(files_s, _best(lambda: symlib.load_checkpoints(tmp / "files"), 1))
            loop_s = min(loop_s, _best(lambda: symlib.params.stack(
                [torch.load(f, weights_only=True) for f in files]), 1))
        print(f"zoo (symlib.load): {zoo_s:.3f} s")
        print(f"files (symlib.load_checkpoints): {files_s:.3f} s")
        print(f"torch.load loop: {loop_s:.3f} s")
        ratio = files_s / zoo_s
        print(f"ratio files / zoo: {ratio:.2f}x (target: below 2x: {'met' if ratio < 2 else 'NOT met'})")
        if args.large:
            threads, one = large(tmp, args.rounds)
            print(f"large files (6 x 32 MB): copy on two threads {threads:.3f} s, on one {one:.3f} s "
                  f"(one / two: {one / threads:.2f}x; MAX_WORKERS here: {loader.MAX_WORKERS})")
    speedup = loop_s / files_s
    print(f"speedup: {speedup:.1f}x")
    return speedup


if __name__ == "__main__":
    main()
