"""Checks of an output folder before any work: can it be written, does it hold another set, an exported
dataset or files symlib did not write (book: "Checkpoint zoos"; the format: :mod:`symlib.store`).

No command writes beside files it did not write: a checkpoint set is written into a new or empty folder,
or into a folder that holds only what symlib writes into one (:func:`foreign`: its manifest, its chunks,
their temporary files and a fan-out's work folder); an exported dataset (:func:`exported`) is never
written into, so that its files keep the sha256 its table and Croissant description record.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open

from symlib.store.chunks import damaged_identity
from symlib.store.files import MANIFEST, STALE, DamagedError, StoreError, read_manifest

WORK = "fanout"
"""The work folder a fan-out keeps inside the set's folder (:mod:`symlib.zoo.fanout`)."""
PLAN = "plan.json"
"""The fan-out's plan in its work folder: what makes a ``fanout`` folder one symlib wrote."""

__all__ = ["PLAN", "WORK", "check_folder", "check_out", "check_owners", "exported", "foreign",
           "refuse_exported"]


def _ours(entry: Path) -> bool:
    """Whether ``entry`` of a set's folder is something symlib writes there: the manifest, a chunk file,
    the temporary file of either (:data:`~symlib.store.files.STALE`), or a fan-out's work folder (empty,
    as a killed fan-out may leave it, or holding its plan)."""
    name = entry.name
    if name == MANIFEST or re.fullmatch(r"chunk-\d+\.safetensors", name):
        return entry.is_file()
    if any(entry.match(pattern) for pattern in STALE):
        return True
    return name == WORK and entry.is_dir() and (not any(entry.iterdir()) or (entry / PLAN).is_file())


def foreign(folder: str | os.PathLike) -> list[str]:
    """The names of the entries of ``folder`` that symlib did not write into a checkpoint set's folder
    (anything but its manifest, chunks, their temporary files and a fan-out's work folder), sorted; empty
    for a folder that does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if not _ours(p))


def exported(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds an exported dataset (``symlib zoo export``): its manifest has an
    ``"export"`` record. Never written into by any command."""
    try:
        return "export" in read_manifest(folder)
    except StoreError:
        return False


def refuse_exported(folder: str | os.PathLike, option: str = "--out") -> None:
    """Refuse, naming the fix, an exported dataset as the folder to write into (:func:`exported`)."""
    if exported(folder):
        raise StoreError(
            f"{folder}: is an exported dataset (`symlib zoo export`); no command writes into one, so that "
            f"its files keep the sha256 its table and Croissant description record: write into a new folder "
            f"(another {option}), or repair the zoo it was exported from and export that again"
        )


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

    Refused, naming the problem and the fix (:class:`StoreError`): what :func:`check_folder` refuses, an
    exported dataset (:func:`exported`), a folder holding files symlib did not write there
    (:func:`foreign`), and a manifest of another format or kind. Nothing is created or changed.

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
    refuse_exported(folder)
    others = foreign(folder)
    if others:
        listed = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise StoreError(
            f"{folder}: holds {listed}, which symlib did not write there; a {what} is written only into a "
            f"new or empty folder, or one holding what symlib wrote (a manifest, chunks): choose another "
            f"--out, or move those files out (nothing was written)"
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
    Unreadable chunks and damaged headers of this set (:func:`~symlib.store.chunks.damaged_identity`) are
    left to the full check (:func:`symlib.store.chunks.read_chunk`)."""
    for file in sorted(Path(folder).glob("chunk-*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception:  # damaged: read_chunk names it
            continue
        if meta.get(key) != value:
            if damaged_identity(meta, key, value):
                continue  # a damaged header of this set: read_chunk names it
            other = f"{key} {meta[key]}" if key in meta else f"no {key}: a {meta.get('kind', 'zoo')} chunk"
            raise StoreError(
                f"{file}: belongs to another {what} ({other}, not {value}); do not mix sets in one folder: "
                f"move that file out, or choose another --out (nothing was written)"
            )
