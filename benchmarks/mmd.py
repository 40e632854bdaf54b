"""The Table 1 MMD workload: ``symlib.stats.mmd`` against a straightforward numpy implementation (book:
chapter "Table 1").

Workload (paper §4): a target of 1,000 OptuNets against 100 samples of one method, for every layer of
OptuNet (conv1 32, conv2 250, fc + bias 110 parameters), 20 kernels, on raw weights and after removing
symmetries (NS). Weights are random, OptuNet-shaped and float64: the target is 1,000 default
initialisations (independent "modes"), the method 100 Gaussian perturbations (std 0.05) of one more
initialisation (a one-mode method). The symmetry removal is done once beforehand (the same code serves
both sides) and is timed apart.

Compared, interleaved in one run:

* ``symlib``: :func:`symlib.stats.mmd.mmd` on each pair (raw, NS);
* ``loop``: the straightforward implementation, loops over symmetry settings, layers and kernels; for each
  kernel the three blocks of distances are computed with numpy (one row at a time), the kernel applied,
  the blocks summed. With ``--kernels k < 20`` only the first ``k/2`` Laplace and ``k/2`` Gaussian kernels
  of every layer run and its time is scaled by ``20 / k`` (every kernel costs the same: its distances and
  one exponential per pair), which the output says;
* ``loop, shared distances``: the same loops, but the two distance matrices of a layer are computed once
  and serve its 10 kernels each (how far the shared distances alone go).

The values of every layer and kernel that ``loop`` computes must equal ours to 1e-10 (relative) or the script
fails. For the chapter's time budget, one comparison with a permutation test and bootstrap intervals
(``--tests``) is timed too. The last line is ``speedup: <x>x``, ``loop`` over ``symlib``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from symlib import models
from symlib.stats import mmd
from symlib.symmetry import trace


# ------------------------------------------------------------------------------ numpy reference
def np_dist(a: np.ndarray, b: np.ndarray, metric: str) -> np.ndarray:
    if metric == "l1":
        return np.array([np.abs(b - r).sum(1) for r in a])
    return np.array([np.sqrt(((b - r) ** 2).sum(1)) for r in a])


def np_bandwidths(d: np.ndarray) -> np.ndarray:
    d = np.sort(d.ravel())
    low = max(d[int(np.floor(len(d) * 0.05))], 0.1) if d[0] < 0.1 else d[0]
    low, high = low / 2, 2 * max(d[-1], 0.3)
    return np.array([low * (high / low) ** (i / 9) for i in range(10)])


def np_kernel(d: np.ndarray, metric: str, h: float) -> np.ndarray:
    return np.exp(-d / h) if metric == "l1" else np.exp(-((d / h) ** 2))


def np_unbiased(kxx, kyy, kxy) -> float:
    m, n = len(kxx), len(kyy)
    sxx = kxx.sum() - np.trace(kxx)
    syy = kyy.sum() - np.trace(kyy)
    return sxx / (m * (m - 1)) + syy / (n * (n - 1)) - 2 * kxy.sum() / (m * n)


def loop_layer(x, y, kernels, shared: bool) -> dict[int, float]:
    """The straightforward per-layer MMD: ``{kernel index: MMD^2_u}`` for the kernels asked for."""
    h = {metric: np_bandwidths(np_dist(x[:500], y[:500], metric)) for metric in ("l1", "l2")}
    cache = {}
    out = {}
    for kern in kernels:
        metric = "l1" if kern < 10 else "l2"
        if shared and metric in cache:
            dxx, dyy, dxy = cache[metric]
        else:
            dxx, dyy, dxy = np_dist(x, x, metric), np_dist(y, y, metric), np_dist(x, y, metric)
            if shared:
                cache[metric] = (dxx, dyy, dxy)
        bw = h[metric][kern % 10]
        out[kern] = np_unbiased(np_kernel(dxx, metric, bw), np_kernel(dyy, metric, bw),
                                np_kernel(dxy, metric, bw))
    return out


def loop_all(pairs, kernels, shared):
    return {sym: [loop_layer(x.numpy(), y.numpy(), kernels, shared) for x, y in zip(p.x, p.y, strict=True)]
            for sym, p in pairs.items()}


# ------------------------------------------------------------------------------ workload
def workload(m: int, n: int, seed: int):
    torch.manual_seed(seed)
    nets = [models.OptuNet().double().state_dict() for _ in range(m + 1)]
    target = {k: torch.stack([s[k] for s in nets[:m]]) for k in nets[0]}
    mode = nets[m]
    g = torch.Generator().manual_seed(seed + 1)
    method = {k: v + 0.05 * torch.randn((n, *v.shape), generator=g, dtype=v.dtype) for k, v in mode.items()}
    return target, method


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the numpy loops run on one core too)")
    ap.add_argument("--target", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--kernels", type=int, default=4, help="kernels per layer the loop version runs (even)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tests", type=int, default=200,
                    help="also time one comparison with this many permutations and bootstrap resamples")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.kernels % 2 or not 2 <= args.kernels <= 20:
        raise SystemExit("--kernels must be even, between 2 and 20")
    kernels = list(range(args.kernels // 2)) + list(range(10, 10 + args.kernels // 2))
    scale = 20 / args.kernels

    spec = trace.spec_of(models.OptuNet().double(), (1, 28, 28))
    target, method = workload(args.target, args.samples, seed=0)
    t = time.perf_counter()
    pairs = {sym: mmd.prepare(target, method, spec, sym) for sym in ("raw", "ns")}
    prep = time.perf_counter() - t
    print(f"workload: {args.target} target vs {args.samples} method OptuNets (random, float64), "
          f"layers {dict(zip(pairs['raw'].names, pairs['raw'].sizes, strict=True))}, 20 kernels, raw + NS; "
          f"{args.threads} threads", flush=True)
    print(f"  symmetry removal + flattening (both sides, not in the ratios): {prep:.2f} s", flush=True)

    ours_t, loop_t, shared_t = [], [], []
    for _ in range(args.repeat):
        t = time.perf_counter()
        ours = {sym: mmd.mmd(p) for sym, p in pairs.items()}
        ours_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref = loop_all(pairs, kernels, shared=False)
        loop_t.append((time.perf_counter() - t) * scale)
        t = time.perf_counter()
        ref_shared = loop_all(pairs, kernels, shared=True)
        shared_t.append((time.perf_counter() - t) * scale if args.kernels == 20 else time.perf_counter() - t)
        print(f"  round: symlib {ours_t[-1]:.2f} s, loop {loop_t[-1]:.1f} s, "
              f"loop shared {shared_t[-1]:.1f} s", flush=True)

    worst = 0.0
    for sym in pairs:
        for layer, (vals, want) in enumerate(zip(ours[sym].values, ref[sym], strict=True)):
            for kern, v in want.items():
                assert v == ref_shared[sym][layer][kern]
                rel = abs(float(vals[kern]) - v) / max(abs(v), 1e-12)
                worst = max(worst, rel)
    if worst > 1e-10:
        raise SystemExit(f"values differ: largest relative difference {worst:.2e} > 1e-10")
    print(f"  values equal: largest relative difference {worst:.1e} over "
          f"{2 * 3 * len(kernels)} layer x kernel values")
    for sym, r in ours.items():
        print(f"  {sym:>3s}: MMD x100 median/mean/max = "
              + " / ".join(f"{v:.2f}" for v in r.summary().values()))
    if args.tests:
        t = time.perf_counter()
        full = mmd.mmd(pairs["ns"], n_permutations=args.tests, n_bootstrap=args.tests)
        row, took = full.summary(), time.perf_counter() - t
        print(f"  NS with {args.tests} permutations + {args.tests} resamples: {took:.1f} s; "
              f"median x100 {row['median']:.2f} [{row['median_lo']:.2f}, {row['median_hi']:.2f}], "
              f"p = {row['median_p']:.3f}", flush=True)
    ours_s, loop_s, shared_s = min(ours_t), min(loop_t), min(shared_t)
    note = "" if args.kernels == 20 else f" (timed on {args.kernels} of 20 kernels per layer, x {scale:g})"
    print(f"symlib.stats.mmd: {ours_s:.2f} s")
    print(f"loop, shared distances: {shared_s:.1f} s"
          + ("" if args.kernels == 20 else f" (timed on {args.kernels} kernels; its distances are paid once, "
             "so not scaled: a lower bound)") + f" -> {shared_s / ours_s:.1f}x")
    print(f"loop: {loop_s:.1f} s{note}")
    speedup = loop_s / ours_s
    print(f"speedup: {speedup:.1f}x")
    return speedup


if __name__ == "__main__":
    main()
