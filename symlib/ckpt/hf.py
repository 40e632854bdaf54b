r"""Hugging Face model folders and Hub repositories (book: "symlib on your own network").

``save_pretrained`` (``transformers``) and ``timm``'s ``save_for_hf`` / ``push_to_hub`` write a folder:
``config.json`` (the architecture) beside ``model.safetensors`` or, above ``max_shard_size``, shards
``model-00001-of-00003.safetensors``, ... with an index ``model.safetensors.index.json`` mapping every
tensor to its shard (older folders: ``pytorch_model.bin`` and its index). :func:`read` reads such a folder
as one checkpoint, every shard lazily; :func:`resolve` turns ``hf://owner/name[@revision]`` into the
folder of a model repository in the Hub's cache (``HF_HUB_OFFLINE=1`` reads the cache only).
A set of fine-tuned seeds is then a list of such folders or addresses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from symlib.ckpt import safetensorsfile, torchfile
from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.lazy import Parsed, Ref, open_bytes

__all__ = ["CONFIG", "INDEXES", "WEIGHTS", "config", "is_folder", "read", "resolve"]

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
HF_PREFIX = "hf://"


def is_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model folder: ``config.json`` beside weights or an index."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file() and any((p / f).is_file() for f in (*WEIGHTS, *INDEXES))


def config(path: str | os.PathLike) -> dict[str, Any]:
    """The folder's ``config.json``."""
    file = Path(path) / CONFIG
    try:
        out = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable ({e})") from None
    if not isinstance(out, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    return out


def kind(cfg: dict[str, Any]) -> str:
    """``"timm"`` for a timm config (``"architecture"``), else ``"transformers"``."""
    return "timm" if "architecture" in cfg and "model_type" not in cfg else "transformers"


def _shards(folder: Path) -> list[Path]:
    for index in INDEXES:
        file = folder / index
        if file.is_file():
            try:
                weight_map = json.loads(file.read_text())["weight_map"]
                shards = set(weight_map.values())  # AttributeError: not an object
                if not all(isinstance(v, str) for v in shards):
                    raise TypeError("its weight_map is not an object of file names")
            except (OSError, ValueError, AttributeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{file}: unreadable index ({type(e).__name__}: {e})") from None
            shards = sorted(shards)
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise CheckpointError(f"{file}: names shards {missing} that are not in {folder} (an "
                                      f"incomplete download?)")
            return [folder / s for s in shards]
    for name in WEIGHTS:
        if (folder / name).is_file():
            return [folder / name]
    raise CheckpointError(f"{folder}: no PyTorch weights ({', '.join(WEIGHTS)} or an index) beside "
                          f"{CONFIG}")


def read(folder: str | os.PathLike, trust_pickle: bool = False) -> Parsed:
    """One Hugging Face model folder as one checkpoint: ``obj`` is ``{name: Ref}`` over all its shards,
    ``kind`` is ``"transformers"`` or ``"timm"`` (from ``config.json``)."""
    folder = Path(folder)
    cfg = config(folder)
    obj: dict[str, Ref] = {}
    data: dict[str, tuple[Any, int]] = {}
    records: dict[str, tuple[int, int | None]] = {}
    layout, files, sizes = [], [], []
    for shard in _shards(folder):
        fb = open_bytes(shard)
        if shard.suffix == ".safetensors":
            part = safetensorsfile.read(fb)
        else:
            part = torchfile.read(fb, trust_pickle)
        files.append(str(shard))
        sizes.append(fb.size)
        layout.append(part.layout)
        items = part.obj.items() if isinstance(part.obj, dict) else ()
        for name, ref in items:
            if name in obj:
                raise CheckpointError(f"{folder}: tensor {name!r} is in two shards (the index is damaged)")
            if isinstance(ref, Ref):  # storage keys are per shard: make them unique
                key = f"{shard.name}:{ref.key}"
                obj[name] = Ref(key, ref.dtype, ref.shape, ref.stride, ref.offset)
                if ref.key in part.data:  # else an error when the tensor is read: a damaged file
                    data[key] = part.data[ref.key]
                if ref.key in part.records:  # a zip record's size and checksum (pytorch_model.bin)
                    records[key] = part.records[ref.key]
            else:
                obj[name] = ref
    if not obj:
        raise CheckpointError(f"{folder}: its weights hold no tensors")
    return Parsed(str(folder), obj, data, kind(cfg), layout=(json.dumps(cfg, sort_keys=True), *layout)
                  if all(x is not None for x in layout) else None, files=tuple(files), sizes=tuple(sizes),
                  metadata={"config": json.dumps(cfg, sort_keys=True)}, records=records)


def resolve(address: str) -> Path:
    """The local folder of ``hf://owner/name[@revision]``, a model repository, through ``huggingface_hub``'s
    cache (``snapshot_download``; with ``HF_HUB_OFFLINE=1`` only the cache is used).

    Raises:
        ImportError: without ``huggingface_hub``.
        CheckpointError: neither in the cache nor reachable.
    """
    repo = address[len(HF_PREFIX):].strip("/").removeprefix("models/")
    repo, _, revision = repo.partition("@")
    if repo.count("/") != 1:
        raise CheckpointError(f"{address}: expected hf://owner/name or hf://owner/name@revision")
    try:
        import huggingface_hub
    except ImportError:
        raise ImportError(f"{address}: reading from the Hugging Face Hub needs huggingface_hub "
                          f"(pip install huggingface_hub)") from None
    try:
        return Path(huggingface_hub.snapshot_download(repo_id=repo, revision=revision or None))
    except Exception as e:  # offline without a cached copy, unknown repository, network errors
        raise CheckpointError(
            f"{address}: cannot resolve the model repository ({type(e).__name__}: {e}); without a network, "
            f"download it once (`hf download {repo}`) or pass a local folder"
        ) from None
