r"""Stacked sets on disk: ``n = n_modes * n_per_mode`` networks of one architecture, every tensor stacked
along a new first axis, in a checkpoint folder (book: "Checkpoint zoos", "symlib on your own network").

A set is written in chunks of ``chunk`` consecutive networks (:func:`ranges`: chunk ``c`` holds networks
``c * chunk`` to ``min((c + 1) * chunk, n) - 1``), mode-major (network ``i`` belongs to mode
``i // n_per_mode``):

* ``chunk-00000.safetensors``, ...: the networks' tensors ``{name: (stop - start, ...)}``; the header holds
  the format, ``"kind"``, the set's identity hash (``"set_hash"``), the chunk index and the ``(index,
  mode)`` of every network (``"samples"``), with the sha256 of the tensors and of the header
  (:mod:`symlib.store.chunks`);
* ``manifest.json``: the core fields every reader uses (:data:`FIELDS`: the method that produced the set,
  ``set_hash``, ``n_modes``, ``n_per_mode``, ``n_samples``, ``chunk``, the ``chunks`` written so far), the
  tensor names, shapes and dtypes of one network, whether the set is complete and the provenance, plus the
  fields of its writer (``fields`` of :func:`write`).

The kind on disk is ``"posterior"`` (:data:`KIND`), for sets of posterior samples
(:mod:`symlib.posteriors.io`) and for imported or canonical checkpoints (:mod:`symlib.ckpt.convert`)
alike: the format is this module's, and :func:`symlib.load` and :func:`symlib.info` dispatch on the kind.

:func:`write` resumes a partial write: a chunk already on disk that belongs to the same set (same identity
hash) and passes :func:`read_chunk` is kept, the others are written, each atomically, the manifest
rewritten after every chunk. :func:`load_params` reads a complete set back, every chunk checked.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from symlib import scales as _scales
from symlib.params import Params
from symlib.store import chunks as _chunks
from symlib.store import folders as _folders
from symlib.store.chunks import LEGACY, atomic_save, check_tensors, chunk_name, sample_records
from symlib.store.files import FORMAT, MANIFEST, StoreError, provenance, remove_stale, write_manifest
from symlib.store.files import read_manifest as _read_manifest

__all__ = ["FIELDS", "KIND", "REPAIR", "check_fields", "check_out", "load_params", "manifest", "ranges",
           "read_chunk", "read_manifest", "write"]

KIND = "posterior"
"""The ``"kind"`` of a stacked set's manifest and chunks (module docstring)."""

REPAIR = ("rerun the command that wrote the set with the same arguments: it rewrites exactly the damaged "
          "chunks")
"""What to do about a damaged chunk, unless the writer says better (``fix`` of :func:`read_chunk`)."""

_FINISH = "rerunning the command that wrote the set with the same arguments"

FIELDS = {"method": str, "set_hash": str, "n_modes": int, "n_per_mode": int, "n_samples": int, "chunk": int,
          "chunks": list}
"""The fields of a set's manifest that readers use, and the type of each."""


