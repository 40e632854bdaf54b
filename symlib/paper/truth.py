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

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from symlib import scales as _scales
from symlib.paper import frontier as _frontier
from symlib.paper import pca_digits as _pd
from symlib.params import Params, unflatten

__all__ = ["COMMITTED", "HIDDEN", "HIDDEN_LARGE", "HYPER", "MAX_BYTES", "PILOT", "REFERENCE",
           "REFERENCE_SEEDS", "REPLICATES", "Reference", "SYMMETRIES", "TARGET_ACCEPT",
           "TARGET_SEED_OFFSET", "agreement_frame", "commit", "committed", "distances", "fill", "kendall",
           "labelled", "layered_sets", "main", "pilot", "pilot_frame", "plan", "predictive_agreement",
           "probabilities", "produce", "ranking_agreement", "reference", "reference_set",
           "reference_summary", "replay", "replicate_seeds", "replicated_agreement",
           "replicated_distances", "replicated_tau", "spread", "target_size"]

HIDDEN: tuple[int, ...] = (2,)
"""The hidden layout of the chapter's Table 1: the largest of the frontier whose reference converges
within the ``cpu`` budget of ``make zoo`` (chapter "Against the true posterior")."""

HIDDEN_LARGE: tuple[int, ...] = (16,)
"""The largest layout the frontier certified: the chapter runs Table 1 on it again, with point distances
(its references committed like :data:`HIDDEN`'s)."""

TARGET_ACCEPT = 0.9
"""The references' target acceptance. At the frontier's 0.75, the pilot runs of the chapter's layout
(:data:`PILOT`) diverged in 3.8% (seed 0) and 14.2% (seed 1) of their trajectories at the posterior's
level within 1,000 draws, above the 1% that the certification rule allows; at 0.9 (a step about two thirds
as long) neither seed had a divergent trajectory at any level."""

REFERENCE = {
    "tiny": dataclasses.replace(_frontier.SETTINGS, n_chains=2, warmup=(20, 20), levels=6, segment=20,
                                rounds=40, budget=60.0, target_accept=TARGET_ACCEPT),
    "cpu": dataclasses.replace(_frontier.SETTINGS, rounds=None, budget=3000.0, target_accept=TARGET_ACCEPT),
    "paper": dataclasses.replace(_frontier.SETTINGS, rounds=5000, target_accept=TARGET_ACCEPT),
}
r"""The reference sampler per scale: the frontier's settings, at the ``cpu`` scale sampled until the
certification rule holds (:func:`symlib.paper.frontier.certify`: the criterion at two checks in a row,
each half alone, few divergences) within 3,000 sampler CPU seconds, on one thread; at the ``paper`` scale
for a fixed 5,000 rounds. At the ``cpu`` scale the certified draws are computed once and committed
(:func:`commit`, ``python -m symlib.paper.truth``), and :func:`reference` loads them."""

REFERENCE_SEEDS: tuple[int, ...] = (0, 1)
"""The independent references of the chapter (their settings' ``seed``: other starts, other random
streams). Their distance to each other is the noise floor of every "matches the posterior"."""

COMMITTED = Path(__file__).parent / "results" / "truth"
"""Where :func:`commit` writes certified references (``<run name>.json`` and ``.safetensors``)."""

REPLAY_ROUNDS = 2
"""Rounds of a fresh start that a committed reference records (:func:`replay`), to check that this code
and these settings begin the same chains."""

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


