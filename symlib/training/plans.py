r"""What a seed determines: a model's initialisation, its data order and its crops (book: "Checkpoint zoos").

A *zoo* is many independently trained networks. Each member ``m`` has its own seed, from which two
independent streams are derived (:func:`streams`): one draws the initial weights (PyTorch's default
initialisation of the module, :func:`init_model`), the other keys the data order (a fresh permutation of
the training set every epoch) and the augmentation (a random crop offset per image), computed by a
counter-based hash (:func:`epoch_plans`) that gives the same integers on every device. Given the same
seed, the plain single-model loop (:func:`symlib.training.plain.train_plain`) and the stacked trainer
(:func:`symlib.training.stacked.train_stacked`) see exactly the same batches and crops, and so does every
loop over :func:`minibatches` (SWAG, VI, SGHMC).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from symlib.params import Params
from symlib.training.recipe import Recipe

__all__ = [
    "DATA_ORDER",
    "Batch",
    "check_images",
    "crop",
    "epoch_plan",
    "epoch_plans",
    "init_model",
    "init_params",
    "minibatches",
    "pad_images",
    "streams",
]


def streams(seed: int) -> tuple[int, int]:
    """Two independent 63-bit seeds derived from ``seed``: (initialisation, data order and augmentation)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    a, b = np.random.SeedSequence(int(seed)).generate_state(2, dtype=np.uint64)
    return int(a) >> 1, int(b) >> 1


