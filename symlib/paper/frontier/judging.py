r"""What a frontier run is and how it is judged (book: chapter "Against the true posterior"): the sampler's
settings (:class:`Settings`, the chapter's :data:`SETTINGS`), the folder name that keys a run to its
settings and data (:func:`name`), the diagnostics every check computes on raw weights, canonical forms
(:func:`canonical_forms`) and invariant functionals (:func:`functionals`), :func:`judge`, and the
certification rule, fixed before any run looks at them (:func:`certify`, :data:`RHAT`, :data:`ESS`,
:func:`halves`). :mod:`symlib.paper.frontier.runs` samples and applies them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import torch

from symlib.paper import pca_digits as _pd
from symlib.params import unflatten

__all__ = ["ESS", "RHAT", "SETTINGS", "Settings", "canonical_forms", "certify", "functionals", "halves",
           "judge", "name", "spec"]


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
