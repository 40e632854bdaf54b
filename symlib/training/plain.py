r"""The plain single-model loop: one ``nn.Module``, ``torch.optim.SGD`` (book: "Checkpoint zoos").

:func:`train_plain` sees exactly the batches and crops of the stacked trainer for the same seed
(:mod:`symlib.training.plans`); it is the reference the stacked trainer is tested and benchmarked
against, and the trainer of the paper-scale ResNet recipes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from symlib.params import Params
from symlib.training.plans import crop, epoch_plans, pad_images
from symlib.training.recipe import Recipe


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
    :func:`train_stacked` for ``seed``. Trains (and returns) a deep copy; ``model`` is not modified.

    This is the reference the stacked trainer is tested and benchmarked against, and the trainer of
    the paper-scale ResNet recipes.

    ``on_step``, if given, is called after every optimiser step with the global step index (from 0)
    and the model's state (``state_dict`` names, parameters and buffers) stacked with a leading axis
    of size 1 and detached, as :func:`train_stacked` passes its models (e.g. a
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
