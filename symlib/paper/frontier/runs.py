r"""One run of the convergence frontier: the sampler's settings, a resumable replica-exchange run of one MLP
layout judged every segment, and what it is judged on (book: chapter "Against the true posterior"; the
sweep over layouts and its command line are :mod:`symlib.paper.frontier`).

:class:`Run` samples the posterior of the problem of :mod:`symlib.paper.pca_digits` with non-reversible
parallel tempering down to the prior (:class:`symlib.posteriors.hmc.ladder.Ladder`) and, every ``segment``
rounds, computes the symmetry-aware diagnostics of :mod:`symlib.stats.convergence` on raw weights,
canonical forms (:func:`spec`) and invariant functionals (:func:`functionals`), :func:`judge`. Every run
is resumable and written atomically (see :class:`Run`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symlib import store, threads
from symlib.paper import pca_digits as _pd
from symlib.params import unflatten
from symlib.posteriors.hmc.ladder import Ladder

__all__ = ["ESS", "RHAT", "SETTINGS", "Run", "Settings", "canonical_forms", "certify", "functionals",
           "halves", "judge", "name", "run", "spec"]


@dataclasses.dataclass(frozen=True)
class Settings:
    r"""Sampler settings of a frontier run (every one of them a parameter of the chapter).

    Attributes:
        n_chains: independent ladders.
        n_leapfrog: leapfrog steps per trajectory.
        warmup: rounds of the adaptation phases; the schedule is re-tuned after each phase but the last
            (:meth:`~symlib.posteriors.hmc.ladder.Ladder.retune`).
        levels: levels of the initial schedule (geometric from 1 to ``1e-3``, then the prior).
        mass: ``"diag"`` or ``"dense"`` covariance of each level's states as inverse mass matrix.
        per_chain: one mass matrix per chain and level (else pooled over the chains).
        orbit_moves: exact Gibbs moves along the scaling orbits before every trajectory
            (:class:`symlib.posteriors.hmc.orbits.ScalingMoves`).
        shift_moves: exact Gibbs moves along the softmax shift before every trajectory
            (:class:`symlib.posteriors.hmc.orbits.SoftmaxShift`), the mass matrices estimated without it.
        target_accept: the step sizes' target acceptance; jitter: their jitter when sampling.
        segment: sampling rounds between two checks; thin: rounds per kept draw.
        budget: CPU seconds of sampling (warm-up included) after which a run that has not converged stops.
        rounds: a fixed number of sampling rounds instead (a reference of known length; ``None``: until
            convergence or the budget).
        n_probe: test digits whose predictive probability is an invariant functional.
        seed: of the initial states and of every random draw.
        confirm: consecutive checks at which the criterion must hold on every kept draw before a run is
            certified (:func:`certify`); 1 is the earlier rule, the first check that passes.
        halves: also require :math:`\hat R <` 1.01 on each half of the kept draws alone.
        max_divergent: the largest share of divergent trajectories at the posterior's level (over every
            sampling round so far) that a certified run may have.
    """

    n_chains: int = 4
    n_leapfrog: int = 20
    warmup: tuple[int, ...] = (50, 100, 200, 300)
    levels: int = 10
    mass: str = "diag"
    per_chain: bool = True
    orbit_moves: bool = True
    shift_moves: bool = True
    target_accept: float = 0.75
    jitter: float = 0.1
    segment: int = 250
    thin: int = 1
    budget: float = 1200.0
    rounds: int | None = None
    n_probe: int = 20
    seed: int = 0
    confirm: int = 2
    halves: bool = True
    max_divergent: float = 0.01


SETTINGS = Settings()
"""The chapter's sampler settings (see the measurements in the chapter)."""

RHAT = 1.01
r"""The criterion of Vehtari et al. (2021) that every check applies on canonical forms and invariant
functionals: :math:`\hat R <` ``RHAT`` (and bulk and tail ESS at least :data:`ESS`)."""

ESS = 400.0
"""The least bulk and tail effective sample size of the criterion (with :data:`RHAT`)."""


