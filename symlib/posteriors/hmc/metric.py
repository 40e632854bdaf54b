r"""Mass matrices of HMC (book: chapter "Table 1"; Neal 2011, §4.1).

With a mass matrix :math:`M`, HMC samples momenta :math:`p \sim \mathcal N(0, M)`, its kinetic energy is
:math:`K(p) = \tfrac12 p^\top M^{-1} p` and leapfrog moves the position by :math:`\epsilon M^{-1} p`. The
target does not depend on :math:`M`; the efficiency does: with :math:`M` the precision of the posterior
(the curvature of :math:`U`), every direction moves at the same speed in units of its own posterior
scale, so one step size and a few leapfrog steps cross the widest and the narrowest directions alike
(the posterior of OptuNet has curvatures from 0.8, the prior alone along the symmetries, to about
:math:`10^5`: without a metric, trajectories cannot leave their starting point).

* :class:`Identity`: :math:`M = I` (the classic sampler).
* :class:`Diagonal`: one mass per coordinate and chain.
* :class:`Dense`: one dense :math:`M = L L^\top` per chain (its Cholesky factor); :func:`from_curvature`
  builds it from a curvature :math:`H` (e.g. the GGN of the likelihood) plus the prior's precision,
  :math:`M = H + \lambda I`, the precision of the Laplace approximation at the chain's start.
* :class:`DenseCovariance`: one dense :math:`M = \Sigma^{-1}` per chain given by :math:`\Sigma`, an estimated
  covariance of the target (the adapted metric of :mod:`symlib.posteriors.hmc.ladder`): the velocity
  :math:`\Sigma p` is one product, with no triangular solve per leapfrog step.

Every metric works on stacked chains ``(C, D)``: ``momentum`` draws :math:`p`, ``velocity`` is
:math:`M^{-1} p` and ``kinetic`` :math:`K(p)` per chain.
"""

from __future__ import annotations

import torch

__all__ = ["Dense", "DenseCovariance", "Diagonal", "Identity", "Metric", "from_curvature"]


class Metric:
    """The interface; the base class is the identity mass."""

    name = "identity"

    def momentum(self, shape: tuple[int, int], gen: torch.Generator, dtype, device) -> torch.Tensor:
        """:math:`p \\sim \\mathcal N(0, M)`, ``(C, D)`` (drawn on the CPU generator, moved to ``device``)."""
        return torch.randn(shape, generator=gen, dtype=dtype).to(device)

    def velocity(self, p: torch.Tensor) -> torch.Tensor:
        """:math:`M^{-1} p`."""
        return p

    def kinetic(self, p: torch.Tensor) -> torch.Tensor:
        """:math:`\\tfrac12 p^\\top M^{-1} p` per chain, ``(C,)``."""
        return 0.5 * (p * self.velocity(p)).sum(1)

    def take(self, index: torch.Tensor) -> Metric:
        """The metric of the chains ``index`` (replica exchange moves states between rows)."""
        return self

    def describe(self) -> dict:
        """JSON-able description for manifests."""
        return {"mass_matrix": self.name}


class Identity(Metric):
    """:math:`M = I`."""


class Diagonal(Metric):
    """:math:`M = \\mathrm{diag}(m)`, ``mass (C, D)`` positive."""

    name = "diagonal"

    def __init__(self, mass: torch.Tensor):
        if mass.ndim != 2 or not bool((mass > 0).all()):
            raise ValueError("a diagonal mass must be (chains, D) and positive")
        self.mass = mass

    def momentum(self, shape, gen, dtype, device):
        return super().momentum(shape, gen, dtype, device) * self.mass.sqrt().to(dtype)

    def velocity(self, p):
        return p / self.mass.to(p.dtype)

    def take(self, index):
        return Diagonal(self.mass[index])


