r"""Full-batch Hamiltonian Monte Carlo, the reference posterior sampler (book: chapter "Table 1").

Beyond the paper (its reviewers asked how the approximations compare with a true posterior sampler):
Metropolis-corrected HMC (Neal 2011) on the posterior of the weights at temperature 1,

.. math:: p(\theta \mid D) \propto \exp(-U(\theta)), \qquad
          U(\theta) = N \bar L(\theta) + \tfrac{\lambda}{2} \lVert\theta\rVert^2,

with :math:`\bar L` the mean cross-entropy over all :math:`N` training images (no mini-batches, no
augmentation) and :math:`\lambda` = :attr:`Setup.prior_precision` (:math:`N \cdot wd`), the same Gaussian
prior as SGHMC. Several chains run **stacked**: one call of :func:`symlib.training.stacked.loss_and_grads`
per data chunk gives the gradient of every chain (OptuNet); other architectures without BatchNorm go through
``torch.func`` (``vmap`` of ``grad`` of ``functional_call``).

Chain ``i`` starts from base model ``i`` (given, or trained here with the setup's recipe by
:func:`symlib.training.stacked.train_stacked`), optionally polished by a few epochs of SGD on :math:`U / N`
without augmentation (``polish_epochs``, part of the burn-in). The sampler (:func:`run_chains`), per chain:

* identity mass matrix; momenta :math:`p \sim \mathcal N(0, I)`, Hamiltonian :math:`H = U + |p|^2 / 2`;
* leapfrog (:func:`leapfrog`) with a fixed number of steps ``n_leapfrog`` per trajectory;
* warm-up: the initial step size from Hoffman & Gelman's (2014, Alg. 4) doubling/halving heuristic,
  then dual averaging (their Alg. 5: :math:`\gamma = 0.05, t_0 = 10, \kappa = 0.75`,
  :math:`\mu = \log 10 \epsilon_0`) of the step size towards ``target_accept`` (default 0.75) on the
  Metropolis acceptance probability :math:`\min(1, e^{-\Delta H})`; warm-up draws are discarded;
* sampling: the step size frozen at its averaged value :math:`\bar\epsilon`, jittered uniformly by
  :math:`\pm` ``jitter`` (10 %) per trajectory (avoids periodic trajectories), keep every ``thin``-th state;
* a trajectory whose energy error exceeds 1000 or is not finite is *divergent* (Stan's convention) and
  is rejected; divergences are counted per chain.

Diagnostics (:mod:`symlib.stats.diagnostics`): rank-normalised split R-hat and bulk ESS per
weight (max/median, min/median), the same for the potential :math:`U` (invariant under the weight-space
symmetries: chains that sit in permuted copies of one mode have a weight R-hat far above 1 even when each
chain mixes well, so the potential's R-hat is the meaningful convergence check of a multi-modal
posterior; its per-chain split value separates drift within a chain from chains resting in modes of
different depth), acceptance rate and divergences per chain, the step sizes, the trajectory length, the
gradient evaluations and the seconds.
"""


from __future__ import annotations

import dataclasses
import warnings

import torch

from symlib import progress as _progress
from symlib import scales as _scales
from symlib import training as _train
from symlib.params import Params, flatten, unflatten
from symlib.posteriors.base import Method, Request, SampleSet, Setup
from symlib.posteriors.hmc.sampler import (
    DIVERGENCE,
    Config,
    HMCResult,
    Potential,
    check_precision,
    leapfrog,
    module_potential,
    run_chains,
    stacked_potential,
)

__all__ = [
    "DIVERGENCE",
    "METHOD",
    "PRESETS",
    "Config",
    "HMCResult",
    "Potential",
    "leapfrog",
    "module_potential",
    "preset",
    "run_chains",
    "sample",
    "stacked_potential",
]




# tiny: a smoke test. cpu: the book's reference sample, 4 chains x 25 draws from 4 SGD base models, chosen
# from measurements on 2 cores: one full-batch gradient (4,000 embedded digits) of 4 stacked chains takes
# 0.45-0.8 s on a quiet machine (3.2 s with 8 jobs sharing the cores), and a run costs
# 1 + (step-size search) + (n_warmup + 25 * thin) * n_leapfrog = 337 gradients, i.e. 2.5-4.5 minutes.
# Measured runs (seed 0, 8 jobs on the 2 cores: 3.2-3.3 s per gradient, 16-17 minutes): acceptance
# 0.86-0.95, step size ~0.002, trajectory length ~0.013, no divergence after warm-up. Without polishing the
# chains were still descending from the SGD solutions (train NLL 0.65 -> 0.44 over the run); with 5 polish
# epochs the draws sit at train NLL 0.32-0.37, a different level per chain (each chain stays in its own
# mode): R-hat of U ~4 across chains, bulk ESS ~4-5 per weight. A diagnosed but *not converged* reference:
# the chains explore around their modes, they do not mix between modes.
# paper: a GPU-sized run.
PRESETS = {
    "tiny": Config(n_warmup=6, n_leapfrog=3, chunk=256),
    "cpu": Config(n_warmup=30, n_leapfrog=6, polish_epochs=5),
    "paper": Config(n_warmup=500, n_leapfrog=50, thin=2, chunk=10000),
}


