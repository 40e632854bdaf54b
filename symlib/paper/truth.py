r"""Table 1 against the true posterior: every approximation beside a converged replica-exchange HMC sample
(book: chapter "Against the true posterior"; beyond the paper).

The paper judges posterior approximations by their distance to 1,000 independently trained networks (a
deep-ensemble target). On the problem of :mod:`symlib.paper.pca_digits` the Bayesian posterior itself can be
sampled to convergence (:mod:`symlib.paper.frontier`), so every approximation is measured against both:

* :func:`reference` samples (or loads from the zoo cache) the posterior of the chosen MLP with the
  chapter's sampler settings (:data:`REFERENCE`: until converged within a budget, or a fixed length), and
  :func:`reference_set` turns its draws into networks;
* :func:`plan` and :func:`produce` give Table 1's rows for the MLP (every method of
  :mod:`symlib.posteriors` one-mode and multi-mode, a deep ensemble of 100, and the DE target of 1,000
  networks trained with other seeds), cached like the OptuNet sets (:func:`symlib.paper.table1.produce`);
* :func:`probabilities` evaluates stacked networks, :func:`predictive_agreement` compares two predictive
  distributions as Izmailov et al. (2021) do: the agreement of their top-1 predictions and the total
  variation between them, averaged over test inputs;
* :func:`kendall` and :func:`ranking_agreement` answer the reviewers' question: does ranking the
  approximations by their distance to the DE target rank them as their distance to the true posterior
  does? Kendall's :math:`\tau` between the two orders, with a bootstrap interval from the MMDs' own
  bootstrap replicates (the same resampled checkpoints in every replicate) and scipy's exact p-value.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from symlib import scales as _scales
from symlib.paper import frontier as _frontier
from symlib.paper import pca_digits as _pd
from symlib.params import Params, unflatten

__all__ = ["HIDDEN", "HYPER", "REFERENCE", "TARGET_SEED_OFFSET", "fill", "kendall", "plan",
           "predictive_agreement", "probabilities", "produce", "ranking_agreement", "reference",
           "reference_set", "target_size"]

HIDDEN: tuple[int, ...] = (2,)
"""The hidden layout of the chapter's Table 1: the largest of the frontier whose reference converges
within the ``cpu`` budget of ``make zoo`` (chapter "Against the true posterior")."""

REFERENCE = {
    "tiny": dataclasses.replace(_frontier.SETTINGS, n_chains=2, warmup=(20, 20), levels=6, segment=20,
                                rounds=40, budget=60.0),
    "cpu": dataclasses.replace(_frontier.SETTINGS, rounds=None, budget=500.0),
    "paper": dataclasses.replace(_frontier.SETTINGS, rounds=5000),
}
r"""The reference sampler per scale: the frontier's settings, at the ``cpu`` scale sampled until the
frontier's criterion holds at a check (every ``segment`` rounds) within 500 sampler CPU seconds (about
five minutes of ``make zoo`` at most, on one thread: see :func:`reference`), at the ``paper`` scale for a
fixed 5,000 rounds. A fixed length at ``cpu`` does not do: from another start (two threads instead of
one change the floating point sums, and so the chains) 1,250 rounds left :math:`\hat R` at 1.018 on
canonical forms where the first run had reached 1.005."""

HYPER: dict[str, dict[str, Any]] = {
    "dropout": {"p": 0.2},
    "laplace": {"structure": "full"},
}
"""The methods' settings beyond their defaults for the MLP (dropout's rate, as for OptuNet; Laplace on
all weights with the dense GGN, as for OptuNet)."""

TARGET_SEED_OFFSET = 1
"""The DE target is trained with run seed ``seed + 1``: seeds disjoint from every other row's."""


def target_size(scale: str) -> int:
    """Networks of the DE target: 1,000 (``tiny``: 12)."""
    return _scales.pick(scale, tiny=12, cpu=1000, paper=1000)


def reference(scale: str = "cpu", hidden: Sequence[int] = HIDDEN, cache_dir: str | os.PathLike | None = None,
              settings: _frontier.Settings | None = None, problem: _pd.Problem = _pd.PROBLEM,
              progress: bool = False) -> _frontier.Run:
    """The posterior of ``hidden`` sampled with :data:`REFERENCE` ``[scale]`` (or ``settings``), in the
    zoo cache (``<cache>/true-posterior/<layout>-<key>``; resumed or loaded when already there).

    The sampler runs on one CPU thread (float64, whatever device the chapter uses), as every run of the
    frontier (:meth:`symlib.paper.frontier.Run.advance`): its budget means the same, and the same chains
    are drawn, on a laptop, a 16-core server beside a GPU or a shared CI machine."""
    from symlib import zoo

    s = settings or _scales.pick(scale, **REFERENCE)
    folder = zoo.cache_dir(cache_dir) / "true-posterior" / _frontier.name(hidden, s, problem)
    return _frontier.run(hidden, s, folder, problem, progress)


