r"""The stacked trainer: ``M`` models trained at once, each on its own batches (book: "Checkpoint zoos").

:func:`train_stacked` trains a zoo's models side by side: every step computes the loss and gradient of
all ``M`` models (:func:`loss_and_grads`, one of the implementations of :mod:`symlib.training.optunet`)
on their own mini-batches and crops (:mod:`symlib.training.plans`), then one SGD step on a flat
parameter buffer (``torch.optim.SGD``'s arithmetic: weight decay, momentum, Nesterov; :func:`sgd_step`
is the same step on a dict of tensors). On CPU the models are split into groups computed side by side by
worker threads with one intra-op thread each; without a per-step hook every group trains on its own
thread from start to end. Whole runs are tested equal to :func:`symlib.training.plain.train_plain`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from symlib import threads
from symlib.params import Params
from symlib.training.optunet import STACKED_FORWARD, optunet_loss_grads_native, step_function
from symlib.training.plans import batch_plans, check_images, crop_rows, cutter, pad_images
from symlib.training.recipe import Recipe

__all__ = ["evaluate_stacked", "loss_and_grads", "sgd_step", "train_stacked"]


def sgd_step(
    params: Params, grads: Params, bufs: Params | None, lr: float, recipe: Recipe
) -> tuple[Params, Params]:
    r"""One ``torch.optim.SGD`` step on stacked tensors (dampening 0): with :math:`d = g + \lambda\theta`,
    :math:`b \leftarrow \mu b + d` (:math:`b = d` at the first step), :math:`d \leftarrow d + \mu b`
    (Nesterov) or :math:`b`, then :math:`\theta \leftarrow \theta - \eta d`.

    Returns new ``(params, bufs)``; the inputs are not modified.
    """
    new_p, new_b = {}, {}
    for k, p in params.items():
        d = grads[k]
        if recipe.weight_decay:
            d = d.add(p, alpha=recipe.weight_decay)
        if recipe.momentum:
            b = d.clone() if bufs is None else bufs[k].mul(recipe.momentum).add_(d)
            new_b[k] = b
            d = d.add(b, alpha=recipe.momentum) if recipe.nesterov else b
        new_p[k] = p.add(d, alpha=-lr)
    return new_p, new_b


def loss_and_grads(
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    arch: str = "optunet",
    feat_mask: torch.Tensor | None = None,
    impl: str | None = None,
    workers: int | None = None,
) -> tuple[torch.Tensor, Params]:
    """Mean cross-entropy of ``M`` stacked models, each on its own batch, and its gradient.

    Args:
        params: stacked parameters ``{name: (M, ...)}``.
        x: ``(M, B, C, H, W)`` images; y: ``(M, B)`` labels.
        arch: a key of :data:`~symlib.training.optunet.STACKED_GRADS`.
        feat_mask: optional dropout multiplier of the features before the last layer (see
            :func:`~symlib.training.optunet.optunet_loss_grads`).
        impl: ``"native"`` (the fused compiled CPU kernel, :mod:`symlib.kernels`), ``"matmul"``
            (hand-written PyTorch products), ``"conv"`` (grouped convolutions) or ``None``: the device's
            default (``"conv"`` on CUDA, ``"native"`` on CPU where a C++ compiler is available, else
            ``"matmul"``).
        workers: on CPU, split the models into this many groups computed side by side by a persistent
            pool of as many threads, one intra-op thread each (default: ``torch.get_num_threads()``; 1 on
            CUDA), as :func:`train_stacked` does. The models are independent: the result does not depend
            on it.

    Returns:
        ``(loss (M,), grads)`` with ``grads`` shaped like ``params``.
    """
    fn = step_function(arch, impl, x.device)
    extra = {} if feat_mask is None else {"feat_mask": feat_mask}
    m = x.shape[0]
    if workers is None:
        workers = torch.get_num_threads() if x.device.type == "cpu" else 1
    k = max(1, min(workers, m))
    if k == 1:
        return fn(params, x, y, **extra)

    def work(sl: slice) -> tuple[torch.Tensor, Params]:
        return fn({n: v[sl] for n, v in params.items()}, x[sl], y[sl], **{n: v[sl] for n, v in extra.items()})

    with threads.single():
        parts = list(_shared_pool(k).map(work, _groups(m, k)))
    loss = torch.cat([p[0] for p in parts])
    return loss, {n: torch.cat([p[1][n] for p in parts]) for n in parts[0][1]}


def _groups(m: int, k: int) -> list[slice]:
    """``k`` consecutive, near-equal slices covering ``range(m)``."""
    bounds = [m * i // k for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@functools.cache
def _shared_pool(k: int):
    """A process-wide pool of ``k`` threads with one intra-op thread each (see :func:`_model_threads`)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(k, initializer=torch.set_num_threads, initargs=(1,), thread_name_prefix="sym")


