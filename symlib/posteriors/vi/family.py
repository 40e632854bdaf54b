r"""The mean-field Gaussian family of Bayes by Backprop and its objective (book: chapter "Table 1"; Blundell
et al. 2015, BLiTZ's defaults).

:func:`bayesian_layers` picks the weights and biases that get a Gaussian, :func:`init_variational` draws
BLiTZ's initialisation, :func:`kl_divergence` is the closed-form KL to the prior and
:func:`elbo_and_grads` the Monte-Carlo objective of stacked posteriors with its hand-written gradient.
:class:`VIResult` holds trained posteriors and draws from them. See :mod:`symlib.posteriors.vi`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from symlib import scales as _scales
from symlib import training as _train
from symlib.params import Params

PRIOR_SIGMA = 0.1


MU_INIT_STD = 0.1


RHO_INIT = {"linear": -6.0, "conv": -7.0}


RHO_INIT_STD = 0.1


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def bayesian_layers(model: nn.Module) -> dict[str, str]:
    """``{parameter name: "linear" | "conv"}`` of the weights and biases of ``Linear`` / ``Conv*`` layers,
    in ``named_parameters`` order."""
    out = {}
    for mname, mod in model.named_modules():
        kind = (
            "linear"
            if isinstance(mod, nn.Linear)
            else "conv"
            if isinstance(mod, nn.modules.conv._ConvNd)
            else None
        )
        if kind is None:
            continue
        for pname, _ in mod.named_parameters(recurse=False):
            out[f"{mname}.{pname}" if mname else pname] = kind
    order = [k for k, _ in model.named_parameters()]
    return {k: out[k] for k in order if k in out}


def init_variational(
    model: nn.Module, n_modes: int, generator: torch.Generator, std_init: float | None = None
) -> tuple[Params, Params]:
    r"""BLiTZ's initialisation of ``n_modes`` posteriors: :math:`\mu \sim \mathcal N(0, 0.1^2)`,
    :math:`\rho \sim \mathcal N(\rho_0, 0.1^2)` with :math:`\rho_0` from :data:`RHO_INIT`, or, with
    ``std_init``, :math:`\rho_0 = \log(e^{s} - 1)` for every layer (initial standard deviation ``s``, as
    Rossi et al. set it). Returns stacked ``(mu, rho)``, ``{name: (n_modes, ...)}``, in the model's dtype."""
    kinds = bayesian_layers(model)
    if not kinds:
        raise ValueError(
            f"{type(model).__name__} has no Linear or Conv layer: mean-field VI puts its Gaussians on the "
            "weights and biases of such layers"
        )
    shapes = dict(model.named_parameters())
    mu, rho = {}, {}
    for k, kind in kinds.items():
        p = shapes[k]
        shape = (n_modes, *p.shape)
        mu[k] = (torch.randn(shape, generator=generator, dtype=torch.float64) * MU_INIT_STD).to(p)
        rho0 = RHO_INIT[kind] if std_init is None else math.log(math.expm1(std_init))
        rho[k] = (rho0 + RHO_INIT_STD * torch.randn(shape, generator=generator, dtype=torch.float64)).to(p)
    return mu, rho


def kl_divergence(mu: Params, rho: Params, prior_sigma: float = PRIOR_SIGMA) -> torch.Tensor:
    r"""Closed-form :math:`\mathrm{KL}(q \| p)` of stacked mean-field Gaussians against
    :math:`\mathcal N(0, \sigma_0^2 I)`: :math:`\sum_i \log\frac{\sigma_0}{\sigma_i} +
    \frac{\sigma_i^2 + \mu_i^2}{2\sigma_0^2} - \frac12`, one value per mode ``(n_modes,)``."""
    total = 0.0
    for k, m in mu.items():
        s = F.softplus(rho[k])
        term = math.log(prior_sigma) - torch.log(s) + (s * s + m * m) / (2 * prior_sigma**2) - 0.5
        total = total + term.reshape(term.shape[0], -1).sum(1)
    return total


