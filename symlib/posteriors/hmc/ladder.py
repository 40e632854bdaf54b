r"""Non-reversible parallel tempering down to the prior, with an adapted schedule and a state that can be
saved and resumed (book: chapter "Against the true posterior"; Syed et al. 2021).

:mod:`symlib.posteriors.hmc.tempering` runs a fixed geometric ladder of HMC replicas. For networks of tens
to hundreds of weights on a few hundred examples the right ladder is not obvious (the gentle example's
ladder of 8 temperatures leaves the swaps between the coldest replicas of a 40-weight MLP almost always
rejected), so :class:`Ladder` learns it. Each of ``C`` independent chains is a ladder of ``K`` levels
:math:`1 = \beta_0 > \dots > \beta_{K-1} = 0` of

.. math:: \pi_k(\theta) \propto \exp(-\beta_k L(\theta)) \, \mathcal N(\theta; 0, \lambda^{-1} I),

where the last level is the prior itself, redrawn exactly (independently) every round. A *round* is one
Metropolis-corrected HMC trajectory at every other level (its own step size and diagonal mass matrix,
:func:`symlib.posteriors.hmc.trajectory.transition`), the prior's redraw, then swaps between neighbours,
alternately the even and the odd pairs (the deterministic even-odd scheme, non-reversible: a replica keeps
its direction until a swap fails). Swaps are accepted with probability
:math:`\min\{1, \exp((\beta_k - \beta_{k+1})(L(\theta_k) - L(\theta_{k+1})))\}`; every move leaves the
product of the :math:`\pi_k` invariant, so the level :math:`\beta = 1` samples the posterior.

**Adaptation** (:meth:`Ladder.adapt`, warm-up only; the draws are discarded): per level, the step size by
dual averaging of the chains' mean acceptance (Hoffman & Gelman 2014) and the diagonal mass from the
variance of the level's states (Stan's regularised estimate); then the schedule, by Syed et al.'s rule:
with :math:`r_k` the rejection rate of the swaps between levels :math:`k` and :math:`k + 1`, the
*communication barrier* :math:`\Lambda(\beta)` is the piecewise-linear function with increments
:math:`r_k`, and the new levels sit at equal steps of :math:`\Lambda`. Their number is
:math:`\lceil 2 \Lambda(1) \rceil + 1` when ``n_levels="auto"`` (about one rejection in two per pair, the
number that maximises round trips per unit of computation for this scheme), within ``[min_levels,
max_levels]``.

**Round trips**: a replica's journey from the prior level to :math:`\beta = 1` and back (the measure of
how well the ladder carries states between the modes; each round trip brings a fresh, independent
draw of the prior to the posterior's level).

:meth:`Ladder.state_dict` / :meth:`Ladder.from_state` hold everything the next round needs (states, their
likelihoods and gradients, the schedule, step sizes, masses, the generator's state, counters), so a run
saved between two segments resumes with exactly the rounds it would have run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from symlib import scales as _scales
from symlib.posteriors.hmc.metric import DenseCovariance, Diagonal, Metric
from symlib.posteriors.hmc.potentials import Potential, check_precision
from symlib.posteriors.hmc.sampler import DualAveraging, initial_step_size, jittered
from symlib.posteriors.hmc.trajectory import transition

__all__ = ["MASSES", "Ladder", "Segment", "barrier", "schedule_from_rejections"]

MASSES = ("diag", "dense")
"""Mass matrices of the tempered levels: the inverse of their states' diagonal or dense covariance."""


def barrier(betas: torch.Tensor, rejections: torch.Tensor) -> torch.Tensor:
    r""":math:`\Lambda` at every level of a schedule ``betas`` (decreasing from 1 to 0): the cumulative sum
    of the swap rejection rates ``rejections`` (one per neighbouring pair) from the prior's end, ``(K,)``,
    0 at :math:`\beta = 0`."""
    r = rejections.double().clamp(0.0, 1.0).flip(0)  # from the prior's end
    return torch.cat([torch.zeros(1, dtype=torch.float64), r.cumsum(0)]).flip(0)


