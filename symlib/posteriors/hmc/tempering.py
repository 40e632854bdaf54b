r"""Replica exchange (parallel tempering) over HMC chains (book: chapter "A gentle example"; Swendsen & Wang
1986, Geyer 1991; the even-odd swap schedule of Okabe et al. 2001 and Syed et al. 2021).

A multi-modal posterior traps a single HMC chain in one mode. Replica exchange runs, for each of ``C``
independent chains, ``K`` replicas at inverse temperatures :math:`1 = \beta_0 > \beta_1 > \dots >
\beta_{K-1} > 0` of the likelihood,

.. math:: \pi_k(\theta) \propto \exp(-\beta_k L(\theta)) \, p(\theta), \qquad
          U_k = \beta_k L + \tfrac{\lambda}{2} \lVert\theta\rVert^2,

so that the hottest replica samples nearly the prior and crosses between modes freely. Every round,
each replica makes one Metropolis-corrected HMC trajectory at its own temperature
(:func:`symlib.posteriors.hmc.trajectory.transition`, its step size adapted by dual averaging during
warm-up), then neighbouring temperatures propose to exchange their states, alternately the pairs
:math:`(0, 1), (2, 3), \dots` and :math:`(1, 2), (3, 4), \dots` (deterministic even-odd), accepted with
probability

.. math:: \min\{1, \exp((\beta_k - \beta_{k+1})(L(\theta_k) - L(\theta_{k+1})))\},

which leaves the product of the :math:`\pi_k` invariant. The draws of :math:`\beta_0 = 1` are a sample
of the posterior; the ``C`` independent ensembles give ``C`` chains whose R-hat is meaningful. Reported
per pair of temperatures: the swap acceptance rate; per chain: how many times a replica travelled from
the coldest to the hottest temperature and back (*round trips*, the measure of how well the ladder
mixes).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from symlib import progress as _progress
from symlib import scales as _scales
from symlib.posteriors.hmc.metric import Identity, Metric
from symlib.posteriors.hmc.potentials import Potential, check_precision
from symlib.posteriors.hmc.sampler import DualAveraging, initial_step_size, jittered
from symlib.posteriors.hmc.trajectory import Step, transition

__all__ = ["TemperedResult", "geometric_ladder", "run_tempered"]


def geometric_ladder(n: int, beta_min: float) -> torch.Tensor:
    """``n`` inverse temperatures from 1 down to ``beta_min`` in geometric steps (float64)."""
    _scales.check_int("n_temperatures", n, 1)
    if not 0 < beta_min <= 1:
        raise ValueError(f"beta_min must lie in (0, 1], got {beta_min!r}")
    if n == 1:
        return torch.ones(1, dtype=torch.float64)
    return torch.logspace(0.0, math.log10(beta_min), n, dtype=torch.float64)


@dataclasses.dataclass
class TemperedResult:
    """What :func:`run_tempered` returns.

    Attributes:
        draws: ``(C, S, D)`` states of the coldest replica (:math:`\\beta = 1`, the posterior).
        potential: ``(C, S)`` their :math:`U = L + \\tfrac\\lambda2|\\theta|^2`; nll: ``(C, S)`` their
            :math:`L`.
        betas: ``(K,)`` the ladder.
        swap_accept: ``(K - 1,)`` acceptance rate of the swaps between neighbours, after warm-up.
        round_trips: ``(C,)`` coldest -> hottest -> coldest journeys of replicas, after warm-up.
        accept_prob: ``(K, C)`` mean HMC acceptance probability after warm-up; step_size: ``(K, C)``.
        divergences: ``(K, C)`` after warm-up.
        n_leapfrog, n_grad (gradient calls, each for all ``K C`` replicas), seconds.
    """

    draws: torch.Tensor
    potential: torch.Tensor
    nll: torch.Tensor
    betas: torch.Tensor
    swap_accept: torch.Tensor
    round_trips: torch.Tensor
    accept_prob: torch.Tensor
    step_size: torch.Tensor
    divergences: torch.Tensor
    n_leapfrog: int
    n_grad: int
    seconds: float

    def diagnostics(self) -> dict[str, Any]:
        """JSON-able sampler diagnostics (convergence itself: :mod:`symlib.stats.convergence`)."""
        return {
            "betas": [float(b) for b in self.betas],
            "swap_accept": [round(float(a), 4) for a in self.swap_accept],
            "round_trips": [int(r) for r in self.round_trips],
            "accept_prob_cold": [round(float(a), 4) for a in self.accept_prob[0]],
            "accept_prob_min": float(self.accept_prob.min()),
            "step_size_cold": [float(s) for s in self.step_size[0]],
            "divergences": int(self.divergences.sum()),
            "n_leapfrog": self.n_leapfrog,
            "n_grad": self.n_grad,
            "seconds": round(self.seconds, 2),
        }


class _Tempered:
    r"""The potentials of every replica, :math:`U_k = \beta_k L + \tfrac{\lambda}{2}\lVert\theta\rVert^2`
    (row ``k * C + c`` at ``beta_row[k * C + c]``), as :func:`~symlib.posteriors.hmc.trajectory.transition`
    calls them; counts its calls and keeps the last :math:`L` and :math:`\nabla L` (``nll``, ``grad``)."""

    def __init__(self, likelihood: Potential, beta_row: torch.Tensor, lam: float):
        self.likelihood, self.beta_row, self.lam = likelihood, beta_row, lam
        self.calls = 0
        self.nll: torch.Tensor | None = None
        self.grad: torch.Tensor | None = None

    def tempered(self, theta: torch.Tensor, nll: torch.Tensor,
                 grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U (R,), grad U (R, D))`` of states ``theta`` from their likelihood ``nll`` and its gradient."""
        return (self.beta_row * nll + 0.5 * self.lam * (theta * theta).sum(1),
                self.beta_row[:, None] * grad + self.lam * theta)

    def __call__(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(U, grad U)`` at ``theta``, one call of the likelihood."""
        self.calls += 1
        self.nll, self.grad = self.likelihood(theta)
        return self.tempered(theta, self.nll, self.grad)


def _replicas(theta0: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    """``(theta, C)``: the initial states of ``K = k`` replicas of ``C`` chains as ``(K C, D)`` rows (row
    ``k * C + c``: temperature ``k`` of chain ``c``), a copy of ``theta0`` ``(K, C, D)`` or of ``(C, D)``
    repeated at every temperature."""
    start = theta0.detach()
    if start.ndim == 2:
        start = start.expand(k, *start.shape)
    _, c, dim = start.shape
    return start.reshape(k * c, dim).clone(), c


def _checked_ladder(betas: torch.Tensor, n_warmup: int, n_samples: int, n_leapfrog: int,
                    thin: int) -> torch.Tensor:
    """``betas`` as float64 once checked to decrease strictly from 1 to a positive value, and the run's
    counts checked (``n_warmup >= 0``, the others ``>= 1``)."""
    betas = torch.as_tensor(betas, dtype=torch.float64)
    if betas.ndim != 1 or not bool((betas > 0).all()) or float(betas[0]) != 1.0 or not bool(
        (betas[1:] < betas[:-1]).all()
    ):
        raise ValueError(f"betas must decrease strictly from 1 to a positive value, got {betas.tolist()}")
    _scales.check_int("n_warmup", n_warmup, 0)
    for name, v in (("n_samples", n_samples), ("n_leapfrog", n_leapfrog), ("thin", thin)):
        _scales.check_int(name, v, 1)
    return betas


@dataclasses.dataclass
class _Exchange:
    """The swaps between neighbouring temperatures of ``C`` ladders of ``K`` replicas, and their counters.

    Attributes:
        betas: ``(K,)`` the ladder; dt, dev: the states' dtype and device.
        label: ``(K, C)`` which replica sits at each row (row ``k * C + c``: temperature ``k`` of chain
            ``c``).
        direction: ``(K C,)`` per replica, 0: not yet at an end, 1: heading hot, 2: heading cold.
        trips: ``(C,)`` round trips so far; swaps, tries: ``(max(K - 1, 1),)`` accepted and proposed
            swaps per pair of neighbours, after warm-up.
    """

    betas: torch.Tensor
    dt: torch.dtype
    dev: torch.device
    label: torch.Tensor
    direction: torch.Tensor
    trips: torch.Tensor
    swaps: torch.Tensor
    tries: torch.Tensor

    @classmethod
    def start(cls, betas: torch.Tensor, c: int, dt: torch.dtype, dev: torch.device) -> _Exchange:
        """No swap yet, every replica at its own row, none at an end."""
        k = betas.shape[0]
        return cls(betas, dt, dev, torch.arange(k * c).reshape(k, c), torch.zeros(k * c, dtype=torch.int64),
                   torch.zeros(c, dtype=torch.int64), torch.zeros(max(k - 1, 1), dtype=torch.float64),
                   torch.zeros(max(k - 1, 1), dtype=torch.float64))

    def swap(self, it: int, theta: torch.Tensor, nll: torch.Tensor, gl: torch.Tensor, gen: torch.Generator,
             warm: bool) -> None:
        r"""Round ``it``'s exchanges, in place on the rows of ``theta``, ``nll`` and ``gl`` (the states,
        their :math:`L` and :math:`\nabla L`) and on the labels: the pairs ``(k, k + 1)`` with ``k`` of
        the parity of ``it``, each accepted with probability :math:`\min\{1, \exp((\beta_k -
        \beta_{k+1})(L_k - L_{k+1}))\}`; counted unless ``warm``."""
        k, c = self.label.shape
        lo = torch.arange(it % 2, k - 1, 2)
        if not lo.numel():
            return
        la, lb = nll.view(k, c)[lo], nll.view(k, c)[lo + 1]
        log_r = (self.betas[lo] - self.betas[lo + 1]).to(self.dt).to(self.dev)[:, None] * (la - lb)
        coin = torch.rand(lo.numel(), c, generator=gen, dtype=torch.float64).to(self.dev)
        ok = torch.log(coin) < log_r.double()
        if not warm:
            self.swaps[lo] += ok.double().sum(1).cpu()
            self.tries[lo] += c
        rows_a = (lo[:, None] * c + torch.arange(c)[None]).to(self.dev)
        a, b = rows_a[ok], (rows_a + c)[ok]
        for t in (theta, nll, gl):
            t[a], t[b] = t[b].clone(), t[a].clone()
        lab = self.label.view(-1)
        lab[a.cpu()], lab[b.cpu()] = lab[b.cpu()].clone(), lab[a.cpu()].clone()

    def travel(self) -> None:
        """Count the round trips completed by the replicas now at the coldest temperature, and turn those
        at either end."""
        k = self.label.shape[0]
        cold, hot = self.label[0], self.label[k - 1]
        done = self.direction[cold] == 2
        self.trips += done.long()
        self.direction[cold] = 1
        self.direction[hot] = torch.where(self.direction[hot] == 1, 2, self.direction[hot])


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The run's settings, checked (:func:`run_tempered`'s arguments): the ladder ``betas`` ``(K,)``, the
    prior precision ``lam``, the counts, the step-size adaptation's target and the jitter after it, and the
    mass matrix."""

    betas: torch.Tensor
    lam: float
    n_warmup: int
    n_samples: int
    n_leapfrog: int
    thin: int
    target_accept: float
    jitter: float
    metric: Metric

    @classmethod
    def of(cls, prior_precision: float, betas: torch.Tensor, n_warmup: int, n_samples: int, n_leapfrog: int,
           thin: int, target_accept: float, jitter: float, metric: Metric | None) -> _Settings:
        """The settings once every argument is checked (a ``ValueError`` naming the first bad one)."""
        lam = check_precision(prior_precision)
        betas = _checked_ladder(betas, n_warmup, n_samples, n_leapfrog, thin)
        return cls(betas, lam, n_warmup, n_samples, n_leapfrog, thin, target_accept, jitter,
                   metric or Identity())

    @property
    def k(self) -> int:
        """``K``, the number of temperatures."""
        return self.betas.shape[0]

    @property
    def total(self) -> int:
        """Rounds of the run: warm-up, then ``thin`` rounds per kept state."""
        return self.n_warmup + self.n_samples * self.thin


