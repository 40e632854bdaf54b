"""Paper-scale datasets with torchvision transforms (book: "Data").

:func:`torchvision_dataset` returns a ``torch.utils.data.Dataset`` of ``(image, label)``
pairs with the paper's preprocessing (App. B):

* MNIST / FashionMNIST: random crop 28, padding 4;
* CIFAR-100: random crop 32, padding 4, horizontal flip;
* SVHN: random crop 32, padding 4 (no flip: digits are not mirror-symmetric);
* TinyImageNet: random crop 64, padding 4, horizontal flip;
* Textures (DTD): resized to 64 (shorter side) and centre-cropped to 64x64;

then scaling to [0, 1] and per-channel normalisation. Augmentation applies to the
``train`` split only when ``train_augment=True``; evaluation sets get only the
deterministic part. A trainer uses it as::

    ds = symlib.data.torchvision_dataset("cifar100", "train", data_root)
    loader = torch.utils.data.DataLoader(ds, batch_size=128, shuffle=True, num_workers=4)
    for x, y in loader: ...

and evaluates on ``symlib.data.load("cifar100", "test", source="torchvision")`` and on
``symlib.data.load_ood("cifar100", source="torchvision")`` (SVHN normalised as CIFAR-100).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from symlib.data.files import TINYIMAGENET_URL, TINYIMAGENET_ZIP_MD5, fetch_hint, resolve_root
from symlib.data.idx import CorruptFileError
from symlib.data.readers import (
    Raw,
    read_cifar10,
    read_cifar100,
    read_dtd,
    read_mnist_like,
    read_svhn,
    read_tinyimagenet,
)
from symlib.data.tensors import SIZES, STATS, check_name, check_split, fingerprint, normalise

AUGMENT = {
    "mnist": dict(crop=28, padding=4, flip=False),
    "fashion-mnist": dict(crop=28, padding=4, flip=False),
    "cifar10": dict(crop=32, padding=4, flip=True),
    "cifar100": dict(crop=32, padding=4, flip=True),
    "svhn": dict(crop=32, padding=4, flip=False),
    "tinyimagenet": dict(crop=64, padding=4, flip=True),
    "textures": dict(crop=None, padding=0, flip=True),
}


def download(name: str, split: str, root: Path) -> None:
    """Fetch ``name``'s ``split`` into ``root`` with torchvision (which checks the archives' md5)."""
    from torchvision import datasets
    from torchvision.datasets.utils import download_and_extract_archive

    if name in ("mnist", "fashion-mnist"):
        cls = datasets.MNIST if name == "mnist" else datasets.FashionMNIST
        cls(str(root), train=split == "train", download=True)
    elif name == "cifar10":
        datasets.CIFAR10(str(root), train=split == "train", download=True)
    elif name == "cifar100":
        datasets.CIFAR100(str(root), train=split == "train", download=True)
    elif name == "svhn":
        datasets.SVHN(str(root / "svhn"), split=split, download=True)
    elif name == "textures":
        datasets.DTD(str(root), split=split, download=True)
    else:
        if not (root / "tiny-imagenet-200" / "wnids.txt").is_file():
            download_and_extract_archive(TINYIMAGENET_URL, str(root), md5=TINYIMAGENET_ZIP_MD5)


def read_raw(
    name: str, split: str, data_root=None, download_missing: bool = False, verify: bool = True
) -> Raw:
    """The stored split of ``name`` under ``data_root`` (torchvision layouts: :mod:`symlib.data.files`)."""
    check_name(name)
    check_split(split)
    root = resolve_root(data_root)
    hint = fetch_hint(name, root)

    def read() -> Raw:
        if name == "mnist":
            return read_mnist_like(root / "MNIST" / "raw", split, name, verify, hint)
        if name == "fashion-mnist":
            return read_mnist_like(root / "FashionMNIST" / "raw", split, name, verify, hint)
        if name == "cifar10":
            return read_cifar10(root, split, verify, hint)
        if name == "cifar100":
            return read_cifar100(root, split, verify, hint)
        if name == "svhn":
            return read_svhn(root, split, verify, hint)
        if name == "tinyimagenet":
            return read_tinyimagenet(root, split, verify, hint)
        return read_dtd(root, split, verify, hint)

    try:
        return read()
    except FileNotFoundError:
        if not download_missing:
            raise
    download(name, split, root)
    return read()


def build_transform(name: str, split: str, train_augment: bool, normalize_as: str | None = None) -> Callable:
    """The torchvision v2 transform for ``name``: augmentation (train only), resize, scale, normalise."""
    from torchvision.transforms import v2

    target = normalize_as or name
    mean, std = STATS[target]
    size = SIZES[target]
    steps: list = [v2.ToImage()]
    if name in ("textures", "tinyimagenet") or SIZES[name] != size:
        steps += [v2.Resize(size, antialias=True), v2.CenterCrop(size)]
    aug = AUGMENT[name]
    if split == "train" and train_augment:
        if aug["crop"] is not None:
            steps.append(v2.RandomCrop(size, padding=aug["padding"]))
        if aug["flip"]:
            steps.append(v2.RandomHorizontalFlip())
    steps.append(Normalise(mean, std))
    return v2.Compose(steps)


class Normalise(torch.nn.Module):
    r"""uint8 pixels to float32 :math:`(p/255 - \mu_c)/\sigma_c`, with exactly the arithmetic of
    :func:`symlib.data.tensors.normalise` (so streamed and in-memory images agree bit for bit)."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        super().__init__()
        self.mean, self.std = tuple(mean), tuple(std)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        if img.dtype != torch.uint8:
            raise TypeError(f"Normalise expects uint8 images, got {img.dtype}")
        return normalise(img.as_subclass(torch.Tensor), self.mean, self.std)


