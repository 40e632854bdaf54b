"""Readers for the on-disk formats of the paper's datasets (book: "Data").

Each reader returns a :class:`Raw` split: ``uint8`` images ``(N, C, H, W)`` held
in memory (MNIST, FashionMNIST, CIFAR-100, SVHN) or a list of image files read
lazily (TinyImageNet, DTD), with ``int64`` labels. Layouts and checks: see
:mod:`symlib.data.files`.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from symlib.data.files import (
    DEBIAN_FASHION_GZ_MD5,
    FASHION_RAW_SHA256,
    TINYIMAGENET_ZIP_MD5,
    TORCHVISION_IDX_MD5,
    check_file,
)
from symlib.data.idx import CorruptFileError, read_idx


@dataclass(frozen=True)
class Raw:
    """One split of a dataset as stored: ``images`` (uint8 NCHW) or ``files``, and ``labels``."""

    labels: np.ndarray
    classes: tuple[str, ...]
    images: np.ndarray | None = None
    files: tuple[Path, ...] | None = None

    def __len__(self) -> int:
        return len(self.labels)


IDX_COUNTS = {"train": 60000, "test": 10000}
IDX_PREFIX = {"train": "train", "test": "t10k"}


def read_mnist_like(folder: Path, split: str, name: str, verify: bool = True, hint: str = "") -> Raw:
    """MNIST / FashionMNIST IDX files in ``folder`` (``<prefix>-images-idx3-ubyte`` or ``.gz``).

    With ``verify``, ``.gz`` archives must match torchvision's md5 (or Debian's for
    FashionMNIST), uncompressed FashionMNIST files the known sha256, and every split its
    official size (60,000 / 10,000 images of 28x28, labels 0..9).
    """
    arrays = []
    for kind in ("images-idx3", "labels-idx1"):
        base = f"{IDX_PREFIX[split]}-{kind}-ubyte"
        raw, gz = folder / base, folder / f"{base}.gz"
        if raw.is_file():
            path = raw
            if verify and name == "fashion-mnist":
                _check_sha256(raw, FASHION_RAW_SHA256[base], hint)
        elif gz.is_file():
            path = gz
            if verify:
                known = (TORCHVISION_IDX_MD5[name][gz.name],)
                if name == "fashion-mnist":
                    known += (DEBIAN_FASHION_GZ_MD5[gz.name],)
                check_file(gz, known, hint)
        else:
            raise FileNotFoundError(f"missing {name} file {raw} (or {gz.name}). {hint}")
        arrays.append((path, read_idx(path)))
    (ipath, images), (lpath, labels) = arrays
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise CorruptFileError(f"{ipath} and {lpath} do not hold matching images (N,H,W) and labels (N,)")
    if verify and (images.shape != (IDX_COUNTS[split], 28, 28) or labels.min() < 0 or labels.max() > 9):
        raise CorruptFileError(
            f"{ipath}: expected {IDX_COUNTS[split]} images 28x28 with labels 0..9, got {images.shape}; "
            f"the file is not the official {name} {split} split. {hint}"
        )
    classes = tuple(str(i) for i in range(10))
    return Raw(labels=labels.astype(np.int64), classes=classes, images=images[:, None].astype(np.uint8))


def _check_sha256(path: Path, sha: str, hint: str) -> None:
    import hashlib

    got = hashlib.sha256(path.read_bytes()).hexdigest()
    if got != sha:
        raise CorruptFileError(f"{path} is corrupt or partial: sha256 {got}, expected {sha}. {hint}")


def read_cifar10(root: Path, split: str, verify: bool = True, hint: str = "") -> Raw:
    """CIFAR-10 python pickles ``cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}``."""
    from torchvision.datasets import CIFAR10

    folder = root / CIFAR10.base_folder
    files = CIFAR10.train_list if split == "train" else CIFAR10.test_list
    meta = check_file(folder / CIFAR10.meta["filename"], CIFAR10.meta["md5"] if verify else None, hint)
    images, labels = [], []
    for name, md5 in files:
        path = check_file(folder / name, md5 if verify else None, hint)
        batch = _unpickle(path)
        try:
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.append(np.asarray(batch["labels"], dtype=np.int64))
        except (KeyError, ValueError) as e:
            raise CorruptFileError(f"{path} is not a CIFAR-10 batch ({e!r}). {hint}") from None
    try:
        classes = tuple(_unpickle(meta)["label_names"])
    except KeyError as e:
        raise CorruptFileError(f"{meta} is not CIFAR-10's batches.meta ({e!r}). {hint}") from None
    return Raw(labels=np.concatenate(labels), classes=classes, images=np.concatenate(images))


def read_cifar100(root: Path, split: str, verify: bool = True, hint: str = "") -> Raw:
    """CIFAR-100 python pickles ``cifar-100-python/{train,test,meta}``; fine labels (100 classes)."""
    from torchvision.datasets import CIFAR100

    folder = root / CIFAR100.base_folder
    md5 = dict(CIFAR100.train_list + CIFAR100.test_list)
    path = check_file(folder / split, md5[split] if verify else None, hint)
    meta = check_file(folder / CIFAR100.meta["filename"], CIFAR100.meta["md5"] if verify else None, hint)
    batch, info = _unpickle(path), _unpickle(meta)
    try:
        images = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(batch["fine_labels"], dtype=np.int64)
        classes = tuple(info["fine_label_names"])
    except (KeyError, ValueError) as e:
        raise CorruptFileError(f"{path} is not a CIFAR-100 batch ({e!r}). {hint}") from None
    if len(images) != len(labels):
        raise CorruptFileError(f"{path}: {len(images)} images but {len(labels)} labels")
    return Raw(labels=labels, classes=classes, images=images)


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return pickle.load(f, encoding="latin1")
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise CorruptFileError(f"{path} is not a readable python pickle ({e!r}); fetch it again") from None


def read_svhn(root: Path, split: str, verify: bool = True, hint: str = "") -> Raw:
    """SVHN ``svhn/{split}_32x32.mat`` (``X`` is ``(32, 32, 3, N)``; label 10 means digit 0)."""
    import scipy.io
    from torchvision.datasets import SVHN

    _, filename, md5 = SVHN.split_list[split]
    path = check_file(root / "svhn" / filename, md5 if verify else None, hint)
    try:
        mat = scipy.io.loadmat(path)
        images = np.ascontiguousarray(np.transpose(mat["X"], (3, 2, 0, 1)), dtype=np.uint8)
        labels = mat["y"].astype(np.int64).reshape(-1) % 10
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise CorruptFileError(f"{path} is not a readable SVHN .mat file ({e!r}); fetch it again") from None
    if len(images) != len(labels):
        raise CorruptFileError(f"{path}: {len(images)} images but {len(labels)} labels")
    return Raw(labels=labels, classes=tuple(str(i) for i in range(10)), images=images)


def read_tinyimagenet(root: Path, split: str, verify: bool = True, hint: str = "") -> Raw:
    """TinyImageNet-200 folder; ``split="test"`` is the official labelled validation set.

    Labels index the sorted WordNet ids of ``wnids.txt``. With ``verify``: the zip (if kept)
    matches its md5, there are 200 classes, 500 training images each, 10,000 validation images.
    """
    base = root / "tiny-imagenet-200"
    if verify and (root / "tiny-imagenet-200.zip").is_file():
        check_file(root / "tiny-imagenet-200.zip", TINYIMAGENET_ZIP_MD5, hint)
    wnids = sorted(check_file(base / "wnids.txt", None, hint).read_text().split())
    index = {w: i for i, w in enumerate(wnids)}
    files, labels = [], []
    if split == "train":
        for w in wnids:
            folder = base / "train" / w / "images"
            found = sorted(folder.glob("*.JPEG"))
            if verify and len(found) != 500:
                raise CorruptFileError(
                    f"{folder} holds {len(found)} images instead of 500; the copy is partial. {hint}"
                )
            files += found
            labels += [index[w]] * len(found)
    else:
        notes = check_file(base / "val" / "val_annotations.txt", None, hint)
        for line in notes.read_text().splitlines():
            if not line.strip():
                continue
            fname, wnid = line.split("\t")[:2]
            if wnid not in index:
                raise CorruptFileError(f"{notes}: unknown class {wnid!r} (not in wnids.txt)")
            path = base / "val" / "images" / fname
            if not path.is_file():
                raise FileNotFoundError(f"{notes} lists {path}, which is missing. {hint}")
            files.append(path)
            labels.append(index[wnid])
    if verify and (len(wnids), len(files)) != (200, 100000 if split == "train" else 10000):
        raise CorruptFileError(
            f"{base}: {len(wnids)} classes and {len(files)} {split} images, expected 200 and "
            f"{100000 if split == 'train' else 10000}; the copy is partial. {hint}"
        )
    return Raw(labels=np.asarray(labels, dtype=np.int64), classes=tuple(wnids), files=tuple(files))


DTD_MD5 = "fff73e5086ae6bdbea199a49dfb8a4c1"  # torchvision.datasets.DTD._MD5, the r1.0.1 tarball


def read_dtd(root: Path, split: str, verify: bool = True, hint: str = "", partition: int = 1) -> Raw:
    """Describable Textures (torchvision layout ``dtd/dtd``); ``split``: train, val or test of ``partition``.

    With ``verify``: the tarball (if kept) matches its md5, 47 classes, 1,880 images in the split.
    """
    base = root / "dtd" / "dtd"
    tarball = root / "dtd" / "dtd-r1.0.1.tar.gz"
    if verify and tarball.is_file():
        check_file(tarball, DTD_MD5, hint)
    listing = check_file(base / "labels" / f"{split}{partition}.txt", None, hint)
    classes = tuple(sorted(p.name for p in (base / "images").iterdir() if p.is_dir()))
    index = {c: i for i, c in enumerate(classes)}
    files, labels = [], []
    for line in listing.read_text().split():
        cls, _ = line.split("/")
        if cls not in index:
            raise CorruptFileError(f"{listing}: class folder {cls!r} missing under {base / 'images'}. {hint}")
        path = base / "images" / line
        if not path.is_file():
            raise FileNotFoundError(f"{listing} lists {path}, which is missing. {hint}")
        files.append(path)
        labels.append(index[cls])
    if verify and (len(classes), len(files)) != (47, 1880):
        raise CorruptFileError(
            f"{base}: {len(classes)} classes and {len(files)} images in {listing.name}, expected 47 and "
            f"1880; the copy is partial. {hint}"
        )
    return Raw(labels=np.asarray(labels, dtype=np.int64), classes=classes, files=tuple(files))