class _FlatSGD:
    """:func:`sgd_step` on one flat ``(M, P)`` buffer: a step is a handful of operations on all the
    parameters at once, whatever their number; :meth:`params` are views of a fresh buffer every step
    (never modified afterwards, as :func:`sgd_step` gives new tensors)."""

    def __init__(self, params: Params, recipe: Recipe):
        self.names = list(params)
        self.shapes = [params[k].shape for k in self.names]
        self.m = self.shapes[0][0]
        self.flat = torch.cat([params[k].reshape(self.m, -1) for k in self.names], 1)
        self.sizes = [math.prod(s[1:]) for s in self.shapes]
        self.recipe, self.buf = recipe, None

    def params(self) -> Params:
        parts = self.flat.split(self.sizes, 1)
        return {k: p.view(s) for k, p, s in zip(self.names, parts, self.shapes, strict=True)}

    def step(self, grads: Sequence[Params], lr: float) -> Params:
        """One step from the gradients of consecutive groups of models (together all ``M``)."""
        r = self.recipe
        rows = [torch.cat([g[k].reshape(g[k].shape[0], -1) for k in self.names], 1) for g in grads]
        d = rows[0] if len(rows) == 1 else torch.cat(rows, 0)  # (M, P)
        if r.weight_decay:
            d.add_(self.flat, alpha=r.weight_decay)
        if r.momentum:
            self.buf = d.clone() if self.buf is None else self.buf.mul_(r.momentum).add_(d)
            d = d.add_(self.buf, alpha=r.momentum) if r.nesterov else self.buf
        self.flat = self.flat.add(d, alpha=-lr)
        return self.params()