def schedule_from_rejections(betas: torch.Tensor, rejections: torch.Tensor, n_levels: int | str = "auto",
                             min_levels: int = 2, max_levels: int = 256) -> torch.Tensor:
    r"""Syed et al.'s schedule update: levels at equal steps of the communication barrier
    :math:`\Lambda` (:func:`barrier`, interpolated linearly in :math:`\beta`), decreasing from 1 to 0.

    Args:
        betas: ``(K,)`` the current schedule, decreasing from 1 to 0.
        rejections: ``(K - 1,)`` swap rejection rates between neighbours.
        n_levels: the new number of levels, or ``"auto"``: :math:`\lceil 2\Lambda(1) \rceil + 1`.
        min_levels, max_levels: bounds of ``"auto"``.
    """
    b = betas.double().flip(0)  # increasing from 0 to 1
    lam = barrier(betas, rejections).flip(0)  # increasing
    total = float(lam[-1])
    if n_levels == "auto":
        n_levels = min(max(int(math.ceil(2 * total)) + 1, min_levels), max_levels)
    _scales.check_int("n_levels", n_levels, 2)
    if total <= 0:
        return torch.linspace(1.0, 0.0, n_levels, dtype=torch.float64)
    targets = torch.linspace(0.0, total, n_levels, dtype=torch.float64)
    out = torch.empty(n_levels, dtype=torch.float64)
    for i, t in enumerate(targets):
        j = int(torch.searchsorted(lam, t, right=False).clamp(1, len(lam) - 1))
        lo, hi = float(lam[j - 1]), float(lam[j])
        w = 0.0 if hi <= lo else (float(t) - lo) / (hi - lo)
        out[i] = b[j - 1] + w * (b[j] - b[j - 1])
    out[0], out[-1] = 0.0, 1.0
    out = torch.cummax(out, 0).values  # monotone despite rounding
    return out.flip(0)


@dataclasses.dataclass
class Segment:
    """What :meth:`Ladder.sample` returns: the states of the level :math:`\\beta = 1`.

    Attributes:
        draws: ``(C, S, D)``; nll: ``(C, S)`` their :math:`L`; potential: ``(C, S)`` their
            :math:`U = L + \\tfrac\\lambda2 \\lVert\\theta\\rVert^2`.
    """

    draws: torch.Tensor
    nll: torch.Tensor
    potential: torch.Tensor


