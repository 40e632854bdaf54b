r"""A mass matrix that follows the scaling orbits, made exact by an auxiliary gauge (book: chapter "Table 1").

Beyond the paper. Moving a ReLU network along a scaling orbit, :math:`\theta \mapsto g_t \theta` with
:math:`(g_t \theta)_j = e^{(P^\top t)_j} \theta_j` (:math:`P` the ``(K, D)`` powers of the :math:`K` hidden
neurons' scalings, +1 on a neuron's incoming weights, -1 on its outgoing ones), leaves the likelihood
unchanged, so its curvature moves with the network:
:math:`\nabla^2 L(g_t \theta) = D_t^{-1} \nabla^2 L(\theta) D_t^{-1}`,
:math:`D_t = \mathrm{diag}(e^{P^\top t})`.
A fixed mass matrix, computed at one point of the orbit, is wrong elsewhere on it, by the square of the
scale: where the exact orbit moves (:class:`symlib.posteriors.hmc.orbits.ScalingMoves`) put a chain's
first-layer channel at half its scale, its incoming weights are four times stiffer than the metric
believes, and the step size that keeps them stable starves every other direction.

A mass matrix may not depend on the current position during a trajectory, or the sampler is no longer
reversible. It may depend on an auxiliary variable that is drawn before each trajectory and kept fixed
during it (a Gibbs step on an extended target). :class:`OrbitGauge` keeps, per chain, a *gauge*
:math:`s \in \mathbb R^K`, a noisy reading of the network's position on its orbit:

.. math:: \pi(\theta, s) = \pi(\theta)\, \mathcal N\big(s;\ \hat s(\theta), \sigma^2 I\big),

where :math:`\hat s` is *equivariant*, :math:`\hat s(g_t \theta) = \hat s(\theta) + t`: with
:math:`\ell_k(\theta) = \tfrac12 \log \sum_{j \in I_k} \theta_j^2` the log-norm of neuron :math:`k`'s
incoming weights :math:`I_k` (entries that all share one exponent vector :math:`a_k`, the column of
:math:`P` at them), :math:`\ell(g_t \theta) = \ell(\theta) + A t` with :math:`A` the rows :math:`a_k`, so
:math:`\hat s = A^{-1} \ell`. One transition of a chain:

1. (optional) the exact move along the scaling orbit, which leaves :math:`\pi(\theta)` invariant;
2. :meth:`OrbitGauge.refresh`: :math:`s \sim \mathcal N(\hat s(\theta), \sigma^2 I)`, exact Gibbs;
3. an HMC trajectory on :math:`\theta` given :math:`s`, of potential
   :math:`U(\theta) + |s - \hat s(\theta)|^2 / 2\sigma^2` (:meth:`OrbitGauge.wrap`) and mass matrix

   .. math:: M(s) = D_{s - s_0}^{-1} \big(G_0 + \sigma^{-2} J_0^\top J_0\big) D_{s - s_0}^{-1} + \lambda I,

   with :math:`G_0` the GGN of the likelihood at the chain's start :math:`\theta_0`, :math:`s_0 =
   \hat s(\theta_0)`, :math:`J_0 = \partial \hat s / \partial \theta` at :math:`\theta_0` (the gauge term's
   Gauss-Newton curvature: along the orbits the trajectory moves by about :math:`\sigma` and the orbit
   moves do the rest) and :math:`\lambda` the prior's precision. Both the GGN and the gauge term transform
   exactly with the orbit, so :math:`M(s)` is the start's metric carried to where the chain is.

Steps 2 and 3 leave :math:`\pi(\theta, s)` invariant, so the chain's :math:`\theta` samples
:math:`\pi(\theta)` exactly whatever :math:`\sigma`, :math:`G_0` or the orbit moves (tested against the
exact law of a Gaussian prior, ``tests/posteriors/test_hmc_gauge.py``). The potential the sampler records
includes the gauge term; :meth:`OrbitGauge.gauge_energy` with the gauge of the draw's trajectory
(``OrbitGauge.history``) removes it.

Where it applies: every neuron's incoming weights must share one scaling pattern (OptuNet, whose second
convolution has one input channel per group, and networks with one hidden layer; not a dense layer after a
hidden layer, whose incoming weights each carry another neuron's scale: :func:`incoming_sets` says so).
What it buys on OptuNet (measured, ``symlib.posteriors.hmc.PRESETS``): with the full Laplace precision as
metric, step sizes of 0.04-0.06 where a fixed GGN + identity metric allowed 0.03, but not chains that
converge within Table 1's budget.
"""

