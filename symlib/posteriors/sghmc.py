r"""Stochastic-gradient Hamiltonian Monte Carlo (Chen et al. 2014; book: chapter "Table 1", paper §4).

**Target.** The full-data posterior at temperature :math:`T` (``T = 1``: the Bayesian posterior),
:math:`p_T(\theta \mid D) \propto \exp(-U(\theta) / T)` with

.. math:: U(\theta) = \sum_{n=1}^{N} \ell(\theta; x_n, y_n) + \tfrac{\lambda}{2}\lVert\theta\rVert^2,
          \qquad \lambda = N \cdot wd,

the Gaussian prior :math:`\mathcal N(0, \lambda^{-1} I)` that matches the recipe's weight decay
(:attr:`~symlib.posteriors.base.Setup.prior_precision`), and the minibatch estimate
:math:`\nabla\tilde U = N\,(\nabla \bar\ell_B + wd\,\theta)` (the batch mean gradient scaled by ``N``).

**Sampler.** Chen et al. (2014), Eq. 15, with mass :math:`M = I`, friction :math:`\alpha` and a noise
estimate :math:`\hat B = \eta \hat V / 2`:

.. math:: \theta \leftarrow \theta + v, \qquad
          v \leftarrow (1 - \alpha)\, v - \eta\, \nabla\tilde U(\theta) + \mathcal N(0,\ q),
          \qquad q_i = \max(0,\ 2 \alpha \eta T - \eta^2 \hat V_i).

The minibatch gradient carries noise of its own, of variance :math:`V_i` per coordinate, which heats the
chain to the effective temperature :math:`T_{\mathrm{eff}} = \overline{(q_i + \eta^2 V_i) / (2\alpha\eta)}`
(:mod:`symlib.posteriors.temperature`). Two settings (``setting``):

* ``"corrected"`` (the default): Chen et al.'s correction with :math:`\hat V` measured per chain from
  ``noise_batches`` fresh minibatches (with the recipe's crops, as the sampler draws them) at the start
  of every epoch, and friction :math:`\alpha = 0.3`. Measured at the ten cpu-scale base models of
  MNIST-OptuNet: :math:`T_{\mathrm{eff}}` 0.97-1.04 (crops), where :math:`\alpha = 0.1` with the correction
  stays at 1.20-1.44 (the noise of many coordinates exceeds what the friction can absorb, :math:`q_i`
  clips at 0) and :math:`\alpha = 0.5` without it at 1.13-1.22.
* ``"paper"``: no correction (:math:`\hat V = 0`, the injected noise exactly
  :math:`\sqrt{2 \alpha \eta T}`), :math:`\alpha = 0.1`: :math:`T_{\mathrm{eff}}` 1.65-2.09 with the crops
  (1.48-1.81 without), not the stated 1.

Both take the recipe's final learning rate by default; every set records, per chain, the effective
temperature measured at every kept sample from an independent set of ``noise_batches`` minibatches, and
the kinetic temperature :math:`\overline{v^2} / \eta` of the velocities after burn-in.

We write :math:`\eta = \mathrm{lr} / N`, so that :math:`\eta \nabla\tilde U =
\mathrm{lr}\,(\nabla\bar\ell_B + wd\,\theta)` is an SGD step with learning rate ``lr`` and momentum
:math:`1 - \alpha`, and the noise standard deviation is :math:`\sqrt{2 \alpha\, \mathrm{lr}\, T / N}`.
(The public "Bayesian-Neural-Networks" repository the paper used runs the scale-adapted variant of
Springenberg et al. 2016; this is Chen et al.'s original.)

**Chains.** ``n_modes`` chains run stacked (OptuNet) or one after another (ResNets), chain ``i`` starting
from base model ``i`` when base models are given (as :func:`symlib.posteriors.sampling.run` does), else
from the initialisation of seed ``base_seeds(n_modes, seed)[i]`` (then lengthen the burn-in). Each chain
discards ``burn_in`` epochs, then keeps one sample every ``thin`` epochs (at the end of the epoch),
``n_per_mode`` samples in all. Every step draws its minibatch independently (``batch_size`` images with
replacement, each with its own random crop of the recipe: :func:`symlib.posteriors.temperature.iid_batches`),
so that the gradient noise of successive steps is independent, as the correction and the effective
temperature assume; an "epoch" is ``ceil(N / batch_size)`` steps. The target is the posterior of the
augmented training set (the expected loss over the crops), as for the target zoo.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from symlib import training as _train
from symlib.params import Params, flatten, stack, state_of, unflatten, unstack
from symlib.posteriors import temperature as _temp
from symlib.posteriors.base import Method, Request, SampleSet, check_positive, reference_state
from symlib.posteriors.modules import init_stacked, new_module
from symlib.posteriors.seeds import base_seeds, generator, stream_seeds
from symlib.progress import bar
from symlib.training import loop
from symlib.training.plans import check_images

__all__ = ["METHOD", "SETTINGS", "sample", "step"]

SETTINGS = {
    "corrected": {"alpha": 0.3, "correction": True},
    "paper": {"alpha": 0.1, "correction": False},
}
"""Named settings of :func:`sample` (``setting=``): friction and whether the gradient noise is corrected."""


def step(
    theta: Params,
    v: Params,
    grad_u: Params,
    eta: float,
    alpha: float,
    temperature: float,
    gen: torch.Generator,
    noise_var: Params | None = None,
) -> tuple[Params, Params]:
    r"""One SGHMC step, in place on new tensors: :math:`v' = (1 - \alpha) v - \eta \nabla\tilde U(\theta)
    + \sqrt{q}\,\xi`, :math:`\theta' = \theta + v'` (Chen et al. 2014, Eq. 15; ``grad_u`` is
    :math:`\nabla\tilde U` at ``theta``), with :math:`q = 2 \alpha \eta T` or, given the gradient-noise
    estimate ``noise_var`` :math:`= \hat V` (same shapes as ``theta``), the corrected
    :math:`q = \max(0, 2 \alpha \eta T - \eta^2 \hat V)`.

    Returns ``(theta', v')``; the inputs are not modified.
    """
    sd = math.sqrt(2.0 * alpha * eta * temperature)
    new_t, new_v = {}, {}
    for k, t in theta.items():
        noise = torch.randn(t.shape, generator=gen, dtype=t.dtype, device=gen.device).to(t.device)
        nv = v[k].mul(1.0 - alpha).sub_(grad_u[k], alpha=eta)
        if noise_var is None:
            nv.add_(noise, alpha=sd)
        else:
            q = (2.0 * alpha * eta * temperature - eta**2 * noise_var[k].to(t.dtype)).clamp_min(0.0)
            nv.add_(noise * q.sqrt())
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
    noise_var: Params | None = None  # the correction's estimate, refreshed every epoch

    def step(self, state: tuple[Params, Params], b: _train.Batch):
        theta, v = state
        loss, grads = _train.loss_and_grads(theta, b.x, b.y, self.arch)
        grad_u = {k: (grads[k] + self.weight_decay * theta[k]) * self.n_train for k in theta}
        return step(theta, v, grad_u, self.eta, self.alpha, self.temperature, self.gen, self.noise_var), loss


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
            new_t, v = step(theta, v, grad_u, self.eta, self.alpha, self.temperature, self.gen,
                            self.noise_var)
            for k, p in ps.items():
                p.copy_(new_t[k])
        return (model, v), loss.detach().reshape(1)


def _walk(rule, state, seed: int, m: int, setup, epochs: int, on_step, pb):
    """Apply the SGHMC ``rule`` to ``m`` stacked chains over independent minibatches
    (:func:`symlib.posteriors.temperature.iid_batches`, generator seeded ``seed``), ``epochs`` epochs."""
    check_images(setup.x, "sghmc")
    gen = torch.Generator().manual_seed(int(seed) % (2**63))
    for b in _temp.iid_batches(gen, m, setup.x, setup.y, setup.recipe, setup.fill, epochs):
        state, loss = rule.step(state, b)
        loop.check_finite_loss(loss, b.step, list(range(m)), "sghmc")
        on_step(b, state, loss)
        pb.update(1)
    return state


class _Thermometer:
    """The correction's gradient-noise estimate (refreshed every epoch) and the measurement of the effective
    and kinetic temperatures of stacked chains (:mod:`symlib.posteriors.temperature`)."""

    def __init__(self, setup, seeds: list[int], n_batches: int, correction: bool, eta: float, alpha: float,
                 temperature: float, names: list[str] | None = None):
        self.setup, self.seeds, self.k, self.names = setup, seeds, n_batches, names
        self.correction, self.eta, self.alpha, self.t = correction, eta, alpha, temperature
        self.t_eff: list[torch.Tensor] = []
        self.v2 = None
        self.n_v2 = 0

    def noise(self, theta: Params, epoch: int, purpose: int) -> torch.Tensor:
        """``(M, D)`` gradient-noise variances at ``theta``, from minibatches of stream ``(epoch, purpose)``
        (0: the correction's estimate, 1: the measurement, independent of it)."""
        off = (2 * epoch + purpose) * 1000
        return _temp.gradient_noise(self.setup, theta, [s + off for s in self.seeds], self.k)

    def estimate(self, theta: Params, epoch: int) -> Params | None:
        """The correction's :math:`\\hat V` as tensors shaped like ``theta``, or ``None`` (no correction)."""
        if not self.correction:
            return None
        v = self.noise(theta, epoch, 0)
        shapes = {k: tuple(theta[k].shape[1:]) for k in (self.names or theta)}
        return {k: t.to(theta[k].dtype) for k, t in unflatten(v, shapes).items()}

    def measure(self, theta: Params, epoch: int, noise_var: Params | None) -> None:
        """Record :math:`T_{\\mathrm{eff}}` of every chain at ``theta``."""
        nv = None if noise_var is None else flatten(noise_var).double()
        noise = self.noise(theta, epoch, 1)
        self.t_eff.append(_temp.effective_temperature(noise, self.eta, self.alpha, self.t, nv))

    def velocity(self, v: Params) -> None:
        """Accumulate :math:`v^2 / \\eta` of every chain (after burn-in)."""
        t = _temp.kinetic_temperature(v, self.eta)
        self.v2 = t if self.v2 is None else self.v2 + t
        self.n_v2 += 1

    def results(self) -> dict[str, list[float]]:
        te = torch.stack(self.t_eff) if self.t_eff else None
        return {
            "effective_temperature": te.mean(0).tolist() if te is not None else [],
            "effective_temperature_min": te.min(0).values.tolist() if te is not None else [],
            "effective_temperature_max": te.max(0).values.tolist() if te is not None else [],
            "kinetic_temperature": (self.v2 / max(self.n_v2, 1)).tolist() if self.v2 is not None else [],
        }


def _check(*, setting: str = "corrected", lr: float | None = None, alpha: float | None = None,
           noise_batches: int = 16, temperature: float = 1.0, burn_in: int | None = None, thin: int = 1,
           **_: object) -> None:
    """The values of SGHMC's hyper-parameters (``None``: a default of the setup, checked when drawing)."""
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {sorted(SETTINGS)}, got {setting!r}")
    check_positive(**({"lr": lr} if lr is not None else {}), temperature=temperature, thin=thin)
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, int | float)
                              or not 0.0 < alpha <= 1.0):
        raise ValueError(f"friction alpha must be in (0, 1], got {alpha!r}")
    if isinstance(noise_batches, bool) or not isinstance(noise_batches, int) or noise_batches < 2:
        raise ValueError(f"noise_batches must be an integer >= 2, got {noise_batches!r}")
    if burn_in is not None and (isinstance(burn_in, bool) or not isinstance(burn_in, int) or burn_in < 0):
        raise ValueError(f"burn_in must be a non-negative number of epochs, got {burn_in!r}")
    if isinstance(thin, bool) or not isinstance(thin, int):
        raise ValueError(f"thin must be a positive number of epochs, got {thin!r}")


