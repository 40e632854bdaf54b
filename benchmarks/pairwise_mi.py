"""Pairwise mutual information for functional collapse (book: chapter "Functional collapse").

All ``N(N-1)/2`` two-member ensembles of ``N`` OptuNets (default 1,000, the paper's §5.1 / App. D.2
size) on the 1,000 embedded MNIST test images: ``pairwise_mi.pairwise_mi`` (blocked, no loop over pairs)
against a straightforward per-pair Python loop (for each pair: average the two members' probabilities,
entropy of the mean minus the mean of the two entropies, averaged over the images; torch on the same
threads, float32 like ours).

* The networks have random weights (PyTorch's default initialisation, one seed per network), not
  trained ones: the cost does not depend on the values, and the probabilities are the softmax outputs of
  real OptuNets (``predict.probs``) with the right shape ``(N, 1000, 10)``.
* The loop is timed on a random subset of pairs (``--loop-pairs``) in two rounds, one before and one after
  the full blocked computation, so that both see the same machine load; its time for all pairs is
  *extrapolated* from its mean time per pair, and the script says so. The loop's values on the subset
  must equal the blocked ones (float32; the tolerance is printed) or the script fails.
* Both run with ``--threads`` torch threads, by default ``torch.get_num_threads()``; ``pairwise_mi``
  splits its row blocks over that many worker threads (each single-threaded), while the loop's tiny
  per-pair operations run on one thread whatever the setting (torch does not split them; measured: the
  same time per pair at 1 and 2 threads), so it is timed the same. ``--threads 1`` gives the
  single-core comparison.

The last line is ``speedup: <x>x``, the extrapolated loop time over the blocked time.
"""

from __future__ import annotations

import argparse
import time

import torch

from symlib import data, models
from symlib import training as T
from symlib.stats import pairwise_mi, predict


def loop_mi(p: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """The baseline: one pair at a time."""

    def entropy(q):
        return -torch.special.xlogy(q, q).sum(-1)

    out = []
    for i, j in pairs:
        mean = (p[i] + p[j]) / 2
        out.append((entropy(mean) - (entropy(p[i]) + entropy(p[j])) / 2).mean().item())
    return torch.tensor(out, dtype=torch.float64)


def _report(what: str, pairs: int, seconds: float) -> None:
    print(f"  {what:<23s} {pairs:>9,} pairs {seconds:9.2f} s {seconds / pairs * 1e6:8.2f} us/pair")


def main(argv=None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=1000, help="number of OptuNets N")
    ap.add_argument("--loop-pairs", type=int, default=500, help="pairs the loop is timed on, per round")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads, and pairwise_mi's workers (default: torch.get_num_threads())")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    x = data.load("mnist", "test").x
    theta = T.init_params(models.OptuNet, range(args.models))
    t = time.perf_counter()
    p = predict.probs(theta, x, "optunet").to(dev)
    n, n_img, c = p.shape
    n_pairs = n * (n - 1) // 2
    print(f"probabilities of {n} randomly initialised OptuNets on {n_img} MNIST test images: "
          f"{tuple(p.shape)} ({time.perf_counter() - t:.1f} s); {n_pairs:,} pairs; device {dev}, "
          f"{args.threads} thread(s) ({args.threads} pairwise_mi worker(s))", flush=True)

    g = torch.Generator().manual_seed(0)
    iu = torch.triu_indices(n, n, 1)
    pick = torch.randperm(n_pairs, generator=g)[: 2 * args.loop_pairs]
    rounds = [pick[: args.loop_pairs], pick[args.loop_pairs :]]

    def timed_loop(idx):
        pairs = list(zip(iu[0, idx].tolist(), iu[1, idx].tolist(), strict=True))
        sync()
        t = time.perf_counter()
        vals = loop_mi(p, pairs)
        sync()
        return time.perf_counter() - t, vals

    t_loop_a, v_a = timed_loop(rounds[0])
    _report("loop, round 1", len(rounds[0]), t_loop_a)
    sync()
    t = time.perf_counter()
    mi = pairwise_mi.pairwise_mi(p, progress=True)
    sync()
    t_ours = time.perf_counter() - t
    _report("pairwise_mi, all pairs", n_pairs, t_ours)
    t_loop_b, v_b = timed_loop(rounds[1])
    _report("loop, round 2", len(rounds[1]), t_loop_b)

    ref = torch.cat([v_a, v_b])
    ours = mi.cpu()[pick]
    atol = 1e-6
    err = float((ours - ref).abs().max())
    print(f"  max |ours - loop| over the {len(ref)} timed pairs: {err:.2e} nats (tolerance {atol:g})")
    print(f"  MI over all pairs: mean {float(mi.mean()):.3e}, min {float(mi.min()):.3e}, "
          f"max {float(mi.max()):.3e} nats")
    if err > atol:
        raise SystemExit(f"pairwise_mi disagrees with the loop by {err:.2e} > {atol:g}")
    per_pair = (t_loop_a + t_loop_b) / len(ref)
    t_loop_all = per_pair * n_pairs
    print(f"  loop, all {n_pairs:,} pairs: {t_loop_all:.1f} s EXTRAPOLATED from its {len(ref)} timed pairs "
          f"({per_pair * 1e6:.0f} us/pair)")
    speedup = t_loop_all / t_ours
    print(f"speedup: {speedup:.1f}x")
    return speedup


if __name__ == "__main__":
    main()
