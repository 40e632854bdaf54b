r"""The on-disk format of checkpoint sets: one owner for zoos and posterior sample sets (book: "Checkpoint
zoos").

A checkpoint set is a folder:

* ``chunk-00000.safetensors``, ``chunk-00001.safetensors``, ...: consecutive networks per file, every
  tensor stacked along a new first axis; the file's metadata holds the format, what the chunk belongs to
  (a zoo's config hash or a sample set's identity hash), per-network records and the sha256 of its
  tensors (:func:`tensor_digest`), checked whenever the file is read;
* ``manifest.json``: what the folder holds (``"kind"``: a zoo, the default, or ``"posterior"``), the
  chunks written so far and whether the set is complete.

Every file is written to a temporary name in the same folder and renamed (:func:`os.replace`), so a
killed run leaves only complete files (:func:`atomic_write_bytes`); the temporary files a killed run
leaves are removed by the next run (:func:`remove_stale`).

:mod:`symlib.zoo` and :mod:`symlib.posteriors.io` add what their manifests record;
:func:`symlib.load` and :func:`symlib.info` read either kind (:func:`kind_of`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from symlib._version import __version__
from symlib.params import Params

FORMAT = "symlib-zoo/1"
MANIFEST = "manifest.json"
KINDS = ("zoo", "posterior")

__all__ = [
    "FORMAT",
    "KINDS",
    "MANIFEST",
    "DamagedError",
    "StoreError",
    "atomic_save",
    "atomic_write_bytes",
    "check_tensors",
    "check_owners",
    "check_out",
    "chunk_name",
    "git_commit",
    "jsonable",
    "kind_of",
    "provenance",
    "read_chunk",
    "read_manifest",
    "remove_stale",
    "tensor_digest",
    "write_manifest",
]


class StoreError(ValueError):
    """A checkpoint folder or file that is missing, corrupt, incomplete or not what was asked for.

    ``symlib.zoo.ZooError`` is this class (zoos and sample sets share the format)."""


class DamagedError(StoreError):
    """A file of a checkpoint set that is missing, unreadable or fails its checksum (a damaged disk, an
    interrupted copy): writing it again from the same computation repairs it. A file that is intact but
    belongs to another set is a plain :class:`StoreError`: it is never overwritten."""


def chunk_name(c: int) -> str:
    """The file name of chunk ``c``: ``chunk-00000.safetensors``, ..."""
    return f"chunk-{c:05d}.safetensors"


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> None:
    """Write ``payload`` to ``path`` through a temporary file in the same folder and a rename, so that
    ``path`` is either its old content or the whole new one, whatever happens."""
    path = Path(path)
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


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 of named tensors (names, dtypes, shapes and bytes), recorded in every chunk file so that
    silently damaged weights are detected when the set is read."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        v = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def atomic_save(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]
) -> None:
    """Write stacked tensors as one safetensors chunk with ``metadata`` and their sha256, atomically."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    payload = safetensors_bytes(tensors, metadata={**metadata, "sha256": tensor_digest(tensors)})
    atomic_write_bytes(path, payload)


def jsonable(obj: Any) -> Any:
    """A JSON round trip (tuples become lists), so that hashes of saved and reloaded records agree."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def write_manifest(folder: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` into ``folder`` atomically."""
    atomic_write_bytes(Path(folder) / MANIFEST, json.dumps(manifest, indent=1).encode())


def _parse_manifest(file: Path) -> dict[str, Any]:
    try:
        man = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedError(
            f"{file}: corrupt manifest ({e}); the chunk files beside it may still be valid: restore the "
            f"manifest, or rerun the command that wrote this folder with the same arguments (`symlib zoo "
            f"train ... --repair` for a zoo): it checks every chunk, keeps the valid ones and rewrites it"
        ) from None
    if not isinstance(man, dict):
        raise DamagedError(f"{file}: corrupt manifest (not a JSON object); restore it or rewrite it as above")
    return man


def kind_of(folder: str | os.PathLike) -> str | None:
    """``"zoo"`` or ``"posterior"`` for a folder with a readable manifest of this format, else ``None``."""
    file = Path(folder) / MANIFEST
    try:
        man = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        return None
    kind = man.get("kind", "zoo")
    return kind if kind in KINDS else None


