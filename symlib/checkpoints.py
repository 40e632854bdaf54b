"""Load or describe any checkpoint folder: a zoo or a posterior sample set (book: "Checkpoint zoos").

Zoos (:mod:`symlib.zoo`) and posterior sample sets (:mod:`symlib.posteriors.io`) share one on-disk format
(:mod:`symlib.store`); their manifests say which kind a folder holds. :func:`load` and :func:`info`
dispatch on it, so a deep ensemble, 1,000 target checkpoints and 100 SWAG draws load alike. Both also read
exported datasets (:mod:`symlib.zoo.dataset`: every chunk is first checked against the sha256 of the
dataset's manifest table, and every row of the table against the manifest and the chunks) and
``hf://owner/name`` addresses (resolved through ``huggingface_hub``'s cache).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from symlib import store, zoo
from symlib.posteriors import io as _posterior_io
from symlib.zoo import dataset as _dataset

__all__ = ["info", "load"]


def _resolve(path: str | os.PathLike) -> Path:
    """A local folder for ``path`` (``hf://`` resolved); an exported dataset is verified first."""
    path = _dataset.resolve(path)
    if path.is_dir() and _dataset.is_dataset(path):
        _dataset.verify(path)
    return path


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
        path: a zoo folder, a posterior sample set, an exported dataset (:func:`symlib.zoo.export`) or
            ``hf://owner/name[@revision]`` (needs ``huggingface_hub``; ``HF_HUB_OFFLINE=1`` reads its
            cache only).
        as_: ``"stacked"``: ``{name: (n, ...)}`` (network ``i`` at index ``i``); ``"models"``: a list of
            eval-mode ``nn.Module``, built by the recipe the folder's manifest records (a network of the
            registry, or the factory an imported set was written with).
        device: where to put the tensors.

    Raises:
        symlib.store.StoreError: naming the file, for a missing or corrupt manifest or chunk, another
            architecture, NaN weights, or missing networks; for a dataset, a chunk whose sha256 does not
            match its manifest table, or a card without the table.
    """
    if as_ not in ("stacked", "models"):
        raise ValueError(f"as_ must be 'stacked' or 'models', got {as_!r}")
    path = _resolve(path)
    if _kind(path) == _posterior_io.KIND:
        params, man = _posterior_io.load_params(path, device)
        return (params, man) if as_ == "stacked" else (_posterior_io.models(params, man, path), man)
    return zoo.load(path, as_=as_, device=device)


def info(path: str | os.PathLike) -> str:
    """A human-readable summary of a zoo (also an incomplete one or a shard), a posterior sample set or an
    exported dataset (whose chunks are checked against its manifest table first); ``hf://`` as in
    :func:`load`."""
    address = str(path)
    path = _resolve(path)
    text = _posterior_io.info(path) if _kind(path) == _posterior_io.KIND else zoo.info(path)
    if _dataset.is_dataset(path):
        rec = store.read_manifest(path).get("export", {})
        rows = len(_dataset.read_table(path))
        text += (
            f"\n  dataset {address}: {_dataset.CARD}, {_dataset.TABLE} ({rows} rows, every chunk's sha256 "
            f"verified, every row checked), {_dataset.CROISSANT}; license {rec.get('license')}, exported "
            f"{rec.get('exported')}"
        )
    return text
