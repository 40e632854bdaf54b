r"""Chunk files of a checkpoint set: stacked tensors with a header that says what they hold, written
atomically and checked whenever they are read (book: "Checkpoint zoos"; the format: :mod:`symlib.store`).

A chunk's header (its safetensors metadata) holds the format, the set it belongs to, its own index, one
record per network, the sha256 of its tensors (:func:`tensor_digest`) and the sha256 of the header
itself (:data:`HEADER`, :func:`header_digest`). :func:`read_chunk` checks all of them; a chunk written
before headers carried their sha256 must hold exactly the entries of its kind then (:data:`LEGACY`).

Every chunk is written byte for byte the same from the same tensors and metadata (:func:`serialize`:
``safetensors`` itself writes the metadata in a random order), so that a chunk written again (``symlib
zoo repair``) has the sha256 of the original, and every sha256 recorded elsewhere (a dataset's table, its
Croissant description) stays true.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from symlib.params import Params
from symlib.store.files import FORMAT, DamagedError, StoreError, atomic_write_bytes

HEADER = "header_sha256"
"""The metadata entry of a chunk that holds the sha256 of its other entries (:func:`header_digest`)."""
LEGACY = {
    "zoo": ("arch", "chunk", "config_hash", "format", "models", "sha256"),
    "posterior": ("chunk", "format", "kind", "samples", "set_hash", "sha256"),
}
"""Per kind, the header entries of a chunk written before headers carried their own sha256."""
ADDED = ("data",)
"""Header entries that later versions write beside the sha256 of the header (a zoo chunk's data record):
a chunk without that sha256 may hold them too (a chunk of this version rewritten as the previous format
wrote it), any other entry is a damaged header."""

__all__ = [
    "ADDED",
    "HEADER",
    "LEGACY",
    "atomic_save",
    "check_tensors",
    "chunk_name",
    "header_digest",
    "damaged_identity",
    "header_records",
    "read_chunk",
    "read_header",
    "sample_records",
    "serialize",
    "tensor_digest",
]


def chunk_name(c: int) -> str:
    """The file name of chunk ``c``: ``chunk-00000.safetensors``, ..."""
    return f"chunk-{c:05d}.safetensors"


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of named tensors (names, dtypes, shapes and bytes), recorded in every chunk file so that
    silently damaged weights are detected when the set is read."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        v = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def header_digest(metadata: Mapping[str, str]) -> str:
    """sha256 of a chunk's metadata entries other than :data:`HEADER` (JSON, sorted keys): written into
    every chunk, so that a damaged header (a flipped byte in a seed, a metric, an index) is detected."""
    body = {k: v for k, v in metadata.items() if k != HEADER}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def serialize(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` and ``metadata``, the same bytes for the same
    input: ``safetensors`` orders the tensors (by dtype, then name) but writes the metadata in a random
    order, so its header is written again here with the metadata sorted by key (the tensors, their
    offsets and data as ``safetensors`` laid them out). Any safetensors reader reads the file."""
    blob = safetensors_bytes(dict(tensors), metadata=dict(metadata))
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8: 8 + n])
    meta = header.pop("__metadata__", None)
    ordered = {"__metadata__": dict(sorted(meta.items()))} if meta is not None else {}
    ordered.update(sorted(header.items(), key=lambda kv: (kv[1]["data_offsets"], kv[0])))
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes: the data stays aligned
    return len(text).to_bytes(8, "little") + text + blob[8 + n:]


def atomic_save(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]
) -> None:
    """Write stacked tensors as one safetensors chunk with ``metadata``, the sha256 of the tensors and
    the sha256 of the header (:func:`header_digest`), atomically and deterministically
    (:func:`serialize`: the same tensors and metadata give the same bytes)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    meta = {**metadata, "sha256": tensor_digest(tensors)}
    meta[HEADER] = header_digest(meta)
    atomic_write_bytes(path, serialize(tensors, meta))


def _intact(meta: Mapping[str, str]) -> bool | None:
    """Whether a chunk's header matches its :data:`HEADER` sha256; ``None`` for a chunk written before
    headers carried one."""
    recorded = meta.get(HEADER)
    return None if recorded is None else recorded == header_digest(meta)


def _legacy(meta: Mapping[str, str], legacy: Sequence[str]) -> bool:
    """Whether a header without its sha256 holds the entries ``legacy`` (:data:`LEGACY`), and at most the
    entries later versions added (:data:`ADDED`)."""
    return set(legacy) <= set(meta) <= set(legacy) | set(ADDED)


def _untrusted(meta: Mapping[str, str]) -> bool:
    """Whether a chunk's header is damaged as far as can be told without knowing its kind: its sha256
    does not match, or it has none and its entries are not those of any chunk written before headers
    carried one (:data:`LEGACY`)."""
    intact = _intact(meta)
    return intact is False or (intact is None and not any(_legacy(meta, v) for v in LEGACY.values()))


def damaged_identity(meta: Mapping[str, str], key: str, value: str) -> bool:
    """Whether a header whose ``key`` (the set it belongs to) is not ``value`` is a damaged header of the
    set ``value`` rather than a header of another set: it fails its own sha256 (or the entry's name itself
    is damaged) and its ``key`` differs from ``value`` in one character only (a flipped byte). A header that
    names another set in full is never taken for damage, intact or not, so that no command overwrites
    another set's chunk."""
    if key not in meta:
        return _untrusted(meta)
    have = str(meta[key])
    near = len(have) == len(value) and sum(a != b for a, b in zip(have, value, strict=True)) == 1
    return near and _intact(meta) is False