@dataclasses.dataclass
class Reference:
    """A reference posterior: its kept draws of the posterior's level and what its run recorded.

    Attributes:
        hidden, settings, problem: the layout and the sampler settings it was drawn with.
        samples: ``(C, S, D)`` float64 draws (chains, draws, flat parameters).
        manifest: the run's record (checks, warm-up phases, CPU and wall seconds, ``converged_at``).
        stats: the ladder's state when the run ended (:meth:`symlib.posteriors.hmc.ladder.Ladder.stats`).
        source: ``"committed"`` (loaded from :data:`COMMITTED`) or ``"sampled"`` (a run of the zoo cache).
        thin: every ``thin``-th kept draw is in ``samples`` (committed references, :func:`commit`).
    """

    hidden: tuple[int, ...]
    settings: _frontier.Settings
    problem: _pd.Problem
    samples: torch.Tensor
    manifest: dict[str, Any]
    stats: dict[str, Any]
    source: str = "sampled"
    thin: int = 1
    _memo: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def from_run(cls, run: _frontier.Run) -> Reference:
        """The reference of a finished :class:`symlib.paper.frontier.Run`."""
        return cls(run.hidden, run.settings, run.problem, run.draws()["draws"], dict(run.manifest),
                   run.ladder.stats(), "sampled")

    @property
    def certified(self) -> bool:
        """Whether the run met the certification rule at its last check."""
        return self.manifest["converged_at"] is not None

    def draws(self) -> dict[str, torch.Tensor]:
        """``{"draws": (C, S, D)}`` (as :meth:`symlib.paper.frontier.Run.draws`)."""
        return {"draws": self.samples}

    def _quantities(self):
        """The draws, their canonical forms and invariant functionals (computed once)."""
        if self._memo is None:
            self._memo = self._compute()
        return self._memo

    def _compute(self):
        d = self.samples
        lik, _ = _pd.likelihood(self.hidden, self.problem)
        c, s, n = d.shape
        flat = d.reshape(c * s, n)
        nll = torch.cat([lik(flat[i : i + 2000])[0] for i in range(0, c * s, 2000)]).reshape(c, s)
        pot = nll + 0.5 * (d * d).sum(2) / self.problem.prior_sd**2
        inv = {"potential": pot, **_frontier.functionals(d, self.hidden, self.problem, self.settings.n_probe)}
        return d, _frontier.canonical_forms(d, self.hidden, self.problem), inv

    def report(self):
        """The diagnostics (raw, canonical, invariant; :func:`symlib.paper.frontier.judge`) recomputed from
        the draws: canonical forms, potential and predictive functionals."""
        d, canon, inv = self._quantities()
        return _frontier.judge(d, canon, inv, self.hidden, self.problem)

    def halves(self) -> list[float]:
        """The worst :math:`\\hat R` (canonical forms and invariant functionals) of each half of the draws
        judged alone, recomputed (the rule's second part, :func:`symlib.paper.frontier.halves`)."""
        d, canon, inv = self._quantities()
        return _frontier.halves(d, canon, inv, self.hidden, self.problem)


def _committed_paths(hidden, settings: _frontier.Settings, problem: _pd.Problem,
                     root: str | os.PathLike | None = None) -> tuple[Path, Path]:
    base = Path(root) if root is not None else COMMITTED
    name = _frontier.name(hidden, settings, problem)
    return base / f"{name}.json", base / f"{name}.safetensors"


def committed(hidden: Sequence[int] = HIDDEN, settings: _frontier.Settings | None = None,
              problem: _pd.Problem = _pd.PROBLEM, root: str | os.PathLike | None = None) -> Reference | None:
    """The committed reference of ``hidden`` with ``settings`` (default: :data:`REFERENCE` ``["cpu"]``),
    or ``None`` when none was committed for exactly these settings and data (:func:`commit`)."""
    from safetensors.torch import load_file

    s = settings or REFERENCE["cpu"]
    meta, tensors = _committed_paths(hidden, s, problem, root)
    if not meta.exists():
        return None
    doc = json.loads(meta.read_text())
    key = _frontier.name(hidden, s, problem).rsplit("-", 1)[1]  # the run's key, as its folder names it
    if doc.get("key") != key:
        raise ValueError(f"{meta} records the run {doc.get('key')}, not {key}: the file was renamed or "
                         "edited; recompute it with `python -m symlib.paper.truth`")
    draws = load_file(str(tensors))["draws"].double()
    return Reference(tuple(doc["hidden"]), s, problem, draws, doc["manifest"], doc["stats"], "committed",
                     int(doc.get("thin", 1)))


def replay(hidden: Sequence[int], settings: _frontier.Settings, problem: _pd.Problem = _pd.PROBLEM,
           rounds: int = REPLAY_ROUNDS) -> torch.Tensor:
    """The posterior level's states ``(C, rounds, D)`` of the first ``rounds`` rounds of a fresh run
    (initial states, initial step sizes, no warm-up): what a committed reference records to show that
    this code and these settings start its chains."""
    from symlib import threads

    run = _frontier.Run(hidden, settings, None, problem)
    with threads.single():
        run._start()
        return run.ladder.sample(rounds).draws


