"""A dataset split held as two tensors, and the per-dataset constants (book: "Data")."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch

NAMES = ("mnist", "fashion-mnist", "cifar10", "cifar100", "svhn", "tinyimagenet", "textures")
SPLITS = ("train", "test")

# Per-channel mean and standard deviation of the training pixels in [0, 1] (the usual constants).
STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    "tinyimagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
    # DTD is only an OOD set (normalised as TinyImageNet); its own constants are ImageNet's.
    "textures": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
# Side of the (square) images a model trained on the dataset sees.
SIZES = {
    "mnist": 28, "fashion-mnist": 28, "cifar10": 32, "cifar100": 32, "svhn": 32, "tinyimagenet": 64,
    "textures": 64,
}
OOD = {"mnist": "fashion-mnist", "cifar10": "svhn", "cifar100": "svhn", "tinyimagenet": "textures"}


def check_name(name: str) -> str:
    """Return ``name`` if it is one of :data:`NAMES`, else raise an error listing them."""
    if name not in NAMES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {NAMES}")
    return name


def check_split(split: str) -> str:
    """Return ``split`` if it is ``"train"`` or ``"test"``."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")
    return split


def ood_pair(name: str) -> str:
    """The out-of-distribution set the paper pairs with ``name`` (Table 1): FashionMNIST for MNIST,
    SVHN for CIFAR-100, Textures (DTD) for TinyImageNet."""
    check_name(name)
    if name not in OOD:
        raise ValueError(
            f"{name!r} is an out-of-distribution set itself; in-distribution sets are {tuple(OOD)}"
        )
    return OOD[name]


@dataclass(frozen=True, eq=False)
class Tensors:
    r"""One split in memory: ``x`` float32 ``(N, C, H, W)`` normalised as :math:`(p - \mu_c) / \sigma_c`
    for pixels :math:`p \in [0, 1]`, ``y`` int64 ``(N,)``.

    Attributes:
        x: images.
        y: labels in ``0 .. num_classes - 1``.
        name: dataset name (one of :data:`NAMES`).
        source: ``"embedded"`` or ``"torchvision"``.
        fingerprint: sha256 of the raw uint8 pixels, labels and normalisation used; equal
            fingerprints mean equal ``x`` and ``y``. Store it in zoo manifests.
        split: ``"train"`` or ``"test"``.
        mean, std: the per-channel constants used to normalise ``x``.
        classes: class names.
    """

    x: torch.Tensor
    y: torch.Tensor
    name: str
    source: str
    fingerprint: str
    split: str = "train"
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    classes: tuple[str, ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return len(self.classes)

    @property
    def black(self) -> tuple[float, ...]:
        """The normalised value of a black pixel per channel: the ``fill`` for
        :func:`~symlib.data.augment.random_crop`."""
        return tuple(-m / s for m, s in zip(self.mean, self.std, strict=True))

    def to(self, device: str | torch.device) -> Tensors:
        """A copy with ``x`` and ``y`` on ``device``."""
        return replace(self, x=self.x.to(device), y=self.y.to(device))


def fingerprint(images: np.ndarray, labels: np.ndarray, mean: tuple, std: tuple) -> str:
    """sha256 over the uint8 pixels (with their shape), the int64 labels and the normalisation."""
    h = hashlib.sha256()
    h.update(repr((images.shape, str(images.dtype), tuple(mean), tuple(std))).encode())
    h.update(np.ascontiguousarray(images).tobytes())
    h.update(np.ascontiguousarray(labels, dtype=np.int64).tobytes())
    return h.hexdigest()


def normalise(images: np.ndarray | torch.Tensor, mean: tuple, std: tuple) -> torch.Tensor:
    r"""uint8 images ``(N, C, H, W)`` to float32 :math:`(p/255 - \mu_c)/\sigma_c`."""
    x = torch.as_tensor(np.asarray(images)) if isinstance(images, np.ndarray) else images
    s = torch.tensor(std, dtype=torch.float64).view(-1, 1, 1)
    m = torch.tensor(mean, dtype=torch.float64).view(-1, 1, 1)
    # one fused affine map p * (1 / (255 s)) - m / s on a fresh float32 copy
    out = x.to(torch.float32)
    out.mul_((1.0 / (255.0 * s)).to(torch.float32)).sub_((m / s).to(torch.float32))
    return out


def make_tensors(images, labels, name, source, split, classes, normalize_as=None) -> Tensors:
    """Build :class:`Tensors` from uint8 images and labels, normalised with the stats of ``normalize_as``."""
    mean, std = STATS[normalize_as or name]
    if images.shape[1] != len(mean):
        raise ValueError(
            f"{name} has {images.shape[1]} channel(s) but normalize_as={normalize_as!r} has {len(mean)}"
        )
    return Tensors(
        x=normalise(images, mean, std),
        y=torch.as_tensor(np.asarray(labels, dtype=np.int64)),
        name=name,
        source=source,
        fingerprint=fingerprint(images, labels, mean, std),
        split=split,
        mean=mean,
        std=std,
        classes=tuple(classes),
    )