def init_model(make: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``make()`` with PyTorch's default initialisation drawn from ``seed``'s initialisation stream
    (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(streams(seed)[0])
        return make()


def init_params(make: Callable[[], nn.Module], seeds: Sequence[int]) -> Params:
    """Initial parameters of one model per seed, stacked: ``{name: (len(seeds), ...)}``."""
    models = [init_model(make, s) for s in seeds]
    return {
        k: torch.stack([dict(m.named_parameters())[k].detach() for m in models])
        for k, _ in models[0].named_parameters()
    }


def epoch_plan(gen: torch.Generator, n: int, padding: int, flip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One epoch's data order and augmentation for one model, drawn from a ``torch.Generator``.

    The trainers use the device-independent counter-based :func:`epoch_plans` instead; this
    generator-based draw stays for code that holds its own generator.

    Returns:
        ``perm`` (n,): the order of the training images; ``aug`` (n, 3) int64: per image (in ``perm``
        order) the crop offsets (row, column) in ``0 .. 2 * padding`` and the flip coin (0/1).
    """
    perm = torch.randperm(n, generator=gen)
    aug = torch.zeros(n, 3, dtype=torch.int64)
    if padding:
        aug[:, :2] = torch.randint(0, 2 * padding + 1, (n, 2), generator=gen)
    if flip:
        aug[:, 2] = torch.randint(0, 2, (n,), generator=gen)
    return perm, aug


_M32 = 0xFFFFFFFF


def _hash32(v: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in ``0 .. 2**32 - 1``.

    Every product stays below ``2**63`` (a 32-bit value times a constant below ``2**31``) and every shift
    is of a non-negative value, so the result is the same exact integer on every device and backend.
    """
    v = (v ^ (v >> 16)) * 0x7FEB352D & _M32
    v = (v ^ (v >> 15)) * 0x5BD1E995 & _M32
    return v ^ (v >> 16)


def _counter_hash(keys: torch.Tensor, epoch: int, counter: torch.Tensor) -> torch.Tensor:
    """``hash(key, epoch, counter)`` in ``0 .. 2**32 - 1``: ``keys`` (M,) 63-bit data-stream seeds,
    ``counter`` any int64 tensor broadcast against ``keys[:, None]``."""
    h = _hash32(keys & _M32) ^ _hash32((keys >> 32) ^ 0x3C6EF372)
    h = _hash32(h[:, None] ^ _hash32(torch.full_like(h[:, None], epoch & _M32) ^ 0x1B873593))
    return _hash32(h ^ counter)


# Version of the per-model data order and crops (:func:`epoch_plans`). Zoo configurations record it, so
# that a cached zoo trained with another order is never taken for this one.
DATA_ORDER = "hash32/1"


def epoch_plans(
    seeds: Sequence[int],
    epoch: int,
    n: int,
    padding: int,
    flip: bool,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""One epoch's data order and augmentation for every model, computed on ``device``.

    Counter-based: with :math:`h_m(e, k)` a 32-bit hash of (model ``m``'s data-stream seed
    (:func:`streams`), epoch ``e``, counter ``k``), the order of the training set is image ``i``
    sorted by the key :math:`h_m(e, i)\,n + i` (distinct keys, so the sort is unique), and the image at
    position ``t`` gets the crop offsets :math:`\lfloor h_m(e, n + 3t + a)\,(2p + 1) / 2^{32} \rfloor`
    (``a`` = 0 rows, 1 columns) and the flip coin :math:`\lfloor h_m(e, n + 3t + 2) / 2^{31} \rfloor`.
    Only exact int64 arithmetic is involved, so the plan is the same on every device (the stacked
    trainer on CPU or CUDA and the plain loop see the same batches), and no per-model generator is
    needed (1,000 models x 60,000 images is a few elementwise operations and one sort).

    Returns:
        ``perms`` (M, n) int64, the order of the training images; ``augs`` (M, n, 3) int64, per position
        the crop offsets (row, column) in ``0 .. 2 * padding`` and the flip coin (0/1).
    """
    keys = torch.tensor([streams(s)[1] for s in seeds], dtype=torch.int64, device=device)
    m = len(seeds)
    ar = torch.arange(n, dtype=torch.int64, device=device)
    perms = (_counter_hash(keys, epoch, ar) * n + ar).argsort(dim=1)
    augs = torch.zeros(m, n, 3, dtype=torch.int64, device=device)
    if padding or flip:
        h = _counter_hash(keys, epoch, n + torch.arange(3 * n, dtype=torch.int64, device=device))
        h = h.view(m, n, 3)
        if padding:
            augs[..., :2] = (h[..., :2] * (2 * padding + 1)) >> 32
        if flip:
            augs[..., 2] = h[..., 2] >> 31
    return perms, augs


def check_images(x: torch.Tensor, what: str = "training") -> None:
    """Refuse training images with NaN or infinite pixels, naming the first ones (once per run: one pass
    over the data). The compiled CPU step would not notice them (its max-pool's comparison skips NaN, so
    the loss stays finite), while the PyTorch path propagates NaN: either way the run would be wrong."""
    if not x.is_floating_point():
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        rows = bad.reshape(x.shape[0], -1).any(1).nonzero().flatten().tolist()
        raise ValueError(
            f"{what}: {len(rows)} training image(s) hold NaN or infinite pixels (indices {rows[:10]}"
            f"{'...' if len(rows) > 10 else ''}); fix or drop them before training (check how the data "
            f"was loaded and normalised)"
        )


def pad_images(x: torch.Tensor, padding: int, fill: float | Sequence[float] = 0.0) -> torch.Tensor:
    """Images ``(N, C, H, W)`` padded by ``padding`` pixels of ``fill`` (a number or one per channel)."""
    if not padding:
        return x
    fill_t = torch.as_tensor(fill, dtype=x.dtype, device=x.device).reshape(-1)
    if fill_t.numel() == 1:
        return F.pad(x, (padding,) * 4, value=float(fill_t))
    if fill_t.numel() != x.shape[1]:
        raise ValueError(f"fill needs one value or one per channel ({x.shape[1]}), got {fill_t.numel()}")
    out = F.pad(x, (padding,) * 4)
    inside = torch.zeros(out.shape[-2:], dtype=torch.bool, device=x.device)
    inside[padding:-padding, padding:-padding] = True
    return torch.where(inside, out, fill_t.view(1, -1, 1, 1))


def crop(xpad: torch.Tensor, idx: torch.Tensor, aug: torch.Tensor, size: int) -> torch.Tensor:
    r"""Cut ``size`` x ``size`` windows out of padded images: :math:`y[\ldots, c, i, j] =
    \tilde x_{\mathrm{idx}}[c, i + o, j + p]`, mirrored left-right where the flip coin is 1.

    Args:
        xpad: padded images ``(N, C, H', W')``.
        idx: image indices, any shape ``lead``.
        aug: ``lead + (3,)`` offsets (row, column) and flip coins, as from :func:`epoch_plan`.
        size: output side.

    Returns:
        ``lead + (C, size, size)``.
    """
    n, c, hp, wp = xpad.shape
    ar = torch.arange(size, device=xpad.device)
    flat_idx, flat_aug = idx.reshape(-1), aug.reshape(-1, 3)
    rows = flat_aug[:, 0, None] + ar  # (K, size)
    cols = flat_aug[:, 1, None] + torch.where(flat_aug[:, 2, None].bool(), size - 1 - ar, ar)
    lin = (rows[:, :, None] * wp + cols[:, None, :]).reshape(-1, 1, size * size)
    if c == 1:  # one gather straight from the whole (padded) set
        out = xpad.reshape(-1)[(flat_idx * (hp * wp)).view(-1, 1, 1) + lin]
    else:
        out = xpad[flat_idx].reshape(-1, c, hp * wp).gather(2, lin.expand(-1, c, -1))
    return out.reshape(*idx.shape, c, size, size)


def crop_rows(xpad: torch.Tensor, idx: torch.Tensor, aug: torch.Tensor, size: int) -> torch.Tensor:
    """:func:`crop` for one-channel images without flips, as one ``index_select`` of image rows: every
    length-``size`` run of the flattened padded set is a row of an overlapping strided view, and the
    window of image ``idx`` at offset ``(o, p)`` is the ``size`` runs starting at
    ``idx * H' W' + (o + i) W' + p``. Same values as :func:`crop` (a copy, exact); ``lead + (1, size, size)``.
    """
    _, _, hp, wp = xpad.shape
    flat = xpad.contiguous().reshape(-1)
    runs = flat.as_strided((flat.numel() - size + 1, size), (1, 1))
    starts = idx * (hp * wp) + aug[..., 0] * wp + aug[..., 1]
    rows = (starts[..., None] + torch.arange(size, device=xpad.device) * wp).reshape(-1)
    return runs.index_select(0, rows).view(*idx.shape, 1, size, size)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One training step of ``M`` stacked models (see :func:`minibatches`).

    Attributes:
        epoch: 0-based epoch; step: 0-based global step; lr: the recipe's learning rate in this epoch;
        last_in_epoch: whether this is the epoch's last step;
        x: ``(M, B, C, H, W)`` augmented images (each model its own); y: ``(M, B)`` labels.
    """

    epoch: int
    step: int
    lr: float
    last_in_epoch: bool
    x: torch.Tensor
    y: torch.Tensor


def minibatches(
    seeds: Sequence[int],
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    fill: float | Sequence[float] = 0.0,
    epochs: int | None = None,
):
    """The mini-batches of ``M = len(seeds)`` independent runs, as
    :func:`~symlib.training.stacked.train_stacked` sees them.

    Every model draws its own data order and crops from its seed's data stream (:func:`streams`), one
    epoch at a time, so any loop over these batches (SGD, SWAG, VI, SGHMC) sees exactly the batches of
    the plain single-model loop for that seed.

    Args:
        seeds: one seed per model.
        x, y: training images ``(N, C, H, W)`` and labels ``(N,)``, on the device to train on.
        recipe: batch size, augmentation and the learning-rate schedule (reported in ``Batch.lr``).
        fill: value of the padding pixels.
        epochs: number of epochs (default ``recipe.epochs``).

    Yields:
        :class:`Batch` for every step.
    """
    n, size = x.shape[0], x.shape[-1]
    xpad = pad_images(x, recipe.crop_padding, fill)
    cut = cutter(x, recipe)
    for epoch, step, lr, last, idx, aug in batch_plans(seeds, n, recipe, epochs, x.device):
        yield Batch(epoch, step, lr, last, cut(xpad, idx, aug, size), y[idx])


def cutter(x: torch.Tensor, recipe: Recipe) -> Callable:
    """How the batches of :func:`minibatches` are cut out of the (padded) training inputs: windows of
    images ``(N, C, H, W)`` (:func:`crop_rows` for one channel without flips, else :func:`crop`), or the
    rows themselves for inputs that are not images (vectors ``(N, d)``: no augmentation, a clear error if
    the recipe asks for one)."""
    if x.ndim != 4:
        if recipe.crop_padding or recipe.flip:
            raise ValueError(
                f"random crops and flips need images (N, C, H, W), got inputs of shape {tuple(x.shape)}; "
                "use a recipe with crop_padding=0 and flip=False"
            )
        return _rows
    return crop_rows if x.shape[1] == 1 and not recipe.flip else crop


def _rows(x: torch.Tensor, idx: torch.Tensor, aug: torch.Tensor, size: int) -> torch.Tensor:
    """The inputs ``idx`` as they are (``aug`` and ``size`` unused): batches of vectors."""
    return x[idx]


def batch_plans(seeds: Sequence[int], n: int, recipe: Recipe, epochs: int | None, device: torch.device):
    """``(epoch, step, lr, last_in_epoch, idx (M, B), aug (M, B, 3))`` per step of :func:`minibatches`."""
    step = 0
    for epoch in range(recipe.epochs if epochs is None else epochs):
        lr = recipe.lr_at(epoch)
        perms, augs = epoch_plans(seeds, epoch, n, recipe.crop_padding, recipe.flip, device)
        for start in range(0, n, recipe.batch_size):
            stop = start + recipe.batch_size
            yield epoch, step, lr, stop >= n, perms[:, start:stop], augs[:, start:stop]
            step += 1
