"""Zoo training throughput: the plain one-model-at-a-time loop against symlib's stacked trainer.

Both train OptuNets with the paper's recipe (batch 64, SGD lr 0.04, weight decay 2e-4, random crop 28
with padding 4), each model on its own mini-batches and crops, on the same data for the same number
of epochs. Prints model-epochs per second for both, their ratio, and the fraction of the CPU's peak
FLOP rate that each reaches; the last line is ``speedup: <ratio>x``.

Peak FLOP rate (an estimate, stated as such): cores x clock x FP32 FLOPs per cycle and core, with
32 FLOPs/cycle for AVX-512 (one 16-lane FMA unit, or two 8-lane ones as on AMD Zen 4) and for AVX2 + FMA
(two 8-lane FMA units, as in every such core since Intel Haswell and AMD Zen 2), 8 otherwise. The compiled
kernel's target is printed too (``-march=native``, or ``$SYMLIB_KERNEL_MARCH``: ``x86-64-v3`` builds the AVX2
kernel on an AVX-512 machine, whose share of the same cores' peak can then be compared). Useful FLOPs per
image are those of the direct convolutions (conv1 40,000, conv2 8,000, linear 200 multiply-adds x 2),
and a training step counts 3x the forward pass.

On CPU each trainer is timed at 1 thread and at ``--threads`` (default: all), interleaved, and keeps its
best rate (the stacked trainer splits its models over ``--threads`` worker threads); the work done per
CPU-second is also printed, which other processes on a shared machine distort less than wall time.
With ``--device cuda`` both trainers run on the GPU (the stacked trainer's default CUDA path:
grouped convolutions, full FP32; ``--tf32`` to allow TF32), the peak is the FP32 peak of the device named
by ``torch.cuda.get_device_name`` (H100 SXM ~67 TFLOP/s, H100 PCIe ~51, an estimate), and the defaults
become the paper's sizes (1,000 models stacked, 60,000 images: the embedded digits repeated).

Both report model-epochs/s, the share of the device's peak, and the extrapolated time of the paper-scale
OptuNet zoo (1,000 models x 60 epochs x 60,000 images).

Usage: ``python benchmarks/zoo_training.py [--device cpu|cuda] [--models 64] [--plain-models 4]
[--epochs 1] [--threads N]``.
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch

from symlib import models
from symlib import training as T

FORWARD_FLOPS = 2 * (25 * 25 * 2 * 16 + 4 * 4 * 10 * 25 + 10 * 10)  # per image
PAPER_IMAGE_STEPS = 1000 * 60 * 60000  # the paper's OptuNet zoo: models x epochs x images

# FP32 (non-tensor-core) peaks in TFLOP/s, by a substring of torch.cuda.get_device_name (first match wins).
GPU_PEAKS = [
    ("H100 PCIe", 51.0), ("H100", 67.0), ("H200", 67.0), ("A100", 19.5), ("L40S", 91.6), ("V100", 15.7)
]


def gpu_peak() -> tuple[float, str]:
    """Estimated FP32 peak of the current CUDA device, and how it was estimated."""
    name = torch.cuda.get_device_name()
    for key, tflops in GPU_PEAKS:
        if key in name:
            return tflops * 1e12, f"{name}: FP32 peak ~{tflops:g} TFLOP/s (datasheet, an estimate)"
    return float("nan"), f"{name}: FP32 peak unknown"


def peak_flops(cores: int) -> tuple[float, str]:
    """Estimated FP32 peak of ``cores`` cores, and how it was estimated."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        info = ""
    flags = set(re.search(r"^flags\s*:(.*)$", info, re.M).group(1).split()) if "flags" in info else set()
    per_cycle = 32 if "avx512f" in flags or {"avx2", "fma"} <= flags else 8
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
        reps = -(-n // len(tr))
        xs, ys = tr.x.repeat(reps, 1, 1, 1)[:n], tr.y.repeat(reps)[:n]
        what = f"embedded MNIST, {n} images" + (f" ({len(tr)} digits repeated)" if reps > 1 else "")
        return xs, ys, float(tr.black[0]), what
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
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", type=int, default=None, help="models for the stacked trainer")
    ap.add_argument("--chunk", type=int, default=None, help="models per stacked chunk")
    ap.add_argument("--plain-models", type=int, default=None, help="models for the plain loop")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--n-train", type=int, default=None)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=2, help="best of this many timings per trainer")
    ap.add_argument("--tf32", action="store_true", help="let the CUDA path use TF32 (default full FP32)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no CUDA device; run on a GPU machine or drop the flag")
    defaults = dict(models=1000, chunk=1000, plain_models=1, n_train=60000) if cuda else dict(
        models=64, chunk=32, plain_models=4, n_train=4000
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    torch.set_num_threads(args.threads)
    x, y, fill = data(args.n_train)[:3]
    what = data(args.n_train)[3]
    x, y = x.to(args.device), y.to(args.device)
    if cuda:
        torch.backends.cudnn.benchmark = True
    recipe = T.OPTUNET_MNIST.scaled(args.epochs)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu'}")
    print(f"data: {what}; {args.epochs} epoch(s); recipe {recipe}")
    print(f"threads: {args.threads} (os.cpu_count() = {os.cpu_count()})")
    step = T.step_function("optunet", None, x.device).__name__
    if not cuda:
        from symlib import kernels

        why = kernels.unavailable_reason()
        march = next((f for f in kernels.flags() if f.startswith("-march=")), "")
        note = f" (native kernel unavailable: {why})" if why else f" (compiled kernel, {march})"
        print(f"stacked step: {step}{note}")
    else:
        print(f"stacked step: {step}")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    cpu_rates: dict[str, list[float]] = {"plain": [], "stacked": []}

    def timed(name: str, run) -> float:
        """Model-epochs per second of wall time; also records them per CPU-second of this process."""
        sync()
        t, c = time.perf_counter(), time.process_time()
        n = run()
        sync()
        cpu_rates[name].append(n / (time.process_time() - c))
        return n / (time.perf_counter() - t)

    def plain() -> float:
        def run() -> int:
            for s in range(args.plain_models):
                T.train_plain(T.init_model(models.OptuNet, s), s, x, y, recipe, fill=fill)
            return args.plain_models * args.epochs

        return timed("plain", run)

    def stacked() -> float:
        def run() -> int:
            for start in range(0, args.models, args.chunk):
                seeds = list(range(start, min(start + args.chunk, args.models)))
                theta = T.init_params(models.OptuNet, seeds)  # train_stacked moves it to x's device
                T.train_stacked(theta, seeds, x, y, recipe, fill=fill, tf32=args.tf32)
            return args.models * args.epochs

        return timed("stacked", run)

    # warm-up (oneDNN / cuDNN kernel creation, the allocator), untimed
    seeds = list(range(min(args.chunk, args.models)))
    T.train_stacked(T.init_params(models.OptuNet, seeds), seeds, x, y, recipe, fill=fill, max_steps=3)
    T.train_plain(T.init_model(models.OptuNet, 0), 0, x, y, recipe, fill=fill, max_steps=3)
    # Tiny operators can run slower on 2 threads than on 1 (synchronisation, a busy machine), so on CPU
    # each trainer is timed at 1 thread and at --threads, interleaved, and keeps its best rate.
    rates_plain: dict[int, list[float]] = {}
    rates_ours: dict[int, list[float]] = {}
    for threads in [args.threads] if cuda else sorted({1, args.threads}):
        torch.set_num_threads(threads)
        for _ in range(args.repeats):
            rates_plain.setdefault(threads, []).append(plain())
            rates_ours.setdefault(threads, []).append(stacked())
    p = max(max(r) for r in rates_plain.values())
    o = max(max(r) for r in rates_ours.values())
    peak, how = gpu_peak() if cuda else peak_flops(args.threads)  # the whole machine
    flops_per_model_epoch = 3 * FORWARD_FLOPS * x.shape[0]
    print(f"peak (estimate): {peak / 1e9:.0f} GFLOP/s = {how}")
    for name, rate in [
        ("plain loop (nn.Module + torch.optim.SGD, one model at a time)", p),
        (f"symlib.training.stacked.train_stacked ({args.chunk} models per chunk)", o),
    ]:
        flops = rate * flops_per_model_epoch
        paper_s = PAPER_IMAGE_STEPS / (rate * x.shape[0])
        print(
            f"{name}: {rate:.2f} model-epochs/s, {flops / 1e9:.2f} GFLOP/s, "
            f"{100 * flops / peak:.2f}% of peak; "
            f"paper-scale zoo (1,000 x 60 epochs x 60,000) in {paper_s / 60:.1f} min"
        )
    for threads in rates_plain:
        print(
            f"timings at {threads} thread(s), model-epochs/s: "
            f"plain {[round(r, 2) for r in rates_plain[threads]]}, "
            f"stacked {[round(r, 2) for r in rates_ours[threads]]}"
        )
    if not cuda:  # what a busy machine does not distort as much: the work per CPU-second
        cp, co = max(cpu_rates["plain"]), max(cpu_rates["stacked"])
        print(
            f"per CPU-second of this process (all threads): plain {cp:.2f}, stacked {co:.2f} model-epochs "
            f"({co * flops_per_model_epoch / 1e9:.2f} GFLOP per core-second for the stacked trainer); "
            f"ratio {co / cp:.2f}x"
        )
    print(f"speedup: {o / p:.2f}x")


if __name__ == "__main__":
    main()