MAX_BYTES = 5_000_000
"""The largest committed draws file: :func:`commit` keeps every ``thin``-th draw, ``thin`` the smallest
that brings the float32 draws under it (the run's own checks, on every draw, are recorded beside them)."""


def commit(run: _frontier.Run, root: str | os.PathLike | None = None, command: str | None = None,
           max_bytes: int = MAX_BYTES) -> Path:
    """Write a finished reference run to ``root`` (:data:`COMMITTED`): its draws of the posterior's level
    (float32, every ``thin``-th so that they stay under ``max_bytes``) and a JSON record of its checks
    (made on every draw), ladder state, machine, ``thin`` and :func:`replay`, written atomically; certified
    or not (a run that did not certify is committed as such). ``command``: how the run was made (default:
    this process's arguments). Returns the JSON's path."""
    import math

    from symlib import store

    meta, tensors = _committed_paths(run.hidden, run.settings, run.problem, root)
    meta.parent.mkdir(parents=True, exist_ok=True)
    draws = run.draws()["draws"]
    thin = max(1, math.ceil(draws.numel() * 4 / max_bytes))
    store.atomic_save({"draws": draws[:, thin - 1 :: thin].float().contiguous()}, tensors,
                      {"format": "symlib-truth-reference/1", "key": run.key, "thin": str(thin)})
    doc = {"format": "symlib-truth-reference/1", "key": run.key, "hidden": list(run.hidden),
           "n_params": run.manifest["n_params"], "certified": run.manifest["converged_at"] is not None,
           "thin": thin, "draws_per_chain": int(draws.shape[1]),
           "settings": dataclasses.asdict(run.settings), "problem": dataclasses.asdict(run.problem),
           "machine": _frontier.machine(), "stats": run.ladder.stats(),
           "replay": replay(run.hidden, run.settings, run.problem).tolist(),
           "manifest": {k: v for k, v in run.manifest.items() if k != "settings"},
           "command": command or "python -m symlib.paper.truth " + " ".join(sys.argv[1:])}
    store.files.atomic_write_bytes(meta, (json.dumps(doc, indent=1) + "\n").encode())
    return meta


def reference(scale: str = "cpu", hidden: Sequence[int] = HIDDEN, cache_dir: str | os.PathLike | None = None,
              settings: _frontier.Settings | None = None, problem: _pd.Problem = _pd.PROBLEM,
              progress: bool = False, seed: int | None = None, sample: bool = True) -> Reference:
    """The posterior of ``hidden`` sampled with :data:`REFERENCE` ``[scale]`` (or ``settings``; ``seed``
    replaces their seed): the committed reference when one was committed for exactly these settings
    (:func:`committed`), else a run in the zoo cache (``<cache>/true-posterior/<layout>-<key>``; resumed or
    loaded when already there; with ``sample=False`` only a finished one, else an error that says how to
    compute it).

    The sampler runs on one CPU thread (float64, whatever device the chapter uses), as every run of the
    frontier (:meth:`symlib.paper.frontier.Run.advance`): its budget means the same, and the same chains
    are drawn, on a laptop, a 16-core server beside a GPU or a shared CI machine."""
    from symlib import zoo

    s = settings or _scales.pick(scale, **REFERENCE)
    if seed is not None:
        s = dataclasses.replace(s, seed=int(seed))
    found = committed(hidden, s, problem)
    if found is not None:
        return found
    folder = zoo.cache_dir(cache_dir) / "true-posterior" / _frontier.name(hidden, s, problem)
    if not sample:
        cached = _frontier.Run(hidden, s, folder, problem)
        if not cached.manifest["done"]:
            layout = " ".join(map(str, hidden))
            raise FileNotFoundError(
                f"no committed reference for the layout {tuple(hidden)} with these settings (seed {s.seed}), "
                f"and none finished in {folder}; compute it once with `python -m symlib.paper.truth --hidden "
                f"{layout} --seeds {s.seed}` (it writes {COMMITTED})")
        return Reference.from_run(cached)
    return Reference.from_run(_frontier.run(hidden, s, folder, problem, progress))


