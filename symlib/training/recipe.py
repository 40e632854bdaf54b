r"""SGD training recipes and the paper's presets (book: "Checkpoint zoos"; paper App. B.1).

A :class:`Recipe` is everything an SGD run needs besides its seed and data: epochs, batch size, learning
rate and its schedule, momentum, weight decay and the augmentation (random crops, flips). Both trainers
(:func:`symlib.training.stacked.train_stacked` and :func:`symlib.training.plain.train_plain`) and every
posterior method read it.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["OPTUNET_MNIST", "RESNET18_CIFAR100", "RESNET18_TINYIMAGENET", "Recipe"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An SGD training recipe (paper App. B.1).

    Attributes:
        epochs: passes over the training set.
        batch_size: images per step (the last batch of an epoch may be smaller).
        lr: initial learning rate.
        momentum: SGD momentum (0 for plain SGD).
        weight_decay: L2 coefficient added to the gradient, as in ``torch.optim.SGD``.
        nesterov: Nesterov momentum.
        schedule: ``"step"`` (multiply by ``gamma`` at each of ``milestones``) or ``"cosine"``
            (cosine annealing to 0 over ``epochs``), stepped once per epoch.
        milestones: epochs at which a step schedule decays.
        gamma: decay factor of a step schedule.
        crop_padding: random crop back to the input size after padding by this many pixels (0: none).
        flip: random horizontal flips.
    """

    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    schedule: str = "step"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    crop_padding: int = 0
    flip: bool = False

    def __post_init__(self):
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")
        if self.schedule not in ("step", "cosine"):
            raise ValueError(f"schedule must be 'step' or 'cosine', got {self.schedule!r}")
        if self.nesterov and self.momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")

    def lr_at(self, epoch: int) -> float:
        r"""Learning rate during ``epoch`` (0-based), as ``MultiStepLR`` / ``CosineAnnealingLR`` give it:
        :math:`\eta_0 \gamma^{\#\{m \le e\}}` or :math:`\tfrac{\eta_0}{2}(1 + \cos(\pi e / E))`."""
        if self.schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / self.epochs))
        return self.lr * self.gamma ** sum(1 for m in self.milestones if m <= epoch)

    def scaled(self, epochs: int) -> Recipe:
        """The same recipe over ``epochs`` epochs, milestones shrunk in proportion (distinct, >= 1)."""
        if epochs == self.epochs:
            return self
        ms = tuple(
            sorted({max(1, round(m * epochs / self.epochs)) for m in self.milestones if m < self.epochs})
        )
        return dataclasses.replace(self, epochs=epochs, milestones=tuple(m for m in ms if m < epochs))


# The paper's recipes (App. B.1). OptuNet: no momentum is mentioned; weight decay 2e-4 as in the
# authors' public "OptuMNIST" sibling; random crop 28 with padding 4.
OPTUNET_MNIST = Recipe(
    epochs=60, batch_size=64, lr=0.04, weight_decay=2e-4, milestones=(15, 30), gamma=0.5, crop_padding=4
)


RESNET18_CIFAR100 = Recipe(
    epochs=75,
    batch_size=128,
    lr=0.1,
    momentum=0.9,
    weight_decay=5e-4,
    nesterov=True,
    milestones=(25, 50),
    gamma=0.1,
    crop_padding=4,
    flip=True,
)


RESNET18_TINYIMAGENET = Recipe(
    epochs=200,
    batch_size=128,
    lr=0.2,
    momentum=0.9,
    weight_decay=5e-4,
    schedule="cosine",
    crop_padding=4,
    flip=True,
)
