"""Reader for the IDX format of MNIST and FashionMNIST (book: "Data").

An IDX file is a big-endian header followed by a dense array:

* two zero bytes, one type byte (``0x08`` = uint8, ...), one byte ``d`` = number of dimensions;
* ``d`` big-endian ``uint32`` sizes;
* ``prod(sizes)`` items of the given type, big-endian, row-major.

Files may be gzip-compressed (``.gz``), as the official archives and Debian's
``dataset-fashion-mnist`` ship them. Any mismatch between the header and the
payload (a truncated download, a wrong file) raises :class:`CorruptFileError`
naming the file.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

from symlib.errors import CorruptFileError

# type byte -> big-endian numpy dtype
IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_bytes(path: str | os.PathLike) -> bytes:
    """The content of ``path``, gunzipped when it ends in ``.gz``; damaged archives raise clearly."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    raw = path.read_bytes()
    if path.suffix != ".gz":
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise CorruptFileError(
            f"{path} is not a valid gzip archive ({e}); it is probably a partial download: "
            "delete it and fetch it again"
        ) from None


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Parse the bytes of an (uncompressed) IDX file into a native-endian numpy array.

    Args:
        data: the whole file content.
        name: how to call the file in error messages.

    Returns:
        An array of shape ``sizes`` with the file's dtype in native byte order.

    Raises:
        CorruptFileError: bad magic number, unknown type, or payload size different from the header's.
    """
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise CorruptFileError(
            f"{name} is not an IDX file (its first bytes {data[:4]!r} are not a valid magic)"
        )
    dtype = IDX_TYPES.get(data[2])
    if dtype is None:
        raise CorruptFileError(f"{name}: unknown IDX type byte 0x{data[2]:02x}")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise CorruptFileError(f"{name} is truncated inside its IDX header")
    shape = tuple(int(s) for s in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise CorruptFileError(
            f"{name}: the IDX header announces shape {shape} ({expected} bytes) but the file holds "
            f"{len(data) - header} bytes after the header; the file is truncated or corrupt, fetch it again"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (raw or ``.gz``) into a numpy array; see :func:`parse_idx`."""
    return parse_idx(read_bytes(path), name=str(path))


def write_idx(path: str | os.PathLike, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file (gzipped if ``path`` ends in ``.gz``); inverse of :func:`read_idx`."""
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): code for code, dt in IDX_TYPES.items()}
    native = array.dtype.newbyteorder("=")
    if native not in codes:
        raise TypeError(f"IDX cannot store dtype {array.dtype}; use one of {sorted(str(d) for d in codes)}")
    dt = IDX_TYPES[codes[native]]
    header = bytes([0, 0, codes[native], array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    data = header + array.astype(dt).tobytes()
    path = Path(path)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path
