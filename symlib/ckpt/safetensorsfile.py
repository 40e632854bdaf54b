r"""Files in the safetensors format (``.safetensors``), read lazily (book: "symlib on your own network").

A safetensors file is an 8-byte little-endian header length, a JSON header (every tensor's dtype, shape
and byte range; an optional ``"__metadata__"`` of strings) and the tensors' bytes. :func:`read` parses
the header into :class:`symlib.ckpt.lazy.Ref` records; the bytes are read only for the tensors wanted.
No code can be in such a file. The symlib chunks of a zoo are safetensors files too, but a folder of them
is read as a set (:func:`symlib.load`).

The header is checked as the ``safetensors`` library checks it: a length inside the file, a JSON object,
every tensor's byte range ``[begin, end)`` with ``0 <= begin <= end``, of exactly the bytes its dtype and
shape need, inside the data section, no two ranges overlapping and all of them covering the data section
exactly. A damaged header is therefore an error, never header or neighbouring bytes read as weights.
The format has **no checksum** of the tensors' bytes, though: a flipped bit inside the data section changes
one weight and cannot be detected (symlib's own folders record the sha256 of every tensor and check it,
:mod:`symlib.store`).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch

from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.lazy import FileBytes, Parsed, Ref

__all__ = ["DTYPES", "MAX_HEADER", "read"]

#: safetensors dtype names -> torch dtypes.
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    **{name: getattr(torch, attr) for name, attr in (
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"), ("U32", "uint32"),
        ("U64", "uint64")) if hasattr(torch, attr)},
}
#: The longest header read (bytes), the ``safetensors`` library's own limit.
MAX_HEADER = 100_000_000


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _record(bad: str, name: str, rec: Any) -> tuple[Ref, int, int]:
    """The :class:`Ref` and byte range ``(begin, end)`` of one tensor's header record, checked alone."""
    try:
        dtype = DTYPES[rec["dtype"]]
        shape, offsets = rec["shape"], rec["data_offsets"]
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(v) for v in offsets)):
            raise TypeError
    except (KeyError, TypeError):
        raise CheckpointError(f"{bad} (tensor {name!r}: unknown dtype or bad record "
                              f"{repr(rec)[:200]})") from None
    ref, (begin, end) = Ref(name, dtype, tuple(shape)), offsets
    if begin < 0 or end < 0 or begin > end:
        raise CheckpointError(f"{bad} (tensor {name!r}: its byte range [{begin}, {end}) is negative or ends "
                              f"before it begins: a damaged header)")
    if end - begin != ref.nbytes:
        raise CheckpointError(f"{bad} (tensor {name!r}: its byte range [{begin}, {end}) holds {end - begin} "
                              f"bytes, but its dtype and shape {ref.shape} need {ref.nbytes}: a damaged "
                              f"header)")
    return ref, begin, end


def _tile(bad: str, ranges: list[tuple[int, int, str]], size: int) -> None:
    """Check that the tensors' byte ranges cover the ``size`` bytes of the data section exactly: no gap, no
    overlap, none beyond its end."""
    at, last = 0, None
    for begin, end, name in sorted(ranges):
        if end > size:
            raise CheckpointError(f"{bad} (tensor {name!r}: its byte range [{begin}, {end}) ends beyond the "
                                  f"{size} bytes of the data section: a truncated file?)")
        if begin < at:
            raise CheckpointError(f"{bad} (tensor {name!r}: its byte range [{begin}, {end}) overlaps the one "
                                  f"of tensor {last!r}, which ends at {at}: a damaged header)")
        if begin > at:
            raise CheckpointError(f"{bad} (tensor {name!r}: its byte range [{begin}, {end}) leaves bytes "
                                  f"[{at}, {begin}) of the data section to no tensor: a damaged header)")
        at, last = end, name
    if at != size:
        where = f"tensor {last!r}: the last byte range ends at {at}" if last else "no tensors"
        raise CheckpointError(f"{bad} ({where}, but the data section holds {size} bytes: a damaged header or "
                              f"bytes appended to the file)")


def read(fb: FileBytes) -> Parsed:
    """Parse a safetensors file: ``obj`` is ``{name: Ref}``, the header's metadata is
    ``Parsed.metadata``. The header is checked (module docstring); the tensors' bytes cannot be: the
    format records no checksum of them.

    Raises:
        CheckpointError: the file is not a valid safetensors file (naming the file, the tensor and what is
            wrong).
    """
    buf = fb.buf
    bad = f"{fb.path}: not a valid safetensors file"
    if fb.size < 8:
        raise CheckpointError(f"{bad} (only {fb.size} bytes: a truncated file?)")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > min(fb.size - 8, MAX_HEADER):
        raise CheckpointError(f"{bad} (its header claims {n} bytes, the file has {fb.size}: a truncated file "
                              f"or not a safetensors file)")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{bad} (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{bad} (its header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    start = 8 + n
    obj, data, ranges = {}, {}, []
    for name, rec in header.items():
        ref, begin, end = _record(bad, name, rec)
        ranges.append((begin, end, name))
        obj[name] = ref
        data[name] = (buf, start + begin)
    _tile(bad, ranges, fb.size - start)
    # the layout: the header (files with the same header hold the same tensors at the same places)
    return Parsed(fb.path, obj, data, "safetensors", layout=bytes(buf[8:8 + n]), files=(fb.path,),
                  sizes=(fb.size,), metadata=meta if isinstance(meta, dict) else {})
