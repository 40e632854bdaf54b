r"""Full-batch Hamiltonian Monte Carlo, the reference posterior sampler (book: chapter "Table 1").

Beyond the paper (its reviewers asked how the approximations compare with a true posterior sampler):
Metropolis-corrected HMC (Neal 2011) on the posterior of the weights at temperature 1,

.. math:: p(\theta \mid D) \propto \exp(-U(\theta)), \qquad
          U(\theta) = N \bar L(\theta) + \tfrac{\lambda}{2} \lVert\theta\rVert^2,

with :math:`\bar L` the mean cross-entropy over all :math:`N` training images (no mini-batches, **no
augmentation**: the posterior of the training set as it is, not of its random crops, which the target
zoo and SGHMC train with) and :math:`\lambda` = :attr:`Setup.prior_precision` (:math:`N \cdot wd`),
the same Gaussian prior as SGHMC. Several chains run **stacked**: one call of
:func:`symlib.training.stacked.loss_and_grads` per data chunk gives the gradient of every chain (OptuNet);
other architectures without BatchNorm go through ``torch.func`` (``vmap`` of ``grad`` of ``functional_call``).

Chain ``i`` starts from base model ``i`` (given, or trained here with the setup's recipe by
:func:`symlib.training.stacked.train_stacked`), polished by SGD on :math:`U / N` without augmentation
until its full-batch potential stops falling (:func:`symlib.posteriors.hmc.local.polish`: blocks of 10
epochs, at most ``polish_epochs``; part of the burn-in). The sampler (:func:`run_chains`), per chain:

* mass matrix (``metric``): ``"ggn"``, the chain's own :math:`M = G + c I` with :math:`G` the GGN of the
  likelihood at its polished start (:mod:`symlib.posteriors.hmc.metric`): the curvatures of OptuNet's
  posterior span five orders of magnitude, and without a metric the step size that the stiffest
  direction allows leaves the widest ones unexplored. :math:`c` (``metric_damping``, default the prior's
  precision) bounds how far a step moves along the directions the GGN sees as flat (the scaling
  symmetries, where the geometry changes fastest); ``"identity"``: :math:`M = I`;
* leapfrog (:func:`leapfrog`) with ``n_leapfrog`` steps per trajectory;
* warm-up: the initial step size from Hoffman & Gelman's (2014, Alg. 4) doubling/halving heuristic,
  then dual averaging (their Alg. 5: :math:`\gamma = 0.05, t_0 = 10, \kappa = 0.75`,
  :math:`\mu = \log 10 \epsilon_0`) of the step size towards ``target_accept`` (default 0.75) on the
  Metropolis acceptance probability :math:`\min(1, e^{-\Delta H})`; warm-up draws are discarded;
* sampling: the step size frozen at its averaged value :math:`\bar\epsilon`, jittered uniformly by
  :math:`\pm` ``jitter`` per trajectory (so is the trajectory's length), keep every ``thin``-th state;
* a trajectory whose energy error exceeds 1000 or is not finite is *divergent* (Stan's convention) and
  is rejected; divergences are counted per chain;
* optionally (``orbit_moves``), before every trajectory, an exact Gibbs move of every neuron along its
  scaling orbit (:mod:`symlib.posteriors.hmc.orbits`), where the likelihood is constant and HMC creeps.

Diagnostics (:func:`symlib.posteriors.hmc.local.judge`, on every kept state while the set stores every
``keep_every``-th): R-hat and bulk/tail ESS on raw weights, canonical forms and invariant functionals
(the potential, the test log-likelihood, the predictive probabilities of ``n_probe`` test images;
:mod:`symlib.stats.convergence`), across chains and per chain; a chain is *converged locally* when its
split R-hat is below 1.05 and its bulk ESS at least 50 on every invariant functional. The cross-chain
R-hat of the potential measures the spread between the basins the chains sit in. Also: acceptance and
divergences per chain, the step sizes and trajectory lengths, the polish's trace, the gradient
evaluations and the seconds of every stage.
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
from symlib.posteriors.hmc import gauge as _gauge
from symlib.posteriors.hmc import metric, orbits
from symlib.posteriors.hmc.potentials import (
    Potential,
    check_precision,
    mlp_likelihood,
    module_potential,
    stacked_potential,
    with_prior,
)
from symlib.posteriors.hmc.sampler import Config, HMCResult, run_chains
from symlib.posteriors.hmc.trajectory import DIVERGENCE, leapfrog

__all__ = [
    "DIVERGENCE",
    "METHOD",
    "PRESETS",
    "Config",
    "HMCResult",
    "Potential",
    "check_precision",
    "leapfrog",
    "metric",
    "mlp_likelihood",
    "orbits",
    "module_potential",
    "preset",
    "run_chains",
    "sample",
    "stacked_potential",
    "with_prior",
]




# tiny: a smoke test. cpu: the book's local reference (book: chapter "Table 1"), 10 chains from the 10
# multi-mode base models (cached), about the budget the chapter allows spent on long trajectories; how it
# was chosen: docs/performance.md, "How Table 1's HMC preset was chosen". paper: a GPU-sized run of the same.
PRESETS = {
    "tiny": Config(n_warmup=6, n_leapfrog=3, grad_chunk=256, metric="ggn", n_test=64, n_probe=4),
    "cpu": Config(n_warmup=10, n_leapfrog=32, jitter=0.2, polish_epochs=60, metric="ggn",
                  metric_damping=100.0, keep_every=5),
    "paper": Config(n_warmup=100, n_leapfrog=50, thin=1, grad_chunk=10000, jitter=0.2, polish_epochs=200,
                    metric="ggn", metric_damping=100.0, keep_every=20),
}


def preset(scale: str) -> Config:
    """The sampler settings of a scale (``tiny``, ``cpu``, ``paper``)."""
    return _scales.pick(scale, **PRESETS)


def _base_models(setup: Setup, seeds: list[int], progress: bool) -> Params:
    """Warm starts: the recipe's SGD from PyTorch's initialisation,
    :func:`symlib.training.stacked.train_stacked`."""
    init = _train.init_params(setup.make_model, seeds)
    if setup.arch == "optunet":  # the stacked fast paths; others go through torch.func
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


def _moves(orbit_moves, gauge):
    """The move before every trajectory: the exact orbit move, then the gauge's redraw (either may be
    ``None``); ``None`` when there is neither."""
    if orbit_moves is None and gauge is None:
        return None

    def moves(theta: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.ones(theta.shape[0], dtype=torch.float64)
        if orbit_moves is not None:
            theta, acc = orbit_moves(theta, gen)
        if gauge is not None:
            gauge.refresh(theta, gen)
        return theta, acc

    return moves


def _potential(setup: Setup, base: Params, lam: float, cfg: Config) -> tuple[Potential, dict[str, tuple]]:
    """The potential of the setup's whole training set with the prior ``lam`` and the shapes of the
    sampled tensors: OptuNet's stacked fast path, other architectures through ``torch.func`` (with a
    warning: slower).

    Raises:
        ValueError: OptuNet base models that lack some of its weights.
    """
    if setup.arch == "optunet":  # the stacked fast paths; others go through torch.func
        names = list(_train.OPTUNET_SHAPES)
        missing = set(names) - set(base)
        if missing:
            raise ValueError(f"base models lack {sorted(missing)}: they are not {setup.arch} weights")
        potential = stacked_potential(setup.x, setup.y, lam, setup.arch, cfg.grad_chunk)
        return potential, dict(_train.OPTUNET_SHAPES)
    warnings.warn(
        f"HMC has a stacked path for OptuNet only: {setup.arch!r} falls back to torch.func (slower)",
        stacklevel=3  # the caller of _draw, as before
    )
    return module_potential(setup.make_model, setup.x, setup.y, lam, cfg.grad_chunk)


def _geometry(setup: Setup, cfg: Config, start: Params, theta0: torch.Tensor, shapes: dict[str, tuple],
              lam: float):
    """The sampler's geometry at the polished starts ``start`` (flat: ``theta0``): ``(metric, seconds,
    orbit_moves, gauge)``, the mass matrix (the gauge's with ``cfg.gauge_sigma``, else the GGN's with
    ``cfg.metric == "ggn"``, else the identity) and the seconds it took, the scaling-orbit moves (with
    ``cfg.orbit_moves`` or a gauge, else ``None``) and the gauge
    (:class:`symlib.posteriors.hmc.gauge.OrbitGauge`, or ``None``)."""
    import time

    from symlib.posteriors.hmc import local

    orbit_moves = gauge = None
    if cfg.orbit_moves or cfg.gauge_sigma:
        from symlib.symmetry import trace

        spec = trace.spec_of(setup.make_model().to(torch.float64), tuple(setup.x.shape[1:]))
        orbit_moves = orbits.ScalingMoves(spec, shapes, lam)
    met, metric_seconds = metric.Identity(), 0.0
    if cfg.gauge_sigma:
        t0 = time.perf_counter()
        g, _ = local.ggn(setup, start, cfg.metric_images)
        gauge = _gauge.OrbitGauge(orbit_moves.powers, theta0, g, lam, cfg.gauge_sigma)
        met, metric_seconds = gauge.metric(), time.perf_counter() - t0
    elif cfg.metric == "ggn":
        met, metric_seconds = local.ggn_metric(setup, start, cfg.metric_damping or lam, cfg.metric_images)
    return met, metric_seconds, orbit_moves, gauge


def _draw(req: Request, **hyper) -> SampleSet:
    """HMC samples: ``n_modes`` chains, ``n_per_mode`` stored states each (chain-major).

    The potential uses all of the setup's training data (no augmentation) and its prior precision. Chain
    ``i`` starts from base model ``i`` (without base models they are trained here with the setup's recipe,
    seeds ``seed + i``), polished (:func:`symlib.posteriors.hmc.local.polish`), and samples with its own
    metric (:func:`symlib.posteriors.hmc.local.ggn_metric`). The chains keep ``n_per_mode * keep_every``
    states; the diagnostics use all of them, the set stores every ``keep_every``-th.

    Args:
        **hyper: overrides of :class:`Config` fields (default: :func:`preset` of ``setup.scale``).

    Returns:
        A :class:`~symlib.posteriors.base.SampleSet` (method ``"hmc"``) whose ``diagnostics`` hold the
        sampler's (acceptance, divergences, step sizes, gradients, seconds), the polish's trace and cost,
        and the convergence judged on raw weights, canonical forms and invariant functionals, across
        chains and per chain (:func:`symlib.posteriors.hmc.local.judge`).
    """
    import time

    from symlib.posteriors.hmc import local

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
    potential, shapes = _potential(setup, base, lam, cfg)
    start = {k: base[k].to(setup.device, setup.x.dtype) for k in shapes}
    start, polished = local.polish(setup, start, seeds, potential, cfg.polish_epochs, progress=progress)
    theta0 = flatten(start)
    n_keep = n_per_mode * cfg.keep_every
    met, metric_seconds, orbit_moves, gauge = _geometry(setup, cfg, start, theta0, shapes, lam)
    moves = _moves(orbit_moves if cfg.orbit_moves else None, gauge)
    res = run_chains(gauge.wrap(potential) if gauge else potential, theta0, cfg.n_warmup, n_keep,
                     cfg.n_leapfrog, cfg.thin, cfg.target_accept, cfg.jitter, seed=seed, progress=progress,
                     metric=met, moves=moves)
    if gauge is not None:  # the recorded potential includes the gauge's energy: take it out
        its = [cfg.n_warmup + k * cfg.thin + cfg.thin - 1 for k in range(n_keep)]
        for k, it in enumerate(its):
            e, _ = gauge.gauge_energy(res.draws[:, k], gauge.history[it])
            res.potential[:, k] -= e.to(res.potential.dtype).to(res.potential.device)
    t0 = time.perf_counter()
    judged = {}
    if n_keep >= 4:
        judged = local.judge(setup, res.draws, res.potential, shapes, cfg.n_test, cfg.n_probe)
    stored = res.draws[:, cfg.keep_every - 1 :: cfg.keep_every]
    flat = stored.reshape(n_modes * n_per_mode, -1)
    params = {k: v.contiguous() for k, v in unflatten(flat, shapes).items()}
    hyper_out = dict(
        dataclasses.asdict(cfg),
        prior_precision=lam,
        temperature=1.0,
        mass_matrix=met.describe()["mass_matrix"],
        start=started,
        data="the training set, no augmentation",
        step_size_adaptation="dual averaging (Hoffman & Gelman 2014)",
    )
    sampler_diagnostics = res.diagnostics()
    if not cfg.orbit_moves:
        sampler_diagnostics.pop("orbit_accept", None)
    diagnostics = {
        **sampler_diagnostics,
        "polish": polished,
        "metric": {k: v for k, v in met.describe().items() if k != "mass_matrix"},
        "seconds_metric": round(metric_seconds, 2),
        "seconds_diagnostics": round(time.perf_counter() - t0, 2),
        "warmup_potential": (res.warmup_potential.double() / setup.n_train).tolist(),
        **judged,
    }
    return SampleSet(
        params=params,
        method="hmc",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper=hyper_out,
        base_seeds=seeds,
        diagnostics=diagnostics,
    )


def _check(**hyper) -> None:
    """The values of HMC's hyper-parameters (:class:`Config`'s checks, on the ``cpu`` preset)."""
    try:
        dataclasses.replace(preset("cpu"), **hyper)
    except TypeError as e:  # a value of the wrong type (a string for a number)
        raise ValueError(f"hmc hyper-parameters {hyper}: a value of the wrong type ({e})") from None


METHOD = Method("hmc", _draw, base="optional", hyper=tuple(f.name for f in dataclasses.fields(Config)),
                check=_check)


sample = METHOD.sampler()