def elbo_and_grads(
    mu: Params,
    rho: Params,
    eps: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    kl_weight: float,
    prior_sigma: float = PRIOR_SIGMA,
    arch: str = "optunet",
) -> tuple[torch.Tensor, torch.Tensor, Params, Params]:
    r"""The Monte-Carlo objective :math:`\mathcal L` of ``n_modes`` stacked posteriors and its gradient
    (hand-written, see the module docstring), through :func:`symlib.training.stacked.loss_and_grads`.

    Args:
        mu, rho: ``{name: (n_modes, ...)}``.
        eps: ``{name: (n_modes, K, ...)}`` standard normal noise, ``K`` Monte-Carlo samples per mode.
        x: ``(n_modes, B, C, H, W)`` images (one batch per mode, shared by its ``K`` samples);
            y: ``(n_modes, B)`` labels.
        kl_weight: :math:`\beta`.
        prior_sigma: :math:`\sigma_0`.
        arch: a stacked architecture (:data:`symlib.training.optunet.STACKED_GRADS`).

    Returns:
        ``(nll (n_modes,), kl (n_modes,), grad_mu, grad_rho)``: the mean over the ``K`` samples of the
        mean cross-entropy, the KL, and the gradients of ``nll + kl_weight * kl``.
    """
    m, k = x.shape[0], next(iter(eps.values())).shape[1]
    sig = {n: F.softplus(r) for n, r in rho.items()}
    w = {n: (mu[n][:, None] + sig[n][:, None] * eps[n]).reshape(m * k, *mu[n].shape[1:]) for n in mu}
    xb = x.repeat_interleave(k, 0)
    yb = y.repeat_interleave(k, 0)
    loss, g = _train.loss_and_grads(w, xb, yb, arch)
    s2 = prior_sigma**2
    g_mu, g_rho = {}, {}
    for n in mu:
        gk = g[n].view(m, k, *mu[n].shape[1:])
        g_mu[n] = gk.mean(1) + kl_weight * mu[n] / s2
        g_rho[n] = ((gk * eps[n]).mean(1) + kl_weight * (sig[n] / s2 - 1 / sig[n])) * torch.sigmoid(rho[n])
    return loss.view(m, k).mean(1), kl_divergence(mu, rho, prior_sigma), g_mu, g_rho


@dataclasses.dataclass
class VIResult:
    """Trained mean-field posteriors of ``n_modes`` independent runs.

    Attributes:
        mean: :math:`\\mu`, ``{name: (n_modes, ...)}`` for the Bayesian parameters.
        rho: :math:`\\rho` (same shapes); :attr:`std` is :math:`\\sigma = \\mathrm{softplus}(\\rho)`.
        point: the other entries of the state dict (point-estimated parameters, buffers), stacked.
        keys: the model's state-dict keys, in order (the order of :meth:`sample`'s output).
        prior_sigma: :math:`\\sigma_0`; kl_weight: :math:`\\beta`.
        seeds: one seed per mode.
        history: per-epoch mean objective, NLL and KL per mode (lists of lists).
    """

    mean: Params
    rho: Params
    point: Params
    keys: list[str]
    prior_sigma: float
    kl_weight: float
    seeds: list[int]
    history: dict[str, list] = dataclasses.field(default_factory=dict)

    @property
    def std(self) -> Params:
        r"""The standard deviations :math:`\sigma = \mathrm{softplus}(\rho)`, shaped as ``rho``."""
        return {k: F.softplus(v) for k, v in self.rho.items()}

    @property
    def n_modes(self) -> int:
        return int(next(iter(self.mean.values())).shape[0])

    def kl(self) -> torch.Tensor:
        """KL of every mode's posterior to the prior, ``(n_modes,)``."""
        return kl_divergence(self.mean, self.rho, self.prior_sigma)

    def sample(self, n_per_mode: int, seed: int = 0) -> Params:
        r"""``n_per_mode`` full weight sets per mode, :math:`w = \mu + \sigma\epsilon`, mode-major
        ``{key: (n_modes * n_per_mode, ...)}`` (point parameters and buffers repeated)."""
        _scales.check_int("n_per_mode", n_per_mode, 1)
        gen = torch.Generator().manual_seed(int(seed))
        out = {}
        for k in self.keys:
            if k in self.mean:
                mu, sd = self.mean[k], F.softplus(self.rho[k])
                e = torch.randn((mu.shape[0], n_per_mode, *mu.shape[1:]), generator=gen, dtype=torch.float64)
                w = mu[:, None] + sd[:, None] * e.to(mu)
            else:
                v = self.point[k]
                w = v[:, None].expand(v.shape[0], n_per_mode, *v.shape[1:])
            out[k] = w.reshape(-1, *w.shape[2:]).clone()
        return out
