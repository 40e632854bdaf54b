r"""The effective temperature of a stochastic-gradient sampler (book: chapter "Table 1"; Chen et al. 2014,
§3.2; Wenzel et al. 2020).

SGHMC's update (:mod:`symlib.posteriors.sghmc`) adds Gaussian noise of variance :math:`q_i` to the
velocity of coordinate :math:`i` every step, :math:`v \leftarrow (1 - \alpha) v - \eta \nabla\tilde U +
\mathcal N(0, q)`, and the minibatch gradient :math:`\nabla\tilde U` brings its own noise, of variance
:math:`V_i` (the variance of the minibatch estimate of :math:`\partial U / \partial \theta_i` over the
random batches, and the random crops when the sampler trains with them). The friction removes energy at
rate :math:`\alpha`; the stationary velocity variance is :math:`(q_i + \eta^2 V_i) / (2\alpha)` per step, and
the sampler is at temperature :math:`T_i` in coordinate :math:`i` where that equals :math:`\eta T_i`:

.. math:: T_i = \frac{q_i + \eta^2 V_i}{2 \alpha \eta}, \qquad
          T_{\mathrm{eff}} = \frac1D \sum_i T_i,

the *effective temperature* (the mean over coordinates, the kinetic temperature of the velocities in the
limit of small steps). The stated temperature :math:`T` injects :math:`q_i = 2\alpha\eta T`, so without a
correction :math:`T_{\mathrm{eff}} = T + \eta \bar V / (2\alpha)`: above :math:`T` by the gradient noise.
Chen et al.'s correction injects :math:`q_i = \max(0, 2\alpha\eta T - \eta^2 \hat V_i)` with an estimate
:math:`\hat V` (their :math:`\hat B = \eta \hat V / 2`); it restores :math:`T` where
:math:`\eta \hat V_i \le 2 \alpha T` and leaves the rest hot.

**Independent minibatches.** The formula assumes that the noise of successive steps is independent.
With the usual epoch-wise shuffling it is not: at fixed weights the noises of one epoch's batches sum to
zero, so a direction that relaxes more slowly than an epoch averages most of the noise away and is
heated far less than the formula says (on a Bayesian linear regression whose relaxation time is one
epoch, the formula predicts 1.40 and the variances come out 1.02-1.06 times the posterior's; the
correction then cools the chain to 0.6-0.7: ``tests/posteriors/test_sghmc_temperature.py``). SGHMC
therefore draws every batch independently (:func:`iid_batches`: ``B`` training images drawn uniformly
with replacement, each with its own random crop), for which the formula and the correction are exact in
the limit of small steps.

* :func:`iid_batches` yields those minibatches;
* :func:`gradient_noise` measures :math:`V` at given weights: the variance over ``n_batches`` fresh
  minibatches of :func:`iid_batches` (with the recipe's crops or without) of
  :math:`N (\nabla \bar\ell_B + wd\,\theta)`;
* :func:`effective_temperature` turns it into :math:`T_{\mathrm{eff}}` for a sampler's settings;
* :func:`kinetic_temperature` is the direct measurement from a run's velocities,
  :math:`\overline{v^2} / \eta`, which also contains the discretisation's own error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from symlib import training as _train
from symlib.params import Params, flatten
from symlib.posteriors.base import Setup
from symlib.training.plans import cutter

__all__ = ["effective_temperature", "gradient_noise", "iid_batches", "injected_variance",
           "kinetic_temperature"]


def iid_batches(gen: torch.Generator, m: int, x: torch.Tensor, y: torch.Tensor, recipe: _train.Recipe,
                fill: float | Sequence[float] = 0.0, epochs: int = 1):
    """Minibatches of ``m`` stacked chains drawn independently at every step: ``recipe.batch_size`` images
    uniformly with replacement, each with its own random crop (and flip) of the recipe, from ``gen`` (on
    the CPU). An "epoch" is ``ceil(N / batch_size)`` steps; yields :class:`symlib.training.Batch` es
    (``x (m, B, C, H, W)``, ``y (m, B)``)."""
    n, size, b = x.shape[0], x.shape[-1], recipe.batch_size
    per_epoch = -(-n // b)
    xpad = _train.pad_images(x, recipe.crop_padding, fill)
    cut = cutter(x, recipe)
    step = 0
    for epoch in range(epochs):
        lr = recipe.lr_at(epoch)
        for j in range(per_epoch):
            idx = torch.randint(0, n, (m, b), generator=gen)
            aug = torch.zeros(m, b, 3, dtype=torch.int64)
            if recipe.crop_padding:
                aug[..., :2] = torch.randint(0, 2 * recipe.crop_padding + 1, (m, b, 2), generator=gen)
            if recipe.flip:
                aug[..., 2] = torch.randint(0, 2, (m, b), generator=gen)
            idx, aug = idx.to(x.device), aug.to(x.device)
            yield _train.Batch(epoch, step, lr, j == per_epoch - 1, cut(xpad, idx, aug, size), y[idx])
            step += 1


def _noise_recipe(setup: Setup, augment: bool) -> _train.Recipe:
    rec = setup.recipe
    return rec if augment else dataclasses.replace(rec, crop_padding=0, flip=False)


def gradient_noise(setup: Setup, theta: Params, seeds: Sequence[int], n_batches: int = 16,
                   augment: bool = True) -> torch.Tensor:
    r"""Per-coordinate variance :math:`V` of the minibatch estimate of :math:`\nabla U` at stacked weights.

    Args:
        setup: the training problem (``N``, batch size, weight decay, crops).
        theta: stacked weights ``{name: (M, ...)}`` (OptuNet's four tensors, or a module's parameters).
        seeds: one seed per model: model ``m``'s batches come from :func:`iid_batches` with a generator
            seeded ``seeds[m]``.
        n_batches: minibatches per model (>= 2; the variance has ``n_batches - 1`` degrees of freedom).
        augment: draw the batches with the recipe's random crops (as the sampler does) or without.

    Returns:
        ``(M, D)`` variances in units of :math:`U^2`, over the parameters of ``theta`` (not its buffers)
        flattened in the order of its keys (of ``named_parameters`` for a module).
    """
    if n_batches < 2:
        raise ValueError(f"n_batches must be at least 2 to estimate a variance, got {n_batches}")
    rec = _noise_recipe(setup, augment)
    n = setup.n_train
    m = next(iter(theta.values())).shape[0]
    xs, ys = [], []
    for s in seeds:
        it = iid_batches(torch.Generator().manual_seed(int(s)), n_batches, setup.x, setup.y, rec, setup.fill)
        b = next(it)
        xs.append(b.x)
        ys.append(b.y)
    batch = _train.Batch(0, 0, 0.0, False, torch.cat(xs), torch.cat(ys))
    if setup.arch in _train.STACKED_GRADS:
        rep = {k: v.repeat_interleave(n_batches, 0) for k, v in theta.items()}
        _, grads = _train.loss_and_grads(rep, batch.x, batch.y, setup.arch)
        g = flatten({k: grads[k] + rec.weight_decay * rep[k] for k in theta})
    else:
        from symlib.posteriors.modules import new_module

        rows = []
        for i in range(m * n_batches):
            model = new_module(setup, {k: v[i // n_batches] for k, v in theta.items()})
            model.train()
            loss = F.cross_entropy(model(batch.x[i]), batch.y[i])
            ps = [(k, p) for k, p in model.named_parameters() if k in theta]
            gs = torch.autograd.grad(loss, [p for _, p in ps])
            rows.append(torch.cat([(gk + rec.weight_decay * p).detach().reshape(-1)
                                   for (_, p), gk in zip(ps, gs, strict=True)]))
        g = torch.stack(rows)
    g = (n * g.double()).reshape(m, n_batches, -1)
    return g.var(1, unbiased=True)


def injected_variance(eta: float, alpha: float, temperature: float,
                      noise_var: torch.Tensor | None = None) -> torch.Tensor | float:
    r"""The velocity noise variance SGHMC injects per step: :math:`2\alpha\eta T`, or with the correction
    :math:`\max(0, 2\alpha\eta T - \eta^2 \hat V_i)` for an estimate ``noise_var`` :math:`= \hat V`."""
    q = 2.0 * alpha * eta * temperature
    if noise_var is None:
        return q
    return (q - eta**2 * noise_var).clamp_min(0.0)


def effective_temperature(noise: torch.Tensor, eta: float, alpha: float, temperature: float = 1.0,
                          noise_var: torch.Tensor | None = None) -> torch.Tensor:
    r""":math:`T_{\mathrm{eff}} = \frac1D \sum_i (q_i + \eta^2 V_i) / (2\alpha\eta)` per model, ``(M,)``.

    Args:
        noise: the measured gradient-noise variances :math:`V` ``(M, D)`` (:func:`gradient_noise`).
        eta, alpha, temperature: the sampler's :math:`\eta`, friction and stated temperature.
        noise_var: the estimate :math:`\hat V` ``(M, D)`` the sampler corrected with (``None``: no
            correction).
    """
    q = injected_variance(eta, alpha, temperature, noise_var)
    q = torch.as_tensor(q, dtype=noise.dtype)
    return ((q + eta**2 * noise) / (2.0 * alpha * eta)).mean(-1)


def kinetic_temperature(velocity: Params, eta: float) -> torch.Tensor:
    r""":math:`\overline{v^2} / \eta` per model from stacked velocities ``{name: (M, ...)}``, ``(M,)``."""
    v = flatten(velocity).double()
    return (v * v).mean(1) / eta
