r"""One Metropolis-corrected HMC trajectory of stacked chains (book: chapter "Table 1"; Neal 2011):
:func:`leapfrog` integrates Hamilton's equations with a mass matrix (:mod:`symlib.posteriors.hmc.metric`),
:func:`transition` draws fresh momenta, integrates and accepts or rejects every chain, calling a
trajectory divergent when its energy ends non-finite or :data:`DIVERGENCE` above its start. The samplers
(:mod:`symlib.posteriors.hmc.sampler`, :mod:`symlib.posteriors.hmc.tempering`,
:mod:`symlib.posteriors.hmc.ladder`) are loops over :func:`transition`.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from symlib.posteriors.hmc.metric import Identity, Metric
from symlib.posteriors.hmc.potentials import Potential

DIVERGENCE = 1000.0
"""The energy error above which a trajectory is divergent (and rejected), Stan's convention."""


def leapfrog(
    theta: torch.Tensor,
    p: torch.Tensor,
    grad: torch.Tensor,
    eps: torch.Tensor | float,
    n_steps: int,
    potential: Potential,
    metric: Metric | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""``n_steps`` leapfrog steps of :math:`H = U(\theta) + \tfrac12 p^\top M^{-1} p` for stacked chains:
    :math:`p \leftarrow p - \tfrac\epsilon2 \nabla U`, :math:`\theta \leftarrow \theta + \epsilon M^{-1} p`,
    :math:`p \leftarrow p - \tfrac\epsilon2 \nabla U` (inner half steps merged).

    Args:
        theta, p, grad: ``(C, D)`` positions, momenta and :math:`\nabla U(\theta)`.
        eps: step size, a number or one per chain ``(C,)``.
        n_steps: number of steps (>= 1).
        potential: ``(C, D) -> (U (C,), grad (C, D))``.
        metric: the mass matrix (default: the identity).

    Returns:
        ``(theta, p, U, grad)`` at the end of the trajectory. Volume preserving and reversible:
        negating the final momentum and integrating again returns to the start.
    """
    metric = metric or Identity()
    e = torch.as_tensor(eps, dtype=theta.dtype, device=theta.device)
    e = e.reshape(-1, 1) if e.ndim else e
    p = p - 0.5 * e * grad
    u = None
    for i in range(n_steps):
        theta = theta + e * metric.velocity(p)
        u, grad = potential(theta)
        if i < n_steps - 1:
            p = p - e * grad
    p = p - 0.5 * e * grad
    return theta, p, u, grad


@dataclasses.dataclass
class Step:
    """One :func:`transition` of every chain: the new state, the Metropolis acceptance probability, whether
    the proposal was accepted, divergent, finite."""

    theta: torch.Tensor
    u: torch.Tensor
    grad: torch.Tensor
    accept_prob: torch.Tensor
    accepted: torch.Tensor
    divergent: torch.Tensor
    finite: torch.Tensor


def transition(theta, u, grad, eps, n_leapfrog: int, potential: Potential, gen: torch.Generator,
               metric: Metric | None = None, on_nonfinite: str = "divergence", where: str = "") -> Step:
    """One Metropolis-corrected HMC trajectory of every chain: fresh momenta, leapfrog, accept or reject
    (a trajectory ending at a non-finite or much higher energy, :data:`DIVERGENCE`, is divergent and
    rejected, Stan's convention; ``on_nonfinite="raise"`` stops at a non-finite one instead)."""
    metric = metric or Identity()
    c = theta.shape[0]
    p = metric.momentum(theta.shape, gen, theta.dtype, theta.device)
    h0 = u + metric.kinetic(p)
    th1, p1, u1, g1 = leapfrog(theta, p, grad, eps, n_leapfrog, potential, metric)
    h1 = u1 + metric.kinetic(p1)
    finite = torch.isfinite(h1) & torch.isfinite(g1).all(1) & torch.isfinite(th1).all(1)
    if on_nonfinite == "raise" and not bool(finite.all()):
        chains = (~finite).nonzero().flatten().tolist()
        e = torch.as_tensor(eps).expand(c)
        raise FloatingPointError(
            f"non-finite potential or gradient at the end of trajectory {where} for chain(s) {chains} "
            f"(step size {[float(v) for v in e[~finite]]}); lower the step size or target a higher "
            "acceptance rate"
        )
    dh = torch.where(finite, h1 - h0, torch.full_like(h1, math.inf))
    accept_prob = torch.exp(torch.clamp(-dh, max=0.0)).double()
    coin = torch.rand(c, generator=gen, dtype=torch.float64).to(theta.device)
    accept = (coin < accept_prob) & finite
    return Step(
        theta=torch.where(accept[:, None], th1, theta),
        u=torch.where(accept, u1, u),
        grad=torch.where(accept[:, None], g1, grad),
        accept_prob=accept_prob,
        accepted=accept,
        divergent=dh > DIVERGENCE,
        finite=finite,
    )
