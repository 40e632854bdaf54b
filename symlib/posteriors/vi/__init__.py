r"""Mean-field variational inference, Bayes by Backprop (book: chapter "Table 1"; paper §4, App. B).

The paper's "BNN" rows (Blundell et al. 2015, with BLiTZ's layer defaults, NOTES "Methods of Table 1").
Every weight and bias of the network's ``Linear`` and ``Conv2d`` layers (the "Bayesian layers") gets an
independent Gaussian :math:`q(w_i) = \mathcal N(\mu_i, \sigma_i^2)`, :math:`\sigma_i = \log(1 + e^{\rho_i})`;
other parameters (BatchNorm's affine weights) stay point estimates and buffers (running statistics) are
updated in training mode, as in a BLiTZ network whose non-Bayesian layers are ordinary modules.

* **Prior**: :math:`\mathcal N(0, \sigma_0^2)` per weight, :math:`\sigma_0 = 0.1` (BLiTZ's scale-mixture
  prior with ``prior_pi = 1`` is its first component, ``prior_sigma_1 = 0.1``).
* **Initialisation** (BLiTZ): :math:`\mu \sim \mathcal N(0, 0.1^2)`, :math:`\rho \sim \mathcal N(-6, 0.1^2)`
  for linear and :math:`\mathcal N(-7, 0.1^2)` for convolutional layers (:data:`RHO_INIT`).
* **Objective**, per mini-batch of :math:`B` examples, with :math:`K = 3` reparameterised samples
  :math:`w_k = \mu + \sigma \odot \epsilon_k`, :math:`\epsilon_k \sim \mathcal N(0, I)`:

  .. math:: \mathcal L(\mu, \rho) = \frac1K \sum_{k=1}^K \frac1B \sum_{b} -\log p(y_b \mid x_b, w_k)
            + \beta\, \mathrm{KL}(q \,\|\, p),

  with the KL in closed form (Gaussian against Gaussian, :func:`kl_divergence`):
  :math:`\sum_i \log\frac{\sigma_0}{\sigma_i} + \frac{\sigma_i^2 + \mu_i^2}{2\sigma_0^2} - \frac12`.
  BLiTZ uses the one-sample Monte-Carlo estimate :math:`\log q(w_k) - \log p(w_k)` instead, whose
  expectation is this KL: same objective in expectation, lower-variance gradients.
* **KL weight**: :math:`\beta = 1/N` by default (``kl_weight``), so that :math:`\mathcal L` is the
  per-example negative ELBO, :math:`-\mathrm{ELBO}/N` in expectation. BLiTZ's ``sample_elbo`` computes
  ``criterion(out, y) + complexity_cost_weight * KL`` with a mean-reduced criterion, so this is BLiTZ with
  ``complexity_cost_weight = 1 / N`` (the value BLiTZ's own examples use).
* **Optimiser**: the paper's (App. B.1: "We train the variational BNN with SGD"), the base recipe's SGD
  (learning rate, schedule, momentum, epochs) without weight decay (the prior is in the KL); ResNet-18 at
  the paper scale: 150 epochs, lr 0.01 decayed once (/ 10) after epoch 80 (:func:`vi_recipe`).
  ``optimizer="adam"`` is available (what BLiTZ users usually run); with SGD and :math:`\beta = 1/N`,
  :math:`\rho` receives gradients of order :math:`\beta` from the KL and :math:`\sigma` barely leaves its
  initial :math:`e^{-6}`: the near-deterministic posterior behind the paper's tiny BNN mutual information.
  Measured at the ``cpu`` scale (4,000 digits, the zoo's 10-epoch recipe, 2 modes): SGD leaves the median
  :math:`\sigma` at 0.001 (its initial value) and reaches 50-62 % test accuracy; Adam (lr 0.01) 0.013-0.016
  and 63-76 %. The prior :math:`\mathcal N(0, 0.1^2)` weighted by :math:`1/N` acts on the means as a weight
  decay of :math:`1 / (N \sigma_0^2) = 0.025` (the recipe's is 2e-4): with few data it dominates.

**Stacked OptuNet.** ``n_modes`` posteriors and their ``K`` Monte-Carlo samples are ``M = n_modes * K``
stacked networks that share the batch of their mode; :func:`symlib.training.stacked.loss_and_grads` gives
:math:`g_k = \partial \bar L / \partial w_k` for each, and the chain rule gives
:math:`\partial_\mu = \tfrac1K\sum_k g_k + \beta\mu/\sigma_0^2`,
:math:`\partial_\rho = \big(\tfrac1K \sum_k g_k \epsilon_k + \beta(\sigma/\sigma_0^2 - 1/\sigma)\big)
\,\mathrm{sigmoid}(\rho)` (:func:`elbo_and_grads`). **Any other module** (the MLP of Rossi et al.,
ResNet-18) trains through ``torch.func.functional_call`` and autograd, one mode after another.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from symlib import progress as _progress
from symlib import scales as _scales
from symlib import training as _train
from symlib.params import Params
from symlib.posteriors.base import Method, Request, SampleSet, Setup
from symlib.posteriors.vi.family import (
    PRIOR_SIGMA,
    RHO_INIT,
    LossFn,
    VIResult,
    bayesian_layers,
    elbo_and_grads,
    init_variational,
    kl_divergence,
)
from symlib.training import loop

__all__ = [
    "METHOD",
    "PRIOR_SIGMA",
    "RHO_INIT",
    "Config",
    "VIResult",
    "bayesian_layers",
    "elbo_and_grads",
    "fit",
    "init_variational",
    "kl_divergence",
    "sample",
    "vi_recipe",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """VI settings (defaults: the paper's, see the module docstring).

    Attributes:
        n_mc: Monte-Carlo samples of the ELBO per step (3).
        prior_sigma: standard deviation of the Gaussian prior (0.1).
        kl_weight: :math:`\\beta` (``None``: ``1 / N``).
        optimizer: ``"sgd"`` (the recipe's SGD, no weight decay) or ``"adam"``.
        lr: initial learning rate (``None``: :func:`vi_recipe`'s); the recipe's schedule scales it.
        epochs: training epochs (``None``: :func:`vi_recipe`'s).
        std_init: initial standard deviation of every weight (``None``: BLiTZ's :data:`RHO_INIT`).
    """

    n_mc: int = 3
    prior_sigma: float = PRIOR_SIGMA
    kl_weight: float | None = None
    optimizer: str = "sgd"
    lr: float | None = None
    epochs: int | None = None
    std_init: float | None = None

    def __post_init__(self):
        _scales.check_int("n_mc", self.n_mc, 1)
        if not (self.prior_sigma > 0 and math.isfinite(self.prior_sigma)):
            raise ValueError(f"prior_sigma must be positive and finite, got {self.prior_sigma!r}")
        if self.kl_weight is not None and not (self.kl_weight >= 0 and math.isfinite(self.kl_weight)):
            raise ValueError(f"kl_weight must be >= 0 and finite, got {self.kl_weight!r}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {self.optimizer!r}")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be positive and finite, got {self.lr!r}")
        if self.epochs is not None:
            _scales.check_int("epochs", self.epochs, 1)
        if self.std_init is not None and not (self.std_init > 0 and math.isfinite(self.std_init)):
            raise ValueError(f"std_init must be positive and finite, got {self.std_init!r}")


def vi_recipe(setup: Setup) -> _train.Recipe:
    """The training recipe of the variational networks: the base recipe without weight decay; for
    ResNet-18 at the paper scale 150 epochs, lr 0.01, one decay / 10 after epoch 80 (App. B.1)."""
    rec = dataclasses.replace(setup.recipe, weight_decay=0.0)
    if setup.arch == "resnet18" and setup.scale == "paper":
        rec = dataclasses.replace(rec, epochs=150, lr=0.01, schedule="step", milestones=(80,), gamma=0.1)
    return rec


# ----------------------------------------------------------------------------- the variational family


def _adam_step(params: Params, grads: Params, state: dict, lr: float, b1=0.9, b2=0.999, e=1e-8) -> Params:
    """``torch.optim.Adam`` (no weight decay) on stacked tensors; ``state`` is updated in place."""
    t = state["t"] = state.get("t", 0) + 1
    out = {}
    for n, p in params.items():
        m = state.setdefault(("m", n), torch.zeros_like(p)).mul_(b1).add_(grads[n], alpha=1 - b1)
        v = (
            state.setdefault(("v", n), torch.zeros_like(p))
            .mul_(b2)
            .addcmul_(grads[n], grads[n], value=1 - b2)
        )
        denom = (v / (1 - b2**t)).sqrt_().add_(e)
        out[n] = p.addcdiv(m, denom, value=-lr / (1 - b1**t))
    return out


# ----------------------------------------------------------------------------- results


# ----------------------------------------------------------------------------- training


def _noise_generator(seeds) -> torch.Generator:
    return torch.Generator().manual_seed(int(np.random.SeedSequence([*seeds, 7]).generate_state(1)[0]))


@dataclasses.dataclass
class _StackedVI:
    """VI's reparameterised step on stacked modes for :func:`symlib.training.loop.run`: state ``(mu, rho,
    SGD momentum buffers)``; the loss is the objective of every mode. The noise of mode ``i`` comes from its
    own generator (the same draws as the generic path)."""

    cfg: Config
    rec: _train.Recipe
    beta: float
    gens: list[torch.Generator]
    arch: str
    lr_scale: float
    adam: dict = dataclasses.field(default_factory=dict)
    last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def step(self, state, batch: _train.Batch):
        mu, rho, bufs = state
        k = self.cfg.n_mc
        eps = {
            n: torch.stack(
                [torch.randn((k, *v.shape[1:]), generator=g, dtype=v.dtype) for g in self.gens]
            ).to(v.device)
            for n, v in mu.items()
        }
        nll, kl, g_mu, g_rho = elbo_and_grads(
            mu, rho, eps, batch.x, batch.y, self.beta, self.cfg.prior_sigma, self.arch
        )
        obj = nll + self.beta * kl
        self.last = (obj, nll, kl)
        if not bool(torch.isfinite(obj).all()):
            return state, obj
        theta = {**{("mu", n): v for n, v in mu.items()}, **{("rho", n): v for n, v in rho.items()}}
        grads = {**{("mu", n): v for n, v in g_mu.items()}, **{("rho", n): v for n, v in g_rho.items()}}
        lr = batch.lr * self.lr_scale
        if self.cfg.optimizer == "adam":
            theta = _adam_step(theta, grads, self.adam, lr)
        else:
            theta, bufs = _train.sgd_step(theta, grads, bufs, lr, self.rec)
        return ({n: theta[("mu", n)] for n in mu}, {n: theta[("rho", n)] for n in rho}, bufs), obj


def _fit_stacked(
    setup: Setup, seeds: list[int], cfg: Config, rec: _train.Recipe, beta: float, bar
) -> VIResult:
    model = setup.make_model()
    m = len(seeds)
    # per mode, the initialisation and the noise of the generic path (same seeds, same draws)
    inits = [init_variational(model, 1, _noise_generator([s, 1]), cfg.std_init) for s in seeds]
    mu = {n: torch.cat([i[0][n] for i in inits]).to(setup.device, setup.x.dtype) for n in inits[0][0]}
    rho = {n: torch.cat([i[1][n] for i in inits]).to(setup.device, setup.x.dtype) for n in inits[0][1]}
    rule = _StackedVI(cfg, rec, beta, [_noise_generator([s]) for s in seeds], setup.arch,
                      1.0 if cfg.lr is None else cfg.lr / rec.lr)
    hist = {"objective": [], "nll": [], "kl": []}
    acc = torch.zeros(3, m, dtype=torch.float64)
    n_steps = [0]

    def record(batch: _train.Batch, state, obj: torch.Tensor) -> None:
        acc.add_(torch.stack(rule.last).detach().double().cpu())
        n_steps[0] += 1
        if batch.last_in_epoch:
            for key, row in zip(hist, acc / n_steps[0], strict=True):
                hist[key].append([round(float(v), 6) for v in row])
            acc.zero_()
            n_steps[0] = 0
            bar.update(1)

    mu, rho, _ = loop.run(rule, (mu, rho, None), seeds, setup.x, setup.y, rec, fill=setup.fill,
                          what="VI objective", on_step=record)
    keys = list(model.state_dict())
    return VIResult(mu, rho, {}, keys, cfg.prior_sigma, beta, list(seeds), hist)


def _batches(seed: int, x: torch.Tensor, y: torch.Tensor, rec: _train.Recipe, fill):
    """One model's mini-batches: :func:`symlib.training.plans.minibatches` for images, a plain shuffle (the
    same data order, :func:`symlib.training.plans.epoch_plans`) for other inputs (no augmentation)."""
    if x.ndim == 4:
        for b in _train.minibatches([seed], x, y, rec, fill):
            yield b.epoch, b.lr, b.last_in_epoch, b.x[0], b.y[0]
        return
    if rec.crop_padding or rec.flip:
        raise ValueError("random crops and flips need images (N, C, H, W); set crop_padding=0, flip=False")
    n = x.shape[0]
    for epoch in range(rec.epochs):
        perm = _train.epoch_plans([seed], epoch, n, 0, False, device=x.device)[0][0]
        for start in range(0, n, rec.batch_size):
            idx = perm[start : start + rec.batch_size]
            yield epoch, rec.lr_at(epoch), start + rec.batch_size >= n, x[idx], y[idx]


def _mc_nll(model, w: Params, point: Params, buffers: Params, xb, yb, loss_fn: LossFn, k: int):
    """Mean over the ``K`` weight sets ``w`` (``{name: (K, ...)}``) of the mean negative log-likelihood."""
    if buffers:  # BatchNorm: K forward passes in training mode (updating the running statistics), as BLiTZ
        outs = [
            torch.func.functional_call(model, {**{n: v[j] for n, v in w.items()}, **point, **buffers}, (xb,))
            for j in range(k)
        ]
    else:  # one vectorised forward of the K networks
        outs = torch.func.vmap(lambda wj: torch.func.functional_call(model, {**wj, **point}, (xb,)))(w)
    return torch.stack([loss_fn(outs[j], yb) for j in range(k)]).mean()


def _fit_module(
    setup: Setup, seeds: list[int], cfg: Config, rec: _train.Recipe, beta: float, bar, loss_fn: LossFn
) -> VIResult:
    """Generic path: any module, ``functional_call`` + autograd, modes one after another."""
    model = setup.make_model().to(setup.device)
    kinds = bayesian_layers(model)
    state = model.state_dict()
    keys = list(state)
    mus, rhos, points, hists = [], [], [], []
    for seed in seeds:
        mu0, rho0 = init_variational(model, 1, _noise_generator([seed, 1]), cfg.std_init)
        mu = {n: v[0].to(setup.device).requires_grad_() for n, v in mu0.items()}
        rho = {n: v[0].to(setup.device).requires_grad_() for n, v in rho0.items()}
        fresh = _train.init_model(setup.make_model, seed).to(setup.device).state_dict()
        point = {
            n: p.detach().clone().requires_grad_() for n, p in model.named_parameters() if n not in kinds
        }
        buffers = {n: fresh[n].clone() for n, _ in model.named_buffers()}
        for n in point:
            point[n].data.copy_(fresh[n])
        params = [*mu.values(), *rho.values(), *point.values()]
        lr0 = cfg.lr if cfg.lr is not None else rec.lr
        if cfg.optimizer == "adam":
            opt = torch.optim.Adam(params, lr=lr0)
        else:
            opt = torch.optim.SGD(params, lr=lr0, momentum=rec.momentum, nesterov=rec.nesterov)
        gen = _noise_generator([seed])
        hist = {"objective": [], "nll": [], "kl": []}
        acc, n_steps = torch.zeros(3, dtype=torch.float64), 0
        model.train()
        step = 0
        for _epoch, lr, last, xb, yb in _batches(seed, setup.x, setup.y, rec, setup.fill):
            for group in opt.param_groups:
                group["lr"] = lr * (lr0 / rec.lr)
            sig = {n: F.softplus(r) for n, r in rho.items()}
            eps = {
                n: torch.randn((cfg.n_mc, *v.shape), generator=gen, dtype=v.dtype).to(v.device)
                for n, v in mu.items()
            }
            w = {n: mu[n] + sig[n] * eps[n] for n in mu}  # (K, ...)
            nll = _mc_nll(model, w, point, buffers, xb, yb, loss_fn, cfg.n_mc)
            kl = kl_divergence(
                {n: v[None] for n, v in mu.items()}, {n: v[None] for n, v in rho.items()}, cfg.prior_sigma
            )[0]
            obj = nll + beta * kl
            if not bool(torch.isfinite(obj)):
                raise FloatingPointError(
                    f"non-finite VI objective for mode seed {seed} at step {step}; lower the learning rate"
                )
            opt.zero_grad(set_to_none=True)
            obj.backward()
            opt.step()
            acc += torch.stack([obj, nll, kl]).detach().double().cpu()
            n_steps += 1
            step += 1
            if last:
                for key, v in zip(hist, acc / n_steps, strict=True):
                    hist[key].append([round(float(v), 6)])
                acc.zero_()
                n_steps = 0
                bar.update(1)
        mus.append({n: v.detach() for n, v in mu.items()})
        rhos.append({n: v.detach() for n, v in rho.items()})
        points.append({**{n: v.detach() for n, v in point.items()}, **buffers})
        hists.append(hist)
    stack = lambda ds: {n: torch.stack([d[n] for d in ds]) for n in ds[0]}  # noqa: E731
    hist = {key: [sum((h[key][e] for h in hists), []) for e in range(len(hists[0][key]))] for key in hists[0]}
    return VIResult(
        stack(mus),
        stack(rhos),
        stack(points) if points[0] else {},
        keys,
        cfg.prior_sigma,
        beta,
        list(seeds),
        hist,
    )


def fit(
    setup: Setup,
    n_modes: int,
    seed: int = 0,
    *,
    progress: bool = True,
    loss_fn: LossFn | None = None,
    **hyper,
) -> VIResult:
    """Train ``n_modes`` independent mean-field posteriors (modes ``i`` has seed ``seed + i``: its
    initialisation, data order, crops and Monte-Carlo noise).

    Args:
        setup: the training problem (its recipe's optimiser settings, see :func:`vi_recipe`).
        n_modes: independent posteriors.
        seed: seed of the first mode.
        progress: a progress bar over epochs.
        loss_fn: ``(outputs, targets) -> mean negative log-likelihood`` (default cross-entropy);
            another likelihood forces the generic path.
        **hyper: fields of :class:`Config`.

    Returns:
        A :class:`VIResult` with the means and standard deviations, stacked over modes.
    """
    _scales.check_int("n_modes", n_modes, 1)
    _scales.check_int("seed", seed, 0)
    METHOD.check_hyper(hyper)
    cfg = Config(**hyper)
    rec = vi_recipe(setup)
    if cfg.epochs is not None:
        rec = rec.scaled(cfg.epochs)
    beta = 1.0 / setup.n_train if cfg.kl_weight is None else cfg.kl_weight
    seeds = [seed + i for i in range(n_modes)]
    stacked = setup.arch in _train.STACKED_GRADS and loss_fn is None
    bar = _progress.bar(rec.epochs * (1 if stacked else n_modes), f"vi ({setup.arch})", enabled=progress)
    try:
        if stacked:
            return _fit_stacked(setup, seeds, cfg, rec, beta, bar)
        return _fit_module(setup, seeds, cfg, rec, beta, bar, loss_fn or F.cross_entropy)
    finally:
        bar.close()


def _check(**hyper) -> None:
    """The values of VI's hyper-parameters (:class:`Config`'s checks)."""
    try:
        Config(**hyper)
    except TypeError as e:  # a value of the wrong type (a string for a number)
        raise ValueError(f"vi hyper-parameters {hyper}: a value of the wrong type ({e})") from None


def _draw(req: Request, **hyper) -> SampleSet:
    """Bayes-by-Backprop samples: ``n_modes`` posteriors trained here (BLiTZ's initialisation, not from
    base models; mode ``i`` has seed ``seed + i``, :func:`fit`), ``n_per_mode`` weight sets drawn from
    each (mode-major; the draws use ``seed`` too).

    Args:
        **hyper: fields of :class:`Config` (``n_mc``, ``prior_sigma``, ``kl_weight``, ``optimizer``,
            ``lr``, ``epochs``, ``std_init``).
    """
    setup, n_modes, n_per_mode, seed = req.setup, req.n_modes, req.n_per_mode, req.seed
    res = fit(setup, n_modes, seed, progress=req.progress, **hyper)
    cfg = Config(**hyper)
    rec = vi_recipe(setup) if cfg.epochs is None else vi_recipe(setup).scaled(cfg.epochs)
    info: dict[str, Any] = dict(
        dataclasses.asdict(cfg), kl_weight=res.kl_weight, recipe=dataclasses.asdict(rec)
    )
    info.update(kl="closed form", prior="N(0, prior_sigma^2)", init="BLiTZ", rho_init=RHO_INIT)
    std = res.std
    diag = {
        "final_objective": res.history["objective"][-1] if res.history.get("objective") else None,
        "final_nll": res.history["nll"][-1] if res.history.get("nll") else None,
        "kl": [float(v) for v in res.kl()],
        "sigma_median": [
            float(torch.cat([v[i].flatten() for v in std.values()]).median()) for i in range(n_modes)
        ],
    }
    return SampleSet(
        params=res.sample(n_per_mode, seed),
        method="vi",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper=info,
        base_seeds=res.seeds,
        diagnostics=diag,
    )


METHOD = Method(
    "vi",
    _draw,
    base="ignored",
    hyper=tuple(f.name for f in dataclasses.fields(Config)),
    check=_check,
    ignored_warning="VI trains its own posteriors from BLiTZ's initialisation; the base models are not used",
)
sample = METHOD.sampler()