@dataclasses.dataclass
class _State:
    r"""Every replica after a round, as ``(K C, ...)`` rows (row ``k * C + c``: temperature ``k`` of chain
    ``c``): the states ``theta``, their tempered potential ``u`` and its gradient ``g``, their likelihood
    ``nll`` (:math:`L`) and its gradient ``gl``, and the step sizes ``eps``."""

    theta: torch.Tensor
    u: torch.Tensor
    g: torch.Tensor
    nll: torch.Tensor
    gl: torch.Tensor
    eps: torch.Tensor


def _init(cfg: _Settings, potential: _Tempered, theta: torch.Tensor,
          gen: torch.Generator) -> tuple[_State, DualAveraging]:
    """The state of the replicas at ``theta`` (one call of the likelihood), with the initial step sizes
    (:func:`~symlib.posteriors.hmc.sampler.initial_step_size`) and their dual-averaging adaptation.

    Raises:
        FloatingPointError: the potential or its gradient is not finite at the initial states.
    """
    u, g = potential(theta)
    nll, gl = potential.nll, potential.grad
    if not bool(torch.isfinite(u).all() & torch.isfinite(g).all()):
        raise FloatingPointError("non-finite potential or gradient at the initial states")
    eps = initial_step_size(theta, u, g, potential, gen, cfg.metric)
    return _State(theta, u, g, nll, gl, eps), DualAveraging(eps, cfg.target_accept)