def certify(criteria: Sequence[bool], halves: Sequence[float] | None, divergent_share: float,
            settings: Settings = SETTINGS) -> bool:
    r"""The certification rule, fixed before any run looks at its diagnostics: the criterion (:data:`RHAT`,
    :data:`ESS` on every kept draw) held at the last ``settings.confirm`` checks in a row (``criteria``,
    oldest first), each half of the kept draws alone has :math:`\hat R <` :data:`RHAT` (``halves``: their
    worst values; ``None`` when ``settings.halves`` is off), and at most ``settings.max_divergent`` of the
    posterior level's trajectories diverged."""
    k = settings.confirm
    if k < 1 or len(criteria) < k or not all(criteria[-k:]):
        return False
    if settings.halves and (halves is None or max(halves) >= RHAT):
        return False
    return divergent_share <= settings.max_divergent


def _key(hidden, settings: Settings, problem: _pd.Problem) -> str:
    text = json.dumps({"hidden": list(hidden), "settings": dataclasses.asdict(settings),
                       "problem": dataclasses.asdict(problem), "data": _pd.load(problem).fingerprint,
                       "format": 2}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def name(hidden: Sequence[int], settings: Settings = SETTINGS, problem: _pd.Problem = _pd.PROBLEM) -> str:
    """The folder name of a run: its layers joined by ``x``, then its key (``4x4-<key>``), so that runs of
    other settings or data never share a folder."""
    h = tuple(int(v) for v in hidden)
    return "x".join(map(str, h)) + f"-{_key(h, settings, problem)}"


def spec(hidden: Sequence[int], problem: _pd.Problem = _pd.PROBLEM):
    """The symmetry spec of the MLP with hidden layers ``hidden`` (:func:`symlib.symmetry.trace.spec_of`,
    float64)."""
    from symlib import models
    from symlib.symmetry import trace

    w = _pd.widths(hidden, problem)
    return trace.spec_of(models.MLPClassifier(w).double(), (w[0],))


def functionals(draws: torch.Tensor, hidden, problem: _pd.Problem = _pd.PROBLEM,
                n_probe: int = 20) -> dict[str, torch.Tensor]:
    """The invariant functionals of draws ``(C, S, D)`` but the potential: ``"test log-likelihood"`` ``(C,
    S)`` and ``"p(y|x)"`` ``(C, S, n_probe)`` (:func:`symlib.stats.convergence.predictive_functionals`)."""
    from symlib.stats import convergence
    from symlib.training import mlp as _mlp

    d = _pd.load(problem)
    c, s, _ = draws.shape
    shapes = _mlp.shapes(_pd.widths(hidden, problem))
    out: dict[str, list] = {}
    for lo in range(0, s, 200):
        part = draws[:, lo : lo + 200]
        logits = _mlp.mlp_forward(unflatten(part.reshape(-1, part.shape[-1]), shapes), d.x_test)
        p = torch.softmax(logits, -1).reshape(c, part.shape[1], *logits.shape[1:])
        for k, v in convergence.predictive_functionals(p, d.y_test, n_probe).items():
            out.setdefault(k, []).append(torch.as_tensor(v))
    return {k: torch.cat(v, 1) for k, v in out.items()}


def judge(draws: torch.Tensor, canonical: torch.Tensor, invariant: dict[str, torch.Tensor], hidden,
          problem: _pd.Problem = _pd.PROBLEM):
    """The diagnostics of draws ``(C, S, D)`` on the three scales
    (:func:`symlib.stats.convergence.diagnose`): raw, canonical (``canonical (C, S, D)``, flat in the same
    order) and ``invariant`` (``{name: (C, S, ...)}``, the potential included)."""
    from symlib.stats import convergence
    from symlib.training import mlp as _mlp

    shapes = _mlp.shapes(_pd.widths(hidden, problem))
    c, s, _ = draws.shape

    def unflat(t):
        return {k: v.reshape(c, s, *v.shape[1:]) for k, v in unflatten(t.reshape(c * s, -1), shapes).items()}

    return convergence.diagnose(unflat(draws), None, invariant, canonical=unflat(canonical))


def halves(draws: torch.Tensor, canonical: torch.Tensor, invariant: dict[str, torch.Tensor], hidden,
           problem: _pd.Problem = _pd.PROBLEM) -> list[float]:
    r"""The worst :math:`\hat R` on canonical forms and invariant functionals of each half of the draws
    ``(C, S, ...)`` judged alone (:func:`judge`): the certification rule's second part."""
    s = draws.shape[1]
    worst = []
    for part in (slice(0, s // 2), slice(s - s // 2, s)):
        rep = judge(draws[:, part], canonical[:, part], {k: v[:, part] for k, v in invariant.items()}, hidden,
                    problem)
        worst.append(max(float(rep[sc].rhat.max()) for sc in ("canonical", "invariant")))
    return worst


def canonical_forms(draws: torch.Tensor, hidden, problem: _pd.Problem = _pd.PROBLEM) -> torch.Tensor:
    """The canonical forms of draws ``(C, S, D)`` of the MLP ``hidden`` (:func:`spec`), flat in the same
    order ``(C, S, D)``: what the ``canonical`` scale of :func:`judge` reads."""
    from symlib.params import flatten
    from symlib.symmetry import canonical
    from symlib.training import mlp as _mlp

    shapes = _mlp.shapes(_pd.widths(hidden, problem))
    c, s, d = draws.shape
    out = canonical.canonicalize(unflatten(draws.reshape(c * s, d), shapes), spec(hidden, problem))
    return flatten(out, list(shapes)).reshape(c, s, d)


class Run:
    """One size's resumable run in ``folder`` (see the module docstring); :meth:`advance` does the work.

    Args:
        hidden: the hidden layout, e.g. ``(8,)`` or ``(4, 4)``.
        settings: the sampler settings.
        folder: where the run lives (created; a folder of another run is refused).
        problem: the data and prior.
    """

    def __init__(self, hidden: Sequence[int], settings: Settings = SETTINGS,
                 folder: str | os.PathLike | None = None, problem: _pd.Problem = _pd.PROBLEM):
        from symlib.posteriors.hmc.ladder import MASSES

        self.hidden, self.settings, self.problem = tuple(int(h) for h in hidden), settings, problem
        if settings.mass not in MASSES:
            raise ValueError(f"mass must be one of {MASSES}, got {settings.mass!r}")
        self.key = _key(self.hidden, settings, problem)
        self.folder = Path(folder) if folder is not None else None
        self.lik, self.shapes = _pd.likelihood(self.hidden, problem)
        from symlib.posteriors.hmc import orbits

        lam = 1.0 / problem.prior_sd**2
        steps = []
        if settings.orbit_moves:
            steps.append(orbits.ScalingMoves(spec(self.hidden, problem), self.shapes, lam))
        self.shift = orbits.SoftmaxShift(self.shapes, lam) if settings.shift_moves else None
        if self.shift is not None:
            steps.append(self.shift)
        self.moves = _compose(steps)
        self.segments: list[dict[str, torch.Tensor]] = []
        self.manifest = self._fresh_manifest()
        self.ladder: Ladder | None = None
        if self.folder is not None and (self.folder / store.MANIFEST).exists():
            self._load()

    # ------------------------------------------------------------------ files
    def _fresh_manifest(self) -> dict[str, Any]:
        return {"kind": "frontier-run", "key": self.key, "hidden": list(self.hidden),
                "n_params": _pd.n_params(self.hidden, self.problem),
                "settings": dataclasses.asdict(self.settings), "problem": dataclasses.asdict(self.problem),
                "phase": 0, "segments": 0, "cpu_s": 0.0, "wall_s": 0.0, "diagnostics_s": 0.0,
                "checks": [], "converged_at": None, "done": False, "warmup": []}

    def _load(self) -> None:
        man = json.loads((self.folder / store.MANIFEST).read_text())
        if man.get("key") != self.key:
            raise store.StoreError(
                f"{self.folder} holds another frontier run (key {man.get('key')}, this one {self.key}); use "
                "another folder"
            )
        self.manifest = man
        from safetensors.torch import load_file

        state = self.folder / self._state_name()
        if state.exists():
            self.ladder = Ladder.from_state(load_file(str(state)), self.lik, 1.0 / self.problem.prior_sd**2,
                                            **self._ladder_args())
        self.segments = [load_file(str(self.folder / f"segment-{i:04d}.safetensors"))
                         for i in range(man["segments"])]

    def _save(self, segment: dict[str, torch.Tensor] | None = None) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = {"format": "symlib-frontier/1", "key": self.key}
        if segment is not None:
            name = f"segment-{len(self.segments) - 1:04d}.safetensors"
            store.atomic_save(segment, self.folder / name, meta)
        name = self._state_name()
        store.atomic_save(self.ladder.state_dict(), self.folder / name, meta)
        store.write_manifest(self.folder, {**self.manifest, **store.provenance()})  # the commit point
        for old in self.folder.glob("state-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def _state_name(self) -> str:
        """The ladder's file after the manifest's phase and segment (a run killed between two writes
        resumes from the state its manifest names)."""
        return f"state-p{self.manifest['phase']}-s{self.manifest['segments']}.safetensors"

    def _ladder_args(self) -> dict[str, Any]:
        s = self.settings
        return {"target_accept": s.target_accept, "jitter": s.jitter, "n_leapfrog": s.n_leapfrog,
                "moves": self.moves, "mass": s.mass, "per_chain": s.per_chain,
                "exact": self.shift.basis if self.shift is not None else None}

    # ------------------------------------------------------------------ work
    def _timed(self, fn):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        self.manifest["cpu_s"] += time.process_time() - c0
        self.manifest["wall_s"] += time.perf_counter() - w0
        return out

    def _start(self) -> None:
        s = self.settings
        gen = torch.Generator().manual_seed(s.seed)
        d = _pd.n_params(self.hidden, self.problem)
        theta0 = self.problem.prior_sd * torch.randn(s.n_chains, d, generator=gen, dtype=torch.float64)
        betas = torch.cat([torch.logspace(0, -3, s.levels - 1, dtype=torch.float64),
                           torch.zeros(1, dtype=torch.float64)])
        self.ladder = self._timed(lambda: Ladder(self.lik, 1.0 / self.problem.prior_sd**2, theta0, betas,
                                                 seed=s.seed + 1, **self._ladder_args()))

    def _stop(self) -> bool:
        m, s = self.manifest, self.settings
        if s.rounds is not None:
            return m["segments"] * s.segment >= s.rounds
        return m["converged_at"] is not None or m["cpu_s"] >= s.budget

    def advance(self, progress: bool = False, max_segments: int | None = None) -> dict[str, Any]:
        """Run (or resume) until the size converges, the budget is spent or, with ``settings.rounds``, the
        fixed length is reached; every phase and segment is saved before the next. ``max_segments``
        returns earlier, after that many new segments (the run stays resumable). Returns the manifest.

        The sampler runs on one intra-op thread whatever the caller's count: the budget counts the
        process's CPU seconds, which idle threads would spend (16 threads spent 500 CPU seconds in 40 s of
        wall time on a 16-core machine), and one thread draws the same chains on every machine."""
        with threads.single():
            return self._advance(progress, max_segments)

    def _advance(self, progress: bool, max_segments: int | None) -> dict[str, Any]:
        s = self.settings
        if self.manifest["done"]:
            return self.manifest
        if self.ladder is None:
            self._start()
            self._save()
        while self.manifest["phase"] < len(s.warmup):
            i = self.manifest["phase"]
            stats = self._timed(lambda i=i: self.ladder.adapt(s.warmup[i]))
            if i < len(s.warmup) - 1:
                self._timed(self.ladder.retune)
            else:  # sampling's counters (divergences, swaps, round trips) count its own rounds only
                self.ladder.reset_counters()
            self.manifest["warmup"].append({**stats, "cpu_s": round(self.manifest["cpu_s"], 2)})
            self.manifest["phase"] = i + 1
            self._save()
            _say(progress, f"{self.hidden}: warm-up phase {i + 1}/{len(s.warmup)}, {self.ladder.n_levels} "
                           f"levels, barrier {stats['barrier']}, {self.manifest['cpu_s']:.0f} CPU s")
        new = 0
        while not self._stop():
            if max_segments is not None and new >= max_segments:
                return self.manifest
            new += 1
            seg = self._timed(lambda: self.ladder.sample(s.segment * s.thin, s.thin))
            t0 = time.perf_counter()
            record = {"draws": seg.draws, "potential": seg.potential, "nll": seg.nll,
                      "canonical": canonical_forms(seg.draws, self.hidden, self.problem),
                      **{f"f:{k}": v for k, v in functionals(seg.draws, self.hidden, self.problem,
                                                              s.n_probe).items()}}
            self.segments.append(record)
            self.manifest["segments"] = len(self.segments)
            check = self.check()
            self.manifest["diagnostics_s"] += time.perf_counter() - t0
            self.manifest["checks"].append(check)
            if check["converged"] and self.manifest["converged_at"] is None:
                self.manifest["converged_at"] = {k: check[k] for k in ("cpu_s", "wall_s", "rounds", "draws")}
            self._save(record)
            _say(progress, f"{self.hidden}: {check['draws']} draws/chain, {check['cpu_s']:.0f} CPU s, R-hat "
                           f"{check['canonical']['rhat_max']:.3f}/{check['invariant']['rhat_max']:.3f}, "
                           f"ESS {check['canonical']['ess_min']:.0f}/{check['invariant']['ess_min']:.0f}")
        self.manifest["done"] = True
        self._save()
        return self.manifest

    def _quantities(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Every kept draw so far, its canonical forms and its invariant functionals (potential included),
        each concatenated over the segments."""
        if not self.segments:
            raise ValueError("no draws yet: advance the run first")
        cat = {k: torch.cat([seg[k] for seg in self.segments], 1) for k in self.segments[0]}
        inv = {"potential": cat["potential"], **{k[2:]: v for k, v in cat.items() if k.startswith("f:")}}
        return cat["draws"], cat["canonical"], inv

    def report(self):
        """The :class:`symlib.stats.convergence.Report` of every kept draw so far."""
        return judge(*self._quantities(), self.hidden, self.problem)

    def check(self) -> dict[str, Any]:
        r"""One check of the certification rule (:func:`certify`) on every kept draw so far, with the
        sampler's state: the criterion on all draws, :math:`\hat R` on each half, the divergent
        trajectories per level and their share at the posterior's level."""
        quantities = self._quantities()  # concatenated once for the whole draws and their halves
        rep = judge(*quantities, self.hidden, self.problem)
        s = self.settings
        rounds = self.manifest["segments"] * s.segment * s.thin
        st = self.ladder.stats()
        out: dict[str, Any] = {"rounds": rounds,
                               "draws": rep.n_draws, "cpu_s": round(self.manifest["cpu_s"], 2),
                               "wall_s": round(self.manifest["wall_s"], 2),
                               "criterion": rep.converged(rhat=RHAT, ess=ESS)}
        for sc in ("raw", "canonical", "invariant"):
            d = rep[sc]
            out[sc] = {"rhat_max": float(d.rhat.max()), "ess_bulk_min": float(d.ess_bulk.min()),
                       "ess_tail_min": float(d.ess_tail.min()),
                       "ess_min": float(min(d.ess_bulk.min(), d.ess_tail.min()))}
        out["halves"] = halves(*quantities, self.hidden, self.problem) if s.halves else None
        per_level = st["divergences_per_level"]
        trajectories = max(st["trajectories_per_level"], 1)
        out["sampler"] = {"levels": len(st["betas"]), "swap_accept_min": min(st["swap_accept"]),
                          "round_trips": st["round_trips"], "accept_cold": st["accept"][0],
                          "step_cold": st["step_size"][0], "divergences": st["divergences"],
                          "divergences_per_level": per_level,
                          "divergent_share_cold": per_level[0] / trajectories, "n_grad": st["n_grad"]}
        previous = [c.get("criterion", c.get("converged", False)) for c in self.manifest["checks"]]
        out["converged"] = certify([*previous, out["criterion"]], out["halves"],
                                   out["sampler"]["divergent_share_cold"], s)
        return out

    def draws(self) -> dict[str, torch.Tensor]:
        """Every kept draw so far: ``{"draws": (C, S, D), "potential": (C, S), "nll": (C, S)}``."""
        return {k: torch.cat([seg[k] for seg in self.segments], 1) for k in ("draws", "potential", "nll")}


def _compose(steps):
    """One move made of ``steps`` in turn (``None`` without any)."""
    if not steps:
        return None

    def moves(theta: torch.Tensor, gen: torch.Generator):
        acc = torch.ones(theta.shape[0], dtype=torch.float64)
        for step in steps:
            theta, a = step(theta, gen)
            acc = acc * a
        return theta, acc

    return moves


def _say(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


def run(hidden: Sequence[int], settings: Settings = SETTINGS, folder: str | os.PathLike | None = None,
        problem: _pd.Problem = _pd.PROBLEM, progress: bool = False) -> Run:
    """:class:`Run` of ``hidden`` advanced to its end (resumed from ``folder`` when it holds it)."""
    r = Run(hidden, settings, folder, problem)
    r.advance(progress)
    return r