def reference_set(run: _frontier.Run, n: int = 1000) -> Params:
    """``n`` draws of the posterior's level evenly spaced along the chains (chain-major, the last draw of
    each chain included), as stacked :class:`symlib.models.MLPClassifier` state dicts (float32)."""
    d = run.draws()["draws"]
    c, s, _ = d.shape
    per = max(1, min(s, -(-n // c)))
    idx = torch.linspace(0, s - 1, per).round().long()
    flat = d[:, idx].reshape(c * per, -1)[:n]
    from symlib.training import mlp as _mlp

    shapes = _mlp.shapes(_pd.widths(run.hidden, run.problem))
    return {k: v.float().contiguous() for k, v in unflatten(flat, shapes).items()}


def plan(scale: str) -> list:
    """Table 1's rows for the MLP: :func:`symlib.paper.table1.plan` (every approximation one-mode and
    multi-mode, DE) with :data:`HYPER`, without OptuNet's local HMC row (the reference here is
    :func:`reference`)."""
    from symlib.paper import table1

    return table1.plan(scale, hmc=False, hyper=HYPER)


def produce(setup, scale: str, seed: int = 0, progress: bool = False,
            timings: dict | None = None) -> dict[tuple[str, str], Any]:
    """Every row of :func:`plan` and the DE target (label ``("DE", "target")``, run seed
    ``seed + TARGET_SEED_OFFSET``), produced or loaded through :func:`symlib.paper.table1.produce`."""
    from symlib.paper import table1

    sets = table1.produce(setup, plan(scale), seed, progress=progress, timings=timings)
    target = table1.Entry("ensemble", "target", target_size(scale), 1)
    sets.update(table1.produce(setup, [target], seed + TARGET_SEED_OFFSET, progress=progress,
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


def kendall(x: Sequence[float], y: Sequence[float]) -> float:
    r"""Kendall's :math:`\tau_b` between two score vectors (ties counted as scipy does); NaN with fewer than
    two finite pairs."""
    from scipy import stats

    a, b = np.asarray(x, np.float64), np.asarray(y, np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 2:
        return float("nan")
    return float(stats.kendalltau(a[ok], b[ok]).statistic)


def ranking_agreement(to_target: Mapping[tuple[str, str], Any], to_truth: Mapping[tuple[str, str], Any],
                      names: Sequence[str], kernels: str = "median",
                      level: float = 0.95) -> dict[str, dict[str, float]]:
    r"""Kendall's :math:`\tau` between the rows' distances to the DE target and to the true posterior.

    Args:
        to_target, to_truth: :func:`symlib.stats.mmd.layered_table` results ``{(name, symmetries):
            Result}`` against each reference, with bootstrap replicates.
        names: the rows ranked (their names in both results).
        kernels: the kernel reduction (``"median"``, Table 1's).
        level: of the percentile interval.

    Returns:
        ``{symmetries: {"tau", "low", "high", "p", "n", "replicates"}}``: :math:`\tau` of the point estimates,
        the percentile interval of :math:`\tau` over the bootstrap replicates (replicate ``b`` of every
        comparison resamples the same target checkpoints), scipy's two-sided p-value of "no association"
        and the number of rows.
    """
    from scipy import stats

    from symlib.stats.mmd.kernels import reduce

    out = {}
    syms = sorted({sym for (_, sym) in to_target} & {sym for (_, sym) in to_truth})
    for sym in syms:
        a = np.array([float(to_target[(n, sym)].value(kernels)) for n in names])
        b = np.array([float(to_truth[(n, sym)].value(kernels)) for n in names])
        res = stats.kendalltau(a, b)
        reps_a = [to_target[(n, sym)].boot for n in names]
        reps_b = [to_truth[(n, sym)].boot for n in names]
        taus = []
        if all(r is not None for r in reps_a + reps_b):
            ra = torch.stack([reduce(r, to_target[(n, sym)].sizes, kernels) for r, n in zip(reps_a, names,
                                                                                           strict=True)])
            rb = torch.stack([reduce(r, to_truth[(n, sym)].sizes, kernels) for r, n in zip(reps_b, names,
                                                                                          strict=True)])
            for j in range(min(ra.shape[1], rb.shape[1])):
                taus.append(kendall(ra[:, j].cpu().numpy(), rb[:, j].cpu().numpy()))
        taus = np.asarray(taus)
        lo, hi = (np.nanquantile(taus, [(1 - level) / 2, (1 + level) / 2]) if taus.size else (np.nan, np.nan))
        out[sym] = {"tau": float(res.statistic), "low": float(lo), "high": float(hi), "p": float(res.pvalue),
                    "n": len(names), "replicates": int(taus.size)}
    return out


def fill(scale: str = "cpu", device: str = "cpu", seed: int = 0, progress: bool = True) -> dict[str, float]:
    """Produce (or check) what the chapter loads, as it asks for it: the reference posterior of
    :data:`HIDDEN` (:func:`reference`) and the sample sets of its Table 1 (:func:`produce`); returns the
    seconds each took (``make zoo``, :mod:`symlib.paper.caches`)."""
    import time

    t0 = time.perf_counter()
    reference(scale, HIDDEN, progress=progress)
    t1 = time.perf_counter()
    produce(_pd.setup(HIDDEN, scale, device), scale, seed, progress=progress)
    return {"reference": t1 - t0, "sample sets": time.perf_counter() - t1}