def _update(it: int, state: _State, cfg: _Settings, potential: _Tempered, adapt: DualAveraging,
            ex: _Exchange, gen: torch.Generator) -> tuple[_State, Step]:
    """Round ``it``: one HMC trajectory per replica at its own temperature (step sizes adapted during
    warm-up, fixed and jittered after it), then the exchanges between neighbouring temperatures
    (:meth:`_Exchange.swap`, and :meth:`_Exchange.travel` after warm-up). Returns the new state and the
    trajectories' transition (acceptance probabilities, divergences)."""
    warm = it < cfg.n_warmup
    eps = state.eps
    if it == cfg.n_warmup and cfg.n_warmup:
        eps = adapt.final.to(state.theta.dtype)
    e = eps if warm else jittered(eps, cfg.jitter, gen)
    st = transition(state.theta, state.u, state.g, e, cfg.n_leapfrog, potential, gen, cfg.metric,
                    where=str(it))
    nll = torch.where(st.accepted, potential.nll, state.nll)
    gl = torch.where(st.accepted[:, None], potential.grad, state.gl)
    theta = st.theta
    if warm:
        eps = adapt.update(st.accept_prob).to(theta.dtype)
    if cfg.k > 1:  # swaps between neighbouring temperatures, even pairs then odd pairs
        ex.swap(it, theta, nll, gl, gen, warm)
    u, g = potential.tempered(theta, nll, gl)
    if not warm and cfg.k > 1:
        ex.travel()
    return _State(theta, u, g, nll, gl, eps), st


