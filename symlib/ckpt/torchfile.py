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

A zip archive records the CRC-32 of each record: every record read (``data.pkl``, each storage of a
wanted tensor; every record before ``torch.load``, which does not check them) is checked against it, so a
damaged file is an error naming it, never changed weights. A file in the legacy format (a plain pickle,
``torch.save(..., _use_new_zipfile_serialization=False)`` or PyTorch before 1.6) records no checksum:
damage to its tensors' bytes cannot be detected. Empty, truncated and non-checkpoint files are errors too.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import threading
import zipfile
from typing import Any, NamedTuple

import torch

from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.lazy import DAMAGED, FileBytes, Parsed, Ref, check_crc

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
    if storage_offset < 0 or min(stride, default=0) < 0 or min(size, default=0) < 0:
        raise ValueError(f"a tensor with a negative offset, shape or stride ({storage_offset}, {size}, "
                         f"{stride})")
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


_U32, _LENGTHS = struct.Struct("<I"), struct.Struct("<HHH")  # a CRC; name, extra and comment lengths


class _Entry(NamedTuple):
    """A record of a zip archive, from its central directory."""

    name: str
    local: int  # where its local header lies
    size: int
    method: int


def _end(buf) -> tuple[int, int, int]:
    """``(entries, size, offset)`` of a zip archive's central directory, from its end record (zip64 too).

    Raises:
        ValueError, struct.error: not a zip archive or a damaged one.
    """
    end = buf.rfind(b"PK\x05\x06", max(0, len(buf) - 65557))
    if end < 0:
        raise ValueError("no zip end record: a truncated file?")
    n, cd_size, cd_off = _u("<HII", buf, end + 10)
    if n == 0xFFFF or cd_off == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
        loc = end - 20
        if _u("<I", buf, loc)[0] != 0x07064B50:
            raise ValueError("no zip64 locator")
        z64 = _u("<Q", buf, loc + 8)[0]
        if _u("<I", buf, z64)[0] != 0x06064B50:
            raise ValueError("no zip64 end record")
        n, cd_size, cd_off = _u("<QQQ", buf, z64 + 32)
    if cd_off + cd_size > end:
        raise ValueError("the central directory ends beyond its end record")
    return n, cd_size, cd_off


def _central(buf, n: int, cd_off: int) -> list[_Entry]:
    """The ``n`` entries of a zip archive's central directory at ``cd_off`` (:func:`_end`).

    Raises:
        ValueError, struct.error: a damaged directory or a name listed twice.
    """
    out, names, p = [], set(), cd_off
    for _ in range(n):
        sig, method, crc, csize, usize, nlen, elen, clen = _u("<I6xH4xIIIHHH", buf, p)
        if sig != 0x02014B50:
            raise ValueError("bad central directory entry")
        loff = _u("<I", buf, p + 42)[0]
        name = bytes(buf[p + 46:p + 46 + nlen]).decode("utf-8", "replace")
        if name in names:
            raise ValueError(f"record {name!r} listed twice")
        names.add(name)
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
        out.append(_Entry(name, loff, usize, method))
        p += 46 + nlen + elen + clen
    return out


def _data_at(buf, loff: int) -> int:
    """Where an entry's bytes start, from its local header."""
    if _u("<I", buf, loff)[0] != 0x04034B50:
        raise ValueError("bad local header")
    nlen, elen = _u("<HH", buf, loff + 26)
    return loff + 30 + nlen + elen


class _Archive(NamedTuple):
    """Where the records of a ``torch.save`` archive lie: ``(index in the directory, where its bytes
    start, size)`` of each (the index finds its CRC-32)."""

    head: int  # data.pkl's local header (a cached layout must find one there)
    records: dict[str, tuple[int, int, int]]  # {name below the root folder: record}
    storages: tuple[tuple[str, int, int, int], ...]  # (storage key, *record) of each data/<key>


_TEMPLATES: dict[bytes, Any] = {}
_DIRECTORIES: dict[bytes, _Archive] = {}
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