from __future__ import annotations

import math

import torch

from symlib.posteriors.hmc.metric import Dense, Metric
from symlib.posteriors.hmc.potentials import Potential
from symlib.symmetry.spec import SymmetryError

__all__ = ["GaugedMetric", "OrbitGauge", "incoming_sets"]


def incoming_sets(powers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The incoming entries of every neuron (``(K, D)`` boolean, where its power is +1) and the matrix
    :math:`A` ``(K, K)`` whose row ``k`` is the exponent vector all of neuron ``k``'s incoming entries share.

    Raises:
        SymmetryError: a neuron without incoming entries, incoming entries moved by different scalings,
            or a singular :math:`A` (the log-norms do not determine the orbit's position).
    """
    if powers.ndim != 2:
        raise ValueError(f"powers must be (neurons, D), got {tuple(powers.shape)}")
    mask = powers == 1
    rows = []
    for k in range(powers.shape[0]):
        cols = powers[:, mask[k]]
        if cols.shape[1] == 0:
            raise SymmetryError(f"neuron {k} of the scalings has no incoming weights to read its scale from")
        if not bool((cols == cols[:, :1]).all()):
            raise SymmetryError(
                f"the incoming weights of neuron {k} are moved by different scalings: its log-norm is not "
                "equivariant; the gauge needs layers whose incoming weights share one scaling pattern"
            )
        rows.append(cols[:, 0])
    a = torch.stack(rows).to(torch.float64)
    if abs(float(torch.linalg.det(a))) < 1e-12:
        raise SymmetryError("the neurons' log-norms do not determine the position on the scaling orbit")
    return mask, a


class OrbitGauge:
    r"""The auxiliary gauge of stacked chains and the mass matrix it selects (module docstring).

    Args:
        powers: ``(K, D)`` exponents of the :math:`K` scalings on the flat weights
            (the ``powers`` attribute of :class:`symlib.posteriors.hmc.orbits.ScalingMoves`).
        theta0: ``(C, D)`` the chains' reference points (their polished starts).
        curvature: ``(C, D, D)`` the likelihood's GGN at ``theta0`` (positive semi-definite).
        prior_precision: :math:`\lambda` of the Gaussian prior.
        sigma: the gauge's noise :math:`\sigma` (in log-scale units; > 0).
    """

    def __init__(self, powers: torch.Tensor, theta0: torch.Tensor, curvature: torch.Tensor,
                 prior_precision: float, sigma: float = 0.1):
        if not (sigma > 0 and math.isfinite(sigma)):
            raise ValueError(f"sigma must be positive and finite, got {sigma!r}")
        if not (prior_precision > 0 and math.isfinite(prior_precision)):
            raise ValueError(f"prior_precision must be positive and finite, got {prior_precision!r}")
        c, d = theta0.shape
        if powers.shape[1] != d or curvature.shape != (c, d, d):
            raise ValueError(f"expected powers (K, {d}) and curvature ({c}, {d}, {d}) for theta0 {(c, d)}, "
                             f"got {tuple(powers.shape)} and {tuple(curvature.shape)}")
        mask, a = incoming_sets(powers)
        self.powers = powers.to(torch.float64)
        self.mask = mask.to(torch.float64)
        self.a_inv = torch.linalg.inv(a)
        self.sigma, self.lam = float(sigma), float(prior_precision)
        th0 = theta0.detach().to("cpu", torch.float64)
        self.s0 = self.estimate(th0, check=True)
        j0 = self.jacobian(th0)
        h = curvature.to("cpu", torch.float64)
        self.h0 = 0.5 * (h + h.transpose(1, 2)) + j0.transpose(1, 2) @ j0 / self.sigma**2
        self.s = self.s0.clone()
        self.history: list[torch.Tensor] = []
        self.version = 0

    def _sumsq(self, theta: torch.Tensor, check: bool = False) -> torch.Tensor:
        """Squared incoming norms ``(C, K)``; with ``check``, a clear error where one is zero or not finite
        (a state the chain stands on; inside a trajectory the energy becomes infinite and the trajectory
        is rejected as divergent)."""
        sq = (theta.to(torch.float64) ** 2) @ self.mask.T  # (C, K)
        if check and not bool((torch.isfinite(sq) & (sq > 0)).all()):
            bad = (~(torch.isfinite(sq) & (sq > 0))).nonzero()[:, 0].unique().tolist()
            raise FloatingPointError(f"chain(s) {bad}: a neuron's incoming weights are all zero or not "
                                     "finite, so its scale (the gauge) is undefined; start from trained "
                                     "networks")
        return sq

    def _from_sumsq(self, sq: torch.Tensor) -> torch.Tensor:
        return (0.5 * sq.log()) @ self.a_inv.T

    def estimate(self, theta: torch.Tensor, check: bool = False) -> torch.Tensor:
        r""":math:`\hat s(\theta) = A^{-1} \ell(\theta)`, ``(C, K)`` (``check``: see ``_sumsq``)."""
        return self._from_sumsq(self._sumsq(theta.to("cpu"), check))

    def jacobian(self, theta: torch.Tensor) -> torch.Tensor:
        r""":math:`\partial \hat s / \partial \theta`, ``(C, K, D)``."""
        th = theta.to("cpu", torch.float64)
        dl = self.mask[None] * th[:, None, :] / self._sumsq(th)[..., None]  # (C, K, D)
        return self.a_inv @ dl

    def gauge_energy(self, theta: torch.Tensor, s: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                        torch.Tensor]:
        r""":math:`E = |s - \hat s(\theta)|^2 / 2\sigma^2` per chain and its gradient in :math:`\theta`
        (float64), with the current gauge unless ``s`` is given."""
        s = self.s if s is None else s
        th = theta.to("cpu", torch.float64)
        sq = self._sumsq(th)
        r = s - self._from_sumsq(sq)  # (C, K)
        w = r @ self.a_inv  # (C, K): A^{-T} r
        grad = -(th * ((w / sq) @ self.mask)) / self.sigma**2
        return (0.5 * (r * r).sum(1) / self.sigma**2).to(theta.device), grad.to(theta.device)

    def wrap(self, potential: Potential) -> Potential:
        """The potential of :math:`\\theta` given the current gauge: ``potential`` plus
        :meth:`gauge_energy`."""

        def gauged(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            u, g = potential(flat)
            e, ge = self.gauge_energy(flat)
            return u + e.to(u.device, u.dtype), g + ge.to(g.device, g.dtype)

        return gauged

    def refresh(self, theta: torch.Tensor, gen: torch.Generator) -> None:
        """Draw the gauge of every chain from :math:`\\mathcal N(\\hat s(\\theta), \\sigma^2 I)` (exact
        Gibbs) and append it to ``history``."""
        noise = torch.randn(self.s0.shape, generator=gen, dtype=torch.float64)
        self.s = self.estimate(theta.detach(), check=True) + self.sigma * noise
        self.history.append(self.s.clone())
        self.version += 1

    def precision(self) -> torch.Tensor:
        """The mass matrices :math:`M(s)` of the current gauge, ``(C, D, D)`` float64."""
        d = torch.exp((self.s - self.s0) @ self.powers)  # (C, D): the entries' scale from s0 to s
        m = self.h0 / (d[:, :, None] * d[:, None, :])
        return m + self.lam * torch.eye(m.shape[1], dtype=m.dtype)

    def metric(self) -> GaugedMetric:
        """The mass matrix that follows this gauge (:class:`GaugedMetric`)."""
        return GaugedMetric(self)


class GaugedMetric(Metric):
    """A dense mass matrix :math:`M(s)` re-factorised whenever the gauge is refreshed
    (:meth:`OrbitGauge.precision`; a :class:`~symlib.posteriors.hmc.metric.Dense` in between): constant
    during each trajectory."""

    name = "ggn, following the scaling orbits"

    def __init__(self, gauge: OrbitGauge):
        self.gauge = gauge
        self._version = -1
        self._dense: Dense | None = None

    @property
    def dense(self) -> Dense:
        """The metric of the current gauge."""
        if self._version != self.gauge.version or self._dense is None:
            chol, bad = torch.linalg.cholesky_ex(self.gauge.precision())
            if bool((bad != 0).any()):
                raise FloatingPointError(f"the gauged mass matrix is not positive definite for chain(s) "
                                         f"{bad.nonzero().flatten().tolist()}")
            self._dense, self._version = Dense(chol), self.gauge.version
        return self._dense

    # the gauge lives on the CPU (float64); the chains' tensors may not
    def momentum(self, shape, gen, dtype, device):
        return self.dense.momentum(shape, gen, dtype, "cpu").to(device)

    def velocity(self, p):
        return self.dense.velocity(p.cpu()).to(p.device)

    def kinetic(self, p):
        return self.dense.kinetic(p.cpu()).to(p.device)

    def take(self, index):
        raise NotImplementedError("a gauged metric follows its chains' own gauges: no replica exchange")

    def describe(self):
        return {"mass_matrix": self.name, "gauge_sigma": self.gauge.sigma}
