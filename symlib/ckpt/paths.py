"""Which checkpoints a source names (book: "symlib on your own network"): :func:`expand` turns the paths,
folders, globs and ``hf://`` addresses given to :func:`symlib.load_checkpoints` (or the shell's
``symlib import``, ``compare``, ``canonicalize``) into a list of checkpoints, each a ``torch.save`` or
Lightning or safetensors file, a Hugging Face model folder or address, or a whole symlib folder.

Folders and globs are listed in natural order (``seed2`` before ``seed10``); a folder holds the files
with one of :data:`EXTENSIONS` and the Hugging Face model folders inside it. Every path is looked at
before any file is parsed: a path that does not exist, a glob that matches nothing, a folder without
checkpoints, a symbolic-link loop and a file or folder that cannot be read are errors naming the path
and the fix. :mod:`symlib.ckpt.loader` reads what :func:`expand` lists.
"""

from __future__ import annotations

import errno
import glob
import os
import re
from collections.abc import Sequence
from pathlib import Path

from symlib import store
from symlib.ckpt import hf
from symlib.ckpt.errors import CheckpointError

__all__ = ["EXTENSIONS", "expand"]

#: File names read as checkpoints in a folder.
EXTENSIONS = (".pt", ".pth", ".ckpt", ".bin", ".safetensors")
_GLOB = re.compile(r"[*?\[]")


def _natural(path: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def _is_set(path: Path) -> bool:
    from symlib.zoo import dataset

    return path.is_dir() and (store.kind_of(path) is not None or dataset.is_dataset(path))


def _folder(path: Path) -> list[tuple[str, str]]:
    if not os.access(path, os.R_OK | os.X_OK):  # before looking inside: name the folder, not a file in it
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    if _is_set(path):
        return [("set", str(path))]
    if hf.is_folder(path):
        return [("hf", str(path))]
    found = []
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name.endswith(EXTENSIONS) and entry.is_file():
                found.append(("file", entry.path))
            elif entry.is_dir() and hf.is_folder(entry.path):
                found.append(("hf", entry.path))
    if not found:
        raise CheckpointError(f"{path}: no checkpoint files in this folder (looked for "
                              f"{', '.join('*' + e for e in EXTENSIONS)} and Hugging Face model folders)")
    return sorted(found, key=lambda it: _natural(it[1]))


def _path_error(e: OSError, given: str) -> CheckpointError:
    """A symlink loop, an unreadable file or folder (or any other failure to look at a path) as a
    :class:`CheckpointError` naming the path and the fix."""
    where = str(e.filename or given)
    seen = f", met through {given}" if where != given else ""
    if e.errno == errno.ELOOP:
        return CheckpointError(f"{where}: a symbolic link that leads back to itself{seen} (a symlink loop); "
                               f"fix or remove the link, or name the checkpoint files themselves")
    if isinstance(e, PermissionError):
        return CheckpointError(f"{where}: permission denied, symlib cannot read it{seen}; make it readable "
                               f"(chmod u+r for a file, u+rx for a folder) or leave it out")
    return CheckpointError(f"{where}: cannot be read{seen} ({e.strerror or e}); check the path")


def _one(text: str) -> list[tuple[str, str]]:
    """What one source names (:func:`expand`); a file or folder that cannot be looked at raises its
    ``OSError``."""
    path = Path(text).expanduser()
    out: list[tuple[str, str]] = []
    if not path.exists() and _GLOB.search(text):
        hits = sorted(glob.glob(str(path), recursive=True), key=_natural)
        if not hits:
            raise CheckpointError(f"{text}: the pattern matches no file (relative to {Path.cwd()})")
        for hit in hits:
            is_file = hit.endswith(EXTENSIONS) or not os.path.isdir(hit)
            out += [("file", hit)] if is_file else _folder(Path(hit))
    elif path.is_dir():
        out += _folder(path)
    elif path.is_file():
        out.append(("file", str(path)))
    else:
        try:
            os.stat(path)  # a symlink loop raises ELOOP here (Path.exists hides it)
        except FileNotFoundError:
            pass
        raise CheckpointError(f"{text}: no such file or folder")
    for kind, found in out:  # loops and unreadable entries, before any file is parsed
        os.stat(found)
        if not os.access(found, os.R_OK | (os.X_OK if kind != "file" else 0)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), found)
    return out


def expand(sources: str | os.PathLike | Sequence[str | os.PathLike]) -> list[tuple[str, str]]:
    """The checkpoints named by ``sources``: ``[(kind, path)]`` with ``kind`` ``"file"``, ``"hf"`` (a
    Hugging Face folder or ``hf://`` address) or ``"set"`` (a symlib folder), in order (globs and
    folders in natural order: ``seed2`` before ``seed10``).

    Raises:
        CheckpointError: a path that does not exist, a glob that matches nothing, a folder without
            checkpoints, a symlib folder given with other sources, a symlink loop, or a file or folder
            that cannot be read (permission denied).
    """
    if isinstance(sources, str | os.PathLike):
        sources = [sources]
    if not sources:
        raise CheckpointError("no checkpoints given: pass files, a folder or a glob such as 'runs/*.pt'")
    out: list[tuple[str, str]] = []
    for src in sources:
        text = str(src)
        if text.startswith(hf.HF_PREFIX):
            out.append(("hf", text))
            continue
        try:
            out += _one(text)
        except OSError as e:
            raise _path_error(e, text) from None
    if any(k == "set" for k, _ in out) and len(out) > 1:
        sets = [p for k, p in out if k == "set"]
        raise CheckpointError(f"{sets[0]}: a symlib folder is a whole set of checkpoints: pass it alone")
    return out


def _identity(path: str) -> str:
    """What makes two sources the same: the path with every symbolic link resolved (an ``hf://`` address
    as it is)."""
    return path if path.startswith(hf.HF_PREFIX) else os.path.realpath(path)
