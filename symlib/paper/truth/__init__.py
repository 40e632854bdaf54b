r"""Table 1 against the true posterior: every approximation beside a converged replica-exchange HMC sample
(book: chapter "Against the true posterior"; beyond the paper).

The paper judges posterior approximations by their distance to 1,000 independently trained networks (a
deep-ensemble target). On the problem of :mod:`symlib.paper.pca_digits` the Bayesian posterior itself can be
sampled to convergence (:mod:`symlib.paper.frontier`), so every approximation is measured against both:

* :mod:`symlib.paper.truth.references`: the reference posteriors, sampled until certified
  (:func:`reference`; committed once at the ``cpu`` scale, :func:`commit`, :func:`committed`), turned into
  networks (:func:`reference_set`) and summarised (:func:`reference_summary`);
* here: :func:`plan`, :func:`replicate_seeds` and :func:`produce` give Table 1's rows for the MLP (every
  method of :mod:`symlib.posteriors` one-mode and multi-mode from several run seeds, a deep ensemble of 100,
  and the DE target of 1,000 networks trained with other seeds), cached like the OptuNet sets
  (:func:`symlib.paper.table1.produce`); :func:`probabilities` evaluates stacked networks,
  :func:`predictive_agreement` compares two predictive distributions as Izmailov et al. (2021) do;
  :func:`fill` fills ``make zoo``'s caches and :func:`main` is ``python -m symlib.paper.truth``;
* :mod:`symlib.paper.truth.rankings` answers the reviewers' question: does ranking the approximations by
  their distance to the DE target rank them as their distance to the true posterior does? Kendall's
  :math:`\tau` between the two orders, with the MMDs' bootstrap and over every combination of replicates
  and references.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from symlib import scales as _scales
from symlib.paper import frontier as _frontier
from symlib.paper import pca_digits as _pd
from symlib.paper.truth.rankings import (  # noqa: F401  (the package's names)
    SYMMETRIES,
    agreement_frame,
    distances,
    kendall,
    labelled,
    layered_sets,
    ranking_agreement,
    replicated_agreement,
    replicated_distances,
    replicated_tau,
    spread,
)
from symlib.paper.truth.references import (  # noqa: F401  (the package's names)
    COMMITTED,
    HIDDEN,
    HIDDEN_LARGE,
    MAX_BYTES,
    PILOT,
    REFERENCE,
    REFERENCE_SEEDS,
    REPLAY_ROUNDS,
    TARGET_ACCEPT,
    Reference,
    _committed_paths,
    commit,
    committed,
    pilot,
    pilot_frame,
    reference,
    reference_set,
    reference_summary,
    replay,
)

__all__ = ["COMMITTED", "HIDDEN", "HIDDEN_LARGE", "HYPER", "MAX_BYTES", "PILOT", "REFERENCE",
           "REFERENCE_SEEDS", "REPLAY_ROUNDS", "REPLICATES", "Reference", "SYMMETRIES", "TARGET_ACCEPT",
           "TARGET_SEED_OFFSET", "agreement_frame", "commit", "committed", "distances", "fill", "kendall",
           "labelled", "layered_sets", "main", "pilot", "pilot_frame", "plan", "predictive_agreement",
           "probabilities", "produce", "ranking_agreement", "reference", "reference_set",
           "reference_summary", "replay", "replicate_seeds", "replicated_agreement",
           "replicated_distances", "replicated_tau", "spread", "target_size"]

HYPER: dict[str, dict[str, Any]] = {
    "dropout": {"p": 0.2},
    "laplace": {"structure": "full"},
}
"""The methods' settings beyond their defaults for the MLP (dropout's rate, as for OptuNet; Laplace on
all weights with the dense GGN, as for OptuNet)."""

TARGET_SEED_OFFSET = 1
"""The DE target is trained with run seed ``seed + 1``: seeds disjoint from every other row's."""

REPLICATES = {"tiny": 2, "cpu": 3, "paper": 5}
"""Independent replicates (run seeds, :func:`replicate_seeds`) of every approximation per scale."""


def target_size(scale: str) -> int:
    """Networks of the DE target: 1,000 (``tiny``: 12)."""
    return _scales.pick(scale, tiny=12, cpu=1000, paper=1000)


def plan(scale: str) -> list:
    """Table 1's rows for the MLP: :func:`symlib.paper.table1.plan` (every approximation one-mode and
    multi-mode, DE) with :data:`HYPER`, without OptuNet's local HMC row (the reference here is
    :func:`reference`)."""
    from symlib.paper import table1

    return table1.plan(scale, hmc=False, hyper=HYPER)


def replicate_seeds(seed: int = 0, scale: str = "cpu") -> list[int]:
    """The run seeds of the replicated approximations: :data:`REPLICATES` ``[scale]`` seeds from ``seed``
    up, skipping the DE target's (``seed + TARGET_SEED_OFFSET``), so that no replicate shares a network
    with the target or with another replicate (:mod:`symlib.posteriors.seeds`)."""
    n = _scales.pick(scale, **REPLICATES)
    target = seed + TARGET_SEED_OFFSET
    out, r = [], seed
    while len(out) < n:
        if r != target:
            out.append(r)
        r += 1
    return out