def _archive(buf) -> tuple[_Archive, list[int]] | None:
    """Where the records of a ``torch.save`` archive lie and the CRC-32 of every directory entry, or
    ``None`` when it is not an archive this reader handles (compressed records, no ``data.pkl``).
    Archives of the same layout (their directories equal but for the checksums and the root folder's
    name, which ``torch.save`` takes from the file name) are parsed once.

    Raises:
        ValueError, struct.error: a damaged zip archive.
    """
    n, cd_size, cd_off = _end(buf)
    cd = bytearray(buf[cd_off:cd_off + cd_size])
    crcs, q, crc_at, lengths = [], 0, _U32.unpack_from, _LENGTHS.unpack_from
    for _ in range(n):  # the key: the directory without its checksums (which differ with the weights)
        crcs.append(crc_at(cd, q + 16)[0])
        cd[q + 16:q + 20] = b"\0\0\0\0"
        a, b, c = lengths(cd, q + 28)
        q += 46 + a + b + c
    root = bytes(cd[46:46 + _u("<H", cd, 28)[0]]).split(b"/", 1)[0] + b"/" if n else b""
    key = bytes(cd).replace(root, b"/")
    hit = _DIRECTORIES.get(key)
    if hit is None or buf[hit.head:hit.head + 4] != ZIP_MAGIC:
        ents = _central(buf, n, cd_off)
        if any(e.method != 0 for e in ents):
            return None  # compressed entries: not written by torch.save
        pkl = next((e for e in ents if e.name.endswith("/data.pkl") and e.name.count("/") == 1), None)
        if pkl is None:
            return None
        top = pkl.name[: -len("data.pkl")]
        records = {e.name[len(top):]: (i, _data_at(buf, e.local), e.size) for i, e in enumerate(ents)
                   if e.name.startswith(top)}
        storages = tuple((k[len("data/"):], *rec) for k, rec in records.items() if k.startswith("data/"))
        hit = _remember(_DIRECTORIES, key, _Archive(pkl.local, records, storages))
    return hit, crcs


def _record(fb: FileBytes, arch: _Archive, crcs: list[int], name: str) -> bytes:
    """The bytes of record ``name`` (below the root folder), checked against its CRC-32."""
    i, start, size = arch.records[name]
    check_crc(fb.path, f"record {name!r} of the zip archive", fb.buf, start, size, crcs[i])
    return bytes(fb.buf[start:start + size])


def _fast(fb: FileBytes) -> Parsed | None:
    """The weights-only reading of a zip archive, or ``None`` when the file needs ``torch.load``. Every
    record read is checked against its CRC-32: ``data.pkl`` and ``byteorder`` here, each storage when a
    tensor of it is first read (:attr:`symlib.ckpt.lazy.Parsed.records`).

    Raises:
        CheckpointError: a damaged or truncated archive (naming what is wrong).
    """
    if sys.byteorder != "little":
        return None
    try:
        found = _archive(fb.buf)
    except (ValueError, struct.error) as e:
        why = e if isinstance(e, ValueError) else "its directory points beyond the end of the file"
        raise CheckpointError(f"{fb.path}: a damaged zip archive ({why}); {DAMAGED}") from None
    if found is None:
        return None
    arch, crcs = found
    if "byteorder" in arch.records and _record(fb, arch, crcs, "byteorder") != b"little":
        return None
    payload = _record(fb, arch, crcs, "data.pkl")
    try:
        obj = _template(payload)
    except _NeedsMore:
        return None
    except Exception as e:  # a damaged pickle
        raise CheckpointError(f"{fb.path}: unreadable torch.save archive ({type(e).__name__}: {e})") from None
    buf = fb.buf
    return Parsed(fb.path, obj, {k: (buf, start) for k, _, start, _ in arch.storages}, "torch",
                  layout=id(obj), files=(fb.path,), sizes=(fb.size,),
                  records={k: (size, crcs[i]) for k, i, _, size in arch.storages})


