r"""Training networks for the posterior methods: deep-ensemble members, MC-dropout networks and base
models (book: chapter "Table 1"; paper App. B.1).

:func:`train_models` trains one network per seed with a recipe, through the one mini-batch loop of
:mod:`symlib.training.loop`: stacked for the architectures with a stacked gradient (OptuNet), one
``nn.Module`` after another otherwise. With ``dropout = p > 0`` every model and image draws its own
mask on the features before the last layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from symlib import training as _train
from symlib.params import Params, stack, state_of
from symlib.posteriors.base import Setup, reference_state
from symlib.posteriors.modules import init_stacked, last_dropout, new_module
from symlib.posteriors.seeds import generator
from symlib.progress import bar
from symlib.training import loop

__all__ = ["train_models"]


def _dropout_mask(gen: torch.Generator, shape: tuple[int, ...], p: float, device, dtype) -> torch.Tensor:
    keep = torch.rand(shape, generator=gen, device=device) >= p
    return keep.to(dtype) / (1.0 - p)


def train_models(
    setup: Setup,
    seeds: Sequence[int],
    *,
    dropout: float = 0.0,
    recipe: _train.Recipe | None = None,
    progress: bool = True,
    desc: str = "train",
    mask_seed: int = 0,
) -> Params:
    """Train one network per seed with the setup's recipe; return their stacked state dicts.

    Stacked architectures (:data:`symlib.training.optunet.STACKED_GRADS`): all models at once, by the zoo
    trainer (:func:`symlib.training.stacked.train_stacked`) without dropout, by
    :class:`symlib.training.loop.StackedSGD` with ``dropout = p > 0``, where each model and image draws its
    own mask on the features before the last layer (entries 0 or ``1 / (1 - p)``) from ``mask_seed``.
    Other architectures: one ``nn.Module`` after another with ``torch.optim.SGD`` on the same batches
    (the module's ``dropout`` layer set to ``p``, its masks from the global RNG seeded with ``mask_seed``).

    Raises:
        FloatingPointError: naming the step and seeds, if a loss becomes NaN or infinite.
    """
    rec = recipe or setup.recipe
    steps = rec.epochs * -(-setup.n_train // rec.batch_size)
    if setup.arch in _train.STACKED_GRADS and not dropout:
        # the zoo trainer: the crops fused into the compiled step, groups of models unsynchronised on
        # their threads; the same weights as the loop below, bit for bit (tested), several times faster
        n_epochs = rec.epochs
        with bar(n_epochs, f"{desc} ({len(seeds)} stacked)", enabled=progress, unit="epoch") as pb:
            theta = _train.train_stacked(init_stacked(setup, seeds), seeds, setup.x, setup.y, rec,
                                         fill=setup.fill[0], arch=setup.arch,
                                         on_epoch=lambda _epoch: pb.update(1))
        finite = torch.stack([torch.isfinite(v.reshape(len(seeds), -1)).all(1) for v in theta.values()])
        finite = finite.all(0)
        if not bool(finite.all()):  # find the step it diverged at, for the error: the loop, on those seeds
            bad = [s for s, ok in zip(seeds, finite.tolist(), strict=True) if not ok]
            rule = loop.StackedSGD(rec, setup.arch)
            loop.run(rule, rule.init(init_stacked(setup, bad)), bad, setup.x, setup.y, rec,
                     fill=setup.fill[0], what=desc)
            raise FloatingPointError(f"{desc}: the weights of the model(s) with seed(s) {bad} are not "
                                     f"finite; the run diverged (lower the learning rate or check the data)")
        return theta
    if setup.arch in _train.STACKED_GRADS:
        gen = generator(mask_seed, setup.device)
        width = reference_state(setup)["fc.weight"][1]  # the features before the last layer

        def mask(b: _train.Batch) -> torch.Tensor | None:
            if not dropout:
                return None
            return _dropout_mask(gen, (len(seeds), width, b.x.shape[1]), dropout, setup.device, b.x.dtype)

        rule = loop.StackedSGD(rec, setup.arch, mask=mask)
        with bar(steps, f"{desc} ({len(seeds)} stacked)", enabled=progress, unit="step") as pb:
            theta, _ = loop.run(rule, rule.init(init_stacked(setup, seeds)), seeds, setup.x, setup.y, rec,
                                fill=setup.fill[0], what=desc, bar=pb)
        return theta
    # the dropout layers draw their masks from the global RNG: seed it, and restore it afterwards
    devices = [setup.device] if setup.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(mask_seed % (2**63))
        if devices:
            torch.cuda.manual_seed(mask_seed % (2**63))
        states = []
        with bar(steps * len(seeds), f"{desc} (one by one)", enabled=progress, unit="step") as pb:
            for s in seeds:
                model = new_module(setup, seed=s)
                if dropout:
                    last_dropout(model).p = dropout
                rule = loop.ModuleSGD(rec)
                model = loop.run(rule, rule.init(model), [s], setup.x, setup.y, rec, fill=setup.fill,
                                 what=desc, bar=pb)
                if dropout:
                    last_dropout(model).p = 0.0
                states.append(state_of(model))
        return stack(states)
