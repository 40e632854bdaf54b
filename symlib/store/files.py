"""Files of a checkpoint set: atomic writes, manifests, provenance and the format's errors (book:
"Checkpoint zoos"; the format: :mod:`symlib.store`)."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from symlib._version import __version__
from symlib.errors import DamagedError, StoreError

FORMAT = "symlib-zoo/1"
MANIFEST = "manifest.json"
KINDS = ("zoo", "posterior")
STALE = (".chunk-*.tmp", f".{MANIFEST}.*.tmp")
"""The temporary files :func:`atomic_write_bytes` leaves in a set's folder when a run is killed
(:func:`remove_stale`)."""


__all__ = [
    "alive",
    "assemble",
    "FORMAT",
    "KINDS",
    "MANIFEST",
    "STALE",
    "DamagedError",
    "StoreError",
    "atomic_write_bytes",
    "file_sha256",
    "git_commit",
    "jsonable",
    "kind_of",
    "no_space",
    "provenance",
    "read_manifest",
    "remove_leftovers",
    "remove_stale",
    "temporary",
    "write_manifest",
]


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, payload: bytes) -> None:
    """Write ``payload`` to ``path`` through a temporary file in the same folder and a rename, so that
    ``path`` is either its old content or the whole new one, whatever happens. The file gets the mode of
    any new file (``0o666`` less the umask: ``0644`` under the usual ``022``), so that a set published
    in a shared folder can be read by the others."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks (what manifests, dataset tables and Croissant record
    of a file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine is running (a zombie, exited but not reaped, is not): whether
    the temporary files it names are still being written."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (an exited child not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def jsonable(obj: Any) -> Any:
    """A JSON round trip (tuples become lists), so that hashes of saved and reloaded records agree."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def write_manifest(folder: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` into ``folder`` atomically; a manifest that already holds exactly these
    bytes is left as it is (a command that changes nothing writes nothing)."""
    file, payload = Path(folder) / MANIFEST, json.dumps(manifest, indent=1).encode()
    try:
        if file.read_bytes() == payload:
            return
    except OSError:
        pass
    atomic_write_bytes(file, payload)


@contextlib.contextmanager
def no_space(folder: str | os.PathLike, after: str) -> Iterator[None]:
    """Turn a full disk (or quota) met while writing into ``folder`` into a :class:`StoreError` naming the
    folder and ``after`` (what is left and what to do: every file is written to a temporary name and
    renamed, so nothing written before is damaged)."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise StoreError(
            f"{folder}: no space left on the device ({os.strerror(e.errno)}) while writing there; {after}"
        ) from e


def temporary(target: str | os.PathLike, tag: str) -> Path:
    """The temporary folder, beside ``target``, in which a command (``tag``: ``export``, ``import``, ...)
    assembles ``target`` before renaming it: ``.NAME.TAG-PID.tmp`` (:func:`remove_leftovers`)."""
    target = Path(target)
    return target.parent / f".{target.name}.{tag}-{os.getpid()}.tmp"


@contextlib.contextmanager
def assemble(target: str | os.PathLike, tag: str, after: str) -> Iterator[Path]:
    """Assemble the folder ``target`` in a temporary folder beside it (:func:`temporary`, yielded; the
    leftovers of killed runs removed first: :func:`remove_leftovers`) and rename it to ``target`` at the
    end (an empty ``target`` is replaced; the caller refuses any other), so that ``target`` appears whole
    or not at all: on any error the temporary folder is removed, and a full disk is a :class:`StoreError`
    naming ``target`` and ``after`` (:func:`no_space`)."""
    target = Path(target)
    with no_space(target, after):
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(target, tag)
        tmp = temporary(target, tag)
        tmp.mkdir()
        try:
            yield tmp
            if target.exists():
                target.rmdir()  # empty (the caller refuses any other)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def remove_leftovers(target: str | os.PathLike, tag: str) -> None:
    """Delete the temporary folders (:func:`temporary`) that killed commands ``tag`` left beside
    ``target``: those whose process is gone, or is this one (a pid used again); those of a command still
    running are kept."""
    target = Path(target)
    prefix = f".{target.name}.{tag}-"
    for tmp in target.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = tmp.name[len(prefix): -len(".tmp")]
        if not pid.isdigit() or (int(pid) != os.getpid() and alive(int(pid))):
            continue
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


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
    for stale in [p for pattern in STALE for p in folder.glob(pattern)]:
        stale.unlink(missing_ok=True)


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
