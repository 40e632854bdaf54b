r"""Files written by ``torch.save`` (``.pt``, ``.pth``, ``.bin``, Lightning's ``.ckpt``), read without
running code (book: "symlib on your own network").

``torch.save`` writes a zip archive: ``<root>/data.pkl``, a pickle of the object in which every tensor
names a *storage* by key, and ``<root>/data/<key>``, each storage's bytes, uncompressed. :func:`read`
parses the archive's directory and unpickles ``data.pkl`` with an unpickler that knows only the names a
file of weights needs (``collections.OrderedDict``, torch's tensor rebuild functions and storage types,
with stand-ins that record where each tensor lies: :class:`symlib.ckpt.lazy.Ref`). Anything else in the
pickle stops it: no code of the file runs. The tensors' bytes are read later, only those wanted.

A file that needs other names (a pickled ``nn.Module``, an ``argparse.Namespace`` of hyper-parameters,
a file in the pre-1.6 format) goes to ``torch.load(weights_only=True)``, torch's own restricted
unpickler (which honours ``torch.serialization.add_safe_globals``). If that refuses too, the file needs
code to be unpickled, which may be arbitrary: a :class:`~symlib.ckpt.errors.CheckpointError` says so and
how to allow it. Only ``trust_pickle=True`` (``--trust-pickle``) runs ``torch.load(weights_only=False)``.

Files of one layout (the same pickle, as the checkpoints of one training run have) are unpickled once.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import threading
from typing import Any

import torch

from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.lazy import FileBytes, Parsed, Ref

__all__ = ["ZIP_MAGIC", "read", "unpickle"]

ZIP_MAGIC = b"PK\x03\x04"

_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}


class _Storage:
    __slots__ = ("dtype", "key")

    def __init__(self, key: str, dtype: torch.dtype):
        self.key, self.dtype = key, dtype


class _StorageType:
    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _rebuild_tensor(storage, storage_offset, size, stride, *_):
    return Ref(storage.key, storage.dtype, tuple(size), tuple(stride), int(storage_offset))


def _rebuild_parameter(data, *_):
    return data


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGES.items()},
}


class _NeedsMore(Exception):
    """The pickle names something the weights-only stand-ins do not cover."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _NeedsMore(f"{module}.{name}") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType)):
            raise _NeedsMore(f"persistent id {pid[:2] if isinstance(pid, tuple) else pid!r}")
        return _Storage(str(pid[2]), pid[1].dtype)


def unpickle(payload: bytes) -> Any:
    """The object of a ``data.pkl`` with every tensor as a :class:`~symlib.ckpt.lazy.Ref`; raises
    ``_NeedsMore`` (internal) when the pickle names anything else than weights need."""
    return _Unpickler(io.BytesIO(payload)).load()


# ------------------------------------------------------------------------------------ the zip directory
def _u(fmt: str, buf, at: int):
    return struct.unpack_from(fmt, buf, at)


def _entries(buf) -> dict[str, tuple[int, int, int]]:
    """``{name: (local header offset, size, method)}`` from a zip's central directory (zip64 too)."""
    end = buf.rfind(b"PK\x05\x06", max(0, len(buf) - 65557))
    if end < 0:
        raise ValueError("no zip end record")
    n, cd_size, cd_off = _u("<HII", buf, end + 10)
    if n == 0xFFFF or cd_off == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
        loc = end - 20
        if _u("<I", buf, loc)[0] != 0x07064B50:
            raise ValueError("no zip64 locator")
        z64 = _u("<Q", buf, loc + 8)[0]
        if _u("<I", buf, z64)[0] != 0x06064B50:
            raise ValueError("no zip64 end record")
        n, cd_size, cd_off = _u("<QQQ", buf, z64 + 32)
    out, p = {}, cd_off
    for _ in range(n):
        sig, method, csize, usize, nlen, elen, clen = _u("<I6xH8xIIHHH", buf, p)
        if sig != 0x02014B50:
            raise ValueError("bad central directory entry")
        loff = _u("<I", buf, p + 42)[0]
        name = bytes(buf[p + 46:p + 46 + nlen]).decode("utf-8", "replace")
        if 0xFFFFFFFF in (usize, csize, loff):
            extra, q = buf[p + 46 + nlen:p + 46 + nlen + elen], 0
            while q + 4 <= len(extra):
                tag, size = _u("<HH", extra, q)
                if tag == 1:
                    vals, r = [], q + 4
                    for v in (usize, csize, loff):
                        if v == 0xFFFFFFFF:
                            vals.append(_u("<Q", extra, r)[0])
                            r += 8
                        else:
                            vals.append(v)
                    usize, csize, loff = vals
                q += 4 + size
        out[name] = (loff, usize, method)
        p += 46 + nlen + elen + clen
    return out


def _data_at(buf, loff: int) -> int:
    """Where an entry's bytes start, from its local header."""
    if _u("<I", buf, loff)[0] != 0x04034B50:
        raise ValueError("bad local header")
    nlen, elen = _u("<HH", buf, loff + 26)
    return loff + 30 + nlen + elen


_TEMPLATES: dict[bytes, Any] = {}
_DIRECTORIES: dict[bytes, tuple[int, int, int, int | None, dict[str, int]]] = {}
_LOCK = threading.Lock()


