r"""``nn.Module`` helpers of a training problem: fresh or loaded modules on its device, the dropout layer
before the last layer, BatchNorm statistics recomputed for new weights (book: chapter "Table 1")."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from symlib import training as _train
from symlib.params import Params
from symlib.posteriors.base import Setup

__all__ = ["bn_update", "init_stacked", "last_dropout", "new_module"]


def init_stacked(setup: Setup, seeds: Sequence[int]) -> Params:
    """The initial weights of one model per seed, stacked, on the setup's device and in its data's
    floating dtype (float64 problems train float64 networks)."""
    return {
        k: v.to(setup.device, setup.x.dtype) for k, v in _train.init_params(setup.make_model, seeds).items()
    }


def new_module(setup: Setup, state: Params | None = None, seed: int | None = None) -> torch.nn.Module:
    """A module of the setup's architecture on its device and in its data's dtype: ``seed``'s
    initialisation, or ``state``."""
    model = _train.init_model(setup.make_model, seed) if seed is not None else setup.make_model()
    model = model.to(setup.device, setup.x.dtype)
    if state is not None:
        model.load_state_dict(state)
    return model


def last_dropout(model: torch.nn.Module) -> torch.nn.Dropout:
    """The ``dropout`` layer before the last linear layer (``model.dropout``), or a clear error."""
    d = getattr(model, "dropout", None)
    if not isinstance(d, torch.nn.Dropout) or not isinstance(getattr(model, "fc", None), torch.nn.Linear):
        raise ValueError(
            f"{type(model).__name__} has no dropout layer before its last layer (expected attributes "
            f"'dropout' (nn.Dropout) and 'fc' (nn.Linear)); MC dropout needs one: use OptuNet or "
            f"ResNet18/ResNet20, which have it"
        )
    return d


@torch.no_grad()
def bn_update(model: torch.nn.Module, setup: Setup, batch_size: int | None = None) -> torch.nn.Module:
    """Recompute BatchNorm running statistics over the training set (cumulative average, as SWAG's
    ``bn_update``), for weights that were not trained with these statistics. No-op without BatchNorm."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model
    was = model.training
    model.train()
    moms = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    bs = batch_size or setup.recipe.batch_size
    for s in range(0, setup.n_train, bs):
        model(setup.x[s : s + bs])
    for m, mom in zip(bns, moms, strict=True):
        m.momentum = mom
    model.train(was)
    return model
