r"""Files in the safetensors format (``.safetensors``), read lazily (book: "symlib on your own network").

A safetensors file is an 8-byte little-endian header length, a JSON header (every tensor's dtype, shape
and byte range; an optional ``"__metadata__"`` of strings) and the tensors' bytes. :func:`read` parses
the header into :class:`symlib.ckpt.lazy.Ref` records; the bytes are read only for the tensors wanted.
No code can be in such a file. The symlib chunks of a zoo are safetensors files too, but a folder of them
is read as a set (:func:`symlib.load`).
"""

from __future__ import annotations

import json
import struct

import torch

from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.lazy import FileBytes, Parsed, Ref

__all__ = ["DTYPES", "read"]

#: safetensors dtype names -> torch dtypes.
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    **{name: getattr(torch, attr) for name, attr in (
        ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("U16", "uint16"), ("U32", "uint32"),
        ("U64", "uint64")) if hasattr(torch, attr)},
}


def read(fb: FileBytes) -> Parsed:
    """Parse a safetensors file: ``obj`` is ``{name: Ref}``, the header's metadata is
    ``Parsed.metadata``.

    Raises:
        CheckpointError: the file is not a valid safetensors file (naming what is wrong).
    """
    buf = fb.buf
    bad = f"{fb.path}: not a valid safetensors file"
    if fb.size < 8:
        raise CheckpointError(f"{bad} (only {fb.size} bytes)")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > fb.size - 8:
        raise CheckpointError(f"{bad} (its header claims {n} bytes, the file has {fb.size})")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{bad} (header: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{bad} (header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    start = 8 + n
    obj, data = {}, {}
    for name, rec in header.items():
        try:
            dtype = DTYPES[rec["dtype"]]
            shape = tuple(int(d) for d in rec["shape"])
            begin, end = (int(v) for v in rec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{bad} (tensor {name!r}: unknown dtype or bad record {rec!r})") from None
        ref = Ref(name, dtype, shape)
        if end - begin != ref.nbytes or start + end > fb.size:
            raise CheckpointError(f"{bad} (tensor {name!r}: its byte range [{begin}, {end}) does not fit its "
                                  f"shape {shape} or the file: a truncated file?)")
        obj[name] = ref
        data[name] = (buf, start + begin)
    # the layout: the header (files with the same header hold the same tensors at the same places)
    return Parsed(fb.path, obj, data, "safetensors", layout=bytes(buf[8:8 + n]), files=(fb.path,),
                  sizes=(fb.size,), metadata=meta if isinstance(meta, dict) else {})
