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


SETTINGS = Settings(target_accept=0.9)
"""The chapter's sampler settings (see the measurements in the chapter): the defaults, with step sizes that
aim at an acceptance of 0.9, at which the pilot runs of the references diverged far less often than at
0.75 (``symlib.paper.truth.pilot``)."""

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


_RECORDED = ("key", "hidden", "n_params", "settings", "problem", "phase", "segments", "cpu_s", "wall_s",
             "diagnostics_s", "checks", "converged_at", "done", "warmup")
"""The entries of a run's ``manifest.json`` after its ``kind``, in their order (:class:`_Progress`)."""


@dataclasses.dataclass
class _Progress:
    """Where a run stands: what its ``manifest.json`` records (:meth:`manifest`), read back by
    :meth:`from_manifest`.

    Attributes:
        key: the run's key (:func:`name`); hidden: its layout; n_params: its number of parameters.
        settings, problem: its :class:`Settings` and problem as dictionaries.
        phase: warm-up phases done; segments: sampling segments done.
        cpu_s, wall_s: the sampler's CPU and wall seconds so far (:meth:`timed`: warm-up included, the
            checks excluded); diagnostics_s: the checks' wall seconds.
        checks: every check (:meth:`Run.check`), oldest first; converged_at: the ``cpu_s``, ``wall_s``,
            ``rounds`` and ``draws`` of the first certified check, or ``None``; done: whether the run ended.
        warmup: each warm-up phase's statistics, with the CPU seconds at its end.
        kind: ``"frontier-run"``.
        extra: the other entries of a manifest read back (the provenance of its last write), in order.
    """

    key: str
    hidden: list[int]
    n_params: int
    settings: dict[str, Any]
    problem: dict[str, Any]
    phase: int = 0
    segments: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    diagnostics_s: float = 0.0
    checks: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    converged_at: dict[str, Any] | None = None
    done: bool = False
    warmup: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    kind: str = "frontier-run"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def fresh(cls, key: str, hidden: tuple[int, ...], settings: Settings, problem: _pd.Problem) -> _Progress:
        """The progress of a run not started yet."""
        return cls(key, list(hidden), _pd.n_params(hidden, problem), dataclasses.asdict(settings),
                   dataclasses.asdict(problem))

    @classmethod
    def from_manifest(cls, man: dict[str, Any]) -> _Progress:
        """The progress a manifest records (every entry of :data:`_RECORDED` required; others kept in
        ``extra``)."""
        known = {"kind", *_RECORDED}
        return cls(**{k: man[k] for k in _RECORDED}, kind=man.get("kind", "frontier-run"),
                   extra={k: v for k, v in man.items() if k not in known})

    def manifest(self) -> dict[str, Any]:
        """The manifest's entries: ``kind``, :data:`_RECORDED` in order, then ``extra``."""
        return {"kind": self.kind, **{k: getattr(self, k) for k in _RECORDED}, **self.extra}

    def timed(self, fn):
        """``fn()``, its CPU and wall seconds added to :attr:`cpu_s` and :attr:`wall_s`."""
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        self.cpu_s += time.process_time() - c0
        self.wall_s += time.perf_counter() - w0
        return out


# ---------------------------------------------------------------------------------------------- files
def _state_file(progress: _Progress) -> str:
    """The ladder's file after the progress's phase and segment (a run killed between two writes resumes
    from the state its manifest names)."""
    return f"state-p{progress.phase}-s{progress.segments}.safetensors"


def _segment_file(i: int) -> str:
    """The file of segment ``i``."""
    return f"segment-{i:04d}.safetensors"


def _read(folder: Path, key: str) -> tuple[_Progress, dict[str, torch.Tensor] | None,
                                           list[dict[str, torch.Tensor]]]:
    """The run of key ``key`` in ``folder``: its progress, the ladder's state its manifest names
    (``None`` when that file is missing) and its segments.

    Raises:
        symlib.store.StoreError: ``folder`` holds another run.
    """
    man = json.loads((folder / store.MANIFEST).read_text())
    if man.get("key") != key:
        raise store.StoreError(
            f"{folder} holds another frontier run (key {man.get('key')}, this one {key}); use another folder"
        )
    progress = _Progress.from_manifest(man)
    from safetensors.torch import load_file

    file = folder / _state_file(progress)
    state = load_file(str(file)) if file.exists() else None
    return progress, state, [load_file(str(folder / _segment_file(i))) for i in range(progress.segments)]