def preset(scale: str) -> Config:
    """The sampler settings of a scale (``tiny``, ``cpu``, ``paper``)."""
    return _scales.pick(scale, **PRESETS)


def _base_models(setup: Setup, seeds: list[int], progress: bool) -> Params:
    """Warm starts: the recipe's SGD from PyTorch's initialisation,
    :func:`symlib.training.stacked.train_stacked`."""
    init = _train.init_params(setup.make_model, seeds)
    if setup.arch in _train.STACKED_GRADS:
        bar = _progress.bar(setup.recipe.epochs, "hmc: base models", enabled=progress)
        out = _train.train_stacked(
            init,
            seeds,
            setup.x,
            setup.y,
            setup.recipe,
            setup.fill,
            setup.arch,
            on_epoch=lambda e: bar.update(1),
        )
        bar.close()
        return out
    models = [
        _train.train_plain(
            _train.init_model(setup.make_model, s), s, setup.x, setup.y, setup.recipe, setup.fill
        )
        for s in seeds
    ]
    return {k: torch.stack([dict(m.named_parameters())[k].detach() for m in models]) for k in init}


def _polish(setup: Setup, start: Params, seeds: list[int], epochs: int, progress: bool) -> Params:
    r"""SGD on :math:`U / N = \bar L + \tfrac{wd}{2}|\theta|^2` without augmentation (see :class:`Config`);
    stacked architectures only (others start from ``start`` as given)."""
    rec = dataclasses.replace(
        setup.recipe,
        epochs=epochs,
        lr=setup.recipe.lr_at(setup.recipe.epochs - 1),
        milestones=(),
        schedule="step",
        crop_padding=0,
        flip=False,
    )
    if setup.arch not in _train.STACKED_GRADS:
        return start
    bar = _progress.bar(epochs, "hmc: polish", enabled=progress)
    out = _train.train_stacked(
        start,
        [s + 7919 for s in seeds],
        setup.x,
        setup.y,
        rec,
        setup.fill,
        setup.arch,
        on_epoch=lambda e: bar.update(1),
    )
    bar.close()
    return out


def _draw(req: Request, **hyper) -> SampleSet:
    """HMC reference samples: ``n_modes`` chains, ``n_per_mode`` kept states each (chain-major).

    The potential uses all of the setup's training data and its prior precision. Chain ``i`` starts from
    base model ``i``; without base models they are trained here with the setup's recipe
    (:func:`symlib.training.stacked.train_stacked`, seeds ``seed + i``).

    Args:
        **hyper: overrides of :class:`Config` fields (default: :func:`preset` of ``setup.scale``).

    Returns:
        A :class:`~symlib.posteriors.base.SampleSet` (method ``"hmc"``) whose ``diagnostics`` hold R-hat,
        ESS, acceptance, divergences, step sizes, gradient evaluations and seconds.
    """
    setup, n_modes, n_per_mode, seed, base, progress = (
        req.setup, req.n_modes, req.n_per_mode, req.seed, req.base, req.progress
    )
    cfg = dataclasses.replace(preset(setup.scale), **hyper)
    lam = check_precision(setup.prior_precision)
    seeds = [seed + i for i in range(n_modes)]
    if base is None:
        base = _base_models(setup, seeds, progress)
        started = "trained here (setup.recipe, train_stacked)"
    else:
        started = "given"
    if setup.arch in _train.STACKED_GRADS:
        names = list(_train.OPTUNET_SHAPES)
        missing = set(names) - set(base)
        if missing:
            raise ValueError(f"base models lack {sorted(missing)}: they are not {setup.arch} weights")
        potential = stacked_potential(setup.x, setup.y, lam, setup.arch, cfg.chunk)
        shapes = dict(_train.OPTUNET_SHAPES)
    else:
        warnings.warn(
            f"no stacked gradient for {setup.arch!r}: HMC falls back to torch.func (slower)", stacklevel=2
        )
        potential, shapes = module_potential(setup.make_model, setup.x, setup.y, lam, cfg.chunk)
    start = {k: base[k].to(setup.device, setup.x.dtype) for k in shapes}
    if cfg.polish_epochs:
        start = _polish(setup, start, seeds, cfg.polish_epochs, progress)
    theta0 = flatten(start)
    res = run_chains(
        potential,
        theta0,
        cfg.n_warmup,
        n_per_mode,
        cfg.n_leapfrog,
        cfg.thin,
        cfg.target_accept,
        cfg.jitter,
        seed=seed,
        progress=progress,
    )
    flat = res.draws.reshape(n_modes * n_per_mode, -1)
    params = {k: v.contiguous() for k, v in unflatten(flat, shapes).items()}
    hyper_out = dict(
        dataclasses.asdict(cfg),
        prior_precision=lam,
        temperature=1.0,
        mass_matrix="identity",
        start=started,
        step_size_adaptation="dual averaging (Hoffman & Gelman 2014)",
    )
    return SampleSet(
        params=params,
        method="hmc",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper=hyper_out,
        base_seeds=seeds,
        diagnostics=res.diagnostics(),
    )


METHOD = Method("hmc", _draw, base="optional", hyper=tuple(f.name for f in dataclasses.fields(Config)))


sample = METHOD.sampler()