def _remember(cache: dict, key: bytes, value: Any) -> Any:
    with _LOCK:
        if len(cache) > 256:
            cache.clear()
        cache[key] = value
    return value


def _template(payload: bytes) -> Any:
    got = _TEMPLATES.get(payload)
    return got if got is not None else _remember(_TEMPLATES, payload, unpickle(payload))


def _directory(buf) -> tuple[int, int, int, int | None, dict[str, int]] | None:
    """``(data.pkl's local header, its start, its size, byteorder's start or None, {storage key: data
    start})`` of a torch.save
    archive, or ``None`` when it is not one this reader handles. Archives of the same layout (their
    directories equal but for the root folder's name, which ``torch.save`` takes from the file name) are
    parsed once."""
    end = buf.rfind(b"PK\x05\x06", max(0, len(buf) - 65557))
    if end < 0:
        return None
    n, cd_size, cd_off = _u("<HII", buf, end + 10)
    key = None
    if n != 0xFFFF and cd_off != 0xFFFFFFFF and cd_off + cd_size <= end:
        cd = bytearray(buf[cd_off:cd_off + cd_size])
        q = 0
        for _ in range(n):  # the key: the directory without its checksums (which differ with the weights)
            if q + 46 > len(cd):
                break
            cd[q + 16:q + 20] = b"\0\0\0\0"
            q += 46 + sum(_u("<HHH", cd, q + 28))
        nlen = _u("<H", cd, 28)[0] if len(cd) >= 46 else 0
        root = bytes(cd[46:46 + nlen]).split(b"/", 1)[0] + b"/"
        key = bytes(cd).replace(root, b"/")
        hit = _DIRECTORIES.get(key)
        if hit is not None and buf[hit[0]:hit[0] + 4] == ZIP_MAGIC:
            return hit
    ents = _entries(buf)
    if any(m != 0 for _, _, m in ents.values()):
        return None  # compressed entries: not written by torch.save
    pkl = next((k for k in ents if k.endswith("/data.pkl") and k.count("/") == 1), None)
    if pkl is None:
        return None
    root = pkl[: -len("data.pkl")]
    order = ents.get(f"{root}byteorder")
    data_prefix = f"{root}data/"
    data = {name[len(data_prefix):]: _data_at(buf, off) for name, (off, _, _) in ents.items()
            if name.startswith(data_prefix)}
    at = _data_at(buf, order[0]) if order else None
    found = (ents[pkl][0], _data_at(buf, ents[pkl][0]), ents[pkl][1], at, data)
    return found if key is None else _remember(_DIRECTORIES, key, found)


def _fast(fb: FileBytes) -> Parsed | None:
    """The weights-only reading of a zip archive, or ``None`` when the file needs ``torch.load``."""
    buf = fb.buf
    if sys.byteorder != "little":
        return None
    try:
        found = _directory(buf)
        if found is None:
            return None
        _, start, size, order, offsets = found
        if order is not None and bytes(buf[order:order + 6]) != b"little":
            return None
        payload = bytes(buf[start:start + size])
    except (ValueError, struct.error, KeyError):
        return None
    if len(payload) != size:
        raise CheckpointError(f"{fb.path}: truncated torch.save archive")
    try:
        obj = _template(payload)
    except _NeedsMore:
        return None
    except Exception as e:  # a damaged pickle
        raise CheckpointError(f"{fb.path}: unreadable torch.save archive ({type(e).__name__}: {e})") from None
    data = {k: (buf, off) for k, off in offsets.items()}
    return Parsed(fb.path, obj, data, "torch", layout=id(obj), files=(fb.path,), sizes=(fb.size,))


def _torch_load(path: str, trust_pickle: bool) -> Any:
    if trust_pickle:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=None)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next((line for line in first if "GLOBAL" in line or "Unsupported" in line), first[0] if first
                      else "")
        raise CheckpointError(
            f"{path}: torch.load(weights_only=True) failed: the file needs code to be unpickled "
            f"({detail.strip()}), and unpickling runs whatever code the file names. If you trust this file, "
            f"allow it with trust_pickle=True (`--trust-pickle` on the command line) or allow that one name "
            f"with torch.serialization.add_safe_globals([...]); better, save the weights alone: "
            f"torch.save(model.state_dict(), path) or safetensors"
        ) from None
    except RuntimeError as e:
        raise CheckpointError(f"{path}: not a file torch.load can read ({e})") from None


def read(fb: FileBytes, trust_pickle: bool = False) -> Parsed:
    """Parse a ``torch.save`` file (module docstring): weights-only and lazy when it can be, else
    ``torch.load(weights_only=True)``.

    Args:
        fb: the file's bytes (:func:`symlib.ckpt.lazy.open_bytes`).
        trust_pickle: unpickle a file that needs code with ``torch.load(weights_only=False)`` (it can run
            arbitrary code: only for files you trust).

    Raises:
        CheckpointError: the file is not a ``torch.save`` file, or it needs code and ``trust_pickle`` is
            not set.
    """
    if bytes(fb.buf[:4]) == ZIP_MAGIC:
        parsed = _fast(fb)
        if parsed is not None:
            return parsed
    obj = _torch_load(fb.path, trust_pickle)
    if isinstance(obj, torch.nn.Module):  # a whole pickled module (only with trust_pickle)
        obj = obj.state_dict()
    return Parsed(fb.path, obj, {}, "torch", layout=None, files=(fb.path,), sizes=(fb.size,))