def _write(folder: Path, progress: _Progress, ladder: Ladder,
           segment: dict[str, torch.Tensor] | None = None) -> None:
    """Save a run atomically: its newest segment (``segment``, the last of ``progress.segments``), the
    ladder's state, then the manifest (the commit point); then remove the ladder's earlier states."""
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": "symlib-frontier/1", "key": progress.key}
    if segment is not None:
        store.atomic_save(segment, folder / _segment_file(progress.segments - 1), meta)
    name = _state_file(progress)
    store.atomic_save(ladder.state_dict(), folder / name, meta)
    store.write_manifest(folder, {**progress.manifest(), **store.provenance()})  # the commit point
    for old in folder.glob("state-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------- checks
def _segment_record(seg, hidden: tuple[int, ...], problem: _pd.Problem,
                    n_probe: int) -> dict[str, torch.Tensor]:
    """What a segment file holds: the posterior level's draws ``(C, S, D)``, their potential and
    likelihood ``(C, S)``, their canonical forms (:func:`canonical_forms`) and their invariant functionals
    (:func:`functionals`, as ``f:<name>``)."""
    return {"draws": seg.draws, "potential": seg.potential, "nll": seg.nll,
            "canonical": canonical_forms(seg.draws, hidden, problem),
            **{f"f:{k}": v for k, v in functionals(seg.draws, hidden, problem, n_probe).items()}}


def _scale_record(d) -> dict[str, float]:
    """A check's record of one scale of a report: the worst :math:`\\hat R` and the least bulk, tail and
    overall ESS."""
    return {"rhat_max": float(d.rhat.max()), "ess_bulk_min": float(d.ess_bulk.min()),
            "ess_tail_min": float(d.ess_tail.min()),
            "ess_min": float(min(d.ess_bulk.min(), d.ess_tail.min()))}


def _sampler_record(st: dict[str, Any]) -> dict[str, Any]:
    """A check's record of the ladder's state (:meth:`~symlib.posteriors.hmc.ladder.Ladder.stats`):
    levels, the least swap acceptance, round trips, acceptance and step size at the posterior's level,
    the divergent trajectories (all, per level, and their share at the posterior's level), gradients."""
    per_level = st["divergences_per_level"]
    trajectories = max(st["trajectories_per_level"], 1)
    return {"levels": len(st["betas"]), "swap_accept_min": min(st["swap_accept"]),
            "round_trips": st["round_trips"], "accept_cold": st["accept"][0],
            "step_cold": st["step_size"][0], "divergences": st["divergences"],
            "divergences_per_level": per_level,
            "divergent_share_cold": per_level[0] / trajectories, "n_grad": st["n_grad"]}


# ---------------------------------------------------------------------------------------------- reporting
def _say(enabled: bool, text: str) -> None:
    """Print ``text`` to stderr when ``enabled``."""
    if enabled:
        print(text, file=sys.stderr, flush=True)


def _warmup_line(hidden: tuple[int, ...], phase: int, n_phases: int, n_levels: int, stats: dict[str, Any],
                 cpu_s: float) -> str:
    """The progress line of a finished warm-up phase (``phase`` counted from 0)."""
    return (f"{hidden}: warm-up phase {phase + 1}/{n_phases}, {n_levels} levels, barrier {stats['barrier']}, "
            f"{cpu_s:.0f} CPU s")


def _check_line(hidden: tuple[int, ...], check: dict[str, Any]) -> str:
    """The progress line of a check: draws, CPU seconds, worst :math:`\\hat R` and least ESS (canonical /
    invariant)."""
    return (f"{hidden}: {check['draws']} draws/chain, {check['cpu_s']:.0f} CPU s, R-hat "
            f"{check['canonical']['rhat_max']:.3f}/{check['invariant']['rhat_max']:.3f}, "
            f"ESS {check['canonical']['ess_min']:.0f}/{check['invariant']['ess_min']:.0f}")


# ---------------------------------------------------------------------------------------------- the run
def _moves(hidden: tuple[int, ...], settings: Settings, problem: _pd.Problem, shapes):
    """The exact Gibbs moves before every trajectory that ``settings`` ask for: ``(shift, moves)``, the
    softmax shift (:class:`symlib.posteriors.hmc.orbits.SoftmaxShift`, or ``None``) and every move in turn,
    the scaling orbits' first (:func:`_compose`; ``None`` without any)."""
    from symlib.posteriors.hmc import orbits

    lam = 1.0 / problem.prior_sd**2
    steps = []
    if settings.orbit_moves:
        steps.append(orbits.ScalingMoves(spec(hidden, problem), shapes, lam))
    shift = orbits.SoftmaxShift(shapes, lam) if settings.shift_moves else None
    if shift is not None:
        steps.append(shift)
    return shift, _compose(steps)


class Run:
    """One size's resumable run in ``folder`` (see the module docstring); :meth:`advance` does the work.

    Its progress (phase, segments, seconds, checks) is a typed record, written to ``folder`` with the
    ladder's state and the segments after every phase and segment, and read back when ``folder`` holds
    the run (:attr:`manifest` is that record as the manifest holds it).

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
        self.shift, self.moves = _moves(self.hidden, settings, problem, self.shapes)
        self.segments: list[dict[str, torch.Tensor]] = []
        self.progress = _Progress.fresh(self.key, self.hidden, settings, problem)
        self.ladder: Ladder | None = None
        if self.folder is not None and (self.folder / store.MANIFEST).exists():
            self.progress, state, self.segments = _read(self.folder, self.key)
            if state is not None:
                self.ladder = Ladder.from_state(state, self.lik, 1.0 / problem.prior_sd**2,
                                                **self._ladder_args())

    @property
    def manifest(self) -> dict[str, Any]:
        """The run's record as its ``manifest.json`` holds it (without the provenance a write adds):
        settings, phase, segments, seconds, every check, whether and when it converged, whether it is done.
        A new dictionary at every call (its lists are the run's own)."""
        return self.progress.manifest()

    def _ladder_args(self) -> dict[str, Any]:
        """The :class:`~symlib.posteriors.hmc.ladder.Ladder`'s arguments from the settings and the moves."""
        s = self.settings
        return {"target_accept": s.target_accept, "jitter": s.jitter, "n_leapfrog": s.n_leapfrog,
                "moves": self.moves, "mass": s.mass, "per_chain": s.per_chain,
                "exact": self.shift.basis if self.shift is not None else None}

    def _save(self, segment: dict[str, torch.Tensor] | None = None) -> None:
        """:func:`_write` the run to its folder (nothing without one)."""
        if self.folder is not None:
            _write(self.folder, self.progress, self.ladder, segment)

    def _start(self) -> None:
        """The ladder at its initial states (drawn from the prior with the settings' seed) and schedule
        (:attr:`Settings.levels` levels, geometric from 1 to ``1e-3``, then the prior)."""
        s = self.settings
        gen = torch.Generator().manual_seed(s.seed)
        d = _pd.n_params(self.hidden, self.problem)
        theta0 = self.problem.prior_sd * torch.randn(s.n_chains, d, generator=gen, dtype=torch.float64)
        betas = torch.cat([torch.logspace(0, -3, s.levels - 1, dtype=torch.float64),
                           torch.zeros(1, dtype=torch.float64)])
        self.ladder = self.progress.timed(lambda: Ladder(self.lik, 1.0 / self.problem.prior_sd**2, theta0,
                                                         betas, seed=s.seed + 1, **self._ladder_args()))

    def _stop(self) -> bool:
        """Whether sampling is over: the fixed number of rounds reached, else certified or out of budget."""
        p, s = self.progress, self.settings
        if s.rounds is not None:
            return p.segments * s.segment >= s.rounds
        return p.converged_at is not None or p.cpu_s >= s.budget

    def advance(self, progress: bool = False, max_segments: int | None = None) -> dict[str, Any]:
        """Run (or resume) until the size converges, the budget is spent or, with ``settings.rounds``, the
        fixed length is reached; every phase and segment is saved before the next. ``max_segments``
        returns earlier, after that many new segments (the run stays resumable). Returns the manifest.

        The sampler runs on one intra-op thread whatever the caller's count: the budget counts the
        process's CPU seconds, which idle threads would spend (docs/performance.md, "On a GPU"), and one
        thread draws the same chains on every machine."""
        with threads.single():
            return self._advance(progress, max_segments)

    def _advance(self, progress: bool, max_segments: int | None) -> dict[str, Any]:
        """:meth:`advance` on the caller's threads: start, the warm-up phases left, then segments."""
        p = self.progress
        if p.done:
            return self.manifest
        if self.ladder is None:
            self._start()
            self._save()
        while p.phase < len(self.settings.warmup):
            self._warm_up(progress)
        new = 0
        while not self._stop():
            if max_segments is not None and new >= max_segments:
                return self.manifest
            new += 1
            self._sample_segment(progress)
        p.done = True
        self._save()
        return self.manifest

    def _warm_up(self, progress: bool) -> None:
        """The next warm-up phase, saved: adaptation, then the schedule re-tuned, or after the last phase
        the counters reset (sampling's divergences, swaps and round trips count its own rounds only)."""
        p, s = self.progress, self.settings
        i = p.phase
        stats = p.timed(lambda: self.ladder.adapt(s.warmup[i]))
        if i < len(s.warmup) - 1:
            p.timed(self.ladder.retune)
        else:
            self.ladder.reset_counters()
        p.warmup.append({**stats, "cpu_s": round(p.cpu_s, 2)})
        p.phase = i + 1
        self._save()
        _say(progress, _warmup_line(self.hidden, i, len(s.warmup), self.ladder.n_levels, stats, p.cpu_s))

    def _sample_segment(self, progress: bool) -> None:
        """The next segment, checked (:meth:`check`) and saved; the first certified check is recorded."""
        p, s = self.progress, self.settings
        seg = p.timed(lambda: self.ladder.sample(s.segment * s.thin, s.thin))
        t0 = time.perf_counter()
        record = _segment_record(seg, self.hidden, self.problem, s.n_probe)
        self.segments.append(record)
        p.segments = len(self.segments)
        check = self.check()
        p.diagnostics_s += time.perf_counter() - t0
        p.checks.append(check)
        if check["converged"] and p.converged_at is None:
            p.converged_at = {k: check[k] for k in ("cpu_s", "wall_s", "rounds", "draws")}
        self._save(record)
        _say(progress, _check_line(self.hidden, check))

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
        p, s = self.progress, self.settings
        rounds = p.segments * s.segment * s.thin
        st = self.ladder.stats()
        out: dict[str, Any] = {"rounds": rounds, "draws": rep.n_draws, "cpu_s": round(p.cpu_s, 2),
                               "wall_s": round(p.wall_s, 2), "criterion": rep.converged(rhat=RHAT, ess=ESS)}
        for sc in ("raw", "canonical", "invariant"):
            out[sc] = _scale_record(rep[sc])
        out["halves"] = halves(*quantities, self.hidden, self.problem) if s.halves else None
        out["sampler"] = _sampler_record(st)
        previous = [c.get("criterion", c.get("converged", False)) for c in p.checks]
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


def run(hidden: Sequence[int], settings: Settings = SETTINGS, folder: str | os.PathLike | None = None,
        problem: _pd.Problem = _pd.PROBLEM, progress: bool = False) -> Run:
    """:class:`Run` of ``hidden`` advanced to its end (resumed from ``folder`` when it holds it)."""
    r = Run(hidden, settings, folder, problem)
    r.advance(progress)
    return r