def read_manifest(folder: str | os.PathLike, kind: str | None = None, how: str = "") -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked: present, valid JSON, this format and (if given) this
    kind. ``how`` tells the user how to produce such a folder (added to the "no manifest" error)."""
    file = Path(folder) / MANIFEST
    if not file.is_file():
        what = {"zoo": "zoo", "posterior": "posterior sample set"}.get(kind or "", "checkpoint set")
        raise StoreError(f"{file}: no {what} manifest here" + (f"; {how}" if how else ""))
    man = _parse_manifest(file)
    if man.get("format") != FORMAT:
        raise StoreError(f"{file}: format {man.get('format')!r}, expected {FORMAT!r}")
    have = man.get("kind", "zoo")
    if kind is not None and have != kind:
        loaders = {"zoo": "symlib.zoo.load", "posterior": "symlib.posteriors.io.load"}
        raise StoreError(
            f"{file}: this folder holds a {'posterior sample set' if have == 'posterior' else have}, "
            f"not a {'posterior sample set' if kind == 'posterior' else kind}; load it with symlib.load "
            f"(or {loaders.get(have, 'symlib.load')})"
        )
    return man


def remove_stale(folder: str | os.PathLike) -> None:
    """Delete the temporary files a killed run left in ``folder`` (one writer per folder at a time)."""
    folder = Path(folder)
    for stale in [*folder.glob(".chunk-*.tmp"), *folder.glob(f".{MANIFEST}.*.tmp")]:
        stale.unlink(missing_ok=True)


def read_chunk(
    path: str | os.PathLike, expect: Mapping[str, str], fix: str
) -> tuple[Params, dict[str, str]]:
    """Read one chunk file and check what every chunk records: readable, this format, the metadata
    values ``expect`` (e.g. the set it belongs to) and the sha256 of its tensors.

    Args:
        path: the chunk file.
        expect: metadata entries the chunk must carry with these values.
        fix: what the user should do about a missing, damaged or foreign file (added to the error).

    Returns:
        ``(tensors, metadata)``.

    Raises:
        StoreError: naming the file and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise DamagedError(f"{path}: missing; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for damaged files
        raise DamagedError(f"{path}: cannot read this file ({type(e).__name__}: {e}); {fix}") from None
    if meta.get("format") != FORMAT:
        raise StoreError(f"{path}: not a {FORMAT} chunk (metadata {sorted(meta)})")
    for key, value in expect.items():
        if meta.get(key) != value:
            raise StoreError(
                f"{path}: belongs to {key} {meta.get(key)}, not {value}; do not mix sets in one folder"
            )
    if meta.get("sha256") != tensor_digest(tensors):
        raise DamagedError(
            f"{path}: its weights do not match the sha256 recorded when it was written, so the file is "
            f"corrupt (a damaged disk or an interrupted copy); {fix}"
        )
    return tensors, meta


def check_out(folder: str | os.PathLike, kind: str) -> tuple[dict[str, Any] | None, bool]:
    """Check, before any work, that ``folder`` can receive a checkpoint set of ``kind``.

    Refused, naming the problem and the fix (:class:`StoreError`): a path that is a file or lies under a
    file, a folder (or, if it does not exist yet, its nearest existing parent) that is not writable, and a
    manifest of another format or kind. Nothing is created or changed.

    Args:
        folder: the output folder (``--out``).
        kind: ``"zoo"`` or ``"posterior"``.

    Returns:
        ``(manifest, damaged)``: the folder's manifest (``None`` if there is none or it is damaged) and
        whether a damaged (unparsable) manifest is there. The caller compares the manifest's identity
        with its own (a zoo's ``config_hash``, a sample set's ``set_hash``) and checks the chunks on disk
        with :func:`check_owners`.
    """
    folder = Path(folder)
    what = {"zoo": "zoo", "posterior": "posterior sample set"}[kind]
    if folder.exists() and not folder.is_dir():
        raise StoreError(f"{folder}: is a file, not a folder; choose another --out (a new or empty folder)")
    parent = folder
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise StoreError(
            f"{folder}: lies under {parent}, which is a file, not a folder; choose another --out"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        where = "this folder" if parent == folder else f"its parent {parent}"
        raise StoreError(
            f"{folder}: {where} is not writable (read-only or no permission), so the {what} could not be "
            f"saved; choose a writable --out or make {parent} writable"
        )
    if not (folder / MANIFEST).exists():
        return None, False
    try:
        man = read_manifest(folder)
    except DamagedError:
        return None, True
    except StoreError as e:
        raise StoreError(f"{e}; choose another --out") from None
    have = man.get("kind", "zoo")
    if have != kind:
        held = {"zoo": "a zoo", "posterior": "a posterior sample set"}.get(have, repr(have))
        raise StoreError(
            f"{folder / MANIFEST}: this folder holds {held}, not a {what}; choose another --out (a zoo and "
            f"a sample set cannot share a folder)"
        )
    return man, False


def check_owners(folder: str | os.PathLike, key: str, value: str, what: str) -> None:
    """Refuse a folder whose chunk files belong to another set (their metadata ``key`` differs from
    ``value``; headers only, so cheap), before any work: writing this set there would overwrite them.
    Unreadable chunks are left to the full check (:func:`read_chunk`)."""
    for file in sorted(Path(folder).glob("chunk-*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception:  # damaged: read_chunk names it
            continue
        if meta.get(key) != value:
            other = f"{key} {meta[key]}" if key in meta else f"no {key}: a {meta.get('kind', 'zoo')} chunk"
            raise StoreError(
                f"{file}: belongs to another {what} ({other}, not {value}); choose another --out "
                f"(nothing was written)"
            )


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
    ``(rows, *shape)`` and finite floating values.

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


def git_commit() -> str | None:
    """The git commit of the symlib checkout, recorded in manifests (``None`` outside a checkout)."""
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


def provenance() -> dict[str, str | None]:
    """What every manifest records of the code that wrote it: the symlib version and git commit."""
    return {"symlib_version": __version__, "git_commit": git_commit()}
