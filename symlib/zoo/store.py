"""Zoo files: atomic writes, stacked safetensors chunks, checksums and the JSON manifest
(book: "Checkpoint zoos").

Every file is written to a temporary name in the same folder and renamed (:func:`os.replace`), so a
killed run leaves only complete files. Each chunk records the sha256 of its tensors
(:func:`tensor_digest`), checked when it is read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from symlib.zoo.config import ZooConfig

FORMAT = "symlib-zoo/1"
MANIFEST = "manifest.json"
Params = dict[str, torch.Tensor]


class ZooError(ValueError):
    """A zoo directory or file that is corrupt, incomplete or does not match its configuration."""


def _chunk_name(c: int) -> str:
    return f"chunk-{c:05d}.safetensors"


def _atomic_write_bytes(path: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tensor_digest(tensors: Params) -> str:
    """sha256 of named tensors (names, dtypes, shapes and bytes), recorded in every chunk file so that
    silently damaged weights are detected when the zoo is read."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        v = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def _atomic_save(tensors: Params, path: Path, metadata: dict[str, str]) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    payload = safetensors_bytes(tensors, metadata={**metadata, "sha256": tensor_digest(tensors)})
    _atomic_write_bytes(path, payload)


def _reference_shapes(cfg: ZooConfig) -> dict[str, tuple[int, ...]]:
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
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for damaged files
        raise ZooError(
            f"{path}: cannot read this zoo file ({type(e).__name__}: {e}); delete it and rerun "
            f"`symlib zoo train` to retrain its models"
        ) from None
    if meta.get("format") != FORMAT or "config_hash" not in meta:
        raise ZooError(f"{path}: not a {FORMAT} chunk (metadata {sorted(meta)})")
    if meta["config_hash"] != cfg.hash:
        raise ZooError(
            f"{path}: belongs to a zoo with config {meta['config_hash']}, not {cfg.hash} "
            f"({cfg.preset}/{cfg.scale}); do not mix zoos in one folder"
        )
    if meta.get("sha256") != tensor_digest(tensors):
        raise ZooError(
            f"{path}: its weights do not match the sha256 recorded when it was written, so the file is "
            f"corrupt (a damaged disk or an interrupted copy); delete it and rerun `symlib zoo train`"
        )
    c = int(meta["chunk"])
    start, stop = cfg.chunk_range(c)
    records = json.loads(meta["models"])
    seeds = [r["seed"] for r in records]
    if seeds != list(cfg.seeds[start:stop]):
        raise ZooError(f"{path}: holds seeds {seeds}, expected {list(cfg.seeds[start:stop])}")
    ref = _reference_shapes(cfg)
    if set(tensors) != set(ref):
        raise ZooError(
            f"{path}: tensors {sorted(tensors)} do not match architecture {cfg.arch!r} ({sorted(ref)})"
        )
    for k, v in tensors.items():
        if tuple(v.shape) != (stop - start, *ref[k]):
            raise ZooError(
                f"{path}: tensor {k!r} has shape {tuple(v.shape)}, expected "
                f"{(stop - start, *ref[k])} for {cfg.arch!r}"
            )
        if v.is_floating_point() and not torch.isfinite(v).all():
            bad = sorted(
                {seeds[i] for i in (~torch.isfinite(v)).flatten(1).any(1).nonzero().flatten().tolist()}
            )
            raise ZooError(
                f"{path}: tensor {k!r} holds NaN or infinite weights (seeds {bad}); delete the file "
                f"and rerun `symlib zoo train` to retrain these models"
            )
    return tensors, records


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not file.is_file():
        raise ZooError(f"{file}: no zoo manifest here; train one with `symlib zoo train --out {path}`")
    try:
        man = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ZooError(f"{file}: corrupt manifest ({e})") from None
    if man.get("format") != FORMAT:
        raise ZooError(f"{file}: format {man.get('format')!r}, expected {FORMAT!r}")
    return man


def _write_manifest(
    out: Path,
    cfg: ZooConfig,
    chunks: list[int],
    records: dict[int, list],
    data_info: dict | None,
    shard: tuple[int, int] | None,
    expected: list[int],
) -> dict[str, Any]:
    import symlib

    models = [r for c in sorted(records) for r in records[c]]
    man = {
        "format": FORMAT,
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
                "file": _chunk_name(c),
                "start": cfg.chunk_range(c)[0],
                "stop": cfg.chunk_range(c)[1],
            }
            for c in sorted(chunks)
        ],
        "shard": list(shard) if shard is not None else None,
        "complete": sorted(chunks) == sorted(expected),
        "symlib_version": symlib.__version__,
        "git_commit": _git_commit(),
    }
    _atomic_write_bytes(out / MANIFEST, json.dumps(man, indent=1).encode())
    return man