@dataclasses.dataclass
class _Trace:
    """What a run keeps after warm-up: every ``thin``-th state of the coldest replicas (``draws`` ``(C, S,
    D)``, their potential ``pots`` and likelihood ``nlls`` ``(C, S)``), and per replica the summed HMC
    acceptance probability ``acc`` and the divergences ``div`` ``(K C,)``."""

    draws: torch.Tensor
    pots: torch.Tensor
    nlls: torch.Tensor
    acc: torch.Tensor
    div: torch.Tensor

    @classmethod
    def empty(cls, cfg: _Settings, c: int, theta: torch.Tensor) -> _Trace:
        """Nothing kept yet, for ``C = c`` chains of states like ``theta``."""
        dim, dt, dev = theta.shape[1], theta.dtype, theta.device
        return cls(torch.empty(c, cfg.n_samples, dim, dtype=dt, device=dev),
                   torch.empty(c, cfg.n_samples, dtype=dt, device=dev),
                   torch.empty(c, cfg.n_samples, dtype=dt, device=dev),
                   torch.zeros(cfg.k * c, dtype=torch.float64), torch.zeros(cfg.k * c, dtype=torch.int64))

    def record(self, it: int, cfg: _Settings, state: _State, st: Step) -> None:
        """Keep round ``it`` (nothing during warm-up): its trajectories' acceptance and divergences, and the
        coldest replicas' states on every ``thin``-th round."""
        if it < cfg.n_warmup:
            return
        self.acc += st.accept_prob.cpu()
        self.div += st.divergent.long().cpu()
        j, r = divmod(it - cfg.n_warmup, cfg.thin)
        if r == cfg.thin - 1:
            c = self.draws.shape[0]
            self.draws[:, j], self.nlls[:, j], self.pots[:, j] = state.theta[:c], state.nll[:c], state.u[:c]

    def result(self, cfg: _Settings, ex: _Exchange, state: _State, n_grad: int,
               seconds: float) -> TemperedResult:
        """The run's :class:`TemperedResult`: the kept states, and the rates averaged over the rounds after
        warm-up."""
        k, c = cfg.k, self.draws.shape[0]
        n_after = max(cfg.total - cfg.n_warmup, 1)
        return TemperedResult(
            draws=self.draws,
            potential=self.pots,
            nll=self.nlls,
            betas=cfg.betas,
            swap_accept=ex.swaps / ex.tries.clamp_min(1),
            round_trips=ex.trips,
            accept_prob=(self.acc / n_after).view(k, c),
            step_size=state.eps.cpu().view(k, c),
            divergences=self.div.view(k, c),
            n_leapfrog=cfg.n_leapfrog,
            n_grad=n_grad,
            seconds=seconds,
        )


