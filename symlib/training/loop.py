r"""One loop over mini-batches with an update rule (book: chapter "Table 1").

The posterior methods train in many ways (plain SGD with dropout masks, SWAG's restarted schedule with
snapshots, VI's reparameterised step, SGHMC's noisy step), but every one of them walks the same
mini-batches (:func:`symlib.training.plans.minibatches`: each model its own data order and crops) and
must stop with a clear error when a loss diverges. :func:`run` is that walk, written once; a method is
then an update *rule*, in the ``init``/``update`` spirit of optax and ``posteriors``: an object whose
``step(state, batch)`` returns the new state and the batch's loss (one value per model).

* :class:`StackedSGD`: ``torch.optim.SGD``'s step (:func:`~symlib.training.stacked.sgd_step`) on ``M``
  stacked models whose gradient :func:`~symlib.training.stacked.loss_and_grads` computes, with an
  optional learning-rate override and dropout mask per batch;
* :class:`ModuleSGD`: the same for one ``nn.Module`` through autograd and ``torch.optim.SGD`` (the
  architectures without a stacked gradient, one model at a time).

:func:`symlib.training.stacked.train_stacked`, the zoo trainer, keeps its own loop: it fuses the crops into
the compiled step and lets groups of models run unsynchronised on worker threads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from symlib.params import Params
from symlib.training.plans import Batch, check_images, minibatches
from symlib.training.recipe import Recipe
from symlib.training.stacked import loss_and_grads, sgd_step

__all__ = ["ModuleSGD", "Rule", "StackedSGD", "check_finite_loss", "run"]


class Rule(Protocol):
    """An update rule: ``step(state, batch) -> (state, loss)``, ``loss`` one value per model ``(M,)``."""

    def step(self, state: Any, batch: Batch) -> tuple[Any, torch.Tensor]:
        """One update from ``state`` on ``batch``: the new state and the batch's loss, one value per model
        ``(M,)`` (:func:`run` stops when one is not finite)."""
        ...


def check_finite_loss(loss: torch.Tensor, step: int, seeds: Sequence[int], what: str) -> None:
    """Stop with an error naming the step and the models whose loss is NaN or infinite."""
    bad = ~torch.isfinite(loss.detach().reshape(-1))
    if bad.any():
        which = [int(seeds[i]) for i in bad.nonzero().flatten().tolist()]
        raise FloatingPointError(
            f"{what}: non-finite loss at step {step} for the model(s) with seed(s) {which}; the run diverged "
            f"(lower the learning rate or check the data)"
        )


def run(
    rule: Rule,
    state: Any,
    seeds: Sequence[int],
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    *,
    fill: float | Sequence[float] = 0.0,
    epochs: int | None = None,
    what: str = "training",
    on_step: Callable[[Batch, Any, torch.Tensor], None] | None = None,
    bar=None,
) -> Any:
    """Walk the mini-batches of ``len(seeds)`` models and apply ``rule`` to each.

    Args:
        rule: the update (:class:`Rule`).
        state: its initial state.
        seeds: one data-stream seed per model (:func:`symlib.training.plans.streams`).
        x, y: training images ``(N, C, H, W)`` and labels, on the device to train on.
        recipe: batch size, augmentation and the learning-rate schedule (``batch.lr``).
        fill: value of the padding pixels of the crops.
        epochs: number of epochs (default ``recipe.epochs``).
        what: names the run in the error raised when a loss is not finite.
        on_step: called after every step with the batch, the new state and the loss (snapshots,
            statistics).
        bar: a progress bar advanced once per step.

    Returns:
        The final state.

    Raises:
        FloatingPointError: a model's loss is NaN or infinite (naming the step and the model's seed).
        ValueError: training images with NaN or infinite pixels (checked once, before the first step).
    """
    check_images(x, what)
    for batch in minibatches(seeds, x, y, recipe, fill, epochs):
        state, loss = rule.step(state, batch)
        check_finite_loss(loss, batch.step, seeds, what)
        if on_step is not None:
            on_step(batch, state, loss)
        if bar is not None:
            bar.update(1)
    return state


@dataclasses.dataclass
class StackedSGD:
    """``torch.optim.SGD`` on ``M`` stacked models of a stacked architecture; state ``(params, momentum
    buffers)``.

    Attributes:
        recipe: momentum, Nesterov and weight decay.
        arch: a key of :data:`symlib.training.optunet.STACKED_GRADS`.
        lr: the learning rate of a batch (default ``batch.lr``, the recipe's schedule).
        mask: the dropout multiplier of a batch's features before the last layer (default none).
    """

    recipe: Recipe
    arch: str = "optunet"
    lr: Callable[[Batch], float] | None = None
    mask: Callable[[Batch], torch.Tensor | None] | None = None

    def init(self, params: Params) -> tuple[Params, Params | None]:
        """The initial state: the stacked parameters and no momentum buffers yet."""
        return dict(params), None

    def step(self, state: tuple[Params, Params | None], batch: Batch):
        """Loss and gradient of every model on its own batch, then one SGD step (see :class:`Rule`)."""
        theta, bufs = state
        mask = self.mask(batch) if self.mask is not None else None
        loss, grads = loss_and_grads(theta, batch.x, batch.y, self.arch, feat_mask=mask)
        lr = self.lr(batch) if self.lr is not None else batch.lr
        theta, bufs = sgd_step(theta, grads, bufs, lr, self.recipe)
        return (theta, bufs), loss


@dataclasses.dataclass
class ModuleSGD:
    """``torch.optim.SGD`` on one ``nn.Module`` (cross-entropy through autograd); state: the module, trained
    in place.

    Attributes:
        recipe: momentum, Nesterov and weight decay.
        lr: the learning rate of a batch (default ``batch.lr``).
    """

    recipe: Recipe
    lr: Callable[[Batch], float] | None = None
    _opt: torch.optim.Optimizer | None = dataclasses.field(default=None, repr=False)

    def init(self, model: torch.nn.Module) -> torch.nn.Module:
        """The initial state: ``model`` in training mode, with a fresh ``torch.optim.SGD`` over its
        parameters."""
        r = self.recipe
        self._opt = torch.optim.SGD(
            model.parameters(), lr=r.lr, momentum=r.momentum, weight_decay=r.weight_decay, nesterov=r.nesterov
        )
        return model.train()

    def step(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.nn.Module, torch.Tensor]:
        """Cross-entropy of the model on ``batch.x[0]``, its backward pass and one optimiser step (none when
        the loss is not finite, so that :func:`run` can stop on it)."""
        if self._opt is None:
            self.init(model)
        for g in self._opt.param_groups:
            g["lr"] = self.lr(batch) if self.lr is not None else batch.lr
        self._opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch.x[0]), batch.y[0])
        if bool(torch.isfinite(loss)):
            loss.backward()
            self._opt.step()
        return model, loss.detach().reshape(1)