def _check_header(
    path: Path, meta: Mapping[str, str], expect: Mapping[str, str], fix: str, legacy: Sequence[str] | None
) -> None:
    """Check a chunk's header: a header that names another set in full (``expect``) is that set's chunk,
    never overwritten; otherwise a header that fails its own sha256 is damage, whichever entry the damage
    hit (a flipped byte in the set's hash included: :func:`damaged_identity`); then the format, the
    entries ``expect`` and, for a chunk written before headers carried their sha256, its entries
    (``legacy``)."""
    intact = _intact(meta)
    if meta.get("format") != FORMAT and intact is not False:
        raise StoreError(f"{path}: not a {FORMAT} chunk (metadata {sorted(meta)})")
    for key, value in expect.items():  # another set's chunk is named as such, damaged or not
        if meta.get(key) != value and not damaged_identity(meta, key, value):
            raise StoreError(
                f"{path}: belongs to {key} {meta.get(key)}, not {value}; do not mix sets in one folder: "
                f"move this file out (it is never overwritten)"
            )
    if intact is False:
        raise DamagedError(
            f"{path}: its header (the metadata that says what the chunk holds) does not match the sha256 "
            f"written with it, so the file is damaged (a flipped byte, an interrupted copy); {fix}"
        )
    for key in expect:
        if key not in meta:  # the entry's name itself was damaged (a header without its sha256)
            raise DamagedError(
                f"{path}: its header (metadata) holds the entries {sorted(meta)}, not those symlib "
                f"writes (no {key!r}), so the file is damaged; {fix}"
            )
    if intact is None and legacy is not None and not _legacy(meta, legacy):
        raise DamagedError(
            f"{path}: its header (metadata) holds the entries {sorted(meta)}, not those symlib writes "
            f"({sorted(legacy)}), so the file is damaged; {fix}"
        )


