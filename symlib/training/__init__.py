"""Training many networks fast (book: "Checkpoint zoos"; paper App. B.1).

* :mod:`~symlib.training.recipe`: SGD recipes and the paper's presets;
* :mod:`~symlib.training.plans`: what a seed determines (initialisation, data order, crops, mini-batches);
* :mod:`~symlib.training.optunet`: the OptuNet forward and backward passes of stacked models;
* :mod:`~symlib.training.stacked`: the stacked trainer (:func:`train_stacked`) and its step;
* :mod:`~symlib.training.plain`: the plain one-model loop it is tested against, and :func:`train_seeds`,
  one run of any ``nn.Module`` per seed, stacked (a checkpoint set of one's own network);
* :mod:`~symlib.training.loop`: one loop over stacked mini-batches with an update rule (the posterior
  methods' SGD, SWAG, VI and SGHMC steps).

The main names are re-exported here: ``symlib.training.train_stacked(...)``.
"""

from symlib.training.optunet import (
    OPTUNET_SHAPES,
    STACKED_FORWARD,
    STACKED_GRADS,
    STACKED_IMPLS,
    optunet_forward,
    optunet_loss_grads,
    step_function,
)
from symlib.training.plain import evaluate_model, train_plain, train_seeds
from symlib.training.plans import (
    DATA_ORDER,
    Batch,
    crop,
    epoch_plan,
    epoch_plans,
    init_model,
    init_params,
    minibatches,
    pad_images,
    streams,
)
from symlib.training.recipe import OPTUNET_MNIST, RESNET18_CIFAR100, RESNET18_TINYIMAGENET, Recipe
from symlib.training.stacked import evaluate_stacked, loss_and_grads, sgd_step, train_stacked

__all__ = [
    "Batch",
    "DATA_ORDER",
    "OPTUNET_MNIST",
    "OPTUNET_SHAPES",
    "RESNET18_CIFAR100",
    "RESNET18_TINYIMAGENET",
    "Recipe",
    "STACKED_FORWARD",
    "STACKED_GRADS",
    "STACKED_IMPLS",
    "crop",
    "epoch_plan",
    "epoch_plans",
    "evaluate_model",
    "evaluate_stacked",
    "init_model",
    "init_params",
    "loss_and_grads",
    "minibatches",
    "optunet_forward",
    "optunet_loss_grads",
    "pad_images",
    "sgd_step",
    "step_function",
    "streams",
    "train_plain",
    "train_seeds",
    "train_stacked",
]
