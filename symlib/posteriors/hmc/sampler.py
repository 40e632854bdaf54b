r"""The HMC sampler: leapfrog with a mass matrix, Metropolis correction, step-size adaptation (book: chapter
"Table 1"; Neal 2011, Hoffman & Gelman 2014).

:func:`run_chains` runs several chains at once on any potential ``flat (C, D) -> (U (C,), grad U (C, D))``
(:mod:`symlib.posteriors.hmc.potentials`) with any mass matrix (:mod:`symlib.posteriors.hmc.metric`) and
returns an :class:`HMCResult` with the draws and their diagnostics, each trajectory one
:func:`~symlib.posteriors.hmc.trajectory.transition` (one Metropolis-corrected trajectory of every chain).
Its step sizes serve the replica-exchange driver too (:mod:`symlib.posteriors.hmc.tempering`):
:class:`DualAveraging` (the step size of every chain), :func:`initial_step_size` and :func:`jittered`.
See :mod:`symlib.posteriors.hmc` for the method built on them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from symlib import progress as _progress
from symlib import scales as _scales
from symlib.posteriors.hmc.metric import Identity, Metric
from symlib.posteriors.hmc.potentials import Potential
from symlib.posteriors.hmc.trajectory import Step, leapfrog, transition
from symlib.stats import diagnostics as _diag

METRICS = ("identity", "ggn")


@dataclasses.dataclass(frozen=True)
class Config:
    r"""Sampler settings (see :data:`symlib.posteriors.hmc.PRESETS`).

    Attributes:
        n_warmup: warm-up trajectories (step-size adaptation; discarded).
        n_leapfrog: leapfrog steps per trajectory.
        thin: keep one state every ``thin`` trajectories after warm-up.
        target_accept: dual-averaging target of the mean acceptance probability.
        jitter: relative uniform jitter of the frozen step size per trajectory (so the trajectory
            length varies by as much, which avoids periodic trajectories).
        grad_chunk: images per call of the stacked gradient (memory only, the sum is the full batch).
        polish_epochs: epochs of SGD on the sampled objective :math:`U / N` (no augmentation, the
            recipe's final learning rate and momentum) applied to the starting points before warm-up:
            the base models were trained with random crops, whose optimum is not the posterior's, and a
            mini-batch epoch costs about one full-batch gradient while the chains would otherwise spend
            much of their budget descending. Part of the burn-in; 0 switches it off.
        metric: the mass matrix, ``"identity"`` or ``"ggn"``: per chain, the GGN of the likelihood plus
            the prior's precision at the chain's polished start
            (:func:`~symlib.posteriors.hmc.metric.from_curvature`), the precision of the local Laplace
            approximation.
        metric_images: training images of the GGN (the first ones, the sum scaled to all ``N``; 0: all):
            the metric only preconditions, a subsample estimate keeps the sampler exact.
        metric_damping: :math:`c` of :math:`M = G + c I` (0: the prior's precision :math:`\lambda`, the
            Laplace precision).
        keep_every: of the kept states, store every ``keep_every``-th in the sample set (the
            diagnostics use all of them).
        n_test, n_probe: test images of the test log-likelihood, and how many of them get their predictive
            probability diagnosed (the invariant functionals; the training images if the setup has no
            test set).
        orbit_moves: before every trajectory, move every neuron along its scaling orbit by an exact
            Gibbs step (:class:`symlib.posteriors.hmc.orbits.ScalingMoves`; one more gradient per
            trajectory). Needs a spec whose hidden layers all have scalings.
        gauge_sigma: with ``metric="ggn"``, a positive value makes the mass matrix follow the chain along
            its scaling orbit through an auxiliary gauge of this noise (log-scale units;
            :mod:`symlib.posteriors.hmc.gauge`; the metric's prior term is then the prior's precision,
            ``metric_damping`` does not apply); 0 keeps the start's metric fixed.
    """

    n_warmup: int
    n_leapfrog: int
    thin: int = 1
    target_accept: float = 0.75
    jitter: float = 0.1
    grad_chunk: int = 1000
    polish_epochs: int = 0
    metric: str = "identity"
    metric_images: int = 0
    metric_damping: float = 0.0
    keep_every: int = 1
    n_test: int = 1000
    n_probe: int = 20
    orbit_moves: bool = False
    gauge_sigma: float = 0.0

    def __post_init__(self):
        zero_ok = ("n_warmup", "polish_epochs", "metric_images", "n_probe")
        for name in (*zero_ok, "n_leapfrog", "thin", "grad_chunk", "keep_every", "n_test"):
            low = 0 if name in zero_ok else 1
            _scales.check_int(name, getattr(self, name), low)
        if not 0 < self.target_accept < 1:
            raise ValueError(f"target_accept must lie in (0, 1), got {self.target_accept}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must lie in [0, 1), got {self.jitter}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, got {self.metric!r}")
        if isinstance(self.metric_damping, bool) or not self.metric_damping >= 0:
            raise ValueError(f"metric_damping must be >= 0, got {self.metric_damping!r}")
        if isinstance(self.gauge_sigma, bool) or not (0 <= self.gauge_sigma < math.inf):
            raise ValueError(f"gauge_sigma must be >= 0 and finite, got {self.gauge_sigma!r}")
        if self.gauge_sigma and self.metric != "ggn":
            raise ValueError("gauge_sigma moves the GGN metric along the orbits: it needs metric='ggn'")



class DualAveraging:
    r"""Hoffman & Gelman (2014, Alg. 5) per chain: :math:`\gamma = 0.05, t_0 = 10, \kappa = 0.75`,
    :math:`\mu = \log 10 \epsilon_0`; :meth:`update` returns the next step sizes, :attr:`final` the
    averaged ones to sample with."""

    def __init__(self, eps0: torch.Tensor, target_accept: float, gamma: float = 0.05, t0: float = 10.0,
                 kappa: float = 0.75):
        self.mu = torch.log(10 * eps0.double())
        self.h_bar = torch.zeros_like(self.mu)
        self.log_eps_bar = torch.log(eps0.double())
        self.target, self.gamma, self.t0, self.kappa = target_accept, gamma, t0, kappa
        self.m = 0

    def update(self, accept_prob: torch.Tensor) -> torch.Tensor:
        """One warm-up iteration: the chains' acceptance probabilities ``(C,)`` in, the step sizes of their
        next trajectory ``(C,)`` out."""
        self.m += 1
        m, t0 = self.m, self.t0
        self.h_bar = (1 - 1 / (m + t0)) * self.h_bar + (self.target - accept_prob.double()) / (m + t0)
        log_eps = self.mu - math.sqrt(m) / self.gamma * self.h_bar
        w = m**-self.kappa
        self.log_eps_bar = w * log_eps + (1 - w) * self.log_eps_bar
        return torch.exp(log_eps)

    @property
    def final(self) -> torch.Tensor:
        r"""The averaged step sizes :math:`\bar\epsilon` ``(C,)``, frozen after warm-up to sample with."""
        return torch.exp(self.log_eps_bar)


@dataclasses.dataclass
class HMCResult:
    """What :func:`run_chains` returns.

    Attributes:
        draws: ``(C, S, D)`` kept states.
        potential: ``(C, S)`` :math:`U` of the kept states.
        accept_prob: ``(C,)`` mean Metropolis acceptance probability after warm-up.
        accepted: ``(C,)`` fraction of accepted trajectories after warm-up.
        divergences: ``(C,)`` divergent trajectories after warm-up (``divergences_warmup`` during it).
        step_size: ``(C,)`` frozen step sizes.
        n_leapfrog: leapfrog steps per trajectory.
        n_grad: gradient evaluations per chain (all chains share each call).
        seconds: wall time; seconds_warmup: of which warm-up.
        metric: the mass matrix's description.
        warmup_potential: ``(C, n_warmup)`` :math:`U` after every warm-up trajectory (the burn-in's trace).
        orbit_accept: ``(C,)`` mean acceptance of the moves along the scaling orbits (``None`` without).
    """

    draws: torch.Tensor
    potential: torch.Tensor
    accept_prob: torch.Tensor
    accepted: torch.Tensor
    divergences: torch.Tensor
    divergences_warmup: torch.Tensor
    step_size: torch.Tensor
    n_leapfrog: int
    n_grad: int
    seconds: float
    seconds_warmup: float
    metric: dict = dataclasses.field(default_factory=lambda: {"mass_matrix": "identity"})
    warmup_potential: torch.Tensor | None = None
    orbit_accept: torch.Tensor | None = None

    def diagnostics(self) -> dict[str, Any]:
        """JSON-able diagnostics: R-hat and ESS of the weights (max/median, min/median) and of the potential
        (across chains and each chain alone: drift within a chain, as opposed to chains resting in modes
        of different depth), acceptance, divergences, step sizes, trajectory lengths, gradients, seconds."""
        c, s, dim = self.draws.shape
        if s >= 4:
            d = _diag.summary(self.draws.double().cpu().numpy())
            u = self.potential.double().cpu().numpy()
            d.update(
                rhat_potential=float(_diag.rhat(u)),
                ess_bulk_potential=float(_diag.ess_bulk(u)),
                rhat_potential_per_chain=[float(_diag.rhat(u[i : i + 1])) for i in range(c)],
                ess_bulk_potential_per_chain=[float(_diag.ess_bulk(u[i : i + 1])) for i in range(c)],
            )
        else:  # too few draws to split the chains: no R-hat / ESS
            d = {"n_chains": c, "n_draws": s, "n_params": dim}
            d.update(dict.fromkeys(["rhat_max", "rhat_median", "ess_bulk_min", "ess_bulk_median",
                                    "ess_tail_min"]))
            d.update(rhat_potential=None, ess_bulk_potential=None, rhat_potential_per_chain=None,
                     ess_bulk_potential_per_chain=None)
        d.update(
            accept_prob=[round(float(a), 4) for a in self.accept_prob],
            accepted=[round(float(a), 4) for a in self.accepted],
            divergences=[int(v) for v in self.divergences],
            divergences_warmup=[int(v) for v in self.divergences_warmup],
            step_size=[float(s) for s in self.step_size],
            n_leapfrog=self.n_leapfrog,
            trajectory_length=[float(s) * self.n_leapfrog for s in self.step_size],
            n_grad=self.n_grad,
            seconds=round(self.seconds, 2),
            seconds_warmup=round(self.seconds_warmup, 2),
        )
        if self.orbit_accept is not None:
            d["orbit_accept"] = [round(float(a), 4) for a in self.orbit_accept]
        return d


def _check_state(u: torch.Tensor, g: torch.Tensor, where: str) -> None:
    bad = ~(torch.isfinite(u) & torch.isfinite(g).all(1))
    if bool(bad.any()):
        chains = bad.nonzero().flatten().tolist()
        raise FloatingPointError(
            f"non-finite potential or gradient for chain(s) {chains} {where}; start the chains from finite "
            "weights with a finite loss (e.g. trained base models) or lower the step size"
        )


def initial_step_size(theta, u, g, potential, gen, metric: Metric | None = None, eps0: float = 0.1,
                      max_iter: int = 40) -> torch.Tensor:
    """Hoffman & Gelman (2014, Alg. 4), per chain: double or halve until the one-step acceptance
    probability crosses 1/2."""
    metric = metric or Identity()
    c = theta.shape[0]
    eps = torch.full((c,), eps0, dtype=theta.dtype, device=theta.device)

    def log_ratio(e):
        p = metric.momentum(theta.shape, gen, theta.dtype, theta.device)
        _, p1, u1, _ = leapfrog(theta, p, g, e, 1, potential, metric)
        lr = (u + metric.kinetic(p)) - (u1 + metric.kinetic(p1))
        return torch.nan_to_num(lr, nan=-math.inf)

    lr = log_ratio(eps)
    direction = torch.where(lr > math.log(0.5), 1.0, -1.0).to(theta.dtype)
    active = torch.ones(c, dtype=torch.bool, device=theta.device)
    for _ in range(max_iter):
        active = active & (direction * lr > -direction * math.log(2.0))
        if not bool(active.any()):
            break
        eps = torch.where(active, eps * 2.0**direction, eps)
        lr = log_ratio(eps)
    return eps


def jittered(eps: torch.Tensor, jitter: float, gen: torch.Generator) -> torch.Tensor:
    """Step sizes ``eps`` times independent uniform factors in ``[1 - jitter, 1 + jitter]``."""
    u = torch.rand(eps.shape[0], generator=gen, dtype=eps.dtype).to(eps.device)
    return eps * (1 + jitter * (2 * u - 1))


def _check_run(on_nonfinite: str, step_size: float | None, n_warmup: int, n_samples: int, n_leapfrog: int,
               thin: int, target_accept: float, jitter: float) -> None:
    """Refuse :func:`run_chains`' arguments before any work: an unknown ``on_nonfinite``, a step size that is
    not positive and finite, no warm-up without a step size, settings :class:`Config` refuses, fewer than
    one sample.

    Raises:
        ValueError: naming the argument.
    """
    if on_nonfinite not in ("divergence", "raise"):
        raise ValueError(f"on_nonfinite must be 'divergence' or 'raise', got {on_nonfinite!r}")
    if step_size is not None and not (step_size > 0 and math.isfinite(step_size)):
        raise ValueError(f"step_size must be positive and finite, got {step_size!r}")
    if n_warmup == 0 and step_size is None:
        raise ValueError("without warm-up (n_warmup=0) give a step_size to sample with")
    Config(n_warmup, n_leapfrog, thin, target_accept, jitter)  # validates the settings
    _scales.check_int("n_samples", n_samples, 1)


@dataclasses.dataclass
class _Tally:
    """What :func:`run_chains` keeps of its ``C`` chains' trajectories.

    Attributes:
        draws: ``(C, S, D)`` kept states; pots: ``(C, S)`` their :math:`U`; warm_pots: ``(C, n_warmup)``
            :math:`U` after every warm-up trajectory.
        acc_sum, n_acc: ``(C,)`` sums of the acceptance probabilities and of the accepted trajectories after
            warm-up; div, div_warm: ``(C,)`` divergent trajectories after and during warm-up.
    """

    draws: torch.Tensor
    pots: torch.Tensor
    warm_pots: torch.Tensor
    acc_sum: torch.Tensor
    n_acc: torch.Tensor
    div: torch.Tensor
    div_warm: torch.Tensor

    @classmethod
    def empty(cls, c: int, dim: int, n_samples: int, n_warmup: int, dt: torch.dtype,
              dev: torch.device) -> _Tally:
        """Nothing counted yet, room for ``n_samples`` states of dtype ``dt`` on ``dev`` per chain."""
        return cls(draws=torch.empty(c, n_samples, dim, dtype=dt, device=dev),
                   pots=torch.empty(c, n_samples, dtype=dt, device=dev),
                   warm_pots=torch.empty(c, n_warmup, dtype=dt, device=dev),
                   acc_sum=torch.zeros(c, dtype=torch.float64, device=dev),
                   n_acc=torch.zeros(c, dtype=torch.float64, device=dev),
                   div=torch.zeros(c, dtype=torch.int64, device=dev),
                   div_warm=torch.zeros(c, dtype=torch.int64, device=dev))

    def warm(self, it: int, st: Step) -> None:
        """Warm-up trajectory ``it``: its divergences and the potential it ends at."""
        self.div_warm += st.divergent.long()
        self.warm_pots[:, it] = st.u

    def sampled(self, i: int, thin: int, st: Step) -> None:
        """Sampling trajectory ``i`` (counted from the end of warm-up): its acceptance and divergences, and
        its end state kept when it completes a group of ``thin``."""
        self.acc_sum += st.accept_prob
        self.n_acc += st.accepted.double()
        self.div += st.divergent.long()
        k, r = divmod(i, thin)
        if r == thin - 1:
            self.draws[:, k], self.pots[:, k] = st.theta, st.u


def run_chains(
    potential: Potential,
    theta0: torch.Tensor,
    n_warmup: int,
    n_samples: int,
    n_leapfrog: int,
    thin: int = 1,
    target_accept: float = 0.75,
    jitter: float = 0.1,
    step_size: float | None = None,
    seed: int = 0,
    on_nonfinite: str = "divergence",
    progress: bool = True,
    metric: Metric | None = None,
    moves: Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> HMCResult:
    """Run ``C`` stacked HMC chains from ``theta0``.

    Warm-up: the initial step size from Hoffman & Gelman's heuristic (:func:`initial_step_size`), then
    :class:`DualAveraging` towards ``target_accept``; sampling: the averaged step size, jittered per
    trajectory (:func:`jittered`), every ``thin``-th state kept.

    Args:
        potential: ``(C, D) -> (U (C,), grad (C, D))``.
        theta0: ``(C, D)`` initial states.
        n_warmup: adaptation trajectories (discarded).
        n_samples: kept states per chain.
        n_leapfrog: leapfrog steps per trajectory.
        thin: trajectories per kept state.
        target_accept: dual-averaging target.
        jitter: relative step-size jitter after warm-up.
        step_size: initial step size (``None``: Hoffman & Gelman's heuristic); if ``n_warmup == 0`` it is
            the frozen step size.
        seed: momenta, jitter and Metropolis coins.
        on_nonfinite: ``"divergence"`` (reject a trajectory that ends at a non-finite energy, as Stan
            does) or ``"raise"`` (stop with an error naming the chain and the trajectory).
        progress: show a progress bar.
        metric: the mass matrix (:mod:`symlib.posteriors.hmc.metric`; default the identity).
        moves: an extra move applied before every trajectory that leaves the target invariant,
            ``(theta, generator) -> (theta, acceptance (C,))``
            (:class:`symlib.posteriors.hmc.orbits.ScalingMoves`); the potential and its gradient are
            recomputed after it.
    """
    _check_run(on_nonfinite, step_size, n_warmup, n_samples, n_leapfrog, thin, target_accept, jitter)
    metric = metric or Identity()
    t_start = time.perf_counter()
    gen = torch.Generator().manual_seed(int(seed))
    theta = theta0.detach().clone()
    c, dim = theta.shape
    dt, dev = theta.dtype, theta.device
    calls = [0]

    def counted(th):
        calls[0] += 1
        return potential(th)

    u, g = counted(theta)
    _check_state(u, g, "at the initial state (trajectory 0)")
    if step_size is None:
        eps = initial_step_size(theta, u, g, counted, gen, metric)
    else:
        eps = torch.full((c,), float(step_size), dtype=dt, device=dev)
    adapt = DualAveraging(eps, target_accept)

    total = n_warmup + n_samples * thin
    tally = _Tally.empty(c, dim, n_samples, n_warmup, dt, dev)
    orbit_acc = torch.zeros(c, dtype=torch.float64)
    t_warm = 0.0
    bar = _progress.bar(total, "hmc", enabled=progress)
    for it in range(total):
        warm = it < n_warmup
        if not warm and it == n_warmup:
            if n_warmup:
                eps = adapt.final.to(dt)
            t_warm = time.perf_counter() - t_start
        e = eps if warm else jittered(eps, jitter, gen)
        if moves is not None:
            theta, acc = moves(theta, gen)
            orbit_acc += acc.cpu()
            u, g = counted(theta)
            _check_state(u, g, f"after the extra move before trajectory {it}")
        st = transition(theta, u, g, e, n_leapfrog, counted, gen, metric, on_nonfinite, str(it))
        theta, u, g = st.theta, st.u, st.grad
        if warm:
            eps = adapt.update(st.accept_prob).to(dt)
            tally.warm(it, st)
        else:
            tally.sampled(it - n_warmup, thin, st)
        bar.update(1)
    bar.close()
    n_after = max(total - n_warmup, 1)
    return HMCResult(
        draws=tally.draws,
        potential=tally.pots,
        accept_prob=tally.acc_sum / n_after,
        accepted=tally.n_acc / n_after,
        divergences=tally.div.cpu(),
        divergences_warmup=tally.div_warm.cpu(),
        step_size=eps.cpu(),
        n_leapfrog=n_leapfrog,
        n_grad=calls[0],
        seconds=time.perf_counter() - t_start,
        seconds_warmup=t_warm if n_warmup else 0.0,
        metric=metric.describe(),
        warmup_potential=tally.warm_pots.cpu(),
        orbit_accept=orbit_acc / max(total, 1) if moves is not None else None,
    )
