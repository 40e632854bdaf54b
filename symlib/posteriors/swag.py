r"""SWAG: stochastic weight averaging Gaussian (Maddox et al. 2019; book: chapter "Table 1", paper App. B.1).

From a trained base model, SGD continues with a restarted high learning rate and ``K = 20`` snapshots
:math:`\theta_1 .. \theta_K` are collected. SWAG keeps, as its public code does (``collect_model``), the
running moments and the deviations from the running mean:

.. math:: \bar\theta_k = \tfrac{1}{k}\textstyle\sum_{i \le k} \theta_i, \quad
          \overline{\theta^2}_k = \tfrac{1}{k}\textstyle\sum_{i \le k} \theta_i^2, \quad
          D_{\cdot, k} = \theta_k - \bar\theta_k,

keeping the last ``rank = 20`` columns of :math:`D`, and samples, as its code's ``sample(scale, cov=True)``
does (the paper's Eq. with the factor :math:`1/\sqrt 2` folded into ``scale``),

.. math:: \theta = \bar\theta + \sqrt{s}\,\Big(\Sigma_{\mathrm{diag}}^{1/2} z_1
          + \frac{1}{\sqrt{R - 1}} D z_2\Big), \quad
          \Sigma_{\mathrm{diag}} = \max(\overline{\theta^2} - \bar\theta^2, 10^{-30}),\
          z_1 \sim \mathcal N(0, I_d),\ z_2 \sim \mathcal N(0, I_R),

with :math:`R` = ``rank`` (the code's ``max_num_models``), so :math:`\mathrm{Cov}[\theta] = s\,
(\Sigma_{\mathrm{diag}} + D D^\top / (R - 1))`, and the paper's sample scale :math:`s = 0.1`.

**Our reading of the schedule** (App. B.1: "20 models ... continuing the training with the classic
high-learning rate schedule (starting with a linear increase) for twice as long ... 20 times with 10-epoch
intervals"). The continued run lasts twice the base recipe (``2 * recipe.epochs`` epochs: 120 for
OptuNet, 150 for ResNet-18) and is cut into 20 equal intervals; the learning rate rises linearly during
the first interval from the base recipe's final rate to the high rate (the recipe's initial rate, 0.04 for
OptuNet, 0.1 for ResNet-18) and stays there; a snapshot ends every interval (every 6 epochs for OptuNet at
the paper scale, every epoch at the ``cpu`` scale). "10-epoch intervals" cannot hold together with "twice
as long" for OptuNet (20 x 10 = 200 > 120 epochs); we keep "twice as long" and 20 evenly spaced
snapshots. Momentum and weight decay are the recipe's; momentum buffers restart at zero.

ResNets: SWAG covers the parameters; every sample's BatchNorm statistics are recomputed on the training
set (SWAG's ``bn_update``). OptuNet (no BatchNorm): the ``M`` modes train stacked.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from symlib import training as _train
from symlib.params import Params, flatten, unflatten, unstack
from symlib.posteriors import modules
from symlib.posteriors.base import Method, Request, SampleSet, Setup, check_positive, reference_state
from symlib.posteriors.modules import new_module
from symlib.posteriors.seeds import generator, stream_seeds
from symlib.progress import bar
from symlib.training import loop

__all__ = ["METHOD", "Moments", "draw", "fit", "sample", "schedule"]


def schedule(n_steps: int, n_snapshots: int, lr: float, lr_start: float) -> tuple[list[float], list[int]]:
    """Per-step learning rates and the 0-based steps after which snapshots are taken.

    Snapshot ``k`` (1..K) follows step ``round(k * n_steps / K) - 1``; the rate rises linearly from
    ``lr_start`` to ``lr`` over the steps up to the first snapshot, then stays at ``lr``.
    """
    if n_steps < n_snapshots:
        raise ValueError(f"{n_snapshots} snapshots need at least as many steps, got {n_steps}")
    snaps = [round(k * n_steps / n_snapshots) - 1 for k in range(1, n_snapshots + 1)]
    warm = snaps[0] + 1
    lrs = [lr_start + (lr - lr_start) * (t + 1) / warm if t < warm else lr for t in range(n_steps)]
    return lrs, snaps


@dataclasses.dataclass
class Moments:
    """SWAG's statistics of ``M`` stacked runs, flattened to ``(M, d)``: running first and second moments
    and the last ``rank`` deviations ``(M, K, d)`` (float64)."""

    rank: int
    mean: torch.Tensor | None = None
    sq_mean: torch.Tensor | None = None
    devs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    n: int = 0

    def collect(self, theta: torch.Tensor) -> None:
        """Add one snapshot ``(M, d)`` (SWAG's ``collect_model``)."""
        theta = theta.detach().to(torch.float64)
        if self.mean is None:
            self.mean, self.sq_mean = torch.zeros_like(theta), torch.zeros_like(theta)
        n = self.n
        self.mean = self.mean * (n / (n + 1.0)) + theta / (n + 1.0)
        self.sq_mean = self.sq_mean * (n / (n + 1.0)) + theta**2 / (n + 1.0)
        self.devs.append(theta - self.mean)
        if len(self.devs) > self.rank:
            self.devs.pop(0)
        self.n += 1

    @property
    def dev(self) -> torch.Tensor:
        """The kept deviations :math:`D`, ``(M, K, d)``."""
        return torch.stack(self.devs, 1)

    @property
    def var(self) -> torch.Tensor:
        r"""The diagonal variance :math:`\overline{\theta^2} - \bar\theta^2`, ``(M, d)`` (not clamped)."""
        return self.sq_mean - self.mean**2


def draw(
    moments: Moments, n: int, gen: torch.Generator, scale: float = 0.1, var_clamp: float = 1e-30
) -> torch.Tensor:
    r"""``n`` SWAG samples per run, ``(M, n, d)`` float64:
    :math:`\bar\theta + \sqrt{s}(\max(\Sigma_{diag}, c)^{1/2} z_1 + D z_2 / \sqrt{R - 1})`."""
    mean, dev = moments.mean, moments.dev  # (M, d), (M, K, d)
    m, k, d = dev.shape
    var = moments.var.clamp_min(var_clamp)
    z1 = torch.randn(m, n, d, generator=gen, dtype=torch.float64).to(mean.device)
    z2 = torch.randn(m, n, k, generator=gen, dtype=torch.float64).to(mean.device)
    low = torch.bmm(z2, dev) / math.sqrt(moments.rank - 1)
    return mean[:, None] + math.sqrt(scale) * (var.sqrt()[:, None] * z1 + low)


def fit(
    setup: Setup,
    base: Params,
    seeds: list[int],
    *,
    lr: float,
    epochs: int,
    n_snapshots: int = 20,
    rank: int = 20,
    progress: bool = True,
    snapshots: list | None = None,
) -> tuple[Moments, list[str], list[float]]:
    """Continue training every base model with SWAG's schedule and collect its moments.

    Args:
        setup: the problem (momentum, weight decay, batch size, augmentation from its recipe).
        base: stacked base models ``(M, ...)`` (checked).
        seeds: one data-stream seed per model.
        lr, epochs: the high learning rate and the length of the continued run.
        n_snapshots, rank: snapshots collected and deviations kept.
        progress: progress bar.
        snapshots: if a list, every flattened snapshot ``(M, d)`` is appended to it (tests).

    Returns:
        ``(moments, names, final_losses)``: the SWAG statistics over the flattened parameters ``names``,
        and each model's mean training loss over the last interval.
    """
    rec = setup.recipe
    steps_per_epoch = -(-setup.n_train // rec.batch_size)
    lrs, snaps = schedule(epochs * steps_per_epoch, n_snapshots, lr, rec.lr_at(rec.epochs - 1))
    snap_set = set(snaps)
    mom = Moments(rank)
    m = len(seeds)
    if setup.arch in _train.STACKED_GRADS:
        names = list(reference_state(setup))
        losses = torch.zeros(m, dtype=torch.float64)
        count = [0]

        def record(b: _train.Batch, state, loss: torch.Tensor) -> None:
            losses.add_(loss.detach().double().cpu())
            count[0] += 1
            if b.step in snap_set:
                flat = flatten(state[0], names)
                mom.collect(flat)
                if snapshots is not None:
                    snapshots.append(flat.detach().clone())
                if b.step != snaps[-1]:
                    losses.zero_()
                    count[0] = 0

        rule = loop.StackedSGD(rec, setup.arch, lr=lambda b: lrs[b.step])
        with bar(len(lrs), f"swag ({m} stacked)", enabled=progress, unit="step") as pb:
            loop.run(rule, rule.init({k: base[k].clone() for k in names}), seeds, setup.x, setup.y, rec,
                     fill=setup.fill[0], epochs=epochs, what="swag", on_step=record, bar=pb)
        return mom, names, (losses / max(count[0], 1)).tolist()
    # nn.Module path: one model after another, the snapshots of all models collected together
    per_model: list[list[torch.Tensor]] = []
    final = []
    with bar(len(lrs) * m, "swag (one by one)", enabled=progress, unit="step") as pb:
        for i, s in enumerate(seeds):
            model = new_module(setup, unstack(base, i))
            names = [k for k, _ in model.named_parameters()]
            snaps_i, acc = [], [0.0, 0]

            def record(b: _train.Batch, model, loss, snaps_i=snaps_i, acc=acc, names=names) -> None:
                acc[0], acc[1] = acc[0] + float(loss), acc[1] + 1
                if b.step in snap_set:
                    params = dict(model.named_parameters())
                    snaps_i.append(torch.cat([params[k].detach().reshape(-1) for k in names]))
                    if b.step != snaps[-1]:
                        acc[0], acc[1] = 0.0, 0

            rule = loop.ModuleSGD(rec, lr=lambda b: lrs[b.step])
            loop.run(rule, rule.init(model), [s], setup.x, setup.y, rec, fill=setup.fill, epochs=epochs,
                     what="swag", on_step=record, bar=pb)
            per_model.append(snaps_i)
            final.append(acc[0] / max(acc[1], 1))
    for k in range(n_snapshots):
        flat = torch.stack([snaps_i[k] for snaps_i in per_model])
        mom.collect(flat)
        if snapshots is not None:
            snapshots.append(flat.clone())
    return mom, names, final


def _check(*, lr: float | None = None, epochs: int | None = None, n_snapshots: int = 20, rank: int = 20,
           scale: float = 0.1, **_: object) -> None:
    """The values of SWAG's hyper-parameters (``None``: the recipe's default, checked when drawing)."""
    given = {"lr": lr, "epochs": epochs, "n_snapshots": n_snapshots, "scale": scale}
    check_positive(**{k: v for k, v in given.items() if v is not None})
    if isinstance(rank, bool) or not (isinstance(rank, int) and 2 <= rank):
        raise ValueError(f"rank must be an integer >= 2, got {rank!r}")


def _draw(
    req: Request,
    *,
    lr: float | None = None,
    epochs: int | None = None,
    n_snapshots: int = 20,
    rank: int = 20,
    scale: float = 0.1,
    var_clamp: float = 1e-30,
    bn_update: bool = True,
) -> SampleSet:
    """SWAG around each of ``n_modes`` base models, ``n_per_mode`` samples each.

    The continued runs' data streams and the Gaussian draws come from
    :func:`~symlib.posteriors.seeds.stream_seeds`.

    Args:
        lr: the high learning rate (default: the recipe's initial rate).
        epochs: length of the continued run (default ``2 * recipe.epochs``).
        n_snapshots: snapshots collected (20).
        rank: deviations kept, the rank of the low-rank part (20, SWAG's ``max_num_models``).
        scale: the sample scale :math:`s` (0.1, paper App. B.1).
        var_clamp: floor of the diagonal variance (SWAG's default 1e-30).
        bn_update: recompute BatchNorm statistics of every sample on the training set.

    Returns:
        The samples (``method="swag"``), diagnostics: each mode's mean loss over the last interval and
        the mean diagonal variance.
    """
    setup, n_modes, n_per_mode, base = req.setup, req.n_modes, req.n_per_mode, req.base
    lr = setup.recipe.lr if lr is None else lr
    epochs = 2 * setup.recipe.epochs if epochs is None else epochs
    _check(lr=lr, epochs=epochs, n_snapshots=n_snapshots, rank=rank, scale=scale)
    *data_seeds, draw_seed = stream_seeds(n_modes + 1, req.seed, "swag")
    mom, names, final = fit(
        setup, base, data_seeds, lr=lr, epochs=epochs, n_snapshots=n_snapshots, rank=rank,
        progress=req.progress,
    )
    flat = draw(mom, n_per_mode, generator(draw_seed), scale, var_clamp)  # (M, n, d)
    flat = flat.reshape(n_modes * n_per_mode, -1)
    rep = {k: v.repeat_interleave(n_per_mode, 0) for k, v in base.items()}
    shapes, dtypes = {k: rep[k].shape[1:] for k in names}, {k: rep[k].dtype for k in names}
    params = {**rep, **unflatten(flat, shapes, dtypes)}
    if bn_update and setup.arch != "optunet":
        for i in range(n_modes * n_per_mode):
            model = modules.bn_update(new_module(setup, unstack(params, i)), setup)
            for k, v in model.state_dict().items():
                params[k][i] = v.detach()
    return SampleSet(
        params=params,
        method="swag",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper={
            "lr": lr,
            "lr_start": setup.recipe.lr_at(setup.recipe.epochs - 1),
            "epochs": epochs,
            "n_snapshots": n_snapshots,
            "rank": rank,
            "scale": scale,
            "var_clamp": var_clamp,
            "bn_update": bn_update and setup.arch != "optunet",
            "momentum": setup.recipe.momentum,
            "weight_decay": setup.recipe.weight_decay,
            "schedule": "linear warm-up over the first of n_snapshots equal intervals, then constant lr",
        },
        diagnostics={
            "final_loss": final,
            "mean_diag_var": float(mom.var.clamp_min(0).mean()),
            "snapshots": mom.n,
        },
    )


METHOD = Method("swag", _draw, base="required", check=_check)
sample = METHOD.sampler()
