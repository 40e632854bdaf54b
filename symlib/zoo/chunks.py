"""A zoo's chunks and manifest on the common format of :mod:`symlib.store` (book: "Checkpoint zoos").

A zoo chunk records the zoo's config hash, its own chunk index, the architecture, one record per model
(seed and metrics) and the data it was trained on (``"data"``: the manifest's data record, with the data
fingerprint; chunks written before it was recorded have none); the zoo's manifest records the
configuration, the data fingerprint, every model's metrics and the chunks written so far. Reading a
chunk (:func:`read_chunk`) checks everything :func:`symlib.store.read_chunk` checks (its header's and
its tensors' sha256), that the chunk is the one its file name says (index and seeds: two chunk files
swapped are named, not loaded) and the architecture's tensor names and shapes. :func:`check_manifest`
checks that what a manifest says about the networks (architecture, seeds, chunks) agrees with its
configuration, whose hash the chunks carry; :func:`symlib.zoo.load` then compares every model's record
with its chunk's (:func:`check_records`) and the manifest's data record with the one every chunk carries
(:func:`check_data`: an edited data fingerprint is named without loading the data, which may not even be
on the machine).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch

from symlib import store
from symlib.params import Params
from symlib.store import FORMAT, MANIFEST, DamagedError, chunk_name, jsonable
from symlib.store import StoreError as ZooError
from symlib.zoo.config import ZooConfig

KIND = "zoo"
RECORD = ("seed", "train_acc", "train_loss", "test_acc", "test_loss")
"""What a chunk and the manifest record of every model."""
DATA = "data"
"""The chunk header entry that holds the manifest's data record (:func:`data_entry`)."""

