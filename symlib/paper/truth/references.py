r"""The reference posteriors of chapter "Against the true posterior": sampled until the certification rule
holds (:func:`symlib.paper.frontier.certify`), committed once with their record (:func:`commit`), loaded
back (:func:`committed`, :func:`reference`) and summarised (:func:`reference_summary`), and the pilot that
chose their step sizes (:func:`pilot`)."""

from __future__ import annotations

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

__all__ = ["COMMITTED", "HIDDEN", "HIDDEN_LARGE", "MAX_BYTES", "PILOT", "REFERENCE", "REFERENCE_SEEDS",
           "REPLAY_ROUNDS", "Reference", "TARGET_ACCEPT", "commit", "committed", "pilot", "pilot_frame",
           "reference", "reference_set", "reference_summary", "replay"]

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

COMMITTED = Path(__file__).parents[1] / "results" / "truth"
"""Where :func:`commit` writes certified references (``<run name>.json`` and ``.safetensors``)."""

REPLAY_ROUNDS = 2
"""Rounds of a fresh start that a committed reference records (:func:`replay`), to check that this code
and these settings begin the same chains."""


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

def _least_ess(d) -> float:
    return float(min(d.ess_bulk.min(), d.ess_tail.min()))


PILOT = COMMITTED / "pilot.json"
"""The committed pilot of the references' step sizes (:func:`pilot`)."""


def pilot(hidden: Sequence[int] = HIDDEN, seeds: Sequence[int] = REFERENCE_SEEDS,
          target_accepts: Sequence[float] = (_frontier.Settings().target_accept, TARGET_ACCEPT),
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

