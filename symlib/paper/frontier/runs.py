r"""One run of the convergence frontier: a resumable replica-exchange run of one MLP layout, judged every
segment (book: chapter "Against the true posterior"; its settings, what it is judged on and the
certification rule are :mod:`symlib.paper.frontier.judging`; the sweep over layouts and its command line
:mod:`symlib.paper.frontier`).

:class:`Run` samples the posterior of the problem of :mod:`symlib.paper.pca_digits` with non-reversible
parallel tempering down to the prior (:class:`symlib.posteriors.hmc.ladder.Ladder`) and, every ``segment``
rounds, computes the symmetry-aware diagnostics of :mod:`symlib.stats.convergence` on raw weights,
canonical forms (:func:`~symlib.paper.frontier.judging.spec`) and invariant functionals
(:func:`~symlib.paper.frontier.judging.functionals`), :func:`~symlib.paper.frontier.judging.judge`. Every
run is resumable and written atomically (see :class:`Run`).
"""

from __future__ import annotations

import dataclasses
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
from symlib.paper.frontier.judging import (
    ESS,
    RHAT,
    SETTINGS,
    Settings,
    _key,
    canonical_forms,
    certify,
    functionals,
    halves,
    judge,
    spec,
)
from symlib.posteriors.hmc.ladder import Ladder

__all__ = ["Run", "run"]


_RECORDED = ("key", "hidden", "n_params", "settings", "problem", "phase", "segments", "cpu_s", "wall_s",
             "diagnostics_s", "checks", "converged_at", "done", "warmup")
"""The entries of a run's ``manifest.json`` after its ``kind``, in their order (:class:`_Progress`)."""


@dataclasses.dataclass
class _Progress:
    """Where a run stands: what its ``manifest.json`` records (:meth:`manifest`), read back by
    :meth:`from_manifest`.

    Attributes:
        key: the run's key (:func:`~symlib.paper.frontier.judging.name`); hidden: its layout; n_params: its
            number of parameters.
        settings, problem: its :class:`~symlib.paper.frontier.judging.Settings` and problem as dictionaries.
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
    likelihood ``(C, S)``, their canonical forms (:func:`~symlib.paper.frontier.judging.canonical_forms`)
    and their invariant functionals (:func:`~symlib.paper.frontier.judging.functionals`, as ``f:<name>``)."""
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
        r"""One check of the certification rule (:func:`~symlib.paper.frontier.judging.certify`) on every
        kept draw so far, with the sampler's state: the criterion on all draws, :math:`\hat R` on each half,
        the divergent trajectories per level and their share at the posterior's level."""
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
