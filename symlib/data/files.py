"""Where data lives on disk and how files are checked (book: "Data").

``data_root`` defaults to ``$SYMLIB_DATA`` or ``~/.cache/symlib/data`` and uses
torchvision's own layouts, so a folder filled by torchvision's downloaders works as is:

=============== ===========================================================================
dataset         files under ``data_root``
=============== ===========================================================================
mnist           ``MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``
fashion-mnist   ``FashionMNIST/raw/`` (same names)
cifar10         ``cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}``
cifar100        ``cifar-100-python/{train,test,meta}``
svhn            ``svhn/{train,test}_32x32.mat``
tinyimagenet    ``tiny-imagenet-200/{wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG,
                val/val_annotations.txt}``
textures        ``dtd/dtd/{images/<class>/*.jpg, labels/{train,val,test}<k>.txt}``
=============== ===========================================================================

Checks (``verify=True``) compare every file with the md5 that torchvision ships for
the official file (MNIST, FashionMNIST archives, CIFAR-10, CIFAR-100, SVHN; the TinyImageNet
zip and the DTD tarball when they are still there) and check counts and structure
where no per-file checksum exists. A failure raises :class:`CorruptFileError`
naming the file and the fix; nothing damaged is used silently.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from symlib.data.idx import CorruptFileError

DEBIAN_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

# Debian's dataset-fashion-mnist (0.0~git20200523.55506a9-1) recompressed the official
# archives: same content, other gzip bytes. md5 of its four .gz files, measured here.
DEBIAN_FASHION_GZ_MD5 = {
    "train-images-idx3-ubyte.gz": "cf8536b0aa1a6ac5fa3f23001093305c",
    "train-labels-idx1-ubyte.gz": "10bea18fdb374794d4bb42e356e600c9",
    "t10k-images-idx3-ubyte.gz": "f78720b4224f21cce2f2ccf2d7a94c9a",
    "t10k-labels-idx1-ubyte.gz": "0d30e22e447f3c33dab9ed536400ac01",
}
# sha256 of the uncompressed FashionMNIST IDX files (measured on Debian's copy).
FASHION_RAW_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
# md5 of the official .gz archives, as torchvision 0.29 lists them (MNIST.resources,
# FashionMNIST.resources); copied here so the embedded path never imports torchvision.
# tests/test_data.py checks that they agree with the installed torchvision.
TORCHVISION_IDX_MD5 = {
    "mnist": {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    },
    "fashion-mnist": {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    },
}
TINYIMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINYIMAGENET_ZIP_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


def default_root() -> Path:
    """``$SYMLIB_DATA`` if set, else ``~/.cache/symlib/data``."""
    env = os.environ.get("SYMLIB_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "symlib" / "data"


def resolve_root(data_root: str | os.PathLike | None) -> Path:
    """``data_root`` as a path, or :func:`default_root` when it is ``None``."""
    return default_root() if data_root is None else Path(data_root).expanduser()


def file_digest(path: str | os.PathLike, algorithm: str = "md5") -> str:
    """Hex digest of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.new(algorithm, usedforsecurity=False) if algorithm == "md5" else hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def check_file(path: Path, md5: str | tuple[str, ...] | None, how_to_fix: str) -> Path:
    """Return ``path`` if it exists and (when ``md5`` is given) its md5 is one of the known ones.

    Raises:
        FileNotFoundError: the file is missing; the message says how to get it.
        CorruptFileError: the file's md5 differs; the message names the file and the fix.
    """
    if not path.is_file():
        raise FileNotFoundError(f"missing data file {path}. {how_to_fix}")
    if md5 is None:
        return path
    known = (md5,) if isinstance(md5, str) else md5
    got = file_digest(path, "md5")
    if got not in known:
        raise CorruptFileError(
            f"{path} is corrupt or partial: md5 {got}, expected {' or '.join(known)}. "
            f"Delete it and fetch it again ({how_to_fix}), or pass verify=False to read it anyway."
        )
    return path


def fetch_hint(name: str, root: Path) -> str:
    """How to get dataset ``name`` into ``root``: the sentence every missing-file error ends with."""
    if name == "tinyimagenet":
        return (
            f"Download {TINYIMAGENET_URL} (md5 {TINYIMAGENET_ZIP_MD5}) and unzip it into {root}, "
            "or call with download=True"
        )
    extra = ""
    if name == "fashion-mnist":
        extra = " Debian's copy also works: `apt-get install dataset-fashion-mnist` (or `make data`)."
    return f"Call with download=True to fetch it with torchvision into {root} (or set SYMLIB_DATA).{extra}"
