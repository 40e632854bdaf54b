"""Load or describe any checkpoint folder: a zoo or a posterior sample set (book: "Checkpoint zoos").

Zoos (:mod:`symlib.zoo`) and posterior sample sets (:mod:`symlib.posteriors.io`) share one on-disk format
(:mod:`symlib.store`); their manifests say which kind a folder holds. :func:`load` and :func:`info`
dispatch on it, so a deep ensemble, 1,000 target checkpoints and 100 SWAG draws load alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from symlib import store, zoo
from symlib.posteriors import io as _posterior_io

__all__ = ["info", "load"]


def _kind(path: Path) -> str:
    kind = store.kind_of(path)
    if kind is None:  # no readable manifest of this format: let the zoo reader say what is wrong
        zoo.chunks.read_manifest(path)
    return kind or "zoo"


def load(
    path: str | os.PathLike, as_: str = "stacked", device: str | torch.device = "cpu"
) -> tuple[Any, dict[str, Any]]:
    """A whole checkpoint folder, every file checked: ``(params, manifest)``.

    Args:
        path: a zoo folder or a posterior sample set.
        as_: ``"stacked"``: ``{name: (n, ...)}`` (network ``i`` at index ``i``); ``"models"``: a list of
            eval-mode ``nn.Module`` (for the architectures of :mod:`symlib.models`).
        device: where to put the tensors.

    Raises:
        symlib.store.StoreError: naming the file, for a missing or corrupt manifest or chunk, another
            architecture, NaN weights, or missing networks.
    """
    if as_ not in ("stacked", "models"):
        raise ValueError(f"as_ must be 'stacked' or 'models', got {as_!r}")
    path = Path(path)
    if _kind(path) == _posterior_io.KIND:
        params, man = _posterior_io.load_params(path, device)
        return (params, man) if as_ == "stacked" else (_posterior_io.models(params, man), man)
    return zoo.load(path, as_=as_, device=device)


def info(path: str | os.PathLike) -> str:
    """A human-readable summary of a zoo (also an incomplete one or a shard) or a posterior sample set."""
    path = Path(path)
    if _kind(path) == _posterior_io.KIND:
        return _posterior_io.info(path)
    return zoo.info(path)
