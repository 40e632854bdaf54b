r"""The Laplace evidence and the prior precision that maximises it (book: chapter "Table 1").

For an isotropic prior :math:`\mathcal N(0, \lambda^{-1} I)` and the eigenvalues :math:`h_i` of the
likelihood curvature at a mode, :func:`log_marginal_likelihood` is laplace-torch's
``log_marginal_likelihood`` in closed form for every :math:`\lambda`, and :func:`tune_prior_precision`
its maximiser.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

__all__ = ["Fits", "check_prior_precision", "log_marginal_likelihood", "tune_prior_precision"]


def check_prior_precision(lam: Any) -> float:
    """Return ``lam`` as a float if it is a finite positive number, else raise a clear error."""
    if isinstance(lam, bool) or not isinstance(lam, (int, float, np.floating, np.integer)):
        raise TypeError(f"prior_precision must be a positive number, got {type(lam).__name__} {lam!r}")
    if not math.isfinite(lam) or lam <= 0:
        raise ValueError(
            f"prior_precision must be a finite positive number (the precision of the Gaussian prior "
            f"N(0, 1/lambda)), got {lam!r}; with prior_precision=None it comes from the weight decay "
            f"(N * wd), which needs a recipe with weight_decay > 0"
        )
    return float(lam)


def log_marginal_likelihood(
    eigs: torch.Tensor, sq_norm: float, log_lik: float, prior_precision: float | torch.Tensor
) -> torch.Tensor:
    r"""Laplace evidence for an isotropic prior :math:`\mathcal N(0, \lambda^{-1} I)` (laplace-torch's
    ``log_marginal_likelihood``):

    .. math:: \log Z(\lambda) = \log p(D \mid \theta^*) - \tfrac12 \Big[ \sum_i \log(h_i + \lambda)
              - D \log \lambda + \lambda \lVert \theta^* \rVert^2 \Big],

    with :math:`h_i` the eigenvalues of the likelihood curvature (so :math:`\log\det P` in closed form
    for every :math:`\lambda`). ``prior_precision`` may be a tensor of values.
    """
    lam = torch.as_tensor(prior_precision, dtype=torch.float64, device=eigs.device)
    lead = lam.shape
    lam = lam.reshape(-1, 1)
    logdet = torch.log(eigs[None, :] + lam).sum(1) - eigs.numel() * torch.log(lam[:, 0])
    return (log_lik - 0.5 * (logdet + lam[:, 0] * sq_norm)).reshape(lead)


def tune_prior_precision(
    eigs: torch.Tensor, sq_norm: float, search_range: tuple[float, float] = (1e-6, 1e8), n_grid: int = 141
) -> float:
    r"""The prior precision that maximises :func:`log_marginal_likelihood`.

    A log-spaced grid locates the maximum, then Brent's method solves the stationarity condition
    :math:`\partial_\lambda \log Z = 0`, i.e. MacKay's :math:`\gamma(\lambda) = \sum_i \frac{h_i}{h_i +
    \lambda} = \lambda \lVert \theta^* \rVert^2` (for PSD curvature the root is unique).

    Raises:
        ValueError: the maximum sits on the edge of ``search_range`` (widen it).
    """
    from scipy.optimize import brentq

    lo, hi = search_range
    check_prior_precision(lo), check_prior_precision(hi)
    floor = float(-eigs.min()) if float(eigs.min()) < 0 else 0.0
    grid = torch.logspace(
        math.log10(max(lo, floor * (1 + 1e-9) + 1e-300)), math.log10(hi), n_grid, dtype=torch.float64
    )
    vals = log_marginal_likelihood(eigs, sq_norm, 0.0, grid)
    k = int(torch.nan_to_num(vals, nan=-math.inf).argmax())
    if k in (0, n_grid - 1):
        raise ValueError(
            f"the Laplace marginal likelihood is largest at the edge of the search range "
            f"({float(grid[k]):.3g}); widen marglik_range={search_range}"
        )
    e = eigs.double().cpu().numpy()

    def deriv(log_lam: float) -> float:  # 2 lambda d log Z / d lambda
        lam = math.exp(log_lam)
        return float(e.size - np.sum(lam / (e + lam)) - lam * sq_norm)

    a, b = math.log(float(grid[k - 1])), math.log(float(grid[k + 1]))
    if deriv(a) * deriv(b) > 0:
        return float(grid[k])
    return math.exp(brentq(deriv, a, b, xtol=1e-12, rtol=1e-12))


@dataclasses.dataclass
class Fits:
    """What a Laplace fit records per mode (the sample set's diagnostics): the prior precision used, the
    log marginal likelihood, the mean training loss, the smallest curvature eigenvalue and the mean
    marginal posterior standard deviation."""

    prior_precision: list[float] = dataclasses.field(default_factory=list)
    log_marginal_likelihood: list[float] = dataclasses.field(default_factory=list)
    train_loss: list[float] = dataclasses.field(default_factory=list)
    min_curvature_eigenvalue: list[float] = dataclasses.field(default_factory=list)
    mean_posterior_std: list[float] = dataclasses.field(default_factory=list)

    def add(self, lam: float, logz: float, loss: float, min_eig: float, mean_std: float) -> None:
        for field, v in zip(dataclasses.fields(self), (lam, logz, loss, min_eig, mean_std), strict=True):
            getattr(self, field.name).append(v)
