r"""The plain single-model loop: one ``nn.Module``, ``torch.optim.SGD`` (book: "Checkpoint zoos",
"symlib on your own network").

:func:`train_plain` sees exactly the batches and crops of the stacked trainer for the same seed
(:mod:`symlib.training.plans`); it is the reference the stacked trainer is tested and benchmarked
against, and the trainer of the paper-scale ResNet recipes. :func:`train_seeds` runs it once per seed
for any architecture, side by side on CPU threads, and stacks the results: a small checkpoint set of
one's own network.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from symlib import threads
from symlib.params import Params, stack
from symlib.training.plans import crop, epoch_plans, init_model, pad_images
from symlib.training.recipe import Recipe

__all__ = ["evaluate_model", "train_plain", "train_seeds"]


def train_plain(
    model: nn.Module,
    seed: int,
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    fill: float | Sequence[float] = 0.0,
    epochs: int | None = None,
    max_steps: int | None = None,
    on_step: Callable[[int, Params], None] | None = None,
) -> nn.Module:
    """The plain loop: one ``nn.Module``, ``torch.optim.SGD`` and the same batches and crops as
    :func:`~symlib.training.stacked.train_stacked` for ``seed``. Trains (and returns) a deep copy;
    ``model`` is not modified.

    This is the reference the stacked trainer is tested and benchmarked against, and the trainer of
    the paper-scale ResNet recipes.

    ``on_step``, if given, is called after every optimiser step with the global step index (from 0)
    and the model's state (``state_dict`` names, parameters and buffers) stacked with a leading axis
    of size 1 and detached, as :func:`~symlib.training.stacked.train_stacked` passes its models (e.g. a
    :class:`symlib.paper.permfreq.PermutationTracker`). The tensors are views of the live model: read them,
    do not modify them, and copy what you keep.
    """

    model = copy.deepcopy(model).to(x.device).train()
    opt = torch.optim.SGD(
        model.parameters(),
        lr=recipe.lr,
        momentum=recipe.momentum,
        weight_decay=recipe.weight_decay,
        nesterov=recipe.nesterov,
    )
    n, size = x.shape[0], x.shape[-1]
    xpad = pad_images(x, recipe.crop_padding, fill)
    step = 0
    for epoch in range(recipe.epochs if epochs is None else epochs):
        for group in opt.param_groups:
            group["lr"] = recipe.lr_at(epoch)
        perms, augs = epoch_plans([seed], epoch, n, recipe.crop_padding, recipe.flip, x.device)
        perm, aug = perms[0], augs[0]
        for start in range(0, n, recipe.batch_size):
            idx = perm[start : start + recipe.batch_size]
            xb = crop(xpad, idx, aug[start : start + recipe.batch_size], size)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), y[idx]).backward()
            opt.step()
            if on_step is not None:
                on_step(step, {k: v.detach().unsqueeze(0) for k, v in model.state_dict().items()})
            step += 1
            if max_steps is not None and step >= max_steps:
                return model
    return model


def train_seeds(
    make_model: Callable[[], nn.Module],
    seeds: Sequence[int],
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    fill: float | Sequence[float] = 0.0,
    epochs: int | None = None,
    workers: int | None = None,
) -> Params:
    r"""Train one copy of any architecture per seed and stack them: a checkpoint set ``{name: (S, ...)}``.

    Seed ``s`` draws the initial weights of ``make_model()`` from its initialisation stream
    (:func:`symlib.training.plans.init_model`) and its data order and crops from its data stream, and
    trains with :func:`train_plain`; the runs are independent, as the paper's target posterior assumes.
    The result holds every entry of the ``state_dict`` (parameters and buffers, e.g. BatchNorm running
    statistics), detached, in the order of ``seeds``, ready for :func:`symlib.mmd`, :func:`symlib.act`
    or :func:`symlib.canonicalize`.

    On a CPU the runs go side by side on ``workers`` threads with one intra-op thread each (small
    networks spend their time in thread synchronisation otherwise). Each run is computed with one
    intra-op thread whatever ``workers`` is, so the weights do not depend on it (float32 convolutions
    reduce in another order with more threads), unless the model draws random numbers in ``forward``
    (dropout uses PyTorch's global generator, shared by the threads). The initial weights of every
    seed are drawn first, on the calling thread: PyTorch's initialisers draw from the global generator,
    which threads seeding it at the same time would share.

    Args:
        make_model: builds the untrained network, e.g. the class of one's ``nn.Module``.
        seeds: one run per seed.
        x, y: training images ``(N, C, H, W)`` and labels ``(N,)``, on the device to train on.
        recipe: the SGD recipe (:class:`~symlib.training.recipe.Recipe`).
        fill: value of the padding of random crops (per channel or one number).
        epochs: train for this many epochs instead of ``recipe.epochs``.
        workers: threads on a CPU (default ``torch.get_num_threads()``, at most one per seed); 1 on CUDA.

    Returns:
        The stacked state dicts of the trained networks.
    """
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("train_seeds needs at least one seed")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct (equal seeds give identical runs), got {seeds}")

    def run(job: tuple[int, nn.Module]) -> Params:
        seed, model = job
        trained = train_plain(model, seed, x, y, recipe, fill=fill, epochs=epochs)
        return {k: v.detach().clone() for k, v in trained.state_dict().items()}

    if workers is None:
        workers = torch.get_num_threads() if x.device.type == "cpu" else 1
    k = max(1, min(int(workers), len(seeds)))
    jobs = [(s, init_model(make_model, s)) for s in seeds]  # one thread draws every initialisation
    with threads.single():
        if k == 1:
            return stack([run(job) for job in jobs])
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(k, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            return stack(list(pool.map(run, jobs)))


@torch.no_grad()
def evaluate_model(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of one model (eval mode) on ``(x, y)``."""
    was = model.training
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start : start + batch_size])
        yb = y[start : start + batch_size]
        correct += int((logits.argmax(-1) == yb).sum())
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
    model.train(was)
    return correct / x.shape[0], loss / x.shape[0]
