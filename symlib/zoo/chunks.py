"""A zoo's chunks and manifest on the common format of :mod:`symlib.store` (book: "Checkpoint zoos").

A zoo chunk records the zoo's config hash, its chunk index and one record per model (seed and metrics);
the zoo's manifest records the configuration, the data fingerprint, every model's metrics and the chunks
written so far. Reading a chunk checks everything :func:`symlib.store.read_chunk` checks, plus the seeds
and the architecture's tensor names and shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from symlib import store
from symlib.params import Params
from symlib.store import FORMAT, MANIFEST, chunk_name
from symlib.store import StoreError as ZooError
from symlib.zoo.config import ZooConfig

KIND = "zoo"

__all__ = [
    "FORMAT",
    "KIND",
    "MANIFEST",
    "ZooError",
    "config_of",
    "read_chunk",
    "read_manifest",
    "repair_hint",
    "write_manifest",
]


DIVERGED = (
    "these networks diverged in training (or the file was altered): this zoo cannot be used as it is; "
    "train it again into another --out, with a smaller learning rate"
)


def repair_hint(folder: str | os.PathLike) -> str:
    """How to repair a damaged or missing chunk of the zoo in ``folder``: the command to run."""
    return (
        f"repair the zoo with `symlib zoo repair {folder}`: it retrains exactly the damaged or missing "
        f"chunks (the same seeds give the same weights, bit for bit)"
    )


def config_of(path: str | os.PathLike, man: dict[str, Any]) -> ZooConfig:
    """The :class:`ZooConfig` a zoo manifest records, checked against its hash (a clear :class:`ZooError`
    for a manifest that was edited or damaged)."""
    try:
        cfg = ZooConfig.from_dict(man["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ZooError(
            f"{Path(path) / MANIFEST}: bad config ({type(e).__name__}: {e}); the manifest was edited or "
            f"damaged: restore it, or rerun `symlib zoo train ... --repair` with the arguments that "
            f"trained it"
        ) from None
    if cfg.hash != man.get("config_hash"):
        raise ZooError(
            f"{Path(path) / MANIFEST}: its config does not match its hash {man.get('config_hash')} (the "
            f"manifest was edited); restore it, or rerun `symlib zoo train ... --repair` with the arguments "
            f"that trained it"
        )
    return cfg


def reference_shapes(cfg: ZooConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one network of the zoo's architecture (built on the meta device)."""
    with torch.device("meta"):
        model = cfg.make_model()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def read_chunk(path: str | os.PathLike, cfg: ZooConfig) -> tuple[Params, list[dict[str, Any]]]:
    """Read and check one chunk file of a zoo with configuration ``cfg``.

    Returns:
        The stacked tensors and the per-model records (seed and metrics).

    Raises:
        ZooError: naming the file, if it is unreadable, belongs to another configuration, has the wrong
            seeds, tensor names or shapes (another architecture), holds NaN/infinite weights, or its
            weights do not match the checksum written with them.
    """
    path = Path(path)
    fix = repair_hint(path.parent)
    tensors, meta = store.read_chunk(path, {"config_hash": cfg.hash}, fix)
    c = int(meta["chunk"])
    start, stop = cfg.chunk_range(c)
    records = json.loads(meta["models"])
    seeds = [r["seed"] for r in records]
    if seeds != list(cfg.seeds[start:stop]):
        raise ZooError(f"{path}: holds seeds {seeds}, expected {list(cfg.seeds[start:stop])}")
    store.check_tensors(
        path, tensors, reference_shapes(cfg), stop - start, f"architecture {cfg.arch!r}", seeds, DIVERGED
    )
    return tensors, records


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a zoo folder (a clear :class:`ZooError` for anything else)."""
    return store.read_manifest(path, KIND, f"train one with `symlib zoo train --out {path}`")


def write_manifest(
    out: Path,
    cfg: ZooConfig,
    chunks: list[int],
    records: dict[int, list],
    data_info: dict | None,
    shard: tuple[int, int] | None,
    expected: list[int],
) -> dict[str, Any]:
    """Write the manifest of a zoo holding ``chunks`` (of ``expected``) with their model ``records``."""
    models = [r for c in sorted(records) for r in records[c]]
    man = {
        "format": FORMAT,
        "kind": KIND,
        "config": cfg.to_dict(),
        "config_hash": cfg.hash,
        "preset": cfg.preset,
        "scale": cfg.scale,
        "arch": cfg.arch,
        "recipe": dataclasses.asdict(cfg.recipe),
        "n_models": cfg.n_models,
        "seeds": [r["seed"] for r in models],
        "data": data_info,
        "models": models,
        "chunks": [
            {
                "chunk": c,
                "file": chunk_name(c),
                "start": cfg.chunk_range(c)[0],
                "stop": cfg.chunk_range(c)[1],
            }
            for c in sorted(chunks)
        ],
        "shard": list(shard) if shard is not None else None,
        "complete": sorted(chunks) == sorted(expected),
        **store.provenance(),
    }
    store.write_manifest(out, man)
    return man
