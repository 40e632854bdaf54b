"""Alignment: our spec-driven coordinate descent against a plain loop over neurons (book: chapter
"Alignment"; Rossi et al. 2023, App. C, Fig. A2).

Prints, in one run:

* Wasserstein alignment of two mean-field posteriors of an MLP 784-512-512-512-10 and of a ResNet-20
  (16/32/64 channels, 10 classes, BatchNorm parameters and statistics aligned too). Means are fresh
  PyTorch initialisations, standard deviations uniform in [0.01, 0.1]: random weights suffice to time
  the algorithm (the cost matrices and assignments have the full sizes; the number of rounds of a
  random pair is of the same order as that of trained networks).
* The same alignment written as a plain loop: per label, each cost matrix entry ``C[i, j]`` is
  ``||m0_i - m1_j||^2 + ||s0_i - s1_j||^2`` summed over the layer's tensors, computed pair by pair in
  Python (numpy for the vectors), with the same visiting order and acceptance rule, so it returns the
  same permutations (checked on the small width, where both run). It is timed on a small width and
  **extrapolated** to the full width by its operation count: seconds per pair evaluation measured on
  the small width, times the pairs the full-width run needs (rounds of our full-width run x the sum
  over labels of (tensors) x n^2). The vectors of a pair are longer at full width, so this is a lower
  bound on the loop's time, and the printed speedup is a lower bound too.
* Fig. A2's profile: weight matching of point estimates (``cost="weights"``, the SGD case) against
  the Wasserstein alignment of posteriors (means and stds, the VI case), against the width.

Times are wall-clock seconds on ``--threads`` threads (1 by default, like the numpy loop: the cost
matrices are small, and extra threads only contend on a shared machine); ours and the loop are timed
interleaved, best of ``--repeat``. The last line is ``speedup: <x>x``: the smaller of the MLP and the
ResNet-20 (extrapolated) speedups.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from symlib import models
from symlib.symmetry import align
from symlib.symmetry.spec import mlp_spec
from symlib.symmetry.trace import spec_of


def _posterior(model, seed):
    g = torch.Generator().manual_seed(seed)
    mean = {k: v.detach().clone().double() for k, v in model.state_dict().items()}
    std = {k: 0.01 + 0.09 * torch.rand(v.shape, generator=g, dtype=torch.float64)
           for k, v in mean.items() if v.is_floating_point()}
    return mean, std


def _pair(arch, width, seed=0):
    """Two independent posteriors of one architecture, and its spec."""
    def make(s):
        torch.manual_seed(s)
        if arch == "mlp":
            return models.MLP([784, width, width, width, 10])
        m = models.ResNet20(num_classes=10, width=width)
        models.randomize_batchnorm(m, torch.Generator().manual_seed(s))
        return m.eval()
    m0, m1 = make(seed), make(seed + 1)
    spec = mlp_spec(m0) if arch == "mlp" else spec_of(m0, (3, 32, 32))
    (a, sa), (b, sb) = _posterior(m0, seed + 10), _posterior(m1, seed + 11)
    return spec, a, sa, b, sb


def _names(spec, mean):
    return [k for k in spec.shapes if mean[k].is_floating_point()
            and any(a.param == k and a.perm is not None for a in spec.actions)]


def loop_align(mean0, std0, mean1, std1, spec, seed=0, max_rounds=100):
    """The plain baseline: Python loops over neuron pairs build every cost matrix (no blocks).

    Returns ``(perms, rounds, pairs)`` with ``pairs`` the pair evaluations done.
    """
    names = _names(spec, mean0)
    acts: dict[str, list[tuple[str, int]]] = {}
    for a in spec.actions:
        if a.perm is not None and a.param in names:
            acts.setdefault(a.perm, []).append((a.param, a.axis))
    labels = [k for k in spec.perms if k in acts]
    np0 = {k: (mean0[k].numpy(), std0[k].numpy()) for k in names}
    np1 = {k: (mean1[k].numpy(), std1[k].numpy()) for k in names}
    perms = {k: np.arange(n) for k, n in spec.perms.items()}
    rng = np.random.default_rng(seed)
    pairs, rounds = 0, 0
    while rounds < max_rounds:
        rounds += 1
        changed = False
        for idx in rng.permutation(len(labels)):
            p = labels[idx]
            n = spec.perms[p]
            c = np.zeros((n, n))
            for param, axis in acts[p]:
                a_m, a_s = (np.moveaxis(t, axis, 0).reshape(n, -1) for t in np0[param])
                b = []
                for t in np1[param]:
                    for q, ax in ((a.perm, a.axis) for a in spec.actions if a.param == param):
                        if q is not None and q != p:
                            t = np.take(t, perms[q], axis=ax)
                    b.append(np.moveaxis(t, axis, 0).reshape(n, -1))
                b_m, b_s = b
                for i in range(n):
                    for j in range(n):
                        c[i, j] += np.sum((a_m[i] - b_m[j]) ** 2) + np.sum((a_s[i] - b_s[j]) ** 2)
                pairs += n * n
            _, cols = linear_sum_assignment(c)
            rows = np.arange(n)
            old = perms[p]
            if c[rows, cols].sum() < c[rows, old].sum() - 1e-12 * n * np.abs(c).max():
                perms[p] = cols
                changed = True
        if not changed:
            break
    return perms, rounds, pairs


def _pairs_per_round(spec, mean):
    names = set(_names(spec, mean))
    return sum(spec.perms[a.perm] ** 2 for a in spec.actions if a.perm is not None and a.param in names)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def compare(arch, small, full, repeat):
    """Ours vs the loop on ``small`` (measured), ours on ``full`` and the loop extrapolated."""
    spec, a, sa, b, sb = _pair(arch, small)
    best_ours, best_loop = float("inf"), float("inf")
    for _ in range(repeat):  # interleaved
        t_ours, ours = _timed(lambda: align.align(a, b, spec, sa, sb, cost="wasserstein"))
        t_loop, (perms, rounds, pairs) = _timed(lambda: loop_align(a, sa, b, sb, spec))
        best_ours, best_loop = min(best_ours, t_ours), min(best_loop, t_loop)
    same = all(np.array_equal(ours.perms[k].numpy(), perms[k]) for k in spec.perms)
    if not same or rounds != ours.rounds:
        raise SystemExit(f"{arch} width {small}: the loop and ours disagree ({rounds}/{ours.rounds} rounds)")
    per_pair = best_loop / pairs
    print(f"  width {small:4d}: ours {best_ours:8.3f} s   loop {best_loop:8.3f} s   ({pairs} pair "
          f"evaluations, {rounds} rounds, same permutations)   measured speedup "
          f"{best_loop / best_ours:6.1f}x", flush=True)
    spec, a, sa, b, sb = _pair(arch, full)
    t_full, res = _timed(lambda: align.align(a, b, spec, sa, sb, cost="wasserstein"))
    pairs_full = res.rounds * _pairs_per_round(spec, a)
    est = per_pair * pairs_full
    print(f"  width {full:4d}: ours {t_full:8.3f} s   ({res.rounds} rounds, W2^2 {res.costs[0]:.1f} -> "
          f"{res.cost:.1f})   loop extrapolated >= {est:8.1f} s ({pairs_full} pairs x "
          f"{per_pair * 1e6:.2f} us)   speedup >= {est / t_full:.1f}x", flush=True)
    return est / t_full


def profile(arch, widths):
    """Fig. A2: weight matching of point estimates vs Wasserstein alignment of posteriors."""
    for w in widths:
        spec, a, sa, b, sb = _pair(arch, w)
        t_wm, wm = _timed(lambda a=a, b=b, spec=spec: align.align(a, b, spec, cost="weights"))
        t_w2, w2 = _timed(lambda a=a, b=b, spec=spec, sa=sa, sb=sb:
                          align.align(a, b, spec, sa, sb, cost="wasserstein"))
        print(f"  width {w:4d}: weight matching {t_wm:7.3f} s ({wm.rounds:2d} rounds)   "
              f"Wasserstein {t_w2:7.3f} s ({w2.rounds:2d} rounds)", flush=True)


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--small-mlp", type=int, default=32, help="width where the loop runs")
    ap.add_argument("--small-resnet", type=int, default=4, help="ResNet-20 width where the loop runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("MLP 784-w-w-w-10, Wasserstein alignment of two mean-field posteriors", flush=True)
    s_mlp = compare("mlp", args.small_mlp, 512, args.repeat)
    print("ResNet-20 (w/2w/4w channels), Wasserstein alignment of two mean-field posteriors", flush=True)
    s_res = compare("resnet20", args.small_resnet, 16, args.repeat)
    print("Fig. A2 profile, MLP 784-w-w-w-10", flush=True)
    profile("mlp", [64, 128, 256, 512])
    print("Fig. A2 profile, ResNet-20", flush=True)
    profile("resnet20", [4, 8, 16])
    speedup = min(s_mlp, s_res)
    print(f"speedup: {speedup:.1f}x")
    return speedup


if __name__ == "__main__":
    main()