@dataclasses.dataclass
class _Plan:
    """One SGHMC draw's resolved settings (:func:`_plan`).

    Attributes:
        lr, alpha, correction, noise_batches, temperature: as :func:`_draw`'s, defaults resolved.
        eta: the step size :math:`\\eta = lr / N`.
        from_base: whether the chains start from the base models.
        burn_in: epochs discarded first; epochs: all of them, ``burn_in + thin * n_per_mode``.
        keep: the epochs after which a sample is kept.
        steps: the steps of one chain, ``epochs * ceil(N / batch_size)``.
        chain_seeds: the initialisations' seeds (without base models); data_seeds: one per chain, of its
            minibatches; thermo_seeds: one per chain, of the gradient-noise estimates.
        rule_args: the SGHMC rule's arguments (its noise generator included).
    """

    lr: float
    alpha: float
    correction: bool
    noise_batches: int
    temperature: float
    eta: float
    from_base: bool
    burn_in: int
    epochs: int
    keep: set[int]
    steps: int
    chain_seeds: list[int]
    data_seeds: list[int]
    thermo_seeds: list[int]
    rule_args: dict[str, Any]


def _plan(req: Request, setting: str, lr: float | None, alpha: float | None, correction: bool | None,
          noise_batches: int, temperature: float, burn_in: int | None, thin: int) -> _Plan:
    """The :class:`_Plan` of a draw: the setting's friction and correction unless overridden, the
    recipe's final learning rate by default, the burn-in's default, the schedule of epochs and the
    random streams (:func:`~symlib.posteriors.seeds.stream_seeds`).

    Raises:
        ValueError: a recipe without weight decay (no proper Gaussian prior), or a non-positive ``lr``.
    """
    setup, n_modes, n_per_mode = req.setup, req.n_modes, req.n_per_mode
    alpha = SETTINGS[setting]["alpha"] if alpha is None else alpha
    correction = SETTINGS[setting]["correction"] if correction is None else bool(correction)
    rec = setup.recipe
    lr = rec.lr_at(rec.epochs - 1) if lr is None else lr
    check_positive(lr=lr)
    if rec.weight_decay <= 0:
        raise ValueError(
            f"SGHMC needs a proper Gaussian prior, but the recipe's weight decay (prior precision / N) is "
            f"{rec.weight_decay}; use a recipe with weight_decay > 0"
        )
    from_base = req.base is not None
    burn_in = (max(1, rec.epochs // 2) if from_base else rec.epochs) if burn_in is None else burn_in
    n_train = setup.n_train
    eta = lr / n_train
    chain_seeds = base_seeds(n_modes, req.seed)
    *data_seeds, noise_seed = stream_seeds(n_modes + 1, req.seed, "sghmc")
    thermo_seeds = stream_seeds(n_modes, req.seed, "sghmc-gradient-noise")
    epochs = burn_in + thin * n_per_mode
    keep = {burn_in + thin * (j + 1) - 1 for j in range(n_per_mode)}  # epochs after which to keep
    gen = generator(noise_seed, setup.device)
    steps = epochs * -(-n_train // rec.batch_size)
    rule_args = dict(n_train=n_train, weight_decay=rec.weight_decay, eta=eta, alpha=alpha,
                     temperature=temperature, gen=gen)
    return _Plan(lr, alpha, correction, noise_batches, temperature, eta, from_base, burn_in, epochs, keep,
                 steps, chain_seeds, data_seeds, thermo_seeds, rule_args)


def _stacked_chains(req: Request, plan: _Plan) -> tuple[Params, list[float], dict[str, list[float]]]:
    """All chains at once on stacked parameters (architectures of :data:`symlib.training.STACKED_GRADS`).

    Returns:
        The kept samples, mode-major ``{name: (n_modes * n_per_mode, ...)}``; the mean training loss of
        each chain after burn-in; the temperatures of :meth:`_Thermometer.results`.

    Raises:
        FloatingPointError: the chains diverged.
    """
    setup, n_modes = req.setup, req.n_modes
    if plan.from_base:
        theta = {k: req.base[k].clone() for k in reference_state(setup)}
    else:
        theta = init_stacked(setup, plan.chain_seeds)
    thermo = _Thermometer(setup, plan.thermo_seeds, plan.noise_batches, plan.correction, plan.eta,
                          plan.alpha, plan.temperature)
    rule = _Stacked(**plan.rule_args, arch=setup.arch, noise_var=thermo.estimate(theta, 0))
    kept: list[Params] = []
    run = torch.zeros(n_modes, dtype=torch.float64)
    cnt = [0]

    def record(b: _train.Batch, state, loss: torch.Tensor) -> None:
        if b.epoch >= plan.burn_in:
            run.add_(loss.detach().double().cpu())
            cnt[0] += 1
            thermo.velocity(state[1])
        if b.last_in_epoch:
            if b.epoch in plan.keep:
                kept.append({k: t.clone() for k, t in state[0].items()})
                thermo.measure(state[0], b.epoch, rule.noise_var)
            if b.epoch + 1 < plan.epochs:
                rule.noise_var = thermo.estimate(state[0], b.epoch + 1)

    state = (theta, {k: torch.zeros_like(t) for k, t in theta.items()})
    with bar(plan.steps, f"sghmc ({n_modes} chains stacked)", enabled=req.progress, unit="step") as pb:
        theta, _ = _walk(rule, state, plan.data_seeds[0], n_modes, setup, plan.epochs, record, pb)
    for t in theta.values():
        if not torch.isfinite(t).all():
            raise FloatingPointError("sghmc: the chains diverged (non-finite weights); lower lr")
    losses = (run / max(cnt[0], 1)).tolist()
    # kept: n_per_mode dicts of (M, ...) -> mode-major (M * n_per_mode, ...)
    params = {k: torch.stack([s[k] for s in kept], 1).flatten(0, 1) for k in kept[0]}
    return params, losses, thermo.results()


def _module_chain(req: Request, plan: _Plan, i: int,
                  pb) -> tuple[list[Params], float, dict[str, list[float]]]:
    """Chain ``i`` on one ``nn.Module`` (gradients by autograd), from base model ``i`` or the
    initialisation of its seed.

    Returns:
        Its kept samples (whole state dicts, buffers included), its mean training loss after burn-in and
        its temperatures (:meth:`_Thermometer.results`, one chain).
    """
    setup = req.setup
    if plan.from_base:
        model = new_module(setup, unstack(req.base, i))
    else:
        model = new_module(setup, seed=plan.chain_seeds[i])
    model.train()
    thermo = _Thermometer(setup, [plan.thermo_seeds[i]], plan.noise_batches, plan.correction, plan.eta,
                          plan.alpha, plan.temperature, names=[k for k, _ in model.named_parameters()])

    def params_of(m):  # the whole state (buffers too), as one stacked model
        return {k: v[None] for k, v in state_of(m).items()}

    def squeeze(nv):
        return None if nv is None else {k: t[0] for k, t in nv.items()}

    rule = _Module(**plan.rule_args, noise_var=squeeze(thermo.estimate(params_of(model), 0)))
    samples, acc = [], [0.0, 0]

    def record(b: _train.Batch, state, loss: torch.Tensor) -> None:
        if b.epoch >= plan.burn_in:
            acc[0], acc[1] = acc[0] + float(loss), acc[1] + 1
            thermo.velocity({k: t[None] for k, t in state[1].items()})
        if b.last_in_epoch:
            p = params_of(state[0])
            if b.epoch in plan.keep:
                samples.append(state_of(state[0]))
                nv = rule.noise_var
                nv = None if nv is None else {k: t[None] for k, t in nv.items()}
                thermo.measure(p, b.epoch, nv)
            if b.epoch + 1 < plan.epochs:
                rule.noise_var = squeeze(thermo.estimate(p, b.epoch + 1))

    v = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    _walk(rule, (model, v), plan.data_seeds[i], 1, setup, plan.epochs, record, pb)
    return samples, acc[0] / max(acc[1], 1), thermo.results()


def _module_chains(req: Request, plan: _Plan) -> tuple[Params, list[float], dict[str, list[float]]]:
    """The chains one after another (:func:`_module_chain`), for architectures without stacked gradients.

    Returns:
        As :func:`_stacked_chains`: the samples mode-major, each chain's mean loss, its temperatures.
    """
    per_chain, losses, chain_temps = [], [], []
    with bar(plan.steps * req.n_modes, "sghmc (chains one by one)", enabled=req.progress, unit="step") as pb:
        for i in range(req.n_modes):
            samples, loss, temps = _module_chain(req, plan, i, pb)
            per_chain.extend(samples)
            losses.append(loss)
            chain_temps.append(temps)
    temps = {k: [t[k][0] for t in chain_temps if t[k]] for k in chain_temps[0]}
    return stack(per_chain), losses, temps


def _draw(
    req: Request,
    *,
    setting: str = "corrected",
    lr: float | None = None,
    alpha: float | None = None,
    correction: bool | None = None,
    noise_batches: int = 16,
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
        setting: ``"corrected"`` (default: gradient-noise correction, friction 0.3) or ``"paper"`` (no
            correction, friction 0.1), :data:`SETTINGS`; ``alpha`` and ``correction`` override it.
        lr: step size as a per-example learning rate, :math:`\\eta = lr / N` (default: the recipe's final
            learning rate, where the base models ended).
        alpha: friction :math:`\\alpha` (momentum ``1 - alpha``).
        correction: subtract the measured gradient noise from the injected noise (Chen et al. 2014).
        noise_batches: minibatches per estimate of the gradient noise (the correction's, every epoch, and
            the temperature measurement's, at every kept sample).
        temperature: :math:`T` (1: the Bayesian posterior).
        burn_in: epochs discarded first (default: ``recipe.epochs // 2`` from base models, ``recipe.epochs``
            from initialisation).
        thin: epochs between kept samples.

    Returns:
        The samples (``method="sghmc"``); diagnostics per chain: the mean training loss over the kept part,
        the effective temperature (mean, min and max over the kept samples) and the kinetic temperature.
    """
    setup = req.setup
    _check(setting=setting, lr=lr, alpha=alpha, noise_batches=noise_batches, temperature=temperature,
           burn_in=burn_in, thin=thin)
    plan = _plan(req, setting, lr, alpha, correction, noise_batches, temperature, burn_in, thin)
    chains = _stacked_chains if setup.arch in _train.STACKED_GRADS else _module_chains
    params, losses, temps = chains(req, plan)
    rec = setup.recipe
    return SampleSet(
        params=params,
        method="sghmc",
        n_modes=req.n_modes,
        n_per_mode=req.n_per_mode,
        hyper={
            "setting": setting,
            "lr": plan.lr,
            "eta": plan.eta,
            "alpha": plan.alpha,
            "correction": plan.correction,
            "noise_batches": noise_batches,
            "temperature": temperature,
            "burn_in_epochs": plan.burn_in,
            "thin_epochs": thin,
            "prior_precision": setup.prior_precision,
            "n_train": setup.n_train,
            "batch_size": rec.batch_size,
            "crop_padding": rec.crop_padding,
            "start": "base models" if plan.from_base else "initialisation",
            "noise_std": math.sqrt(2.0 * plan.alpha * plan.eta * temperature),
        },
        diagnostics={"mean_loss_after_burn_in": losses, **temps},
    )


METHOD = Method("sghmc", _draw, base="optional", check=_check)
sample = METHOD.sampler()
