r"""Stochastic-gradient Hamiltonian Monte Carlo (Chen et al. 2014; book: chapter "Table 1", paper §4).

**Target.** The full-data posterior at temperature :math:`T` (``T = 1``: the Bayesian posterior),
:math:`p_T(\theta \mid D) \propto \exp(-U(\theta) / T)` with

.. math:: U(\theta) = \sum_{n=1}^{N} \ell(\theta; x_n, y_n) + \tfrac{\lambda}{2}\lVert\theta\rVert^2,
          \qquad \lambda = N \cdot wd,

the Gaussian prior :math:`\mathcal N(0, \lambda^{-1} I)` that matches the recipe's weight decay
(:attr:`Setup.prior_precision`), and the minibatch estimate
:math:`\nabla\tilde U = N\,(\nabla \bar\ell_B + wd\,\theta)` (the batch mean gradient scaled by ``N``).

**Sampler.** Chen et al. (2014), Eq. 15, with mass :math:`M = I`, friction :math:`\alpha` and noise
estimate :math:`\hat\beta = 0`:

.. math:: \theta \leftarrow \theta + v, \qquad
          v \leftarrow (1 - \alpha)\, v - \eta\, \nabla\tilde U(\theta) + \mathcal N(0,\ 2 \alpha \eta T),

the injected noise being exactly :math:`\sqrt{2 \alpha \eta T}` (never shrunk: a sampler with less noise
is an optimiser). We write :math:`\eta = \mathrm{lr} / N`, so that :math:`\eta \nabla\tilde U =
\mathrm{lr}\,(\nabla\bar\ell_B + wd\,\theta)` is an SGD step with learning rate ``lr`` and momentum
:math:`1 - \alpha`, and the noise standard deviation is :math:`\sqrt{2 \alpha\, \mathrm{lr}\, T / N}`.
(The public "Bayesian-Neural-Networks" repository the paper used runs the scale-adapted variant of
Springenberg et al. 2016; this is Chen et al.'s original.)

**Chains.** ``n_modes`` chains run stacked (OptuNet) or one after another (ResNets), chain ``i`` starting
from base model ``i`` when base models are given (as :func:`symlib.posteriors.sampling.run` does), else
from the initialisation of seed ``base_seeds(n_modes, seed)[i]`` (then lengthen the burn-in). Each chain
discards ``burn_in`` epochs, then keeps one sample every ``thin`` epochs (at the end of the epoch),
``n_per_mode`` samples in all. Minibatches and augmentation follow the recipe (the posterior of the
augmented training set, as for the target zoo).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from symlib import train as _train
from symlib.posteriors import sampling
from symlib.posteriors.base import Params, SampleSet, Setup


def step(
    theta: Params,
    v: Params,
    grad_u: Params,
    eta: float,
    alpha: float,
    temperature: float,
    gen: torch.Generator,
) -> tuple[Params, Params]:
    r"""One SGHMC step, in place on new tensors: :math:`v' = (1 - \alpha) v - \eta \nabla\tilde U(\theta)
    + \sqrt{2 \alpha \eta T}\,\xi`, :math:`\theta' = \theta + v'` (Chen et al. 2014, Eq. 15, with
    :math:`\hat\beta = 0`; ``grad_u`` is :math:`\nabla\tilde U` at ``theta``).

    Returns ``(theta', v')``; the inputs are not modified.
    """
    sd = math.sqrt(2.0 * alpha * eta * temperature)
    new_t, new_v = {}, {}
    for k, t in theta.items():
        noise = torch.randn(t.shape, generator=gen, dtype=t.dtype, device=gen.device).to(t.device)
        nv = v[k].mul(1.0 - alpha).sub_(grad_u[k], alpha=eta).add_(noise, alpha=sd)
        new_v[k], new_t[k] = nv, t + nv
    return new_t, new_v


def sample(
    setup: Setup,
    n_modes: int,
    n_per_mode: int,
    seed: int = 0,
    *,
    base: Params | None = None,
    progress: bool = True,
    lr: float | None = None,
    alpha: float = 0.1,
    temperature: float = 1.0,
    burn_in: int | None = None,
    thin: int = 1,
) -> SampleSet:
    """SGHMC chains on the setup's posterior, ``n_per_mode`` thinned samples per chain.

    Args:
        setup: the problem (data ``N``, batches, augmentation, the prior :math:`\\lambda = N\\,wd`).
        n_modes: chains (one per base model when ``base`` is given).
        n_per_mode: samples kept per chain.
        seed: run seed (noise and data streams: :func:`~symlib.posteriors.sampling.stream_seeds`).
        base: stacked base models ``(n_modes, ...)`` to start from (optional; else from initialisation).
        progress: progress bar.
        lr: step size as a per-example learning rate, :math:`\\eta = lr / N` (default: the recipe's final
            learning rate, where the base models ended).
        alpha: friction :math:`\\alpha` (momentum ``1 - alpha``; 0.1).
        temperature: :math:`T` (1: the Bayesian posterior).
        burn_in: epochs discarded first (default: ``recipe.epochs // 2`` from base models, ``recipe.epochs``
            from initialisation).
        thin: epochs between kept samples.

    Returns:
        The samples (``method="sghmc"``), diagnostics: mean training loss of each chain over the kept part.
    """
    sampling.check_sizes(n_modes, n_per_mode)
    rec = setup.recipe
    lr = rec.lr_at(rec.epochs - 1) if lr is None else lr
    sampling.check_positive(lr=lr, temperature=temperature, thin=thin)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"friction alpha must be in (0, 1], got {alpha!r}")
    if rec.weight_decay <= 0:
        raise ValueError(
            f"SGHMC needs a proper Gaussian prior, but the recipe's weight decay (prior precision / N) is "
            f"{rec.weight_decay}; use a recipe with weight_decay > 0"
        )
    from_base = base is not None
    if from_base:
        base = sampling.check_base(setup, base, n_modes, "sghmc")
    burn_in = (max(1, rec.epochs // 2) if from_base else rec.epochs) if burn_in is None else burn_in
    if isinstance(burn_in, bool) or not isinstance(burn_in, int) or burn_in < 0:
        raise ValueError(f"burn_in must be a non-negative number of epochs, got {burn_in!r}")
    if isinstance(thin, bool) or not isinstance(thin, int):
        raise ValueError(f"thin must be a positive number of epochs, got {thin!r}")
    n_train = setup.n_train
    eta = lr / n_train
    chain_seeds = sampling.base_seeds(n_modes, seed)
    *data_seeds, noise_seed = sampling.stream_seeds(n_modes + 1, seed, "sghmc")
    epochs = burn_in + thin * n_per_mode
    keep = {burn_in + thin * (j + 1) - 1 for j in range(n_per_mode)}  # epochs after which to keep
    gen = sampling.generator(noise_seed, setup.device)
    from symlib.progress import bar

    steps = epochs * -(-n_train // rec.batch_size)
    kept: list[Params] = []
    losses: list[float] = []
    if setup.arch == "optunet":
        if from_base:
            theta = {k: base[k].clone() for k in _train.OPTUNET_SHAPES}
        else:
            theta = sampling.init_stacked(setup, chain_seeds)
        v = {k: torch.zeros_like(t) for k, t in theta.items()}
        run = torch.zeros(n_modes, dtype=torch.float64)
        cnt = 0
        with bar(steps, f"sghmc ({n_modes} chains stacked)", enabled=progress, unit="step") as pb:
            for b in _train.minibatches(data_seeds, setup.x, setup.y, rec, setup.fill[0], epochs=epochs):
                loss, grads = _train.loss_and_grads(theta, b.x, b.y, "optunet")
                sampling.check_finite_loss(loss, b.step, chain_seeds, "sghmc")
                grad_u = {k: (grads[k] + rec.weight_decay * theta[k]) * n_train for k in theta}
                theta, v = step(theta, v, grad_u, eta, alpha, temperature, gen)
                if b.epoch >= burn_in:
                    run += loss.detach().double().cpu()
                    cnt += 1
                if b.last_in_epoch and b.epoch in keep:
                    kept.append({k: t.clone() for k, t in theta.items()})
                pb.update(1)
        for t in theta.values():
            if not torch.isfinite(t).all():
                raise FloatingPointError("sghmc: the chains diverged (non-finite weights); lower lr")
        losses = (run / max(cnt, 1)).tolist()
        # kept: n_per_mode dicts of (M, ...) -> mode-major (M * n_per_mode, ...)
        params = {k: torch.stack([s[k] for s in kept], 1).flatten(0, 1) for k in kept[0]}
    else:
        per_chain = []
        with bar(steps * n_modes, "sghmc (chains one by one)", enabled=progress, unit="step") as pb:
            for i in range(n_modes):
                if from_base:
                    model = sampling.new_module(setup, sampling.unstack(base, i))
                else:
                    model = sampling.new_module(setup, seed=chain_seeds[i])
                model.train()
                names = [k for k, _ in model.named_parameters()]
                v = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
                samples_i, run, cnt = [], 0.0, 0
                for b in _train.minibatches(
                    [data_seeds[i]], setup.x, setup.y, rec, setup.fill, epochs=epochs
                ):
                    model.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(model(b.x[0]), b.y[0])
                    sampling.check_finite_loss(loss, b.step, [chain_seeds[i]], "sghmc")
                    loss.backward()
                    with torch.no_grad():
                        ps = dict(model.named_parameters())
                        theta = {k: ps[k].detach() for k in names}
                        grad_u = {k: (ps[k].grad + rec.weight_decay * theta[k]) * n_train for k in names}
                        new_t, v = step(theta, v, grad_u, eta, alpha, temperature, gen)
                        for k in names:
                            ps[k].copy_(new_t[k])
                    if b.epoch >= burn_in:
                        run, cnt = run + float(loss.detach()), cnt + 1
                    if b.last_in_epoch and b.epoch in keep:
                        samples_i.append(sampling.state_of(model))
                    pb.update(1)
                per_chain.extend(samples_i)
                losses.append(run / max(cnt, 1))
        params = sampling.stack(per_chain)
    return SampleSet(
        params=params,
        method="sghmc",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper={
            "lr": lr,
            "eta": eta,
            "alpha": alpha,
            "temperature": temperature,
            "burn_in_epochs": burn_in,
            "thin_epochs": thin,
            "prior_precision": setup.prior_precision,
            "n_train": n_train,
            "batch_size": rec.batch_size,
            "start": "base models" if from_base else "initialisation",
            "noise_std": math.sqrt(2.0 * alpha * eta * temperature),
        },
        diagnostics={"mean_loss_after_burn_in": losses},
    )