def open_image(path: Path) -> torch.Tensor:
    """An RGB image file as a uint8 ``(3, H, W)`` tensor; unreadable files raise :class:`CorruptFileError`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            arr = np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise CorruptFileError(
            f"image {path} cannot be decoded ({e}); replace it from the official archive"
        ) from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1)


class ImageDataset(Dataset):
    """``(image, label)`` pairs of one split; images are transformed on access.

    Attributes:
        raw: the stored split (:class:`~symlib.data.readers.Raw`).
        transform: applied to each uint8 ``(C, H, W)`` image.
        name, split, classes: what the data is.
    """

    def __init__(self, raw: Raw, transform: Callable, name: str, split: str, normalize_as: str | None = None):
        self.raw, self.transform, self.name, self.split = raw, transform, name, split
        self.classes = raw.classes
        self.normalize_as = normalize_as or name
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.raw)

    def image(self, i: int) -> torch.Tensor:
        """The stored uint8 image ``i`` before any transform."""
        if self.raw.images is not None:
            return torch.from_numpy(self.raw.images[i])
        return open_image(self.raw.files[i])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.image(i)), int(self.raw.labels[i])

    @property
    def fingerprint(self) -> str:
        """sha256 of the stored pixels (or image files' bytes), labels and normalisation; computed once."""
        if self._fingerprint is None:
            mean, std = STATS[self.normalize_as]
            if self.raw.images is not None:
                self._fingerprint = fingerprint(self.raw.images, self.raw.labels, mean, std)
            else:
                import hashlib

                h = hashlib.sha256(repr((mean, std)).encode())
                for f in self.raw.files:
                    h.update(f.read_bytes())
                h.update(np.ascontiguousarray(self.raw.labels).tobytes())
                self._fingerprint = h.hexdigest()
        return self._fingerprint


def torchvision_dataset(
    name: str,
    split: str = "train",
    data_root=None,
    train_augment: bool = True,
    download: bool = False,
    verify: bool = True,
    normalize_as: str | None = None,
) -> ImageDataset:
    """A torch ``Dataset`` of the paper-scale ``name`` with the paper's transforms (module docstring).

    Args:
        name: one of ``mnist, fashion-mnist, cifar10, cifar100, svhn, tinyimagenet, textures``.
        split: ``"train"`` or ``"test"`` (TinyImageNet's test is its labelled validation set).
        data_root: folder with torchvision's layouts; default ``$SYMLIB_DATA`` or ``~/.cache/symlib/data``.
        train_augment: random crop / flip on the train split (never on test).
        download: fetch missing files with torchvision; otherwise a missing file raises
            ``FileNotFoundError`` saying how to get it.
        verify: check files against the official checksums and sizes (:mod:`symlib.data.files`);
            ``False`` reads whatever is there (for tests and home-made subsets).
        normalize_as: use this dataset's normalisation and image size (e.g. ``"cifar100"`` for
            SVHN as its OOD set); default ``name``.
    """
    if normalize_as is not None:
        check_name(normalize_as)
    raw = read_raw(name, split, data_root, download_missing=download, verify=verify)
    return ImageDataset(
        raw, build_transform(name, split, train_augment, normalize_as), name, split, normalize_as
    )