def produce(setup, scale: str, seed: int = 0, progress: bool = False,
            timings: dict | None = None, target: bool = True) -> dict[tuple[str, str], Any]:
    """Every row of :func:`plan` with run seed ``seed`` and, with ``target``, the DE target (label
    ``("DE", "target")``, run seed ``seed + TARGET_SEED_OFFSET``), produced or loaded through
    :func:`symlib.paper.table1.produce`."""
    from symlib.paper import table1

    sets = table1.produce(setup, plan(scale), seed, progress=progress, timings=timings)
    if target:
        entry = table1.Entry("ensemble", "target", target_size(scale), 1)
        sets.update(table1.produce(setup, [entry], seed + TARGET_SEED_OFFSET, progress=progress,
                                   timings=timings))
    return sets


def probabilities(params, x: torch.Tensor) -> torch.Tensor:
    """``(S, N, 10)`` softmax outputs (float64) of stacked MLP classifiers (a ``SampleSet`` or a state dict)
    on inputs ``x (N, d)``, by the stacked forward pass (:func:`symlib.training.mlp.mlp_forward`)."""
    from symlib.training import mlp as _mlp

    params = dict(getattr(params, "params", params))
    p = {k: v.double() for k, v in params.items()}
    return torch.softmax(_mlp.mlp_forward(p, x.double()), -1)


def predictive_agreement(p: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    r"""Izmailov et al.'s (2021) comparison of two predictive distributions from per-sample probabilities
    ``p (S, N, K)`` and ``q (S', N, K)`` (each averaged over its samples first): the *agreement*, the share
    of inputs whose most probable class is the same, and the *total variation*
    :math:`\frac1N \sum_n \tfrac12 \sum_k |\bar p_{nk} - \bar q_{nk}|`, both in percent."""
    if p.ndim != 3 or q.ndim != 3 or p.shape[1:] != q.shape[1:]:
        raise ValueError(f"p and q must be (samples, inputs, classes) on the same inputs, got "
                         f"{tuple(p.shape)} "
                         f"and {tuple(q.shape)}")
    pb, qb = p.double().mean(0), q.double().mean(0)
    agree = (pb.argmax(-1) == qb.argmax(-1)).double().mean()
    tv = 0.5 * (pb - qb).abs().sum(-1).mean()
    return {"agreement": 100 * float(agree), "total variation": 100 * float(tv)}


def fill(scale: str = "cpu", device: str = "cpu", seed: int = 0, progress: bool = True) -> dict[str, float]:
    """Produce (or check) what the chapter loads, as it asks for it: the references of :data:`HIDDEN`
    and :data:`HIDDEN_LARGE` (:func:`reference`, one per :data:`REFERENCE_SEEDS`; at the ``cpu`` scale the
    committed ones, never sampled here) and the replicated sample sets of their Table 1 (:func:`produce`
    for every :func:`replicate_seeds`); returns the seconds each took (``make zoo``,
    :mod:`symlib.paper.caches`)."""
    import time

    t0 = time.perf_counter()
    for hidden in (HIDDEN, HIDDEN_LARGE):
        for k in REFERENCE_SEEDS:
            reference(scale, hidden, progress=progress, seed=k, sample=scale != "cpu")
    t1 = time.perf_counter()
    for hidden in (HIDDEN, HIDDEN_LARGE):
        setup = _pd.setup(hidden, scale, device)
        for r in replicate_seeds(seed, scale):
            produce(setup, scale, r, progress=progress, target=r == seed)
    return {"references": t1 - t0, "sample sets": time.perf_counter() - t1}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m symlib.paper.truth``: sample the chapter's references until certified (resumable, in the
    zoo cache) and commit them (:func:`commit`); returns the exit status (1 when one did not certify)."""
    p = argparse.ArgumentParser(prog="python -m symlib.paper.truth",
                                description="Sample and commit the certified references of chapter "
                                            "'Against the true posterior'.")
    p.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN),
                   help="hidden widths: 16, or 4 4")
    p.add_argument("--seeds", type=int, nargs="+", default=list(REFERENCE_SEEDS),
                   help="one independent reference per seed, one after the other (run several commands "
                        "to use several cores)")
    p.add_argument("--budget", type=float, default=REFERENCE["cpu"].budget, help="sampler CPU seconds")
    p.add_argument("--root", default=None, help=f"where to commit (default {COMMITTED})")
    p.add_argument("--pilot", action="store_true",
                   help=f"instead: the short runs that chose the step sizes, into {PILOT}")
    args = p.parse_args(argv)
    if args.pilot:
        doc = pilot(args.hidden, args.seeds)
        print(pilot_frame(doc).to_string(), flush=True)
        return 0
    failed = 0
    for k in args.seeds:
        s = dataclasses.replace(REFERENCE["cpu"], budget=args.budget, seed=k)
        from symlib import zoo

        folder = zoo.cache_dir() / "true-posterior" / _frontier.name(args.hidden, s)
        run = _frontier.run(args.hidden, s, folder, progress=True)
        path = commit(run, args.root, command="python -m symlib.paper.truth " + " ".join(
            ["--hidden", *map(str, args.hidden), "--seeds", str(k), "--budget", f"{args.budget:g}"]))
        ok = run.manifest["converged_at"] is not None
        failed += not ok
        print(f"{tuple(args.hidden)} seed {k}: {'certified' if ok else 'NOT certified'} after "
              f"{run.manifest['cpu_s']:.0f} CPU s; committed {path}", flush=True)
    return 1 if failed else 0