def _check_zip(path: str) -> None:
    """Check every record of a zip archive against its CRC-32 (``torch.load`` does not), before
    ``torch.load`` reads it."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except Exception as e:  # whatever a damaged archive makes zipfile raise
        raise CheckpointError(f"{path}: a damaged zip archive ({type(e).__name__}: {e}); {DAMAGED}") from None
    if bad is not None:
        raise CheckpointError(f"{path}: record {bad!r} of the zip archive fails its CRC-32 checksum or "
                              f"its local header; {DAMAGED}")


#: Words of torch's weights-only errors that mean "the file names code", as opposed to a damaged pickle.
_NEEDS_CODE = ("GLOBAL", "unrecognized function", "allowlisted", "must be imported")


def _unreadable(fb: FileBytes, e: BaseException) -> CheckpointError:
    """The error for a file ``torch.load`` cannot read: what it says, what the file looks like, the fix."""
    text = str(e).rpartition("WeightsUnpickler error:")[2]  # torch's own words, after its advice
    detail = next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]
    error = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
    head = bytes(fb.buf[:9])
    if head[:2] in (ZIP_MAGIC[:2], b"\x80\x02"):
        what = DAMAGED
    elif head[8:9] == b"{":
        what = "it looks like a safetensors file: name it *.safetensors"
    else:
        what = (f"it starts with {head[:8]!r}, neither a zip archive (torch.save) nor a pickle (torch.save "
                f"before PyTorch 1.6): not a checkpoint file; pass one written by torch.save or safetensors")
    return CheckpointError(f"{fb.path}: not a file torch.load can read ({error}): {what}")


def _torch_load(fb: FileBytes, trust_pickle: bool) -> Any:
    """``torch.load`` of a file the weights-only reader does not handle; every failure a
    :class:`~symlib.ckpt.errors.CheckpointError`."""
    try:
        return torch.load(fb.path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines()]
        detail = next((line for line in lines if any(w in line for w in _NEEDS_CODE)), None)
        if detail is None or trust_pickle:
            raise _unreadable(fb, e) from None
        raise CheckpointError(
            f"{fb.path}: torch.load(weights_only=True) failed: the file needs code to be unpickled "
            f"({detail}), and unpickling runs whatever code the file names. If you trust this file, "
            f"allow it with trust_pickle=True (`--trust-pickle` on the command line) or allow that one name "
            f"with torch.serialization.add_safe_globals([...]); better, save the weights alone: "
            f"torch.save(model.state_dict(), path) or safetensors"
        ) from None
    except Exception as e:  # EOFError, KeyError, OSError, RuntimeError...: whatever a damaged file raises
        raise _unreadable(fb, e) from None


def read(fb: FileBytes, trust_pickle: bool = False) -> Parsed:
    """Parse a ``torch.save`` file (module docstring): weights-only and lazy when it can be, else
    ``torch.load(weights_only=True)``.

    A zip archive (``torch.save`` since PyTorch 1.6) records a CRC-32 of every record: each record read
    is checked against it (by ``_fast`` and :class:`~symlib.ckpt.lazy.Parsed`, or all of them before
    ``torch.load``, which does not check them), so a flipped bit is an error, never a changed weight. A
    file in the legacy format (a plain pickle, ``_use_new_zipfile_serialization=False``) has no checksum:
    damage to its tensors' bytes cannot be detected.

    Args:
        fb: the file's bytes (:func:`symlib.ckpt.lazy.open_bytes`).
        trust_pickle: unpickle a file that needs code with ``torch.load(weights_only=False)`` (it can run
            arbitrary code: only for files you trust).

    Raises:
        CheckpointError: the file is empty, not a ``torch.save`` file, damaged or truncated (a record that
            fails its checksum), or it needs code and ``trust_pickle`` is not set.
    """
    if fb.size == 0:
        raise CheckpointError(f"{fb.path}: an empty file (0 bytes), not a checkpoint: a save that failed or "
                              f"an interrupted copy; save or copy it again")
    if bytes(fb.buf[:4]) == ZIP_MAGIC:
        parsed = _fast(fb)
        if parsed is not None:
            return parsed
        _check_zip(fb.path)
    obj = _torch_load(fb, trust_pickle)
    if isinstance(obj, torch.nn.Module):  # a whole pickled module (only with trust_pickle)
        obj = obj.state_dict()
    return Parsed(fb.path, obj, {}, "torch", layout=None, files=(fb.path,), sizes=(fb.size,))
