r"""The architecture of checkpoints, for the checkpoint layer (book: "symlib on your own network").

The :class:`~symlib.models.recipe.Recipe` itself lives with the networks (:mod:`symlib.models.recipe`);
this module adds what needs the symmetry and checkpoint layers: a recipe's traced symmetries
(:func:`spec`) and the recipe a folder records (:func:`of_folder`: a symlib manifest, or a Hugging Face or
timm ``config.json``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from symlib.errors import CheckpointError, InputShapeError
from symlib.models.recipe import BUILDERS, Recipe, from_config, load_factory, parse_shape

__all__ = ["BUILDERS", "SCALINGS", "Recipe", "from_config", "load_factory", "of_folder", "parse_shape",
           "spec"]

SCALINGS = {"all": "auto", "auto": "auto", "partial": "partial", "none": "none"}
"""``--scalings``: the command line's names of :func:`symlib.spec_of`'s ``scalings`` (``all`` is ``auto``)."""


def spec(recipe: Recipe, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu",
         origin: str = "given", scalings: str = "auto", vocab: int | None = None):
    """The network's symmetries, traced (:func:`symlib.spec_of`) on a freshly built copy of ``recipe``.

    Args:
        origin: where the input shape came from, for the message (``"--input-shape"``, ``"recorded by
            the set's manifest"``).
        scalings: which scaling symmetries to keep (``"auto"``/``"all"``, ``"partial"``, ``"none"``: as
            :func:`symlib.spec_of`; ``--scalings``).
        vocab: the vocabulary of a network that reads token ids (``--vocab``); by default a Hugging Face
            text model's ``vocab_size``.

    Raises:
        SymmetryError: the network runs but symlib cannot derive its symmetries (the message names the
            layer).
        CheckpointError: the network does not run on one input of the recipe's shape (naming the shape,
            where it came from and what the first layer takes); the tracer's own error is chained for
            ``--debug``.
    """
    from symlib.symmetry.trace import spec_of

    model = recipe.build()
    shape = recipe.shape(model)
    vocab = recipe.vocab if vocab is None else int(vocab)
    try:
        return spec_of(model.to(device, dtype), shape, scalings=SCALINGS.get(scalings, scalings), vocab=vocab)
    except InputShapeError as e:  # the forward pass on an input of this shape failed
        cause = e.__cause__ or e
        while cause.__cause__ is not None:  # the first error, not the tracer's wrapping of it
            cause = cause.__cause__
        e = cause
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise CheckpointError(
            f"{recipe.describe()} does not run on one input of shape {','.join(map(str, shape))} ({origin}): "
            f"{type(e).__name__}: {first}; pass the shape of one input without the batch axis "
            f"(--input-shape, input_shape=){_first_layer(model)}") from e


def _first_layer(model: torch.nn.Module) -> str:
    """``"; its first layer, conv1, takes 3 channels"``: what the first convolution or linear layer reads
    (empty when it has none)."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.conv._ConvNd):
            return f"; its first layer, {name}, takes {m.in_channels} channels"
        if isinstance(m, torch.nn.Linear):
            return f"; its first layer, {name}, takes {m.in_features} features"
    return ""


def of_folder(path: str | os.PathLike) -> Recipe | None:
    """The recipe a folder records: a symlib folder's manifest (:func:`symlib.store.architecture`) or a
    ``config.json`` (:func:`from_config`); ``None`` when it records none."""
    from symlib import store
    from symlib.ckpt import hf

    folder = Path(path)
    if store.kind_of(folder) is not None:
        return store.architecture(store.read_manifest(folder), str(folder))
    if (folder / hf.CONFIG).is_file():
        return from_config(folder, hf.config(folder))
    return None
