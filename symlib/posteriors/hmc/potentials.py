r"""Potentials of stacked networks for HMC (book: chapters "A gentle example" and "Table 1").

A *potential* maps the flat weights of ``C`` stacked chains to the negative log posterior and its
gradient, ``flat (C, D) -> (U (C,), grad U (C, D))``, with a Gaussian prior
:math:`\mathcal N(0, \lambda^{-1} I)`:

.. math:: U(\theta) = \beta\, L(\theta) + \tfrac{\lambda}{2} \lVert\theta\rVert^2, \qquad
          L(\theta) = -\sum_{n=1}^N \log p(y_n \mid x_n, \theta),

:math:`\beta = 1` for the posterior, :math:`\beta < 1` a tempered one (replica exchange,
:mod:`symlib.posteriors.hmc.tempering`). A *likelihood* is the same map for :math:`L` alone
(``flat -> (L (C,), grad L (C, D))``); :func:`with_prior` adds the prior and the inverse temperature.

* :func:`stacked_potential`: OptuNet through the stacked hand-written gradient
  (:func:`symlib.training.stacked.loss_and_grads`), the full batch in chunks;
* :func:`module_potential`: any ``nn.Module`` without buffers through ``torch.func``;
* :func:`mlp_likelihood`: small ReLU MLPs (the gentle example's perceptron, the marginals chapter's
  regression MLP), forward and backward written out as batched matrix products over the chains, with a
  Bernoulli (binary cross-entropy on the logit) or Gaussian (fixed noise) likelihood.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from symlib import training as _train
from symlib.params import flatten, unflatten

Potential = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``flat (C, D) -> (U (C,), grad (C, D))``; a likelihood has the same signature for :math:`L`."""

LIKELIHOODS = ("bernoulli", "gaussian")

__all__ = [
    "LIKELIHOODS",
    "Potential",
    "check_precision",
    "mlp_likelihood",
    "mlp_shapes",
    "module_potential",
    "stacked_potential",
    "with_prior",
]


def check_precision(prior_precision: float) -> float:
    lam = float(prior_precision)
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(
            f"the prior precision must be positive and finite, got {prior_precision!r}: HMC needs a proper "
            "Gaussian prior (give the recipe a positive weight_decay, lambda = N * weight_decay)"
        )
    return lam


def with_prior(likelihood: Potential, prior_precision: float, beta: float | torch.Tensor = 1.0) -> Potential:
    r""":math:`U = \beta L + \tfrac{\lambda}{2}|\theta|^2` from a likelihood ``flat -> (L, grad L)``;
    ``beta`` a number or one per chain ``(C,)``."""
    lam = check_precision(prior_precision)

    def potential(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nll, g = likelihood(flat)
        b = torch.as_tensor(beta, dtype=flat.dtype, device=flat.device)
        return b * nll + 0.5 * lam * (flat * flat).sum(1), (b[:, None] if b.ndim else b) * g + lam * flat

    return potential


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

    def likelihood(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = flat.shape[0]
        params = unflatten(flat, shapes)
        u = flat.new_zeros(c)
        g = torch.zeros_like(flat)
        for s in range(0, n, chunk):
            xb, yb = x[s : s + chunk], y[s : s + chunk]
            nb = xb.shape[0]
            loss, grads = _train.loss_and_grads(params, xb.expand(c, *xb.shape), yb.expand(c, nb), arch)
            u = u + nb * loss
            g = g + nb * flatten(grads)
        return u, g

    return with_prior(likelihood, lam)


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

    def likelihood(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u = flat.new_zeros(flat.shape[0])
        g = torch.zeros_like(flat)
        for s in range(0, n, chunk):
            gb, ub = grad_nll(flat, x[s : s + chunk], y[s : s + chunk])
            u, g = u + ub, g + gb
        return u, g

    return with_prior(likelihood, lam), shapes


def mlp_shapes(widths: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters of :class:`symlib.models.MLP` ``(widths)``, in order."""
    out = {}
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=False)):
        out[f"{2 * i}.weight"], out[f"{2 * i}.bias"] = (b, a), (b,)
    return out


def mlp_likelihood(
    widths: Sequence[int],
    x: torch.Tensor,
    y: torch.Tensor,
    likelihood: str = "bernoulli",
    noise_sd: float = 1.0,
) -> tuple[Potential, dict[str, tuple[int, ...]]]:
    r"""The negative log-likelihood of stacked ReLU MLPs (:class:`symlib.models.MLP`) on the full data.

    ``"bernoulli"`` (one output, binary labels ``y`` in {0, 1}): :math:`L = \sum_n
    \mathrm{softplus}(f_n) - y_n f_n`, the summed binary cross-entropy on the logit :math:`f_n`.
    ``"gaussian"`` (one output): :math:`L = \sum_n (f_n - y_n)^2 / (2\sigma^2) + N \log(\sigma\sqrt{2\pi})`
    with the fixed noise standard deviation :math:`\sigma` = ``noise_sd``.

    Returns:
        ``(likelihood, shapes)``: ``flat (C, D) -> (L (C,), grad L (C, D))`` (forward and backward as
        batched matrix products, in the dtype of ``flat``) and the parameter shapes.
    """
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}")
    if widths[-1] != 1:
        raise ValueError(f"a one-output MLP is needed (binary or scalar regression), got {list(widths)}")
    if not (noise_sd > 0 and math.isfinite(noise_sd)):
        raise ValueError(f"noise_sd must be positive and finite, got {noise_sd!r}")
    shapes = mlp_shapes(widths)
    n_layers = len(widths) - 1
    n = x.shape[0]
    const = n * math.log(noise_sd * math.sqrt(2 * math.pi))

    def nll(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = unflatten(flat, shapes)
        c = flat.shape[0]
        ws = [p[f"{2 * i}.weight"] for i in range(n_layers)]
        bs = [p[f"{2 * i}.bias"] for i in range(n_layers)]
        acts, zs = [x.to(flat.dtype).expand(c, *x.shape)], []
        for i in range(n_layers):
            z = torch.baddbmm(bs[i].unsqueeze(1), acts[-1], ws[i].transpose(1, 2))  # (C, N, out)
            zs.append(z)
            if i < n_layers - 1:
                acts.append(torch.relu(z))
        f = zs[-1][..., 0]
        yy = y.to(flat.dtype)
        if likelihood == "bernoulli":
            loss = (F.softplus(f) - yy * f).sum(1)
            dz = (torch.sigmoid(f) - yy)[..., None]
        else:
            r = f - yy
            loss = 0.5 * (r * r).sum(1) / noise_sd**2 + const
            dz = (r / noise_sd**2)[..., None]
        grads = {}
        for i in range(n_layers - 1, -1, -1):
            grads[f"{2 * i}.weight"] = torch.bmm(dz.transpose(1, 2), acts[i])
            grads[f"{2 * i}.bias"] = dz.sum(1)
            if i:
                dz = torch.bmm(dz, ws[i]) * (zs[i - 1] > 0)
        return loss, flatten({k: grads[k] for k in shapes})

    return nll, shapes
