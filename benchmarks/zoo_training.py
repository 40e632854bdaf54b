"""Zoo training throughput: the plain one-model-at-a-time loop against symlib's stacked trainer.

Both train OptuNets with the paper's recipe (batch 64, SGD lr 0.04, weight decay 2e-4, random crop 28
with padding 4), each model on its own mini-batches and crops, on the same data for the same number
of epochs. Prints model-epochs per second for both, their ratio, and the fraction of the CPU's peak
FLOP rate that each reaches; the last line is ``speedup: <ratio>x``.

Peak FLOP rate (an estimate, stated as such): cores x clock x FP32 FLOPs per cycle and core, with
32 FLOPs/cycle for AVX-512 (one 16-lane FMA unit), 16 for AVX2 + FMA, 8 otherwise. Useful FLOPs per
image are those of the direct convolutions (conv1 40,000, conv2 8,000, linear 200 multiply-adds x 2),
and a training step counts 3x the forward pass.

Each trainer is timed at 1 thread and at ``--threads`` (default: all), interleaved, and keeps its best rate.

Usage: ``python benchmarks/zoo_training.py [--models 64] [--plain-models 4] [--epochs 1] [--threads N]``.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch

from symlib import models
from symlib import train as T

FORWARD_FLOPS = 2 * (25 * 25 * 2 * 16 + 4 * 4 * 10 * 25 + 10 * 10)  # per image


def peak_flops(cores: int) -> tuple[float, str]:
    """Estimated FP32 peak of ``cores`` cores, and how it was estimated."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        info = ""
    flags = set(re.search(r"^flags\s*:(.*)$", info, re.M).group(1).split()) if "flags" in info else set()
    per_cycle = 32 if "avx512f" in flags else 16 if {"avx2", "fma"} <= flags else 8
    ghz = re.search(r"@\s*([\d.]+)\s*GHz", info)
    if ghz:
        clock = float(ghz.group(1))
    else:
        mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", info, re.M)
        clock = float(mhz.group(1)) / 1000 if mhz else 2.0
    return cores * clock * 1e9 * per_cycle, f"{cores} cores x {clock:.2f} GHz x {per_cycle} FP32 FLOPs/cycle"


def data(n: int) -> tuple[torch.Tensor, torch.Tensor, float, str]:
    try:
        from symlib import data as sdata

        tr = sdata.load("mnist", "train")
        return tr.x[:n], tr.y[:n], float(tr.black[0]), f"embedded MNIST, {min(n, len(tr))} images"
    except Exception as e:  # the benchmark still runs without the data module
        g = torch.Generator().manual_seed(0)
        return (
            torch.randn(n, 1, 28, 28, generator=g),
            torch.randint(0, 10, (n,), generator=g),
            0.0,
            f"random images ({n}; MNIST unavailable: {e})",
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=64, help="models for the stacked trainer")
    ap.add_argument("--chunk", type=int, default=32, help="models per stacked chunk")
    ap.add_argument("--plain-models", type=int, default=4, help="models for the plain loop")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=2, help="best of this many timings per trainer")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, y, fill, what = data(args.n_train)
    recipe = T.OPTUNET_MNIST.scaled(args.epochs)
    print(f"data: {what}; {args.epochs} epoch(s); recipe {recipe}")
    print(f"threads: {args.threads} (os.cpu_count() = {os.cpu_count()})")

    def plain() -> float:
        t = time.perf_counter()
        for s in range(args.plain_models):
            T.train_plain(T.init_model(models.OptuNet, s), s, x, y, recipe, fill=fill)
        return args.plain_models * args.epochs / (time.perf_counter() - t)

    def stacked() -> float:
        t = time.perf_counter()
        for start in range(0, args.models, args.chunk):
            seeds = list(range(start, min(start + args.chunk, args.models)))
            T.train_stacked(T.init_params(models.OptuNet, seeds), seeds, x, y, recipe, fill=fill)
        return args.models * args.epochs / (time.perf_counter() - t)

    # Tiny operators can run slower on 2 threads than on 1 (synchronisation, a busy machine), so each
    # trainer is timed at 1 thread and at --threads, interleaved, and keeps its best rate.
    rates_plain: dict[int, list[float]] = {}
    rates_ours: dict[int, list[float]] = {}
    for threads in sorted({1, args.threads}):
        torch.set_num_threads(threads)
        for _ in range(args.repeats):
            rates_plain.setdefault(threads, []).append(plain())
            rates_ours.setdefault(threads, []).append(stacked())
    p = max(max(r) for r in rates_plain.values())
    o = max(max(r) for r in rates_ours.values())
    peak, how = peak_flops(args.threads)  # the whole machine, whichever thread count won
    flops_per_model_epoch = 3 * FORWARD_FLOPS * x.shape[0]
    print(f"peak (estimate): {peak / 1e9:.0f} GFLOP/s = {how}")
    for name, rate in [
        ("plain loop (nn.Module + torch.optim.SGD, one model at a time)", p),
        (f"symlib.train.train_stacked ({args.chunk} models per chunk)", o),
    ]:
        flops = rate * flops_per_model_epoch
        print(
            f"{name}: {rate:.2f} model-epochs/s, {flops / 1e9:.2f} GFLOP/s, {100 * flops / peak:.2f}% of peak"
        )
    for threads in rates_plain:
        print(
            f"timings at {threads} thread(s), model-epochs/s: "
            f"plain {[round(r, 2) for r in rates_plain[threads]]}, "
            f"stacked {[round(r, 2) for r in rates_ours[threads]]}"
        )
    print(f"speedup: {o / p:.2f}x")


if __name__ == "__main__":
    main()
