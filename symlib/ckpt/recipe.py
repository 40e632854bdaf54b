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

from symlib.models.recipe import BUILDERS, Recipe, from_config, load_factory, parse_shape

__all__ = ["BUILDERS", "Recipe", "from_config", "load_factory", "of_folder", "parse_shape", "spec"]


def spec(recipe: Recipe, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu"):
    """The network's symmetries, traced (:func:`symlib.spec_of`) on a freshly built copy of ``recipe``."""
    from symlib.symmetry.trace import spec_of

    model = recipe.build()
    return spec_of(model.to(device, dtype), recipe.shape(model))


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