def run_tempered(
    likelihood: Potential,
    prior_precision: float,
    theta0: torch.Tensor,
    betas: torch.Tensor,
    n_warmup: int,
    n_samples: int,
    n_leapfrog: int,
    thin: int = 1,
    target_accept: float = 0.75,
    jitter: float = 0.1,
    seed: int = 0,
    metric: Metric | None = None,
    progress: bool = True,
) -> TemperedResult:
    r"""Replica-exchange HMC: ``C`` independent chains, each a ladder of ``K`` tempered replicas.

    Args:
        likelihood: ``flat (R, D) -> (L (R,), grad L (R, D))``, the negative log-likelihood of stacked
            networks (:func:`symlib.posteriors.hmc.potentials.mlp_likelihood`).
        prior_precision: :math:`\lambda` of the Gaussian prior :math:`\mathcal N(0, \lambda^{-1} I)`.
        theta0: ``(C, D)`` initial states (every replica of chain ``c`` starts at ``theta0[c]``) or
            ``(K, C, D)``.
        betas: ``(K,)`` inverse temperatures, decreasing from 1 (:func:`geometric_ladder`).
        n_warmup: rounds of step-size adaptation (discarded); n_samples: kept states per chain;
        n_leapfrog: leapfrog steps per trajectory; thin: rounds per kept state.
        target_accept, jitter: as :func:`symlib.posteriors.hmc.sampler.run_chains`.
        seed: momenta, jitter, Metropolis coins and swaps.
        metric: a mass matrix shared by every replica (default the identity).
        progress: show a progress bar.
    """
    cfg = _Settings.of(prior_precision, betas, n_warmup, n_samples, n_leapfrog, thin, target_accept, jitter,
                       metric)
    theta, c = _replicas(theta0, cfg.k)
    beta_row = cfg.betas.to(theta.dtype).to(theta.device).repeat_interleave(c)
    potential = _Tempered(likelihood, beta_row, cfg.lam)
    gen = torch.Generator().manual_seed(int(seed))
    t0 = time.perf_counter()
    state, adapt = _init(cfg, potential, theta, gen)
    trace = _Trace.empty(cfg, c, theta)
    ex = _Exchange.start(cfg.betas, c, theta.dtype, theta.device)
    bar = _progress.bar(cfg.total, "replica exchange", enabled=progress)
    for it in range(cfg.total):
        state, st = _update(it, state, cfg, potential, adapt, ex, gen)
        trace.record(it, cfg, state, st)
        bar.update(1)
    bar.close()
    return trace.result(cfg, ex, state, potential.calls, time.perf_counter() - t0)
