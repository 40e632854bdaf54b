"""Tensors inside files, read only when wanted (book: "symlib on your own network").

A checkpoint file is parsed into its content with every tensor replaced by a :class:`Ref`: its dtype,
shape and strides and where its bytes lie (a storage key and an element offset). The bytes stay in the
file until :meth:`Parsed.copy` writes them straight into a row of the stacked output: an optimizer's
state beside the weights, or the tensors of a prefix that is not wanted, are never read. Small files are
read whole (one system call); large ones are memory-mapped, so only the pages of wanted tensors are
touched.

Before a tensor's bytes are used they are checked against the file: they must lie inside it and inside
their storage, and a storage whose file records a CRC-32 (each record of a ``torch.save`` zip archive;
``Parsed.records``) is checked against it the first time one of its tensors is read, so a flipped bit
is an error, never a changed weight.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from symlib.ckpt.errors import CheckpointError

__all__ = ["DAMAGED", "MMAP_ABOVE", "FileBytes", "Parsed", "Ref", "check_crc", "open_bytes"]

#: Files larger than this (bytes) are memory-mapped instead of read whole.
MMAP_ABOVE = 8 << 20
#: Records up to this size (bytes) are copied to be checked (faster than a view for small ones).
_COPY_BELOW = 1 << 16
#: The end of every message about a damaged file: what happened and the fix.
DAMAGED = "the file is damaged (a bad disk, an interrupted download or copy): copy or save it again"


@dataclasses.dataclass(frozen=True)
class Ref:
    """Where a tensor of a file lies: ``key`` names its storage (a ``torch.save`` storage, a safetensors
    tensor), ``offset`` is its first element in that storage; ``stride`` is ``None`` for a contiguous
    tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None
    offset: int = 0

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements."""
        return math.prod(self.shape) * self.dtype.itemsize

    @functools.cached_property
    def contiguous(self) -> bool:
        """Whether the elements are one contiguous run of bytes, in order."""
        if self.stride is None:
            return True
        expect, run = [], 1
        for d in reversed(self.shape):
            expect.append(run)
            run *= d
        return all(s == e for s, e, d in zip(self.stride, reversed(expect), self.shape, strict=True) if d > 1)

    @functools.cached_property
    def span(self) -> int:
        """Bytes from the first element to the end of the last one (:attr:`nbytes` when contiguous; 0 for
        an empty tensor)."""
        if self.contiguous or not math.prod(self.shape):
            return self.nbytes
        last = sum((d - 1) * s for d, s in zip(self.shape, self.stride, strict=True))
        return (1 + last) * self.dtype.itemsize


class FileBytes:
    """The bytes of one file: read whole below :data:`MMAP_ABOVE`, memory-mapped above."""

    __slots__ = ("buf", "path", "size")

    def __init__(self, path: str | os.PathLike, mmap_above: int = MMAP_ABOVE):
        self.path = str(path)
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            if self.size > mmap_above:
                self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            else:
                self.buf = f.read()


def open_bytes(path: str | os.PathLike) -> FileBytes:
    """The bytes of ``path`` (:class:`FileBytes`)."""
    return FileBytes(path)


def check_crc(path: str, what: str, buf, start: int, size: int, crc: int) -> None:
    """Check that bytes ``[start, start + size)`` of ``buf``, the bytes of file ``path``, lie inside it and
    match ``crc`` (a CRC-32, as a zip archive records one per record); ``what`` names the record.

    Raises:
        CheckpointError: beyond the end of ``buf`` (a truncated file) or another checksum (a damaged one).
    """
    if start < 0 or start + size > len(buf):
        raise CheckpointError(f"{path}: {what}: its bytes [{start}, {start + size}) end beyond the end of "
                              f"the file ({len(buf)} bytes): a truncated file; {DAMAGED}")
    if size <= _COPY_BELOW:
        got = zlib.crc32(buf[start:start + size])
    else:
        with memoryview(buf)[start:start + size] as view:  # no copy, also of a memory map
            got = zlib.crc32(view)
    if got != crc:
        raise CheckpointError(f"{path}: {what}: its bytes do not match the CRC-32 checksum the file records "
                              f"for them ({got:08x}, recorded {crc:08x}); {DAMAGED}")


_NO_RECORD = (None, None)

_NP = {
    torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
    torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


@dataclasses.dataclass
class Parsed:
    """A parsed checkpoint file.

    Attributes:
        path: the file (for a Hugging Face folder, the folder).
        obj: its content, tensors as :class:`Ref` (or as tensors, for a file that had to be unpickled
            by ``torch.load``).
        data: ``{storage key: (bytes, byte offset of the storage)}``.
        kind: ``"torch"``, ``"lightning"``, ``"safetensors"``, ``"transformers"``, ``"timm"``, ...
        layout: an identity shared by files of the same layout (the same tensors at the same places),
            so that the choice of the state dict and its prefix is made once for all of them.
        files: the files read (several for a sharded folder).
        sizes: their sizes in bytes.
        metadata: what the file says of itself (a safetensors header's metadata).
        records: ``{storage key: (bytes, CRC-32 or None)}`` for storages whose size the file records (a
            zip record of a ``torch.save`` archive and its checksum): a tensor must lie inside its storage,
            and the storage's bytes must match the checksum (checked once, when a tensor of it is first
            read). Storages not listed are only checked to lie inside the file.
    """

    path: str
    obj: Any
    data: Mapping[str, tuple[Any, int]] = dataclasses.field(default_factory=dict)
    kind: str = "torch"
    layout: object = None
    files: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)
    records: Mapping[str, tuple[int, int | None]] = dataclasses.field(default_factory=dict)
    _checked: set[str] = dataclasses.field(default_factory=set, init=False, repr=False, compare=False)

    def _source(self, ref: Ref) -> tuple[Any, int]:
        """``(bytes, byte offset of the tensor's first element)``, checked (class docstring: ``records``)."""
        try:
            buf, start = self.data[ref.key]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor storage {ref.key!r} is missing from the file; "
                                  f"{DAMAGED}") from None
        begin = ref.offset * ref.dtype.itemsize
        end = begin + ref.span
        size, crc = self.records.get(ref.key, _NO_RECORD)
        if begin < 0 or start + end > len(buf) or (size is not None and end > size):
            raise self._outside(ref, begin, end, size, len(buf))
        if crc is not None and ref.key not in self._checked:
            check_crc(self.path, f"tensor storage {ref.key!r}", buf, start, size, crc)
            self._checked.add(ref.key)
        return buf, start + begin

    def _outside(self, ref: Ref, begin: int, end: int, size: int | None, n: int) -> CheckpointError:
        """The error for a tensor whose bytes ``[begin, end)`` of its storage (of ``size`` bytes, when
        known) are not all inside it or inside the file (``n`` bytes)."""
        what = f"{self.path}: tensor storage {ref.key!r}"
        if begin < 0:
            return CheckpointError(f"{what}: a tensor with a negative offset; {DAMAGED}")
        if size is not None and end > size:
            return CheckpointError(f"{what} holds {size} bytes, but a tensor of shape {ref.shape} needs "
                                   f"bytes [{begin}, {end}) of it; {DAMAGED}")
        return CheckpointError(f"{what}: its bytes end beyond the end of the file ({n} bytes): a truncated "
                               f"file; {DAMAGED}")

    def tensor(self, leaf: Ref | torch.Tensor) -> torch.Tensor:
        """The tensor of ``leaf`` (a view on the file's bytes; copy it before keeping it)."""
        if isinstance(leaf, torch.Tensor):
            return leaf
        buf, start = self._source(leaf)
        span = leaf.span
        raw = np.frombuffer(buf, np.uint8, count=span, offset=start) if span else np.empty(0, np.uint8)
        with warnings.catch_warnings():  # the bytes are only read: a read-only buffer is fine
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(raw).view(leaf.dtype) if span else torch.empty(0, dtype=leaf.dtype)
        if leaf.contiguous:
            return flat.reshape(leaf.shape)
        return flat.as_strided(leaf.shape, leaf.stride)

    def copy(self, leaf: Ref | torch.Tensor, dst: torch.Tensor, dst_bytes: np.ndarray | None = None) -> None:
        """Write ``leaf`` into ``dst`` (a row of the stacked output). ``dst_bytes``, the same row as a
        ``uint8`` numpy array, is the fast path for a contiguous tensor of ``dst``'s dtype (one copy of
        bytes, no tensor built)."""
        if (
            dst_bytes is not None
            and isinstance(leaf, Ref)
            and leaf.dtype == dst.dtype
            and leaf.contiguous
            and leaf.nbytes == dst_bytes.size
        ):
            buf, start = self._source(leaf)
            dst_bytes[...] = np.frombuffer(buf, np.uint8, count=leaf.nbytes, offset=start)
            return
        dst.copy_(self.tensor(leaf).reshape(dst.shape))