def train_stacked(
    params: Params,
    seeds: Sequence[int],
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    fill: float | Sequence[float] = 0.0,
    arch: str = "optunet",
    epochs: int | None = None,
    max_steps: int | None = None,
    on_epoch: Callable[[int], None] | None = None,
    on_step: Callable[[int, Params], None] | None = None,
    impl: str | None = None,
    tf32: bool = False,
    workers: int | None = None,
) -> Params:
    """Train ``M = len(seeds)`` models at once, each on its own mini-batches and crops.

    Args:
        params: initial stacked parameters ``{name: (M, ...)}`` (not modified).
        seeds: one seed per model (its data order and augmentation stream,
            :func:`~symlib.training.plans.streams`).
        x, y: training images ``(N, C, H, W)`` and labels ``(N,)``, on the device to train on.
        recipe: optimiser, schedule and augmentation.
        fill: value of the padding pixels (black in the normalised scale).
        arch: a key of :data:`~symlib.training.optunet.STACKED_GRADS`.
        epochs: train for this many epochs (default ``recipe.epochs``).
        max_steps: stop after this many steps in total (for tests).
        on_epoch: called with the epoch index after every epoch (progress bars).
        on_step: called after every step with the global step index and the updated stacked
            parameters (do not modify them; cheap per-step statistics such as permutation tracking).
        impl: the step's implementation, ``"native"``, ``"matmul"`` or ``"conv"`` (default: ``"conv"`` on
            CUDA, ``"native"`` on CPU where the compiled kernel builds, else ``"matmul"``; all compute the
            same gradient; see :func:`loss_and_grads`).
        tf32: let the CUDA path use TF32 products (faster, about 3 decimal digits); default full FP32.
        workers: on CPU, split the models into this many groups computed side by side by as many
            threads, one intra-op thread each (default: ``torch.get_num_threads()``; 1 on CUDA). The
            models are independent, so the result does not depend on it. Without ``on_step`` each group
            trains on its own thread from start to end (no barrier at every step; ``on_epoch`` then
            follows the first group); with it, the groups advance in lockstep so that the hook sees
            every model after every step.

    Returns:
        The trained stacked parameters.

    Raises:
        ValueError: training images with NaN or infinite pixels (checked once, before the first step).
    """
    check_images(x, "train_stacked")
    fn = step_function(arch, impl, x.device)
    fused = None  # the kernel's entry with the crop fused into it, where it applies
    if fn is optunet_loss_grads_native and cutter(x, recipe) is crop_rows:
        from symlib import kernels

        fused = kernels.optunet_loss_grads_crop
    if tf32:
        fn = functools.partial(fn, tf32=True)
    m = len(seeds)
    if any(p.shape[0] != m for p in params.values()):
        raise ValueError(
            f"params must be stacked for {m} models; got shapes {[tuple(p.shape) for p in params.values()]}"
        )
    opt = _FlatSGD({k: v.detach().to(x.device) for k, v in params.items()}, recipe)
    theta = opt.params()
    n, size = x.shape[0], x.shape[-1]
    xpad = pad_images(x, recipe.crop_padding, fill)
    cut = cutter(x, recipe)
    if workers is None:
        workers = torch.get_num_threads() if x.device.type == "cpu" else 1
    groups = _groups(m, max(1, min(workers, m)))

    def work(sl: slice, th: Params, idx: torch.Tensor, aug: torch.Tensor) -> Params:
        part = {k: v[sl] for k, v in th.items()}
        if fused is not None:
            return fused(part, xpad, idx[sl], aug[sl], y[idx[sl]])[1]
        return fn(part, cut(xpad, idx[sl], aug[sl], size), y[idx[sl]])[1]

    if len(groups) > 1 and on_step is None:
        # No per-step hook needs all the models at once: every group trains on its own thread from start
        # to end (its own data plans, which depend on the seed only, and its own SGD buffer), without a
        # barrier at every step. Same results as the lockstep loop below.
        def run_group(i: int) -> Params:
            sl = groups[i]
            opt_g = _FlatSGD({k: v[sl] for k, v in theta.items()}, recipe)
            th = opt_g.params()
            for epoch, step, lr, last, idx, aug in batch_plans(seeds[sl], n, recipe, epochs, x.device):
                th = opt_g.step([work(slice(None), th, idx, aug)], lr)
                if max_steps is not None and step + 1 >= max_steps:
                    break
                if last and on_epoch is not None and i == 0:
                    on_epoch(epoch)  # progress: the first group's epochs
            return th

        with _model_threads(len(groups)) as pool:
            done = list(pool.map(run_group, range(len(groups))))
        return {k: torch.cat([d[k] for d in done]) for k in theta}

    with _model_threads(len(groups)) as pool:
        for epoch, step, lr, last, idx, aug in batch_plans(seeds, n, recipe, epochs, x.device):
            if pool is None:
                grads = [work(groups[0], theta, idx, aug)]
            else:
                grads = list(pool.map(lambda sl, th=theta, i=idx, a=aug: work(sl, th, i, a), groups))
            theta = opt.step(grads, lr)
            if on_step is not None:
                on_step(step, theta)
            if max_steps is not None and step + 1 >= max_steps:
                return theta
            if last and on_epoch is not None:
                on_epoch(epoch)
    return theta


@contextlib.contextmanager
def _model_threads(k: int):
    """``k`` worker threads with one intra-op thread each (``None`` for ``k = 1``): the models of a step are
    split into ``k`` groups computed side by side. Each PyTorch operator releases the GIL, and one thread
    per group avoids the intra-op synchronisation that dominates tiny operators on a busy CPU."""
    if k <= 1:
        yield None
        return
    from concurrent.futures import ThreadPoolExecutor

    with threads.single(), ThreadPoolExecutor(k, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        yield pool


@torch.no_grad()
def evaluate_stacked(
    params: Params, x: torch.Tensor, y: torch.Tensor, arch: str = "optunet", batch_size: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy and mean cross-entropy of every stacked model on ``(x, y)``: two ``(M,)`` tensors."""
    forward = STACKED_FORWARD[arch]
    m = next(iter(params.values())).shape[0]
    correct = torch.zeros(m, dtype=torch.float64, device=x.device)
    loss = torch.zeros(m, dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[0], batch_size):
        logits = forward(params, x[start : start + batch_size])
        yb = y[start : start + batch_size]
        correct += (logits.argmax(-1) == yb).sum(1)
        loss += F.cross_entropy(logits.transpose(1, 2), yb.expand(m, -1), reduction="none").sum(1).double()
    return (correct / x.shape[0]).float(), (loss / x.shape[0]).float()