def read_header(
    path: str | os.PathLike, expect: Mapping[str, str], fix: str, legacy: Sequence[str] | None = None
) -> dict[str, str]:
    """Read and check the header (metadata) of one chunk file, without its tensors: readable, this format,
    the values ``expect`` and the header's own sha256 (:func:`header_digest`).

    Args:
        path: the chunk file.
        expect: metadata entries the chunk must carry with these values (the set it belongs to); a
            different value is another set's chunk (:class:`StoreError`, "do not mix sets"), never
            overwritten.
        fix: what the user should do about a missing or damaged file (added to the error).
        legacy: the entries a chunk written before headers carried their sha256 holds, exactly (another
            set of entries is a damaged header); ``None``: such chunks are not checked further.

    Returns:
        The metadata.

    Raises:
        DamagedError: a missing or unreadable file, a damaged header; StoreError: not a chunk of this
            format, or a chunk of another set.
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedError(f"{path}: missing; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except Exception as e:  # safetensors raises several types for damaged files
        raise DamagedError(f"{path}: cannot read this file ({type(e).__name__}: {e}); {fix}") from None
    _check_header(path, meta, expect, fix, legacy)
    return meta


def read_chunk(
    path: str | os.PathLike, expect: Mapping[str, str], fix: str, legacy: Sequence[str] | None = None
) -> tuple[Params, dict[str, str]]:
    """Read one chunk file and check what every chunk records: readable, this format, the metadata
    values ``expect`` (e.g. the set it belongs to), the sha256 of its header and of its tensors.

    Args:
        path: the chunk file.
        expect: metadata entries the chunk must carry with these values.
        fix: what the user should do about a missing or damaged file (added to the error).
        legacy: as :func:`read_header`.

    Returns:
        ``(tensors, metadata)``.

    Raises:
        StoreError: naming the file and the fix (:class:`DamagedError` for what rewriting the chunk
            repairs).
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedError(f"{path}: missing; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for damaged files
        raise DamagedError(f"{path}: cannot read this file ({type(e).__name__}: {e}); {fix}") from None
    _check_header(path, meta, expect, fix, legacy)
    if meta.get("sha256") != tensor_digest(tensors):
        raise DamagedError(
            f"{path}: its weights do not match the sha256 recorded when it was written, so the file is "
            f"corrupt (a damaged disk or an interrupted copy); {fix}"
        )
    return tensors, meta


def header_records(
    path: str | os.PathLike, meta: Mapping[str, str], entry: str, fields: Sequence[str], fix: str
) -> list[dict[str, Any]]:
    """The per-network records a chunk's header holds in ``entry``: a JSON list of objects with exactly
    ``fields``, every value a number (a zoo's ``"models"``: seed and metrics; a sample set's
    ``"samples"``: index and mode).

    Raises:
        DamagedError: naming the chunk and ``fix``, when the entry is missing or not such a list (a
            damaged header).
    """
    try:
        recs = json.loads(meta[entry])
        ok = isinstance(recs, list) and all(
            isinstance(r, dict) and sorted(r) == sorted(fields)
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in r.values())
            for r in recs
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise DamagedError(
            f"{path}: its header (metadata) is damaged: its {entry!r} entry is not the list of records "
            f"symlib writes ({', '.join(fields)} of every network); {fix}"
        )
    return recs


def sample_records(
    path: str | os.PathLike, meta: Mapping[str, str], start: int, stop: int, n_per_mode: int | None,
    fix: str,
) -> list[dict[str, int]]:
    """The sample records (``index``, ``mode``) of a posterior chunk's header, checked to be samples
    ``start`` to ``stop - 1`` (the chunk its file name says) and, given ``n_per_mode``, of modes
    ``index // n_per_mode`` (mode-major sets).

    Raises:
        DamagedError: a damaged header, or a chunk file at another chunk's name; StoreError: modes that
            contradict the manifest's ``n_per_mode`` (an edited manifest).
    """
    recs = header_records(path, meta, "samples", ("index", "mode"), fix)
    idx = [r["index"] for r in recs]
    if idx != list(range(start, stop)):
        raise DamagedError(
            f"{path}: holds samples {idx[:3]}..., expected {start}..{stop - 1}: chunk files were swapped or "
            f"renamed, or the header is damaged; move each file back to its name, or {fix}"
        )
    modes = [r["mode"] for r in recs]
    if n_per_mode and modes != [i // n_per_mode for i in idx]:
        raise StoreError(
            f"{path}: holds samples of modes {sorted(set(modes))}, but the manifest's {n_per_mode} samples "
            f"per mode put them in modes {sorted({i // n_per_mode for i in idx})}: the manifest was edited "
            f"or damaged; restore it, or {fix}"
        )
    return recs


def check_tensors(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    shapes: Mapping[str, Sequence[int]],
    rows: int,
    what: str,
    labels: Sequence[Any] | None = None,
    fix: str = "",
) -> None:
    """Check the tensors of a chunk against the shapes of one network: the same names, shapes
    ``(rows,) + shape`` and finite floating values.

    Args:
        path: the chunk (for the message).
        tensors: what it holds.
        shapes: names and shapes of one network.
        rows: networks in the chunk.
        what: the architecture or set, for the message (e.g. ``"architecture 'optunet'"``).
        labels: one label per row (seeds), to name the networks with non-finite weights.
        fix: what to do about non-finite weights.
    """
    if set(tensors) != set(shapes):
        raise StoreError(f"{path}: tensors {sorted(tensors)} do not match {what} ({sorted(shapes)})")
    for k, v in tensors.items():
        want = (rows, *tuple(shapes[k]))
        if tuple(v.shape) != want:
            raise StoreError(f"{path}: tensor {k!r} has shape {tuple(v.shape)}, expected {want} for {what}")
        if v.is_floating_point() and not torch.isfinite(v).all():
            bad = (~torch.isfinite(v)).flatten(1).any(1).nonzero().flatten().tolist()
            names = sorted({labels[i] for i in bad}) if labels is not None else bad
            raise StoreError(
                f"{path}: tensor {k!r} holds NaN or infinite weights "
                f"({'seeds' if labels is not None else 'rows'} {names})" + (f"; {fix}" if fix else "")
            )