def reference_set(run: Reference | _frontier.Run, n: int = 1000) -> Params:
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
        ``{symmetries: {"tau", "low", "high", "p", "n", "replicates"}}``, keyed (label the rows by key with
        :func:`labelled`, never by position): :math:`\tau` of the point estimates,
        the percentile interval of :math:`\tau` over the bootstrap replicates (replicate ``b`` of every
        comparison resamples the same target checkpoints), scipy's two-sided p-value of "no association"
        and the number of rows.
    """
    from scipy import stats

    from symlib.stats.mmd.kernels import reduce

    out = {}
    both = {sym for (_, sym) in to_target} & {sym for (_, sym) in to_truth}
    syms = [k for k in SYMMETRIES if k in both] + sorted(both - set(SYMMETRIES))
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


SYMMETRIES = {"raw": "raw weights (MMD)", "ns": "symmetries removed (NS)"}
"""The label of each comparison's key (:func:`ranking_agreement`, :func:`replicated_agreement`): tables
built from their results keep the keys and take these labels by key, never by position."""


def labelled(result: Mapping[str, Mapping[str, float]]):
    """A result keyed by symmetries (``{"raw": {...}, "ns": {...}}``) as a table whose rows carry the
    :data:`SYMMETRIES` label of their own key."""
    import pandas as pd

    unknown = set(result) - set(SYMMETRIES)
    if unknown:
        raise KeyError(f"no label for {sorted(unknown)}: expected keys among {sorted(SYMMETRIES)}")
    frame = pd.DataFrame.from_dict({SYMMETRIES[k]: dict(v) for k, v in result.items()}, orient="index")
    frame.index.name = "comparison"
    return frame


def _signs(values: np.ndarray) -> np.ndarray:
    """``sign(v[i, a] - v[j, b])`` for every pair of rows ``i < j``: ``(P, R, R)`` from ``(n, R)``."""
    n = values.shape[0]
    i, j = np.triu_indices(n, 1)
    return np.sign(values[i][:, :, None] - values[j][:, None, :])


def replicated_tau(to_target: np.ndarray, to_truth: np.ndarray) -> np.ndarray:
    r"""Kendall's :math:`\tau_b` for every combination of replicates and references.

    Args:
        to_target: ``(n, R)``, row ``i``'s replicate ``r`` distance to the DE target (or any score; ties,
            e.g. of an indicator, are counted as :math:`\tau_b` does).
        to_truth: ``(n, R, K)``, the same replicate's distance to reference ``k``.

    Returns:
        ``(R,) * n + (K,)``: :math:`\tau_b` between the two orders when row ``i`` is represented by
        replicate ``r_i`` (the same replicate in both orders) and the truth by reference ``k``.
    """
    a = np.asarray(to_target, np.float64)
    b = np.asarray(to_truth, np.float64)
    n, r = a.shape
    if b.shape[:2] != (n, r) or b.ndim != 3:
        raise ValueError(f"to_truth must be (rows, replicates, references) = ({n}, {r}, K), got {b.shape}")
    k = b.shape[2]
    if n > 14 or r**n * k > 5_000_000:
        raise ValueError(f"{r}^{n} x {k} combinations are too many to enumerate; rank fewer rows or "
                         "replicates")
    sa = _signs(a)  # (P, R, R)
    sb = np.stack([_signs(b[:, :, q]) for q in range(k)], -1)  # (P, R, R, K)
    shape = (r,) * n + (k,)
    num = np.zeros(shape)
    ta = np.zeros(shape)
    tb = np.zeros(shape)
    for p, (i, j) in enumerate(zip(*np.triu_indices(n, 1), strict=True)):
        view = [1] * (n + 1)
        view[i], view[j], view[n] = r, r, k
        num += (sa[p][:, :, None] * sb[p]).reshape(view)
        ta += (sa[p][:, :, None] == 0).astype(np.float64).repeat(k, 2).reshape(view)
        tb += (sb[p] == 0).astype(np.float64).reshape(view)
    pairs = n * (n - 1) / 2
    with np.errstate(invalid="ignore", divide="ignore"):
        return num / np.sqrt((pairs - ta) * (pairs - tb))


def replicated_agreement(to_target: Mapping[str, Mapping[tuple, float]],
                         to_truth: Mapping[str, Mapping[tuple, float]], groups: Mapping[str, Sequence[str]],
                         level: float = 0.95) -> dict[tuple[str, str], dict[str, float]]:
    r"""Kendall's :math:`\tau` between the rows' distances to the DE target and to the true posterior, over
    replicated methods and several references.

    Args:
        to_target: ``{symmetries: {(row, replicate): distance}}``.
        to_truth: ``{symmetries: {(row, replicate, reference): distance}}``, every row with the same
            replicates and references.
        groups: ``{group: rows}``, e.g. every row, without the deep ensemble, the one-mode rows.
        level: of the percentile interval over the combinations.

    Returns:
        ``{(group, symmetries): {"tau", "mean", "low", "high", "min", "max", "n", "combinations"}}``:
        ``tau`` at the first replicate and reference (the tables' point), then the mean, the percentile
        interval and the range over every combination (each row represented by any one of its replicates,
        the truth by any one reference: :func:`replicated_tau`).
    """
    out = {}
    for sym in to_target:
        reps = sorted({r for (_, r) in to_target[sym]})
        refs = sorted({q for (_, _, q) in to_truth[sym]})
        for group, rows in groups.items():
            missing = [(n, r) for n in rows for r in reps if (n, r) not in to_target[sym]] + [
                (n, r, q) for n in rows for r in reps for q in refs if (n, r, q) not in to_truth[sym]]
            if missing:
                raise KeyError(f"{sym}: no distance for {missing[:3]} (group {group!r})")
            a = np.array([[to_target[sym][(n, r)] for r in reps] for n in rows])
            b = np.array([[[to_truth[sym][(n, r, q)] for q in refs] for r in reps] for n in rows])
            taus = replicated_tau(a, b).ravel()
            lo, hi = np.nanquantile(taus, [(1 - level) / 2, (1 + level) / 2])
            out[(group, sym)] = {"tau": float(replicated_tau(a[:, :1], b[:, :1, :1]).ravel()[0]),
                                 "mean": float(np.nanmean(taus)), "low": float(lo), "high": float(hi),
                                 "min": float(np.nanmin(taus)), "max": float(np.nanmax(taus)),
                                 "n": len(rows), "combinations": int(taus.size)}
    return out


def _least_ess(d) -> float:
    return float(min(d.ess_bulk.min(), d.ess_tail.min()))


PILOT = COMMITTED / "pilot.json"
"""The committed pilot of the references' step sizes (:func:`pilot`)."""


def pilot(hidden: Sequence[int] = HIDDEN, seeds: Sequence[int] = REFERENCE_SEEDS,
          target_accepts: Sequence[float] = (_frontier.SETTINGS.target_accept, TARGET_ACCEPT),
          segments: int = 4, out: str | os.PathLike | None = PILOT) -> dict[str, Any]:
    """Short runs of the reference's sampler (warm-up, then ``segments`` checks) for every seed and target
    acceptance: the divergent trajectories at each level, the step size at the posterior's level and the
    diagnostics at each check. Written to ``out`` (atomically; ``None``: not written) and returned."""
    from symlib import store

    runs = []
    for ta in target_accepts:
        for k in seeds:
            s = dataclasses.replace(REFERENCE["cpu"], target_accept=float(ta), seed=int(k))
            r = _frontier.Run(hidden, s, None)
            r.advance(max_segments=segments)
            runs.append({"target_accept": float(ta), "seed": int(k), "checks": r.manifest["checks"],
                         "cpu_s": round(r.manifest["cpu_s"], 2)})
    doc = {"format": "symlib-truth-pilot/1", "hidden": list(hidden), "machine": _frontier.machine(),
           "settings": dataclasses.asdict(REFERENCE["cpu"]), "runs": runs}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        store.files.atomic_write_bytes(out, (json.dumps(doc, indent=1) + "\n").encode())
    return doc


def pilot_frame(doc: Mapping[str, Any]):
    """The pilot (:func:`pilot`) as a table, one line per target acceptance and seed, from its last check."""
    import pandas as pd

    lines = {}
    for run in doc["runs"]:
        last = run["checks"][-1]
        sam = last["sampler"]
        lines[(run["target_accept"], run["seed"])] = {
            "draws per chain": last["draws"], "step size at beta = 1": sam["step_cold"],
            "divergent at beta = 1": sam["divergences_per_level"][0],
            "share at beta = 1": sam["divergent_share_cold"],
            "divergent, all levels": sum(sam["divergences_per_level"]),
            "worst R-hat (canonical)": last["canonical"]["rhat_max"], "CPU s": run["cpu_s"]}
    frame = pd.DataFrame.from_dict(lines, orient="index")
    frame.index = pd.MultiIndex.from_tuples(frame.index, names=["target acceptance", "seed"])
    return frame


def reference_summary(refs: Mapping[int, Reference], reports: Mapping[int, Any]):
    """One line per reference (keyed by its seed): where it comes from, its length (the run's draws per chain
    and the ones stored) and cost, its ladder, the diagnostics recomputed from its stored draws
    (``reports``, :meth:`Reference.report`), the last two checks
    of its run, each half's worst :math:`\\hat R` and its divergent trajectories; ``certified`` is the
    rule at its last check (:func:`symlib.paper.frontier.certify`)."""
    import pandas as pd

    lines = {}
    for k, ref in refs.items():
        rep, man, st = reports[k], ref.manifest, ref.stats
        checks = man.get("checks") or [{}]
        last = checks[-1]
        per_level = st.get("divergences_per_level") or []
        trajectories = st.get("trajectories_per_level") or 0
        lines[k] = {
            "source": ref.source, "draws per chain": last.get("draws", rep.n_draws),
            "draws stored (every thin-th)": rep.n_draws,
            "CPU s": round(man["cpu_s"], 1), "levels": len(st["betas"]),
            "barrier": man["warmup"][-1]["barrier"] if man.get("warmup") else np.nan,
            "worst R-hat (canonical)": float(rep["canonical"].rhat.max()),
            "worst R-hat (invariant)": float(rep["invariant"].rhat.max()),
            "worst R-hat (raw)": float(rep["raw"].rhat.max()),
            "least ESS (canonical)": _least_ess(rep["canonical"]),
            "least ESS (invariant)": _least_ess(rep["invariant"]),
            "criterion at the last two checks": " / ".join(
                "yes" if c.get("criterion", c.get("converged")) else "no" for c in checks[-2:]),
            "worst R-hat of each half": " / ".join(f"{h:.4f}" for h in (last.get("halves") or [])) or "-",
            "divergent at beta = 1": per_level[0] if per_level else np.nan,
            "share at beta = 1": per_level[0] / trajectories if per_level and trajectories else np.nan,
            "divergent, all levels": sum(per_level) if per_level else np.nan,
            "round trips (least chain)": min(st["round_trips"]),
            "certified": "yes" if ref.certified else "no",
        }
    frame = pd.DataFrame.from_dict(lines, orient="index")
    frame.index.name = "reference seed"
    return frame


def distances(lay, rows: Mapping[Any, str], reference: str, symmetries: Sequence[str] = ("raw", "ns"),
              kernels: str = "median", known: Mapping[tuple[str, str], Any] | None = None
              ) -> dict[str, dict[Any, float]]:
    """:math:`100 \\times` the MMD (the point value, as the tables print it) of every set of ``rows``
    (``{key: name in lay}``) against the set ``reference`` of a :func:`symlib.stats.mmd.layered`:
    ``{symmetries: {key: distance}}``. ``known``: results already measured against ``reference``
    (:func:`symlib.stats.mmd.layered_table`, ``{(name, symmetries): Result}``), read instead of measured
    again."""
    from symlib.stats import mmd as _mmd

    known = known or {}

    def one(name: str, sym: str) -> float:
        res = known.get((name, sym)) or _mmd.mmd(lay.pair(reference, name, sym))
        return 100 * float(res.value(kernels))

    return {sym: {key: one(name, sym) for key, name in rows.items()} for sym in symmetries}


def layered_sets(target, references: Mapping[int, Any], by_rep: Mapping[int, Mapping[tuple, Any]], seed: int,
                 spec, symmetries: Sequence[str] = ("raw", "ns")):
    """Every set of the replicated comparison, symmetries removed once (:func:`symlib.stats.mmd.layered`).

    Args:
        target: the DE target. references: ``{seed: networks}``, the first is ``"HMC"``, the others
            ``"HMC <seed>"``. by_rep: ``{run seed: {(method, modes): set}}`` (:func:`produce`).
        seed: the first replicate's run seed (its rows are named ``"<method> (<modes>)"``, the others'
            ``"<method> (<modes>) #<run seed>"``). spec: the MLP's symmetries.

    Returns:
        ``(layered, labels, reference_names)``: ``labels`` maps each row name to its ``(method, modes)``
        key, ``reference_names`` each reference seed to its name in ``layered``.
    """
    from symlib.stats import mmd as _mmd

    labels = {f"{a} ({b})": (a, b) for (a, b) in by_rep[seed]}
    ref_names = {k: "HMC" if i == 0 else f"HMC {k}" for i, k in enumerate(references)}
    sets = {"target": target, **{ref_names[k]: v for k, v in references.items()},
            **{n: by_rep[seed][lab] for n, lab in labels.items()},
            **{f"{n} #{r}": by_rep[r][lab] for n, lab in labels.items() for r in by_rep if r != seed}}
    return _mmd.layered(sets, spec, symmetries), labels, ref_names


def replicated_distances(lay, labels: Mapping[str, tuple], reference_names: Mapping[int, str],
                         reps: Sequence[int], seed: int, known: Mapping[str, Mapping] | None = None):
    """The distances of every replicate of every row (:func:`layered_sets`) to the DE target and to every
    reference (:func:`distances`; ``known``: ``{reference name: layered_table results}`` already measured).

    Returns:
        ``(to_target, to_truth)``: ``{symmetries: {(row, run seed): distance}}`` and ``{symmetries: {(row,
        run seed, reference seed): distance}}``, as :func:`replicated_agreement` takes them.
    """
    known = known or {}
    rows = {(n, r): (n if r == seed else f"{n} #{r}") for n in labels for r in reps}
    to_target = distances(lay, rows, "target", known=known.get("target"))
    to_truth: dict[str, dict] = {sym: {} for sym in to_target}
    for k, name in reference_names.items():
        for sym, d in distances(lay, rows, name, known=known.get(name)).items():
            to_truth[sym].update({(n, r, k): v for (n, r), v in d.items()})
    return to_target, to_truth


def agreement_frame(to_target, to_truth, labels: Mapping[str, tuple]):
    """:func:`replicated_agreement` over all rows, without the deep ensemble, within the one-mode and within
    the multi-mode rows, and what the one-mode/multi-mode label alone reaches over all rows, as a table
    indexed by ``(rows, comparison)`` (the :data:`SYMMETRIES` label of each key)."""
    import pandas as pd

    names = list(labels)
    one = {n: labels[n][1] == "one-mode" for n in names}
    groups = {"all rows": names,
              "without the deep ensemble": [n for n in names if labels[n] != ("DE", "multi-mode")],
              "one-mode rows": [n for n in names if one[n]],
              "multi-mode rows": [n for n in names if labels[n][1] == "multi-mode" and labels[n][0] != "DE"]}
    out = replicated_agreement(to_target, to_truth, groups)
    reps = sorted({r for (_, r) in next(iter(to_target.values()))})
    split = {sym: {(n, r): float(one[n]) for n in names for r in reps} for sym in to_target}
    out.update({("the mode split alone", sym): v for (_, sym), v in
                replicated_agreement(split, to_truth, {"all rows": names}).items()})
    frame = pd.DataFrame.from_dict({(g, SYMMETRIES[sym]): v for (g, sym), v in out.items()}, orient="index")
    frame.index = pd.MultiIndex.from_tuples(frame.index, names=["rows", "comparison"])
    return frame


def spread(to_target: Mapping[str, Mapping[tuple, float]], to_truth: Mapping[str, Mapping[tuple, float]],
           names: Sequence[str]):
    """Per row and comparison, the replicates' distances to the DE target and to the true posterior (every
    reference): mean, least and largest (:math:`100 \\times` the MMD), keyed by row name and by the
    :data:`SYMMETRIES` label of each comparison."""
    import pandas as pd

    cols = {}
    for sym, label in SYMMETRIES.items():
        if sym not in to_target:
            continue
        for who, src in (("target", to_target[sym]), ("HMC", to_truth[sym])):
            vals = {n: [v for key, v in src.items() if key[0] == n] for n in names}
            cols[(label, f"to {who}", "mean")] = {n: float(np.mean(v)) for n, v in vals.items()}
            cols[(label, f"to {who}", "least")] = {n: float(np.min(v)) for n, v in vals.items()}
            cols[(label, f"to {who}", "largest")] = {n: float(np.max(v)) for n, v in vals.items()}
    frame = pd.DataFrame(cols)
    frame.columns.names = ["comparison", "distance", "over replicates"]
    # sorted on the first two levels, so that selecting a (comparison, distance) block is a plain lookup
    frame = frame.sort_index(axis=1, level=[0, 1], sort_remaining=False)
    return frame.loc[list(names)]


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


if __name__ == "__main__":
    sys.exit(main())
