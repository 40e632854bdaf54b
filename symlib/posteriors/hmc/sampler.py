r"""The HMC sampler: potentials of stacked networks, leapfrog, Metropolis correction, step-size adaptation
(book: chapter "Table 1"; Neal 2011, Hoffman & Gelman 2014).

:func:`run_chains` runs several chains at once on any potential ``flat (C, D) -> (U (C,), grad U (C, D))``
(:func:`stacked_potential` for OptuNet, :func:`module_potential` for other networks without BatchNorm)
and returns an :class:`HMCResult` with the draws and their diagnostics. See :mod:`symlib.posteriors.hmc`
for the method built on it.
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
from symlib import training as _train
from symlib.params import flatten, unflatten
from symlib.stats import diagnostics as _diag

Potential = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


DIVERGENCE = 1000.0


@dataclasses.dataclass(frozen=True)
class Config:
    """Sampler settings (see :data:`PRESETS`).

    Attributes:
        n_warmup: warm-up trajectories (step-size adaptation; discarded).
        n_leapfrog: leapfrog steps per trajectory.
        thin: keep one state every ``thin`` trajectories after warm-up.
        target_accept: dual-averaging target of the mean acceptance probability.
        jitter: relative uniform jitter of the frozen step size per trajectory.
        chunk: images per call of the stacked gradient (memory only, the sum is the full batch).
        polish_epochs: epochs of SGD on the sampled objective :math:`U / N` (no augmentation, the
            recipe's final learning rate and momentum) applied to the starting points before warm-up:
            the base models were trained with random crops, whose optimum is not the posterior's, and a
            mini-batch epoch costs about one full-batch gradient while the chains would otherwise spend
            much of their budget descending. Part of the burn-in; 0 switches it off.
    """

    n_warmup: int
    n_leapfrog: int
    thin: int = 1
    target_accept: float = 0.75
    jitter: float = 0.1
    chunk: int = 1000
    polish_epochs: int = 0

    def __post_init__(self):
        for name in ("n_warmup", "n_leapfrog", "thin", "chunk", "polish_epochs"):
            _scales.check_int(name, getattr(self, name), 0 if name in ("n_warmup", "polish_epochs") else 1)
        if not 0 < self.target_accept < 1:
            raise ValueError(f"target_accept must lie in (0, 1), got {self.target_accept}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must lie in [0, 1), got {self.jitter}")


def check_precision(prior_precision: float) -> float:
    lam = float(prior_precision)
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(
            f"the prior precision must be positive and finite, got {prior_precision!r}: HMC needs a proper "
            "Gaussian prior (give the recipe a positive weight_decay, lambda = N * weight_decay)"
        )
    return lam


def stacked_potential(
    x: torch.Tensor, y: torch.Tensor, prior_precision: float, arch: str = "optunet", chunk: int = 1000
) -> Potential:
    r"""``flat (C, D) -> (U (C,), grad U (C, D))`` for ``C`` stacked networks of a stacked architecture,
    :math:`U = \sum_{\mathrm{chunks}} n_b \bar L_b + \tfrac{\lambda}{2}|\theta|^2` (the full batch)."""
    lam = check_precision(prior_precision)
    if arch not in _train.STACKED_GRADS:
        raise ValueError(f"no stacked gradient for {arch!r}; use module_potential (torch.func) instead")
    shapes = dict(_train.OPTUNET_SHAPES) if arch == "optunet" else None
    n = x.shape[0]

    def potential(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = flat.shape[0]
        params = unflatten(flat, shapes)
        u = 0.5 * lam * (flat * flat).sum(1)
        g = lam * flat
        for s in range(0, n, chunk):
            xb, yb = x[s : s + chunk], y[s : s + chunk]
            nb = xb.shape[0]
            loss, grads = _train.loss_and_grads(params, xb.expand(c, *xb.shape), yb.expand(c, nb), arch)
            u = u + nb * loss
            g = g + nb * flatten(grads)
        return u, g

    return potential


def module_potential(
    make_model: Callable[[], torch.nn.Module],
    x: torch.Tensor,
    y: torch.Tensor,
    prior_precision: float,
    chunk: int = 1000,
) -> tuple[Potential, dict[str, tuple[int, ...]]]:
    r"""The potential of any ``nn.Module`` without buffers (no BatchNorm) through ``torch.func``:
    ``vmap`` over chains of ``grad`` of ``functional_call``. Returns ``(potential, shapes)``."""
    lam = check_precision(prior_precision)
    model = make_model().to(x.device)
    if any(True for _ in model.buffers()):
        raise ValueError(
            "HMC's generic path needs a model without buffers (BatchNorm running statistics change with "
            "the batch, so the posterior is not defined by the weights alone); use a network without "
            "BatchNorm"
        )
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    n = x.shape[0]

    def nll(flat, xb, yb):
        p = unflatten(flat[None], shapes)
        out = torch.func.functional_call(model, {k: v[0] for k, v in p.items()}, (xb,))
        return torch.nn.functional.cross_entropy(out, yb, reduction="sum")

    grad_nll = torch.func.vmap(torch.func.grad_and_value(nll), in_dims=(0, None, None))

    def potential(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = 0.5 * lam * (flat * flat).sum(1)
        g = lam * flat
        for s in range(0, n, chunk):
            gb, ub = grad_nll(flat, x[s : s + chunk], y[s : s + chunk])
            u, g = u + ub, g + gb
        return u, g

    return potential, shapes


def leapfrog(
    theta: torch.Tensor,
    p: torch.Tensor,
    grad: torch.Tensor,
    eps: torch.Tensor | float,
    n_steps: int,
    potential: Potential,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``n_steps`` leapfrog steps of :math:`H = U(\theta) + |p|^2/2` for stacked chains (identity mass):
    :math:`p \leftarrow p - \tfrac\epsilon2 \nabla U`, :math:`\theta \leftarrow \theta + \epsilon p`,
    :math:`p \leftarrow p - \tfrac\epsilon2 \nabla U` (inner half steps merged).

    Args:
        theta, p, grad: ``(C, D)`` positions, momenta and :math:`\nabla U(\theta)`.
        eps: step size, a number or one per chain ``(C,)``.
        n_steps: number of steps (>= 1).
        potential: ``(C, D) -> (U (C,), grad (C, D))``.

    Returns:
        ``(theta, p, U, grad)`` at the end of the trajectory. Volume preserving and reversible:
        negating the final momentum and integrating again returns to the start.
    """
    e = torch.as_tensor(eps, dtype=theta.dtype, device=theta.device)
    e = e.reshape(-1, 1) if e.ndim else e
    p = p - 0.5 * e * grad
    u = None
    for i in range(n_steps):
        theta = theta + e * p
        u, grad = potential(theta)
        if i < n_steps - 1:
            p = p - e * grad
    p = p - 0.5 * e * grad
    return theta, p, u, grad


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

    def diagnostics(self) -> dict[str, Any]:
        """JSON-able diagnostics (see the module docstring)."""
        c, s, dim = self.draws.shape
        if s >= 4:
            d = _diag.summary(self.draws.double().cpu().numpy())
            u = self.potential.double().cpu().numpy()
            d.update(
                rhat_potential=float(_diag.rhat(u)),
                ess_bulk_potential=float(_diag.ess_bulk(u)),
                # each chain alone, split in halves: drift within a chain (burn-in too short), as opposed
                # to chains resting in different modes of different depth
                rhat_potential_per_chain=[float(_diag.rhat(u[i : i + 1])) for i in range(c)],
            )
        else:  # too few draws to split the chains: no R-hat / ESS
            d = {"n_chains": c, "n_draws": s, "n_params": dim}
            d.update(dict.fromkeys(["rhat_max", "rhat_median", "ess_bulk_min", "ess_bulk_median"]))
            d.update(rhat_potential=None, ess_bulk_potential=None, rhat_potential_per_chain=None)
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
        return d


def _check_state(u: torch.Tensor, g: torch.Tensor, where: str) -> None:
    bad = ~(torch.isfinite(u) & torch.isfinite(g).all(1))
    if bool(bad.any()):
        chains = bad.nonzero().flatten().tolist()
        raise FloatingPointError(
            f"non-finite potential or gradient for chain(s) {chains} {where}; start the chains from finite "
            "weights with a finite loss (e.g. trained base models) or lower the step size"
        )


def _initial_step_size(theta, u, g, potential, gen, eps0: float = 0.1, max_iter: int = 40) -> torch.Tensor:
    """Hoffman & Gelman (2014, Alg. 4), per chain: double or halve until the one-step acceptance
    probability crosses 1/2."""
    c = theta.shape[0]
    eps = torch.full((c,), eps0, dtype=theta.dtype, device=theta.device)

    def log_ratio(e):
        p = torch.randn(theta.shape, generator=gen, dtype=theta.dtype).to(theta.device)
        _, p1, u1, _ = leapfrog(theta, p, g, e, 1, potential)
        lr = (u + 0.5 * (p * p).sum(1)) - (u1 + 0.5 * (p1 * p1).sum(1))
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
) -> HMCResult:
    """Run ``C`` stacked HMC chains from ``theta0`` (see the module docstring for the algorithm).

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
    """
    if on_nonfinite not in ("divergence", "raise"):
        raise ValueError(f"on_nonfinite must be 'divergence' or 'raise', got {on_nonfinite!r}")
    if step_size is not None and not (step_size > 0 and math.isfinite(step_size)):
        raise ValueError(f"step_size must be positive and finite, got {step_size!r}")
    if n_warmup == 0 and step_size is None:
        raise ValueError("without warm-up (n_warmup=0) give a step_size to sample with")
    Config(n_warmup, n_leapfrog, thin, target_accept, jitter)  # validates the settings
    _scales.check_int("n_samples", n_samples, 1)
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
        eps = _initial_step_size(theta, u, g, counted, gen)
    else:
        eps = torch.full((c,), float(step_size), dtype=dt, device=dev)

    # dual averaging state (Hoffman & Gelman 2014, Alg. 5)
    mu = torch.log(10 * eps)
    h_bar = torch.zeros(c, dtype=torch.float64, device=dev)
    log_eps_bar = torch.zeros(c, dtype=torch.float64, device=dev)
    gamma, t0, kappa = 0.05, 10.0, 0.75

    total = n_warmup + n_samples * thin
    draws = torch.empty(c, n_samples, dim, dtype=dt, device=dev)
    pots = torch.empty(c, n_samples, dtype=dt, device=dev)
    acc_sum = torch.zeros(c, dtype=torch.float64, device=dev)
    n_acc = torch.zeros(c, dtype=torch.float64, device=dev)
    div = torch.zeros(c, dtype=torch.int64, device=dev)
    div_warm = torch.zeros(c, dtype=torch.int64, device=dev)
    t_warm = 0.0
    bar = _progress.bar(total, "hmc", enabled=progress)
    for it in range(total):
        warm = it < n_warmup
        if warm:
            e = eps
        else:
            if it == n_warmup:
                if n_warmup:
                    eps = torch.exp(log_eps_bar).to(dt)
                t_warm = time.perf_counter() - t_start
            e = eps * (1 + jitter * (2 * torch.rand(c, generator=gen, dtype=dt).to(dev) - 1))
        p = torch.randn(c, dim, generator=gen, dtype=dt).to(dev)
        h0 = u + 0.5 * (p * p).sum(1)
        th1, p1, u1, g1 = leapfrog(theta, p, g, e, n_leapfrog, counted)
        h1 = u1 + 0.5 * (p1 * p1).sum(1)
        finite = torch.isfinite(h1) & torch.isfinite(g1).all(1) & torch.isfinite(th1).all(1)
        if on_nonfinite == "raise" and not bool(finite.all()):
            chains = (~finite).nonzero().flatten().tolist()
            raise FloatingPointError(
                f"non-finite potential or gradient at the end of trajectory {it} for chain(s) {chains} "
                f"(step size {[float(v) for v in e[~finite]]}); lower the step size or target a higher "
                "acceptance rate"
            )
        dh = torch.where(finite, h1 - h0, torch.full_like(h1, math.inf))
        divergent = dh > DIVERGENCE
        accept_prob = torch.exp(torch.clamp(-dh, max=0.0)).double()
        coin = torch.rand(c, generator=gen, dtype=torch.float64).to(dev)
        accept = (coin < accept_prob) & finite
        theta = torch.where(accept[:, None], th1, theta)
        u = torch.where(accept, u1, u)
        g = torch.where(accept[:, None], g1, g)
        if warm:
            m = it + 1
            h_bar = (1 - 1 / (m + t0)) * h_bar + (target_accept - accept_prob) / (m + t0)
            log_eps = mu.double() - math.sqrt(m) / gamma * h_bar
            w = m**-kappa
            log_eps_bar = w * log_eps + (1 - w) * log_eps_bar
            eps = torch.exp(log_eps).to(dt)
            div_warm += divergent.long()
        else:
            acc_sum += accept_prob
            n_acc += accept.double()
            div += divergent.long()
            k, r = divmod(it - n_warmup, thin)
            if r == thin - 1:
                draws[:, k], pots[:, k] = theta, u
        bar.update(1)
    bar.close()
    n_after = max(total - n_warmup, 1)
    return HMCResult(
        draws=draws,
        potential=pots,
        accept_prob=acc_sum / n_after,
        accepted=n_acc / n_after,
        divergences=div.cpu(),
        divergences_warmup=div_warm.cpu(),
        step_size=eps.cpu(),
        n_leapfrog=n_leapfrog,
        n_grad=calls[0],
        seconds=time.perf_counter() - t_start,
        seconds_warmup=t_warm if n_warmup else 0.0,
    )