class Ladder:
    r"""``C`` independent ladders of ``K`` tempered replicas down to the prior (see the module docstring).

    Args:
        likelihood: ``flat (R, D) -> (L (R,), grad L (R, D))``, the negative log-likelihood of stacked
            networks (any number of rows).
        prior_precision: :math:`\lambda` of the prior :math:`\mathcal N(0, \lambda^{-1} I)`.
        theta0: ``(C, D)`` initial states of the posterior's level (the other levels start from prior
            draws) or ``(K, C, D)``.
        betas: ``(K,)`` the initial schedule, decreasing strictly from 1 to 0.
        seed: of every random draw.
        target_accept: the step sizes' target acceptance.
        jitter: relative jitter of the step sizes per round (after adaptation).
        n_leapfrog: leapfrog steps per trajectory.
        moves: an extra move of every tempered level before its trajectory, ``(theta (R, D), generator)
            -> (theta, acceptance (R,))``, that must leave every :math:`\pi_k` invariant: a move along
            the scaling orbits, where the likelihood is constant
            (:class:`symlib.posteriors.hmc.orbits.ScalingMoves`); the likelihood and its gradient are
            recomputed after it.
        mass: ``"diag"`` or ``"dense"``: the inverse mass matrix of every level is the diagonal or the
            dense covariance of its states in the last adaptation phase.
        per_chain: one mass matrix per chain and level, else one per level (pooled over the chains).
        exact: an orthonormal basis ``(D, r)`` of directions that ``moves`` samples exactly (the softmax
            shift, :class:`symlib.posteriors.hmc.orbits.SoftmaxShift`): the covariances are estimated on
            the states without their component there, so the step sizes follow the other directions.
    """

    def __init__(self, likelihood: Potential, prior_precision: float, theta0: torch.Tensor,
                 betas: torch.Tensor, seed: int = 0, target_accept: float = 0.75, jitter: float = 0.1,
                 n_leapfrog: int = 10, moves=None, mass: str = "diag", per_chain: bool = False,
                 exact: torch.Tensor | None = None):
        self.likelihood, self.moves, self.exact = likelihood, moves, exact
        if mass not in MASSES:
            raise ValueError(f"mass must be one of {MASSES}, got {mass!r}")
        self.mass, self.per_chain = mass, bool(per_chain)
        self.lam = check_precision(prior_precision)
        self.target_accept, self.jitter = float(target_accept), float(jitter)
        self.n_leapfrog = _scales.check_int("n_leapfrog", n_leapfrog, 1)
        if not 0 < self.target_accept < 1:
            raise ValueError(f"target_accept must lie in (0, 1), got {target_accept}")
        self.gen = torch.Generator().manual_seed(int(seed))
        betas = _check_betas(betas)
        k = betas.shape[0]
        theta0 = theta0.detach().double()
        if theta0.ndim == 2:
            c, d = theta0.shape
            prior = torch.randn(k - 1, c, d, generator=self.gen, dtype=torch.float64) / math.sqrt(self.lam)
            theta0 = torch.cat([theta0[None], prior])
        if theta0.ndim != 3 or theta0.shape[0] != k:
            raise ValueError(f"theta0 must be (chains, D) or (levels={k}, chains, D), "
                             f"got {tuple(theta0.shape)}")
        self.betas = betas
        self.theta = theta0.clone()
        self.nll, self.grad = self._likelihood(self.theta)
        if not bool(torch.isfinite(self.nll).all() & torch.isfinite(self.grad).all()):
            raise FloatingPointError("non-finite likelihood or gradient at the initial states")
        d = self.theta.shape[2]
        groups = self.theta.shape[1] if self.per_chain else 1
        eye = torch.eye(d, dtype=torch.float64)
        self.cov = eye.expand(k, groups, d, d).clone() if mass == "dense" else torch.ones(k, groups, d,
                                                                                           dtype=torch.float64)
        self._metric = None
        self.rounds = 0
        self.n_grad = 1
        self.step = self._initial_steps()
        self._reset_counters()

    # ------------------------------------------------------------------ bookkeeping
    @property
    def n_levels(self) -> int:
        return int(self.betas.shape[0])

    @property
    def n_chains(self) -> int:
        return int(self.theta.shape[1])

    def _likelihood(self, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, c, d = theta.shape
        nll, g = self.likelihood(theta.reshape(k * c, d))
        return nll.reshape(k, c), g.reshape(k, c, d)

    def reset_counters(self) -> None:
        """Start the counters (swaps, acceptance, divergences per level, round trips) afresh, e.g. when
        sampling begins after the warm-up; the chains are unchanged."""
        self._reset_counters()

    def _reset_counters(self) -> None:
        k, c = self.n_levels, self.n_chains
        self.swaps = torch.zeros(max(k - 1, 1), dtype=torch.float64)
        self.tries = torch.zeros(max(k - 1, 1), dtype=torch.float64)
        self.accept = torch.zeros(k, dtype=torch.float64)
        self.n_moves = 0
        self.divergences = torch.zeros(k, dtype=torch.int64)
        # round trips: which replica sits where, and where each last touched an end
        self.label = torch.arange(k * c).reshape(k, c)
        self.heading = torch.zeros(k * c, dtype=torch.int64)  # 0 unknown, 1 towards beta = 1, 2 back
        self.trips = torch.zeros(c, dtype=torch.int64)

    def _potential_rows(self, rows: slice):
        """The potential of the levels ``rows`` (flattened ``(levels * C, D)``)."""
        beta = self.betas[rows].repeat_interleave(self.n_chains)[:, None]
        lam = self.lam

        def potential(th: torch.Tensor):
            nll, g = self.likelihood(th)
            return beta[:, 0] * nll + 0.5 * lam * (th * th).sum(1), beta * g + lam * th

        return potential

    def _initial_steps(self) -> torch.Tensor:
        """Hoffman & Gelman's initial step size of every level (the median over its chains)."""
        k, c, d = self.theta.shape
        hot = slice(0, k - 1)
        th = self.theta[hot].reshape(-1, d)
        beta = self.betas[hot].repeat_interleave(c)
        u = beta * self.nll[hot].reshape(-1) + 0.5 * self.lam * (th * th).sum(1)
        g = beta[:, None] * self.grad[hot].reshape(-1, d) + self.lam * th
        eps = initial_step_size(th, u, g, self._potential_rows(hot), self.gen)
        self.n_grad += 1
        steps = eps.reshape(k - 1, c).median(1).values
        return torch.cat([steps, torch.ones(1, dtype=torch.float64)])

    # ------------------------------------------------------------------ one round
    def _round(self, eps: torch.Tensor) -> torch.Tensor:
        """HMC at every level but the prior's, the prior's exact redraw, then the swaps; returns the
        acceptance probabilities ``(K - 1, C)``."""
        k, c, d = self.theta.shape
        hot = slice(0, k - 1)
        if self.moves is not None:
            moved, _ = self.moves(self.theta[hot].reshape(-1, d), self.gen)
            self.theta[hot] = moved.reshape(k - 1, c, d)
            self.nll[hot], self.grad[hot] = self._likelihood(self.theta[hot])
            self.n_grad += 1
        th = self.theta[hot].reshape(-1, d)
        beta = self.betas[hot].repeat_interleave(c)
        u = beta * self.nll[hot].reshape(-1) + 0.5 * self.lam * (th * th).sum(1)
        g = beta[:, None] * self.grad[hot].reshape(-1, d) + self.lam * th
        last: dict[str, torch.Tensor] = {}

        def potential(x: torch.Tensor):
            nll, gl = self.likelihood(x)
            last["nll"], last["g"] = nll, gl
            return beta * nll + 0.5 * self.lam * (x * x).sum(1), beta[:, None] * gl + self.lam * x

        metric = self.metric()
        st = transition(th, u, g, eps[hot].repeat_interleave(c), self.n_leapfrog, potential, self.gen, metric)
        self.n_grad += self.n_leapfrog
        acc = st.accepted
        self.theta[hot] = st.theta.reshape(k - 1, c, d)
        self.nll[hot] = torch.where(acc, last["nll"], self.nll[hot].reshape(-1)).reshape(k - 1, c)
        grad = torch.where(acc[:, None], last["g"], self.grad[hot].reshape(-1, d))
        self.grad[hot] = grad.reshape(k - 1, c, d)
        self.divergences[: k - 1] += st.divergent.reshape(k - 1, c).sum(1)
        # the prior's level: an exact, independent draw
        fresh = torch.randn(1, c, d, generator=self.gen, dtype=torch.float64) / math.sqrt(self.lam)
        self.theta[k - 1 :] = fresh
        nll, gl = self._likelihood(fresh)
        self.nll[k - 1 :], self.grad[k - 1 :] = nll, gl
        self._swap()
        self.rounds += 1
        return st.accept_prob.reshape(k - 1, c)

    def _swap(self) -> None:
        k, c = self.n_levels, self.n_chains
        lo = torch.arange(self.rounds % 2, k - 1, 2)
        if lo.numel():
            la, lb = self.nll[lo], self.nll[lo + 1]
            log_r = (self.betas[lo] - self.betas[lo + 1])[:, None] * (la - lb)
            coin = torch.rand(lo.numel(), c, generator=self.gen, dtype=torch.float64)
            ok = torch.log(coin) < log_r
            self.swaps[lo] += ok.double().sum(1)
            self.tries[lo] += c
            rows, cols = lo[:, None].expand(-1, c)[ok], torch.arange(c)[None].expand(lo.numel(), -1)[ok]
            for t in (self.theta, self.nll, self.grad, self.label):
                a, b = t[rows, cols].clone(), t[rows + 1, cols].clone()
                t[rows, cols], t[rows + 1, cols] = b, a
        # round trips: a replica reaching beta = 1 after the prior, then the prior again
        cold, prior = self.label[0], self.label[k - 1]
        back = (self.heading[prior] == 2)
        self.trips += back.long()
        self.heading[prior] = 1
        self.heading[cold] = torch.where(self.heading[cold] == 1, 2, self.heading[cold])

    # ------------------------------------------------------------------ phases
    def adapt(self, n_rounds: int, mass: bool = True) -> dict[str, Any]:
        """``n_rounds`` warm-up rounds: dual averaging of every level's step size, then (``mass``) every
        level's diagonal mass from its states' variance. Resets the counters; returns the phase's swap
        rejection rates and acceptance."""
        _scales.check_int("n_rounds", n_rounds, 1)
        self._reset_counters()
        k, c, d = self.theta.shape
        dual = DualAveraging(self.step[: k - 1].clone(), self.target_accept)
        kept = []
        half = n_rounds // 2
        eps = self.step.clone()
        for r in range(n_rounds):
            acc = self._round(eps)
            self.accept[: k - 1] += acc.mean(1)
            self.n_moves += 1
            eps[: k - 1] = dual.update(acc.mean(1)).to(eps.dtype)
            if r >= half:  # the second half's states estimate the covariance
                kept.append(self.theta[: k - 1].clone())
        self.step[: k - 1] = dual.final
        if mass and len(kept) * (1 if self.per_chain else c) >= 2:
            self._estimate(torch.stack(kept, 2))  # (K - 1, C, S, D)
        return self.stats()

    def _estimate(self, states: torch.Tensor) -> None:
        """Every tempered level's covariance (per chain or pooled) from its states ``(K - 1, C, S, D)``,
        shrunk towards ``1e-3 I`` as Stan does: ``n / (n + 5) cov + 1e-3 * 5 / (n + 5)``."""
        k1, c, s, d = states.shape
        if self.exact is not None:
            u = self.exact.to(states.dtype)
            states = states - (states @ u) @ u.T
        x = states if self.per_chain else states.reshape(k1, 1, c * s, d)
        n = x.shape[2]
        xc = x - x.mean(2, keepdim=True)
        if self.mass == "dense":
            cov = xc.transpose(2, 3) @ xc / (n - 1)
            eye = torch.eye(d, dtype=torch.float64)
            cov = (n / (n + 5.0)) * cov + 1e-3 * (5.0 / (n + 5.0)) * eye
        else:
            cov = (n / (n + 5.0)) * (xc * xc).sum(2) / (n - 1) + 1e-3 * (5.0 / (n + 5.0))
        self.cov[:k1] = cov
        self._metric = None

    def metric(self) -> Metric:
        """The mass matrices of the tempered levels, one row per replica ``(K - 1) C`` (level-major): the
        inverses of the estimated covariances."""
        if self._metric is None:
            k, c = self.n_levels, self.n_chains
            cov = self.cov[: k - 1].expand(k - 1, c, *self.cov.shape[2:]).reshape(-1, *self.cov.shape[2:])
            if self.mass == "dense":
                self._metric = DenseCovariance(cov)
            else:
                self._metric = Diagonal(1.0 / cov)
        return self._metric

    def retune(self, n_levels: int | str = "auto", min_levels: int = 2,
               max_levels: int = 256) -> torch.Tensor:
        """A new schedule from the last phase's swap rejections (:func:`schedule_from_rejections`); every
        new level takes the states, likelihoods, step size and mass matrices of the old level nearest to
        it in :math:`\\Lambda` (the next adaptation phase adjusts them). Returns the new schedule."""
        rej = 1.0 - self.swaps / self.tries.clamp_min(1)
        new = schedule_from_rejections(self.betas, rej, n_levels, min_levels, max_levels)
        lam_old = barrier(self.betas, rej)
        lam_new = barrier(new, torch.full((len(new) - 1,), float(lam_old[0]) / max(len(new) - 1, 1)))
        # the nearest old level of every new one, by the barrier
        near = (lam_new[:, None] - lam_old[None]).abs().argmin(1)
        near[0], near[-1] = 0, self.n_levels - 1
        self.theta, self.nll = self.theta[near].clone(), self.nll[near].clone()
        self.grad = self.grad[near].clone()
        self.step, self.cov = self.step[near].clone(), self.cov[near].clone()
        self._metric = None
        self.betas = new
        self._reset_counters()
        return new

    def sample(self, n_rounds: int, thin: int = 1) -> Segment:
        """``n_rounds`` rounds with the adapted step sizes (jittered) and masses; keeps the posterior
        level's state every ``thin``-th round. The counters (swaps, acceptance, round trips) accumulate
        over successive calls."""
        _scales.check_int("n_rounds", n_rounds, 1)
        _scales.check_int("thin", thin, 1)
        k, c, d = self.theta.shape
        n_keep = n_rounds // thin
        draws = torch.empty(c, n_keep, d, dtype=torch.float64)
        nll = torch.empty(c, n_keep, dtype=torch.float64)
        for r in range(n_rounds):
            eps = torch.cat([jittered(self.step[: k - 1], self.jitter, self.gen), self.step[k - 1 :]])
            acc = self._round(eps)
            self.accept[: k - 1] += acc.mean(1)
            self.n_moves += 1
            j, rest = divmod(r, thin)
            if rest == thin - 1 and j < n_keep:
                draws[:, j], nll[:, j] = self.theta[0], self.nll[0]
        pot = nll + 0.5 * self.lam * (draws * draws).sum(2)
        return Segment(draws, nll, pot)

    def stats(self) -> dict[str, Any]:
        """JSON-able: the schedule, swap acceptance per pair, rejection barrier, round trips per chain,
        mean HMC acceptance and step size per level, divergences, rounds and gradient calls so far."""
        rate = self.swaps / self.tries.clamp_min(1)
        return {
            "betas": [float(b) for b in self.betas],
            "swap_accept": [round(float(a), 4) for a in rate],
            "barrier": float(barrier(self.betas, 1.0 - rate)[0]) if self.tries.sum() else None,
            "round_trips": [int(t) for t in self.trips],
            "accept": [round(float(a) / max(self.n_moves, 1), 4) for a in self.accept[:-1]],
            "step_size": [float(s) for s in self.step[:-1]],
            "divergences": int(self.divergences.sum()),
            "divergences_per_level": [int(v) for v in self.divergences[:-1]],
            "trajectories_per_level": self.n_moves * self.n_chains,
            "rounds": self.rounds,
            "n_grad": self.n_grad,
        }

    # ------------------------------------------------------------------ saving and resuming
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor the next round needs, and the counters (for :meth:`from_state`)."""
        return {
            "theta": self.theta, "nll": self.nll, "grad": self.grad, "betas": self.betas, "step": self.step,
            "cov": self.cov, "gen": self.gen.get_state(), "swaps": self.swaps, "tries": self.tries,
            "accept": self.accept, "divergences": self.divergences, "label": self.label,
            "heading": self.heading, "trips": self.trips,
            "counters": torch.tensor([self.rounds, self.n_grad, self.n_moves], dtype=torch.int64),
        }

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], likelihood: Potential, prior_precision: float,
                   target_accept: float = 0.75, jitter: float = 0.1, n_leapfrog: int = 10,
                   moves=None, mass: str = "diag", per_chain: bool = False,
                   exact: torch.Tensor | None = None) -> Ladder:
        """The ladder saved by :meth:`state_dict`, ready to continue (no gradient is recomputed)."""
        self = cls.__new__(cls)
        self.likelihood, self.moves, self.lam = likelihood, moves, check_precision(prior_precision)
        self.exact = exact
        self.mass, self.per_chain, self._metric = mass, bool(per_chain), None
        self.target_accept, self.jitter = float(target_accept), float(jitter)
        self.n_leapfrog = _scales.check_int("n_leapfrog", n_leapfrog, 1)
        self.gen = torch.Generator()
        self.gen.set_state(state["gen"])
        for key in ("theta", "nll", "grad", "betas", "step", "cov", "swaps", "tries", "accept",
                    "divergences", "label", "heading", "trips"):
            setattr(self, key, state[key].clone())
        self.rounds, self.n_grad, self.n_moves = (int(v) for v in state["counters"])
        return self


def _check_betas(betas) -> torch.Tensor:
    b = torch.as_tensor(betas, dtype=torch.float64)
    if b.ndim != 1 or b.shape[0] < 2 or float(b[0]) != 1.0 or float(b[-1]) != 0.0 or not bool(
        (b[1:] < b[:-1]).all()
    ):
        raise ValueError(
            f"betas must decrease strictly from 1 to 0 (the posterior's level first, the prior's last), "
            f"got {b.tolist()}"
        )
    return b
