"""Kendall's tau between successive sorting permutations: ``symlib.paper.permfreq.kendall_tau`` against a
loop of ``scipy.stats.kendalltau`` calls (book: chapter "Permutations during training").

The workload is what the permutation tracker sees over a training run: ``S`` steps x ``M`` runs x the
layers of a network (``--widths``, padded into one tensor). Both are timed in the same run, interleaved
(``--repeats`` rounds, the best of each kept), and must agree to 1e-12. The last line is
``speedup: <x>x`` (scipy loop time over ours).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from scipy import stats

from symlib.paper import permfreq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=630)  # the cpu-scale zoo recipe
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 10])  # OptuNet's hidden layers
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    width = max(args.widths)
    lengths = torch.tensor(args.widths)
    perms = [torch.rand(args.steps + 1, args.runs, n, generator=g).argsort(-1) for n in args.widths]
    seq = torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in perms], 2)  # S+1,M,L,n

    def ours():
        return permfreq.kendall_tau(seq[1:], seq[:-1], lengths).numpy()

    def scipy_loop():
        a = seq.numpy()
        out = np.empty((args.steps, args.runs, len(args.widths)))
        for s in range(args.steps):
            for m in range(args.runs):
                for l, n in enumerate(args.widths):
                    out[s, m, l] = stats.kendalltau(a[s + 1, m, l, :n], a[s, m, l, :n]).statistic
        return out

    best = {"ours": float("inf"), "scipy": float("inf")}
    for _ in range(args.repeats):
        for name, fn in (("ours", ours), ("scipy", scipy_loop)):
            t0 = time.perf_counter()
            val = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            if name == "ours":
                mine = val
            else:
                ref = val
    err = float(np.abs(mine - ref).max())
    if err > 1e-12:
        raise SystemExit(f"the two disagree by {err:.1e}")
    n_taus = args.steps * args.runs * len(args.widths)
    print(f"{n_taus} taus ({args.steps} steps x {args.runs} runs x widths {args.widths}), "
          f"{args.threads} threads")
    print(f"ours  {best['ours'] * 1e3:9.1f} ms")
    print(f"scipy {best['scipy'] * 1e3:9.1f} ms (one kendalltau call per step, run and layer)")
    print(f"largest difference {err:.1e}")
    print(f"speedup: {best['scipy'] / best['ours']:.0f}x")


if __name__ == "__main__":
    main()
