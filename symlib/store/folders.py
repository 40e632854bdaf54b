"""Checks of an output folder before any work: can it be written, does it hold another set (book:
"Checkpoint zoos"; the format: :mod:`symlib.store`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from safetensors import safe_open

from symlib.store.chunks import _untrusted
from symlib.store.files import MANIFEST, DamagedError, StoreError, read_manifest

__all__ = ["check_folder", "check_out", "check_owners"]


def check_folder(folder: str | os.PathLike, what: str, option: str = "--out") -> None:
    """Check, before any work, that ``folder`` can be created or written: refused, naming ``option`` and
    the fix (:class:`StoreError`), are a path that is a file or lies under a file, and a folder (or, if it
    does not exist yet, its nearest existing parent) that is not writable. Nothing is created.

    Args:
        folder: the folder to write into.
        what: what would be written there, for the message (e.g. ``"zoo"``).
        option: how the user named the folder (``"--out"``, ``"--to"``, ``"--cache"``).
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise StoreError(
            f"{folder}: is a file, not a folder; choose another {option} (a new or empty folder)"
        )
    parent = folder
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise StoreError(
            f"{folder}: lies under {parent}, which is a file, not a folder; choose another {option}"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        where = "this folder" if parent == folder else f"its parent {parent}"
        raise StoreError(
            f"{folder}: {where} is not writable (read-only or no permission), so the {what} could not be "
            f"saved; choose a writable {option} or make {parent} writable"
        )


def check_out(folder: str | os.PathLike, kind: str) -> tuple[dict[str, Any] | None, bool]:
    """Check, before any work, that ``folder`` can receive a checkpoint set of ``kind``.

    Refused, naming the problem and the fix (:class:`StoreError`): what :func:`check_folder` refuses, and
    a manifest of another format or kind. Nothing is created or changed.

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
    check_folder(folder, what)
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
    Unreadable chunks and damaged headers are left to the full check
    (:func:`symlib.store.chunks.read_chunk`)."""
    for file in sorted(Path(folder).glob("chunk-*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception:  # damaged: read_chunk names it
            continue
        if meta.get(key) != value:
            if key not in meta and _untrusted(meta):
                continue  # a damaged header: read_chunk names it
            other = f"{key} {meta[key]}" if key in meta else f"no {key}: a {meta.get('kind', 'zoo')} chunk"
            raise StoreError(
                f"{file}: belongs to another {what} ({other}, not {value}); do not mix sets in one folder: "
                f"move that file out, or choose another --out (nothing was written)"
            )
