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

import dataclasses
import math

import torch
import torch.nn.functional as F

from symlib import training as _train
from symlib.params import Params, stack, state_of, unstack
from symlib.posteriors.base import Method, Request, SampleSet, check_positive
from symlib.posteriors.modules import init_stacked, new_module
from symlib.posteriors.seeds import base_seeds, generator, stream_seeds
from symlib.progress import bar
from symlib.training import loop

__all__ = ["METHOD", "sample", "step"]


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


@dataclasses.dataclass
class _Stacked:
    """The SGHMC rule of stacked chains for :func:`symlib.training.loop.run`; state ``(theta, v)``."""

    n_train: int
    weight_decay: float
    eta: float
    alpha: float
    temperature: float
    gen: torch.Generator
    arch: str = "optunet"

    def step(self, state: tuple[Params, Params], b: _train.Batch):
        theta, v = state
        loss, grads = _train.loss_and_grads(theta, b.x, b.y, self.arch)
        grad_u = {k: (grads[k] + self.weight_decay * theta[k]) * self.n_train for k in theta}
        return step(theta, v, grad_u, self.eta, self.alpha, self.temperature, self.gen), loss


@dataclasses.dataclass
class _Module(_Stacked):
    """The same rule on one ``nn.Module`` (gradients by autograd); state: the module and ``v``."""

    def step(self, state, b: _train.Batch):
        model, v = state
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(b.x[0]), b.y[0])
        if not bool(torch.isfinite(loss)):
            return (model, v), loss.detach().reshape(1)
        loss.backward()
        with torch.no_grad():
            ps = dict(model.named_parameters())
            theta = {k: p.detach() for k, p in ps.items()}
            grad_u = {k: (ps[k].grad + self.weight_decay * theta[k]) * self.n_train for k in ps}
            new_t, v = step(theta, v, grad_u, self.eta, self.alpha, self.temperature, self.gen)
            for k, p in ps.items():
                p.copy_(new_t[k])
        return (model, v), loss.detach().reshape(1)


def _draw(
    req: Request,
    *,
    lr: float | None = None,
    alpha: float = 0.1,
    temperature: float = 1.0,
    burn_in: int | None = None,
    thin: int = 1,
) -> SampleSet:
    """SGHMC chains on the setup's posterior, ``n_per_mode`` thinned samples per chain.

    The chains start from the base models when given (one chain per base model), else from the
    initialisation of ``base_seeds(n_modes, seed)``; their noise and data orders come from
    :func:`~symlib.posteriors.seeds.stream_seeds`. The posterior is the setup's: data ``N``, batches,
    augmentation and the prior :math:`\\lambda = N\\,wd`.

    Args:
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
    setup, n_modes, n_per_mode, base = req.setup, req.n_modes, req.n_per_mode, req.base
    rec = setup.recipe
    lr = rec.lr_at(rec.epochs - 1) if lr is None else lr
    check_positive(lr=lr, temperature=temperature, thin=thin)
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"friction alpha must be in (0, 1], got {alpha!r}")
    if rec.weight_decay <= 0:
        raise ValueError(
            f"SGHMC needs a proper Gaussian prior, but the recipe's weight decay (prior precision / N) is "
            f"{rec.weight_decay}; use a recipe with weight_decay > 0"
        )
    from_base = base is not None
    burn_in = (max(1, rec.epochs // 2) if from_base else rec.epochs) if burn_in is None else burn_in
    if isinstance(burn_in, bool) or not isinstance(burn_in, int) or burn_in < 0:
        raise ValueError(f"burn_in must be a non-negative number of epochs, got {burn_in!r}")
    if isinstance(thin, bool) or not isinstance(thin, int):
        raise ValueError(f"thin must be a positive number of epochs, got {thin!r}")
    n_train = setup.n_train
    eta = lr / n_train
    chain_seeds = base_seeds(n_modes, req.seed)
    *data_seeds, noise_seed = stream_seeds(n_modes + 1, req.seed, "sghmc")
    epochs = burn_in + thin * n_per_mode
    keep = {burn_in + thin * (j + 1) - 1 for j in range(n_per_mode)}  # epochs after which to keep
    gen = generator(noise_seed, setup.device)
    steps = epochs * -(-n_train // rec.batch_size)
    rule_args = dict(n_train=n_train, weight_decay=rec.weight_decay, eta=eta, alpha=alpha,
                     temperature=temperature, gen=gen)
    if setup.arch in _train.STACKED_GRADS:
        if from_base:
            theta = {k: base[k].clone() for k in _train.OPTUNET_SHAPES}
        else:
            theta = init_stacked(setup, chain_seeds)
        kept: list[Params] = []
        run = torch.zeros(n_modes, dtype=torch.float64)
        cnt = [0]

        def record(b: _train.Batch, state, loss: torch.Tensor) -> None:
            if b.epoch >= burn_in:
                run.add_(loss.detach().double().cpu())
                cnt[0] += 1
            if b.last_in_epoch and b.epoch in keep:
                kept.append({k: t.clone() for k, t in state[0].items()})

        state = (theta, {k: torch.zeros_like(t) for k, t in theta.items()})
        with bar(steps, f"sghmc ({n_modes} chains stacked)", enabled=req.progress, unit="step") as pb:
            theta, _ = loop.run(_Stacked(**rule_args, arch=setup.arch), state, data_seeds, setup.x, setup.y,
                                rec, fill=setup.fill[0], epochs=epochs, what="sghmc", on_step=record, bar=pb)
        for t in theta.values():
            if not torch.isfinite(t).all():
                raise FloatingPointError("sghmc: the chains diverged (non-finite weights); lower lr")
        losses = (run / max(cnt[0], 1)).tolist()
        # kept: n_per_mode dicts of (M, ...) -> mode-major (M * n_per_mode, ...)
        params = {k: torch.stack([s[k] for s in kept], 1).flatten(0, 1) for k in kept[0]}
    else:
        per_chain, losses = [], []
        with bar(steps * n_modes, "sghmc (chains one by one)", enabled=req.progress, unit="step") as pb:
            for i in range(n_modes):
                if from_base:
                    model = new_module(setup, unstack(base, i))
                else:
                    model = new_module(setup, seed=chain_seeds[i])
                model.train()
                samples_i, acc = [], [0.0, 0]

                def record(b: _train.Batch, state, loss: torch.Tensor, samples_i=samples_i, acc=acc) -> None:
                    if b.epoch >= burn_in:
                        acc[0], acc[1] = acc[0] + float(loss), acc[1] + 1
                    if b.last_in_epoch and b.epoch in keep:
                        samples_i.append(state_of(state[0]))

                v = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
                loop.run(_Module(**rule_args), (model, v), [data_seeds[i]], setup.x, setup.y, rec,
                         fill=setup.fill, epochs=epochs, what="sghmc", on_step=record, bar=pb)
                per_chain.extend(samples_i)
                losses.append(acc[0] / max(acc[1], 1))
        params = stack(per_chain)
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


METHOD = Method("sghmc", _draw, base="optional")
sample = METHOD.sampler()