class Dense(Metric):
    """A dense :math:`M = L L^\\top` per chain, given by its lower Cholesky factor ``chol (C, D, D)``."""

    name = "dense"

    def __init__(self, chol: torch.Tensor, info: dict | None = None):
        if chol.ndim != 3 or chol.shape[1] != chol.shape[2]:
            raise ValueError(f"a dense metric needs Cholesky factors (chains, D, D), got {tuple(chol.shape)}")
        self.chol = chol
        self.info = dict(info or {})

    def momentum(self, shape, gen, dtype, device):
        z = super().momentum(shape, gen, self.chol.dtype, self.chol.device)
        return (self.chol @ z[..., None])[..., 0].to(dtype)

    def velocity(self, p):
        v = torch.cholesky_solve(p.to(self.chol.dtype)[..., None], self.chol)[..., 0]
        return v.to(p.dtype)

    def kinetic(self, p):
        w = torch.linalg.solve_triangular(self.chol, p.to(self.chol.dtype)[..., None], upper=False)[..., 0]
        return (0.5 * (w * w).sum(1)).to(p.dtype)

    def take(self, index):
        return Dense(self.chol[index], self.info)

    def describe(self):
        return {"mass_matrix": self.name, **self.info}


class DenseCovariance(Metric):
    r"""A dense :math:`M = \Sigma^{-1}` per chain, given by ``cov`` :math:`\Sigma` ``(C, D, D)`` (symmetric
    positive definite): momenta :math:`p = A z` with :math:`A A^\top = \Sigma^{-1}` (computed once),
    velocity :math:`\Sigma p`, kinetic energy :math:`\tfrac12 p^\top \Sigma p`."""

    name = "dense covariance"

    def __init__(self, cov: torch.Tensor):
        if cov.ndim != 3 or cov.shape[1] != cov.shape[2]:
            raise ValueError(f"a dense covariance metric needs (chains, D, D), got {tuple(cov.shape)}")
        self.cov = 0.5 * (cov + cov.transpose(1, 2))
        chol, bad = torch.linalg.cholesky_ex(self.cov)
        if bool((bad != 0).any()):
            raise ValueError(f"the covariance of chain(s) {bad.nonzero().flatten().tolist()} is not positive "
                             "definite; regularise it (add a multiple of the identity)")
        # A = L^{-T} for Sigma = L L^T: A A^T = L^{-T} L^{-1} = Sigma^{-1}
        eye = torch.eye(cov.shape[1], dtype=cov.dtype, device=cov.device).expand_as(chol)
        self.factor = torch.linalg.solve_triangular(chol.transpose(1, 2), eye, upper=True)

    def momentum(self, shape, gen, dtype, device):
        z = super().momentum(shape, gen, self.cov.dtype, self.cov.device)
        return torch.bmm(self.factor, z[..., None])[..., 0].to(dtype)

    def velocity(self, p):
        return torch.bmm(self.cov, p.to(self.cov.dtype)[..., None])[..., 0].to(p.dtype)

    def take(self, index):
        return DenseCovariance(self.cov[index])


def from_curvature(curvature: torch.Tensor, prior_precision: float, info: dict | None = None) -> Dense:
    r"""The dense metric :math:`M = H + \lambda I` of curvatures ``H (C, D, D)`` (symmetric, positive
    semi-definite: a GGN) and a Gaussian prior's precision :math:`\lambda > 0`, in float64."""
    h = curvature.to(torch.float64)
    h = 0.5 * (h + h.transpose(1, 2))
    eye = torch.eye(h.shape[1], dtype=h.dtype, device=h.device)
    chol, bad = torch.linalg.cholesky_ex(h + float(prior_precision) * eye)
    if bool((bad != 0).any()):
        raise ValueError(
            f"curvature + prior precision is not positive definite for chain(s) "
            f"{bad.nonzero().flatten().tolist()}: pass a positive semi-definite curvature (a GGN, not an "
            "exact Hessian away from a minimum)"
        )
    ev = torch.linalg.eigvalsh(h + float(prior_precision) * eye)
    return Dense(chol, {"curvature_min": ev[:, 0].tolist(), "curvature_max": ev[:, -1].tolist(),
                        **(info or {})})