def ranges(n: int, chunk: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of every chunk of a set of ``n`` networks, ``chunk`` per file (the last one may
    hold fewer)."""
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def check_fields(file: str | os.PathLike, man: Mapping[str, Any]) -> None:
    """Check that the manifest read from ``file`` holds the core fields (:data:`FIELDS`) with their types,
    a positive ``chunk`` and ``n_samples``, and ``chunks`` records ``{"chunk": int, "file": str, ...}``.

    Raises:
        StoreError: naming the field and the fix.
    """
    fix = ("the manifest was edited or damaged: restore it, or rerun the command that wrote the set with "
           "the same arguments to rewrite it")
    for key, kind in FIELDS.items():
        value = man.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            got = "missing" if key not in man else f"{type(value).__name__} {value!r}"[:80]
            raise StoreError(f"{file}: field {key!r} should be a {kind.__name__}, is {got}; {fix}")
    if man["chunk"] < 1 or man["n_samples"] < 1:
        raise StoreError(f"{file}: 'chunk' and 'n_samples' must be positive, are {man['chunk']} and "
                         f"{man['n_samples']}; {fix}")
    for ch in man["chunks"]:
        good = isinstance(ch, dict) and isinstance(ch.get("chunk"), int) and isinstance(ch.get("file"), str)
        if not good:
            raise StoreError(f"{file}: a record of 'chunks' is {str(ch)[:80]}, not {{'chunk': int, 'file': "
                             f"str, ...}}; {fix}")


def read_manifest(path: str | os.PathLike, how: str = "") -> dict[str, Any]:
    """The manifest of the set in folder ``path``, checked to be one (format, kind) and to hold the core
    fields (:func:`check_fields`); ``how`` tells the user how to produce such a set (added to the "no
    manifest" error).

    Raises:
        StoreError: naming the problem.
    """
    man = _read_manifest(path, KIND, how)
    check_fields(Path(path) / MANIFEST, man)
    return man


def check_out(out: str | os.PathLike, set_hash: str, method: str, n_modes: int, n_per_mode: int) -> None:
    """Check, before any work, that ``out`` can receive the set ``set_hash`` (of ``method``, ``n_modes``
    x ``n_per_mode`` networks; :func:`symlib.store.check_out`): not a file, not under a file, writable,
    not holding a zoo, another set or chunks of one. A damaged manifest is accepted: every chunk is then
    checked and the manifest rewritten.

    Raises:
        StoreError: naming the problem and the fix.
    """
    out = Path(out)
    old, _ = _folders.check_out(out, KIND)
    if old is not None and old.get("set_hash") != set_hash:
        raise StoreError(
            f"{out / MANIFEST}: this folder holds another sample set ({old.get('method')}, "
            f"{old.get('n_modes')} x {old.get('n_per_mode')}, hash {old.get('set_hash')}), "
            f"not this one ({method}, {n_modes} x {n_per_mode}, {set_hash}); choose another --out"
        )
    _folders.check_owners(out, "set_hash", set_hash, "sample set")


def manifest(
    method: str,
    set_hash: str,
    n_modes: int,
    n_per_mode: int,
    chunk: int,
    done: list[int],
    shapes: Mapping[str, list[int]],
    dtypes: Mapping[str, str],
    fields: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of a set of which chunks ``done`` are on disk: the core fields, the writer's
    ``fields`` (after ``n_samples``), one network's tensor ``shapes`` and ``dtypes``, the chunk records,
    whether the set is complete and the provenance (:func:`symlib.store.provenance`)."""
    n = n_modes * n_per_mode
    spans = ranges(n, chunk)
    return {
        "format": FORMAT,
        "kind": KIND,
        "method": method,
        "set_hash": set_hash,
        "n_modes": n_modes,
        "n_per_mode": n_per_mode,
        "n_samples": n,
        **(fields or {}),
        "shapes": dict(shapes),
        "dtypes": dict(dtypes),
        "chunk": chunk,
        "chunks": [{"chunk": c, "file": chunk_name(c), "start": s, "stop": e}
                   for c, (s, e) in enumerate(spans) if c in done],
        "complete": sorted(done) == list(range(len(spans))),
        **provenance(),
    }


def _read_file(path: Path, set_hash: str, shapes: Mapping[str, list[int]], start: int, stop: int,
               n_per_mode: int | None, fix: str) -> Params:
    tensors, meta = _chunks.read_chunk(path, {"kind": KIND, "set_hash": set_hash}, fix, legacy=LEGACY[KIND])
    sample_records(path, meta, start, stop, n_per_mode, fix)
    check_tensors(path, tensors, shapes, stop - start, "the manifest's tensors", fix=fix)
    return tensors


def write(
    params: Params,
    out: str | os.PathLike,
    *,
    method: str,
    set_hash: str,
    n_modes: int,
    n_per_mode: int,
    chunk: int | None = None,
    fields: Mapping[str, Any] | None = None,
    fix: str = "",
) -> dict[str, Any]:
    """Write the stacked set ``params`` into ``out`` (created if needed), resuming a partial write (module
    docstring).

    Args:
        params: ``{name: (n_modes * n_per_mode, ...)}``, mode-major.
        out: its folder.
        method: what produced the set (recorded).
        set_hash: the set's identity (a hex string: two writes with the same identity write the same set).
        n_modes, n_per_mode: the set's structure.
        chunk: networks per file (default ``n_per_mode``: one mode per file).
        fields: the writer's own manifest fields (what it records of the set).
        fix: what to do about non-finite weights (added to the error).

    Returns:
        The manifest (:func:`read_manifest`).

    Raises:
        ValueError: the tensors do not hold ``n_modes * n_per_mode`` networks, or hold NaN or infinite
            weights (nothing is written, no folder created).
        StoreError: ``out`` cannot receive the set (:func:`check_out`; checked before anything is written).
    """
    out = Path(out)
    n = n_modes * n_per_mode
    rows = {int(v.shape[0]) for v in params.values()}
    if rows != {n}:
        raise ValueError(f"a set of {n_modes} x {n_per_mode} networks holds {n} along the first axis of "
                         f"every tensor; got shapes {[tuple(v.shape) for v in params.values()]}")
    for k, v in params.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            bad = (~torch.isfinite(v)).reshape(v.shape[0], -1).any(1).nonzero().flatten().tolist()
            raise ValueError(
                f"sample set {method}: tensor {k!r} holds NaN or infinite values (samples "
                f"{bad[:10]}{'...' if len(bad) > 10 else ''}); not saved, nothing written"
                + (f": {fix}" if fix else "")
            )
    chunk = n_per_mode if chunk is None else _scales.check_int("chunk", chunk, 1)
    check_out(out, set_hash, method, n_modes, n_per_mode)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    shapes = {k: list(v.shape[1:]) for k, v in params.items()}
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in params.items()}
    spans = ranges(n, chunk)
    done: list[int] = []
    for c, (s, e) in enumerate(spans):
        file = out / chunk_name(c)
        if file.exists():
            try:
                _read_file(file, set_hash, shapes, s, e, None, fix or REPAIR)
                done.append(c)
                continue
            except StoreError:
                pass  # damaged, or of this set but chunked otherwise (check_out refused other sets'): rewrite

    def record() -> None:
        man = manifest(method, set_hash, n_modes, n_per_mode, chunk, done, shapes, dtypes, fields)
        write_manifest(out, man)

    record()
    for c, (s, e) in enumerate(spans):
        if c in done:
            continue
        recs = [{"index": i, "mode": i // n_per_mode} for i in range(s, e)]
        meta = {"format": FORMAT, "kind": KIND, "set_hash": set_hash, "chunk": str(c),
                "samples": json.dumps(recs)}
        atomic_save({k: v[s:e] for k, v in params.items()}, out / chunk_name(c), meta)
        done.append(c)
        record()
    return read_manifest(out)


def read_chunk(path: str | os.PathLike, manifest: Mapping[str, Any], c: int, fix: str = REPAIR) -> Params:
    """Read and check chunk ``c`` of the set in folder ``path`` described by ``manifest`` (format, kind,
    identity hash, checksums, sample indices and modes, tensor names and shapes, finiteness).

    Raises:
        StoreError: naming the file and ``fix`` (:class:`~symlib.store.files.DamagedError` for what
            rewriting the chunk repairs).
    """
    start, stop = ranges(manifest["n_samples"], manifest["chunk"])[c]
    return _read_file(Path(path) / chunk_name(c), manifest["set_hash"], manifest["shapes"], start, stop,
                      manifest.get("n_per_mode"), fix)


def load_params(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    *,
    manifest: dict[str, Any] | None = None,
    fix: str = REPAIR,
    finish: str = _FINISH,
) -> tuple[Params, dict[str, Any]]:
    """The stacked networks ``{name: (n, ...)}`` of the complete set in folder ``path``, every chunk
    checked (:func:`read_chunk`), on ``device``, and its manifest (read by :func:`read_manifest` unless
    given).

    Raises:
        StoreError: the set is incomplete (``finish`` says how to complete it), or a chunk is damaged
            (``fix``).
    """
    path = Path(path)
    man = read_manifest(path) if manifest is None else manifest
    n_chunks = len(ranges(man["n_samples"], man["chunk"]))
    have = sorted(ch["chunk"] for ch in man["chunks"])
    if not man.get("complete") or have != list(range(n_chunks)):
        missing = sorted(set(range(n_chunks)) - set(have))
        raise StoreError(f"{path / MANIFEST}: sample set is incomplete (chunks {missing} missing); finish it "
                         f"by {finish}")
    parts = [read_chunk(path, man, c, fix) for c in range(n_chunks)]
    dev = _scales.check_device(device)
    return {k: torch.cat([p[k] for p in parts]).to(dev) for k in parts[0]}, man