__all__ = [
    "DATA",
    "FORMAT",
    "KIND",
    "MANIFEST",
    "RECORD",
    "Chunk",
    "ZooError",
    "check_data",
    "check_manifest",
    "check_records",
    "config_of",
    "data_entry",
    "read",
    "read_chunk",
    "read_manifest",
    "read_records",
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


def _index(path: Path, chunk: int | None) -> int:
    if chunk is not None:
        return int(chunk)
    m = re.fullmatch(r"chunk-(\d+)\.safetensors", path.name)
    if m is None:
        raise ValueError(f"{path}: not named like a chunk (chunk-00000.safetensors, ...); pass its index")
    return int(m.group(1))


def _records(path: Path, meta: dict[str, str], cfg: ZooConfig, c: int, fix: str) -> list[dict[str, Any]]:
    """The model records of chunk ``c`` from its header, checked: the chunk is the one its name says."""
    if not 0 <= c < cfg.n_chunks:
        raise ZooError(f"{path}: zoo {cfg.preset}/{cfg.scale} has {cfg.n_chunks} chunks, not a chunk {c}")
    records = store.header_records(path, meta, "models", RECORD, fix)
    try:
        held = int(meta["chunk"])
    except (KeyError, ValueError):
        held = None
    if held is None or meta.get("arch") != cfg.arch:
        raise DamagedError(
            f"{path}: its header (metadata) is damaged: it does not record the chunk index and the "
            f"architecture {cfg.arch!r} as symlib writes them; {fix}"
        )
    seeds = [r["seed"] for r in records]
    want = list(cfg.seeds[slice(*cfg.chunk_range(c))])
    if held == c and seeds == want:
        return records
    if 0 <= held < cfg.n_chunks and held != c and seeds == list(cfg.seeds[slice(*cfg.chunk_range(held))]):
        raise DamagedError(
            f"{path}: holds chunk {held} of this zoo (seeds {seeds}), not chunk {c} (seeds {want}): chunk "
            f"files were swapped or renamed; move it back to {chunk_name(held)} (and each other misplaced "
            f"chunk to its own name), or {fix}"
        )
    raise DamagedError(
        f"{path}: its header records chunk {held} with seeds {seeds}, but chunk {c} of this zoo holds seeds "
        f"{want}: the header is damaged; {fix}"
    )


class Chunk(NamedTuple):
    """One chunk file of a zoo, read and checked (:func:`read`).

    Attributes:
        tensors: the stacked tensors (``None`` when only the header was read).
        records: the per-model records (seed and metrics).
        data: the data record the chunk was trained on (``None`` for a chunk written before chunks
            recorded it).
    """

    tensors: Params | None
    records: list[dict[str, Any]]
    data: dict[str, Any] | None


def data_entry(data: Any) -> str:
    """The header entry :data:`DATA` of a chunk trained on ``data`` (the manifest's data record): JSON with
    sorted keys, so that the same record gives the same bytes."""
    return json.dumps(data, sort_keys=True)


def _data(path: Path, meta: dict[str, str], fix: str) -> dict[str, Any] | None:
    if DATA not in meta:
        return None
    try:
        data = json.loads(meta[DATA])
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise DamagedError(f"{path}: its header (metadata) is damaged: its {DATA!r} entry is not the data "
                           f"record symlib writes; {fix}")
    return data


def read(path: str | os.PathLike, cfg: ZooConfig, chunk: int | None = None, full: bool = True) -> Chunk:
    """Read and check one chunk file of a zoo with configuration ``cfg``: in ``full`` (tensors too, as
    :func:`read_chunk`), else its header only (as :func:`read_records`).

    Returns:
        The :class:`Chunk`: tensors (``None`` unless ``full``), records and data record.
    """
    path = Path(path)
    c = _index(path, chunk)
    fix = repair_hint(path.parent)
    expect, legacy = {"config_hash": cfg.hash}, store.LEGACY[KIND]
    if not full:
        meta = store.read_header(path, expect, fix, legacy=legacy)
        return Chunk(None, _records(path, meta, cfg, c, fix), _data(path, meta, fix))
    tensors, meta = store.read_chunk(path, expect, fix, legacy=legacy)
    records = _records(path, meta, cfg, c, fix)
    start, stop = cfg.chunk_range(c)
    store.check_tensors(
        path, tensors, reference_shapes(cfg), stop - start, f"architecture {cfg.arch!r}",
        [r["seed"] for r in records], DIVERGED,
    )
    return Chunk(tensors, records, _data(path, meta, fix))


def read_chunk(
    path: str | os.PathLike, cfg: ZooConfig, chunk: int | None = None
) -> tuple[Params, list[dict[str, Any]]]:
    """Read and check one chunk file of a zoo with configuration ``cfg``.

    Args:
        path: the chunk file.
        cfg: the zoo's configuration.
        chunk: its index (default: the one its name says, ``chunk-00003.safetensors``: 3).

    Returns:
        The stacked tensors and the per-model records (seed and metrics).

    Raises:
        ZooError: naming the file, if it belongs to another configuration ("do not mix sets"), or has
            tensor names or shapes of another architecture, or NaN/infinite weights; a
            :class:`symlib.store.DamagedError` (repaired by ``symlib zoo repair``) if it is missing,
            unreadable, its header or weights do not match the sha256 written with them, or it holds
            another chunk of the zoo (its index and seeds: a file swapped or renamed).
    """
    got = read(path, cfg, chunk)
    return got.tensors, got.records


def read_records(path: str | os.PathLike, cfg: ZooConfig, chunk: int | None = None) -> list[dict[str, Any]]:
    """The model records of one chunk file, from its header only (cheap): the checks of
    :func:`read_chunk` but the weights' sha256, shapes and finiteness."""
    return read(path, cfg, chunk, full=False).records


def check_data(path: str | os.PathLike, man: dict[str, Any], file: str, data: dict[str, Any] | None) -> None:
    """Check that the manifest ``man`` of the zoo in ``path`` records the data that its chunk ``file`` was
    trained on (``data``, from the chunk's header, whose sha256 vouches for it; ``None``: a chunk written
    before chunks recorded it, nothing to compare).

    Raises:
        ZooError: naming the manifest, both data fingerprints and the fix.
    """
    if data is None or man.get("data") == data:
        return
    have = man["data"] if isinstance(man.get("data"), dict) else {}
    k = next(k for k in sorted(set(data) | set(have) | {"fingerprint"}) if have.get(k) != data.get(k))
    raise ZooError(
        f"{Path(path) / MANIFEST}: records data {k} {have.get(k)!r}, but {file} was trained on data {k} "
        f"{data.get(k)!r} (its header records it, and its sha256 vouches for it); {_fix_manifest(path)}"
    )


def _fix_manifest(path: str | os.PathLike) -> str:
    return (
        f"the manifest was edited or damaged: restore it, or rebuild it from the chunks with `symlib zoo "
        f"repair {path}`"
    )


def check_manifest(path: str | os.PathLike, man: dict[str, Any], cfg: ZooConfig) -> None:
    """Check that what a zoo manifest says about its networks agrees with its configuration ``cfg``
    (:func:`config_of`, checked against its hash, which every chunk carries): the preset, scale,
    architecture, recipe and size, the chunks listed, the models' seeds (in ``"models"`` and
    ``"seeds"``) and whether it is complete. Cheap (the manifest only); :func:`symlib.zoo.load` also
    compares every model's record with its chunk's (:func:`check_records`).

    Raises:
        ZooError: naming the entry, the value recorded and the expected one, and the fix.
    """
    file = Path(path) / MANIFEST
    fix = _fix_manifest(path)
    derived = {
        "preset": cfg.preset, "scale": cfg.scale, "arch": cfg.arch,
        "recipe": jsonable(dataclasses.asdict(cfg.recipe)), "n_models": cfg.n_models,
    }
    for key, value in derived.items():
        if man.get(key) != value:
            raise ZooError(
                f"{file}: records {key} {man.get(key)!r}, but its configuration (config {cfg.hash}, which "
                f"its chunks carry) says {value!r}; {fix}"
            )
    try:
        chunks = [int(ch["chunk"]) for ch in man["chunks"]]
        for ch, c in zip(man["chunks"], chunks, strict=True):
            span = [ch.get("start"), ch.get("stop")]
            if not 0 <= c < cfg.n_chunks or ch.get("file") != chunk_name(c) or span != [*cfg.chunk_range(c)]:
                raise ValueError(f"chunk entry {ch}")
        seeds = [m["seed"] for m in man["models"]]
        shard = man.get("shard")
        mine = list(range(int(shard[0]), cfg.n_chunks, int(shard[1])) if shard else range(cfg.n_chunks))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ZooError(
            f"{file}: its chunk or model list is malformed ({type(e).__name__}: {e}); {fix}"
        ) from None
    want = [s for c in sorted(set(chunks)) for s in cfg.seeds[slice(*cfg.chunk_range(c))]]
    if seeds != want:
        raise ZooError(
            f"{file}: lists models of seeds {_short(seeds)}, but its chunks {_short(sorted(chunks))} hold "
            f"seeds {_short(want)}; {fix}"
        )
    if man.get("seeds") != seeds:
        raise ZooError(
            f"{file}: records seeds {_short(man.get('seeds'))}, but its models are those of seeds "
            f"{_short(seeds)}; {fix}"
        )
    if bool(man.get("complete")) != (sorted(set(chunks)) == mine):
        raise ZooError(
            f"{file}: says complete={man.get('complete')}, but it lists chunks {_short(chunks)}; {fix}"
        )


def _short(items: Any, n: int = 8) -> str:
    if not isinstance(items, list):
        return repr(items)
    return str(items[:n])[:-1] + (", ...]" if len(items) > n else "]")


def check_records(
    path: str | os.PathLike, man: dict[str, Any], cfg: ZooConfig, c: int, records: list[dict[str, Any]]
) -> None:
    """Check that the manifest ``man`` (checked by :func:`check_manifest`) records for the models of
    chunk ``c`` exactly what the chunk holds (``records``, from :func:`read_chunk`): seeds and metrics.

    Raises:
        ZooError: naming the model, the entry and both values, and the fix.
    """
    chunks = sorted({int(ch["chunk"]) for ch in man["chunks"]})
    if c not in chunks:
        return
    offset = sum(len(range(*cfg.chunk_range(k))) for k in chunks if k < c)
    listed = man["models"][offset: offset + len(records)]
    file = Path(path) / MANIFEST
    if len(listed) != len(records):
        raise ZooError(f"{file}: lists {len(listed)} models for {chunk_name(c)}, which holds {len(records)}; "
                       f"{_fix_manifest(path)}")
    for mine, theirs in zip(listed, records, strict=True):
        if mine != theirs:
            k = ([k for k in RECORD if mine.get(k) != theirs.get(k)] or sorted(set(mine) ^ set(theirs)))[0]
            raise ZooError(
                f"{file}: records {k} {mine.get(k)!r} for the model of seed {theirs['seed']}, but "
                f"{chunk_name(c)} holds {theirs.get(k)!r}; {_fix_manifest(path)}"
            )


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
    merging: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the manifest of a zoo holding ``chunks`` (of ``expected``) with their model ``records``;
    ``merging`` (``{"shards": [...]}``) marks a folder that :func:`symlib.zoo.merge` is filling. A manifest
    that already holds exactly these bytes is not written again (:func:`symlib.store.write_manifest`)."""
    models = [r for c in sorted(records) for r in records[c]]
    man = {
        "format": FORMAT,
        "kind": KIND,
        "config": cfg.to_dict(),
        "config_hash": cfg.hash,
        "preset": cfg.preset,
        "scale": cfg.scale,
        "arch": cfg.arch,
        "architecture": cfg.architecture.record(),
        "recipe": dataclasses.asdict(cfg.recipe),
        "n_models": cfg.n_models,
        "seeds": [r["seed"] for r in models],
        "data": dict(sorted(data_info.items())) if isinstance(data_info, dict) else data_info,  # one order
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
        **({"merging": merging} if merging else {}),
        **store.provenance(),
    }
    store.write_manifest(out, man)
    return man
