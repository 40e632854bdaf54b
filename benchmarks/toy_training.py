"""Training the gentle example's 10,000 perceptrons: one-at-a-time loop vs symlib's vectorised trainer.

The baseline is what the authors' released notebook does: one ``nn.Module`` per
network, ``torch.optim.SGD``, a Python loop over minibatches and over networks.
It is timed on a subset of networks and extrapolated linearly (each network
costs the same); minibatches are taken by tensor indexing, which is faster than
a ``DataLoader`` and so makes the baseline conservative. symlib's trainer runs
all networks, on the same data and with the same settings (2-2-1, SGD lr 2,
batch 10, 10 epochs).

Usage: ``python benchmarks/toy_training.py [--models 10000] [--subset 20] [--threads N]``.
The last line is ``speedup: <ratio>x``.
"""

from __future__ import annotations

import argparse
import time

import torch

from symlib.paper import toy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=10_000)
    ap.add_argument("--subset", type=int, default=20, help="networks the baseline loop trains")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = toy.two_gaussians(seed=0)
    gen = torch.Generator().manual_seed(0)

    toy.train_mlp_loop(data, generator=gen)  # warm-up
    start = time.perf_counter()
    for _ in range(args.subset):
        toy.train_mlp_loop(data, generator=gen)
    per_model = (time.perf_counter() - start) / args.subset
    loop_total = per_model * args.models

    toy.train_mlps(data, 100, progress=False)  # warm-up
    res = toy.train_mlps(data, args.models, seed=0, progress=False)
    kept = int((res.losses <= 0.01).sum())

    print(f"threads: {torch.get_num_threads()}, networks: {args.models}, epochs: 10, batch: 10")
    print(f"loop (nn.Module + optim.SGD), measured on {args.subset} networks: {per_model * 1e3:.1f} ms each, "
          f"extrapolated to {args.models}: {loop_total:.1f} s")
    print(f"symlib.paper.toy.train_mlps, all {args.models} networks: {res.seconds:.2f} s "
          f"({kept} reach loss <= 0.01)")
    print(f"speedup: {loop_total / res.seconds:.0f}x")


if __name__ == "__main__":
    main()
