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
import torch.nn.functional as F

from symlib import train as _train
from symlib.posteriors import sampling
from symlib.posteriors.base import Params, SampleSet, Setup


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
        return torch.stack(self.devs, 1)

    @property
    def var(self) -> torch.Tensor:
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


def _flat(params: Params, names: list[str]) -> torch.Tensor:
    return torch.cat([params[k].reshape(params[k].shape[0], -1) for k in names], 1)


def _unflat(vec: torch.Tensor, like: Params, names: list[str]) -> Params:
    out, i = {}, 0
    for k in names:
        shape = like[k].shape[1:]
        size = math.prod(shape)
        out[k] = vec[:, i : i + size].reshape(vec.shape[0], *shape).to(like[k].dtype)
        i += size
    return out


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
    from symlib.progress import bar

    rec = setup.recipe
    steps_per_epoch = -(-setup.n_train // rec.batch_size)
    lrs, snaps = schedule(epochs * steps_per_epoch, n_snapshots, lr, rec.lr_at(rec.epochs - 1))
    snap_set = set(snaps)
    mom = Moments(rank)
    m = len(seeds)
    losses = torch.zeros(m, dtype=torch.float64)
    count = 0
    if setup.arch == "optunet":
        names = list(_train.OPTUNET_SHAPES)
        theta = {k: base[k].clone() for k in names}
        bufs = None
        with bar(len(lrs), f"swag ({m} stacked)", enabled=progress, unit="step") as pb:
            for b in _train.minibatches(seeds, setup.x, setup.y, rec, setup.fill[0], epochs=epochs):
                loss, grads = _train.loss_and_grads(theta, b.x, b.y, "optunet")
                sampling.check_finite_loss(loss, b.step, seeds, "swag")
                theta, bufs = _train.sgd_step(theta, grads, bufs, lrs[b.step], rec)
                losses += loss.detach().double().cpu()
                count += 1
                if b.step in snap_set:
                    flat = _flat(theta, names)
                    mom.collect(flat)
                    if snapshots is not None:
                        snapshots.append(flat.detach().clone())
                    if b.step != snaps[-1]:
                        losses.zero_()
                        count = 0
                pb.update(1)
        return mom, names, (losses / max(count, 1)).tolist()
    # nn.Module path: one model after another, the snapshots of all models collected together
    per_model: list[list[torch.Tensor]] = []
    final = []
    with bar(len(lrs) * m, "swag (one by one)", enabled=progress, unit="step") as pb:
        for i, s in enumerate(seeds):
            model = sampling.new_module(setup, sampling.unstack(base, i)).train()
            names = [k for k, _ in model.named_parameters()]
            opt = torch.optim.SGD(
                model.parameters(),
                lr=lrs[0],
                momentum=rec.momentum,
                weight_decay=rec.weight_decay,
                nesterov=rec.nesterov,
            )
            snaps_i, run_loss, cnt = [], 0.0, 0
            for b in _train.minibatches([s], setup.x, setup.y, rec, setup.fill, epochs=epochs):
                for g in opt.param_groups:
                    g["lr"] = lrs[b.step]
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(b.x[0]), b.y[0])
                sampling.check_finite_loss(loss, b.step, [s], "swag")
                loss.backward()
                opt.step()
                run_loss, cnt = run_loss + float(loss.detach()), cnt + 1
                if b.step in snap_set:
                    params = dict(model.named_parameters())
                    snaps_i.append(torch.cat([params[k].detach().reshape(-1) for k in names]))
                    if b.step != snaps[-1]:
                        run_loss, cnt = 0.0, 0
                pb.update(1)
            per_model.append(snaps_i)
            final.append(run_loss / max(cnt, 1))
    for k in range(n_snapshots):
        flat = torch.stack([snaps_i[k] for snaps_i in per_model])
        mom.collect(flat)
        if snapshots is not None:
            snapshots.append(flat.clone())
    return mom, names, final


def sample(
    setup: Setup,
    n_modes: int,
    n_per_mode: int,
    seed: int = 0,
    *,
    base: Params | None = None,
    progress: bool = True,
    lr: float | None = None,
    epochs: int | None = None,
    n_snapshots: int = 20,
    rank: int = 20,
    scale: float = 0.1,
    var_clamp: float = 1e-30,
    bn_update: bool = True,
) -> SampleSet:
    """SWAG around each of ``n_modes`` base models, ``n_per_mode`` samples each.

    Args:
        setup: the training problem.
        n_modes, n_per_mode: sizes.
        seed: run seed (data streams and Gaussian draws from
            :func:`~symlib.posteriors.sampling.stream_seeds`).
        base: the stacked base models ``(n_modes, ...)`` (required).
        progress: progress bar.
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
    sampling.check_sizes(n_modes, n_per_mode)
    base = sampling.check_base(setup, base, n_modes, "swag")
    lr = setup.recipe.lr if lr is None else lr
    epochs = 2 * setup.recipe.epochs if epochs is None else epochs
    sampling.check_positive(lr=lr, epochs=epochs, n_snapshots=n_snapshots, scale=scale)
    if not (isinstance(rank, int) and 2 <= rank):
        raise ValueError(f"rank must be an integer >= 2, got {rank!r}")
    *data_seeds, draw_seed = sampling.stream_seeds(n_modes + 1, seed, "swag")
    mom, names, final = fit(
        setup, base, data_seeds, lr=lr, epochs=epochs, n_snapshots=n_snapshots, rank=rank, progress=progress
    )
    flat = draw(mom, n_per_mode, sampling.generator(draw_seed), scale, var_clamp)  # (M, n, d)
    flat = flat.reshape(n_modes * n_per_mode, -1)
    rep = {k: v.repeat_interleave(n_per_mode, 0) for k, v in base.items()}
    params = {**rep, **_unflat(flat, rep, names)}
    if bn_update and setup.arch != "optunet":
        for i in range(n_modes * n_per_mode):
            model = sampling.bn_update(sampling.new_module(setup, sampling.unstack(params, i)), setup)
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
