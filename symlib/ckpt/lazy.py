"""Tensors inside files, read only when wanted (book: "symlib on your own network").

A checkpoint file is parsed into its content with every tensor replaced by a :class:`Ref`: its dtype,
shape and strides and where its bytes lie (a storage key and an element offset). The bytes stay in the
file until :meth:`Parsed.copy` writes them straight into a row of the stacked output: an optimizer's
state beside the weights, or the tensors of a prefix that is not wanted, are never read. Small files are
read whole (one system call); large ones are memory-mapped, so only the pages of wanted tensors are
touched.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["MMAP_ABOVE", "FileBytes", "Parsed", "Ref", "open_bytes"]

#: Files larger than this (bytes) are memory-mapped instead of read whole.
MMAP_ABOVE = 8 << 20


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
    """

    path: str
    obj: Any
    data: Mapping[str, tuple[Any, int]] = dataclasses.field(default_factory=dict)
    kind: str = "torch"
    layout: object = None
    files: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)

    def _source(self, ref: Ref) -> tuple[Any, int]:
        try:
            buf, start = self.data[ref.key]
        except KeyError:
            from symlib.ckpt.errors import CheckpointError

            raise CheckpointError(f"{self.path}: tensor storage {ref.key!r} is missing from the file (a "
                                  f"truncated or damaged file?)") from None
        return buf, start + ref.offset * ref.dtype.itemsize

    def tensor(self, leaf: Ref | torch.Tensor) -> torch.Tensor:
        """The tensor of ``leaf`` (a view on the file's bytes; copy it before keeping it)."""
        if isinstance(leaf, torch.Tensor):
            return leaf
        buf, start = self._source(leaf)
        if leaf.contiguous:
            span = leaf.nbytes
        else:
            last = sum((d - 1) * s for d, s in zip(leaf.shape, leaf.stride, strict=True))
            span = (1 + last) * leaf.dtype.itemsize if math.prod(leaf.shape) else 0
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
