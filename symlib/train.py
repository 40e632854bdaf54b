r"""Training recipes and the fast many-model trainer (book: "Checkpoint zoos").

A *zoo* is many independently trained networks. Each member ``m`` has its own
seed, from which two independent streams are derived (:func:`streams`): one draws
the initial weights (PyTorch's default initialisation of the module), the other
keys the data order (a fresh permutation of the training set every epoch) and the
augmentation (a random crop offset per image), computed by a counter-based hash
(:func:`epoch_plans`) that gives the same integers on every device. Given the same seed, the plain
single-model loop (:func:`train_plain`) and the stacked trainer
(:func:`train_stacked`) see exactly the same batches and crops.

**Stacked OptuNet.** On a CPU, a 392-parameter network is far too small to keep
the arithmetic units busy: a plain training step is dominated by per-operator
overhead and by convolution kernels that are inefficient for 1 or 2 channels.
:func:`optunet_forward` therefore evaluates ``M`` OptuNets, each on its own
mini-batch, with a few batched matrix products:

* conv 1 (1 -> 2 channels, 4x4) as a Toeplitz product: for output row ``i``,
  :math:`z[c, i, :] = \sum_{k} x[i + k, :]\, T_{c,k}` with
  :math:`T_{c,k}[j', j] = w[c, k, j' - j]` (zero outside the kernel), so the
  whole layer is one ``(B \cdot 24, 112) \times (112, 48)`` product per model;
* max-pool 3 on that product's output seen as one image (ReLU and max commute, so
  the ReLU runs on the pooled, nine-times smaller tensor);
* grouped conv 2 (2 groups of 1 -> 5, 5x5) as a dense ``(64, 80)`` product per group;
* global average pool and the linear layer as a batched ``baddbmm``.

The structured matrices are built from the weights by a constant index pattern (exact, :func:`_place`).

**Training** (:func:`train_stacked`) does not go through autograd on CPU: :func:`_optunet_loss_grads`
computes the loss and its gradient by a hand-written backward pass (softmax, products,
ReLU masks, the max-pool's recorded maxima), in a layout that keeps the images of a
mini-batch innermost (``(model, feature, ..., image)``), so that every elementwise op, the
pooling (PyTorch's channels-last kernel, with the images as channels) and the products run
over contiguous runs of ``B`` values. Conv 1 there is one product of its shared ``(12, 36)``
diagonal block with four overlapping slices of the column matrix (2.25x the useful
multiply-adds, not the 7x of the full Toeplitz matrix). The crops are one ``index_select`` of
image rows (:func:`_crop_segments`). On CPU the models of a step are split into groups computed
side by side by worker threads with one intra-op thread each. On CUDA the step is a few grouped
convolutions with the models as groups, differentiated by autograd (``impl="conv"``, full FP32
unless ``tf32=True``). The optimiser reproduces ``torch.optim.SGD`` (:func:`sgd_step`; weight
decay, momentum, Nesterov) on one flat parameter buffer. Tests check the gradient against
autograd, the two implementations against each other and whole runs against :func:`train_plain`,
in float64.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

Params = dict[str, torch.Tensor]

OPTUNET_SHAPES = {
    "conv1.weight": (2, 1, 4, 4),
    "conv2.weight": (10, 1, 5, 5),
    "fc.weight": (10, 10),
    "fc.bias": (10,),
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An SGD training recipe (paper App. B.1).

    Attributes:
        epochs: passes over the training set.
        batch_size: images per step (the last batch of an epoch may be smaller).
        lr: initial learning rate.
        momentum: SGD momentum (0 for plain SGD).
        weight_decay: L2 coefficient added to the gradient, as in ``torch.optim.SGD``.
        nesterov: Nesterov momentum.
        schedule: ``"step"`` (multiply by ``gamma`` at each of ``milestones``) or ``"cosine"``
            (cosine annealing to 0 over ``epochs``), stepped once per epoch.
        milestones: epochs at which a step schedule decays.
        gamma: decay factor of a step schedule.
        crop_padding: random crop back to the input size after padding by this many pixels (0: none).
        flip: random horizontal flips.
    """

    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    schedule: str = "step"
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    crop_padding: int = 0
    flip: bool = False

    def __post_init__(self):
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError(f"epochs and batch_size must be >= 1, got {self.epochs}, {self.batch_size}")
        if self.schedule not in ("step", "cosine"):
            raise ValueError(f"schedule must be 'step' or 'cosine', got {self.schedule!r}")
        if self.nesterov and self.momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")

    def lr_at(self, epoch: int) -> float:
        r"""Learning rate during ``epoch`` (0-based), as ``MultiStepLR`` / ``CosineAnnealingLR`` give it:
        :math:`\eta_0 \gamma^{\#\{m \le e\}}` or :math:`\tfrac{\eta_0}{2}(1 + \cos(\pi e / E))`."""
        if self.schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / self.epochs))
        return self.lr * self.gamma ** sum(1 for m in self.milestones if m <= epoch)

    def scaled(self, epochs: int) -> Recipe:
        """The same recipe over ``epochs`` epochs, milestones shrunk in proportion (distinct, >= 1)."""
        if epochs == self.epochs:
            return self
        ms = tuple(
            sorted({max(1, round(m * epochs / self.epochs)) for m in self.milestones if m < self.epochs})
        )
        return dataclasses.replace(self, epochs=epochs, milestones=tuple(m for m in ms if m < epochs))


# The paper's recipes (App. B.1). OptuNet: no momentum is mentioned; weight decay 2e-4 as in the
# authors' public "OptuMNIST" sibling; random crop 28 with padding 4.
OPTUNET_MNIST = Recipe(
    epochs=60, batch_size=64, lr=0.04, weight_decay=2e-4, milestones=(15, 30), gamma=0.5, crop_padding=4
)
RESNET18_CIFAR100 = Recipe(
    epochs=75,
    batch_size=128,
    lr=0.1,
    momentum=0.9,
    weight_decay=5e-4,
    nesterov=True,
    milestones=(25, 50),
    gamma=0.1,
    crop_padding=4,
    flip=True,
)
RESNET18_TINYIMAGENET = Recipe(
    epochs=200,
    batch_size=128,
    lr=0.2,
    momentum=0.9,
    weight_decay=5e-4,
    schedule="cosine",
    crop_padding=4,
    flip=True,
)


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


# ----------------------------------------------------------------------------- stacked OptuNet


def _toeplitz_index(width: int, k: int, out: int) -> torch.Tensor:
    """``(width, out)`` index into a kernel row padded by a zero: ``j' - j`` inside the kernel, else ``k``."""
    d = torch.arange(width)[:, None] - torch.arange(out)[None, :]
    return torch.where((d >= 0) & (d < k), d, torch.full_like(d, k))


def _conv_matrix_index(side: int, k: int, outs: int) -> torch.Tensor:
    """``(side**2, outs * o**2)`` index (``o = side - k + 1``) into ``outs`` flattened ``k x k`` kernels
    followed by one zero: the matrix of a 1-channel ``side x side`` valid convolution, ``outs`` outputs."""
    o = side - k + 1
    i, j = torch.arange(side).view(-1, 1, 1, 1, 1), torch.arange(side).view(1, -1, 1, 1, 1)
    c = torch.arange(outs).view(1, 1, -1, 1, 1)
    p, q = torch.arange(o).view(1, 1, 1, -1, 1), torch.arange(o).view(1, 1, 1, 1, -1)
    di, dj = i - p, j - q
    inside = (di >= 0) & (di < k) & (dj >= 0) & (dj < k)
    idx = torch.where(inside, c * k * k + di.clamp(0, k - 1) * k + dj.clamp(0, k - 1), outs * k * k)
    return idx.reshape(side * side, outs * o * o)


def optunet_forward(params: Params, x: torch.Tensor) -> torch.Tensor:
    r"""Logits of ``M`` stacked OptuNets (same function as :class:`symlib.models.OptuNet` in eval mode).

    Args:
        params: ``{"conv1.weight": (M, 2, 1, 4, 4), "conv2.weight": (M, 10, 1, 5, 5),
            "fc.weight": (M, 10, 10), "fc.bias": (M, 10)}``.
        x: ``(M, B, 1, 28, 28)`` (each model its own images) or ``(B, 1, 28, 28)`` (shared).

    Returns:
        Logits ``(M, B, 10)``.
    """
    w1, w2, fw, fb = (params[k] for k in OPTUNET_SHAPES)
    m = w1.shape[0]
    if x.shape[-3:] != (1, 28, 28) or x.ndim not in (4, 5):
        raise ValueError(f"OptuNet takes (M, B, 1, 28, 28) or (B, 1, 28, 28) images, got {tuple(x.shape)}")
    _, _, i2, toeplitz1 = _optunet_pattern_indices(str(w1.device))
    # conv 1 as a Toeplitz product, rows (k, j'), columns (c, j); only output rows/columns 0..23 survive
    # the 3x3 pooling.
    t = _place(w1.reshape(m * 2, 16), toeplitz1).view(m, 2, 112, 24).transpose(1, 2).reshape(m, 112, 48)
    rows = x[..., 0, :, :].unfold(-2, 4, 1)[..., :24, :, :].transpose(-1, -2)  # (..., 24, 4, 28)
    if x.ndim == 4:
        b = x.shape[0]
        z = rows.reshape(b * 24, 112) @ t.permute(1, 0, 2).reshape(112, m * 48)
        z = z.view(b, 24, m, 48).permute(2, 0, 1, 3)
    else:
        b = x.shape[1]
        z = torch.bmm(rows.reshape(m, b * 24, 112), t)
    # max-pool 3 (windows never straddle the two channels, 24 = 8 * 3), then ReLU (they commute).
    z = F.relu(F.max_pool2d(z.reshape(m * b, 1, 24, 48), 3))  # (M*B, 1, 8, 16): rows i, columns (c, j)
    # grouped conv 2 (2 groups of 1 -> 5 channels, 5x5) as one dense (64, 80) product per (model, group).
    h = z.view(m, b, 8, 2, 8).permute(0, 3, 1, 2, 4).reshape(m * 2, b, 64)  # (M*2, B, 8*8)
    # t2: (M*2, 64, 80), rows (i, j), columns (o, p, q)
    t2 = _place(w2.reshape(m * 10, 25), i2).view(m * 2, 5, 64, 16).transpose(1, 2).reshape(m * 2, 64, 80)
    h2 = F.relu(torch.bmm(h, t2)).view(m, 2, b, 5, 16).mean(-1)  # GAP: (M, 2, B, 5)
    feats = h2.permute(0, 2, 1, 3).reshape(m, b, 10)
    return torch.baddbmm(fb[:, None, :], feats, fw.transpose(1, 2))


STACKED_FORWARD = {"optunet": optunet_forward}


def _crop_segments(xpad: torch.Tensor, idx: torch.Tensor, aug: torch.Tensor, size: int) -> torch.Tensor:
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


@functools.cache
def _optunet_pattern_indices(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the kernel weights go in the matrices of :func:`_optunet_loss_grads` and
    :func:`optunet_forward`, flattened: entry ``e`` of a matrix is weight ``idx[e]`` of the flattened
    kernel, or zero where ``idx[e]`` is the kernel size (see :func:`_place`).

    Conv 1, per output channel: the full matrix (``24 x 112``, rows ``(s, r)`` for output row
    ``i = 6 s + r``, columns ``(i', k_j)``, entry ``w[i' - i, k_j]``) and one diagonal block of it
    (``6 x 36``: rows ``r``, columns ``(i' - 6 s, k_j)``, the same for every ``s``). Conv 2, per output
    channel: its dense ``64 x 16`` matrix (rows ``(i, j)``, columns ``(p, q)``). Conv 1 for the forward
    pass, per output channel: its Toeplitz matrix (``112 x 24``, rows ``(k_i, j')``, columns ``j``).
    """
    i = torch.arange(24).view(24, 1, 1)
    ip, kj = torch.arange(28).view(1, 28, 1), torch.arange(4).view(1, 1, 4)
    d = ip - i
    full = torch.where((d >= 0) & (d < 4), d * 4 + kj, 16).reshape(-1)
    r, ipl = torch.arange(6).view(6, 1, 1), torch.arange(9).view(1, 9, 1)
    d = ipl - r
    block = torch.where((d >= 0) & (d < 4), d * 4 + kj, 16).reshape(-1)
    i2 = _conv_matrix_index(8, 5, 1).reshape(-1)
    toe = _toeplitz_index(28, 4, 24).view(1, 28, 24)  # (j', j) -> kernel column, or 4 outside
    k = torch.arange(4).view(-1, 1, 1)
    toeplitz = torch.where(toe < 4, k * 4 + toe, 16).reshape(-1)
    return full.to(device), block.to(device), i2.to(device), toeplitz.to(device)


def _place(w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of ``w`` (R, K) placed into the pattern ``idx`` (values 0..K, K: zero): ``(R, idx.numel())``."""
    return F.pad(w, (0, 1)).index_select(1, idx)


def _place_grad(g: torch.Tensor, idx: torch.Tensor, k: int) -> torch.Tensor:
    """Adjoint of :func:`_place`: the entries of ``g`` (R, idx.numel()) summed back onto ``k`` weights."""
    out = torch.zeros(g.shape[0], k + 1, dtype=g.dtype, device=g.device)
    return out.index_add_(1, idx, g)[:, :k]


def _optunet_loss_grads(
    params: Params, x: torch.Tensor, y: torch.Tensor, feat_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, Params]:
    r"""Mean cross-entropy of ``M`` stacked OptuNets on their own batches and its gradient, by a
    hand-written backward pass (no autograd graph). Same function as :func:`optunet_forward`.

    Layout: every activation keeps the batch axis innermost, ``(model, feature, ..., image)``, so that the
    elementwise operations, the pooling (PyTorch's channels-last kernel, images as channels) and the
    products run over contiguous runs of ``B`` values.

    * conv 1 is one product per model, :math:`Z = A X` with :math:`X[(i', k_j), (j, b)] = x_b[i', j + k_j]`
      (``112 x 24B``) and :math:`A[(c, i), (i', k_j)] = w[c, i' - i, k_j]` (zero outside the kernel); the
      rows of :math:`A` are ordered by blocks of six output rows, :math:`i = 6s + r`, whose pooling
      windows stay inside the block and which only meet input rows :math:`6s .. 6s + 8`: the weight
      gradient :math:`\partial A = \partial Z X^\top` is taken block by block (a third of the work);
    * max-pool 3 (first maximum of each window in row-major order, PyTorch's rule, which matters for the
      ties of flat image regions) and ReLU (they commute, so the ReLU runs after the pool);
    * conv 2 as a dense ``(64, 80)`` matrix per (model, group), GAP and the linear layer.

    Backward: with :math:`p = \mathrm{softmax}(\ell)` the logits' gradient is :math:`(p - e_y) / B`; each
    product :math:`Z = A X` passes back :math:`\partial A = \partial Z X^\top` and :math:`\partial X =
    A^\top \partial Z`; the ReLUs their masks; the pool routes to the recorded maxima; and the gradients of
    the structured matrices are summed back onto the kernels (:func:`_place_grad`).

    Args:
        params: stacked parameters as in :func:`optunet_forward`.
        x: ``(M, B, 1, 28, 28)`` images.
        y: ``(M, B)`` labels.
        feat_mask: optional ``(M, 10, B)`` multiplier of the 10 pooled features before the linear layer
            (dropout: entries 0 or ``1 / (1 - p)``, one draw per model and image); ``None``: no dropout.

    Returns:
        ``(loss (M,), grads)`` with ``grads`` shaped like ``params``.
    """
    w1, w2, fw, fb = (params[k] for k in OPTUNET_SHAPES)
    m, b = x.shape[0], x.shape[1]
    _, i1_block, i2, _ = _optunet_pattern_indices(str(w1.device))
    # conv 1, block by block: output rows 6 s + r (s = 0..3, r = 0..5) only meet input rows 6 s .. 6 s + 8,
    # and the (12, 36) block A1 (rows (c, r), columns (i' - 6 s, kj)) is the same for every s, so the layer
    # is one product of A1 with the four overlapping 36-row slices X_s of the column matrix, side by side:
    # (M*4, 12, 36) @ (M*4, 36, 24B) (2.25x the useful multiply-adds; only output rows/columns 0..23
    # survive the pooling).
    a1 = _place(w1.reshape(m * 2, 16), i1_block).view(m, 1, 12, 36)
    xn = x[:, :, 0].permute(0, 2, 3, 1).contiguous()  # (M, i', j', B)
    # X[m, s, (di, kj), (j, b)] = x_b[6 s + di, j + kj]: one strided copy of xn
    cols = xn.as_strided((m, 4, 9, 4, 24, b), (784 * b, 168 * b, 28 * b, b, b, 1)).reshape(m * 4, 36, 24 * b)
    # (M*8, B, 6, 24) channels-last: one image per (model, s, c), rows r; windows never straddle two s
    z = torch.bmm(a1.expand(m, 4, 12, 36).reshape(m * 4, 12, 36), cols).view(m * 8, 6, 24, b)
    z = z.permute(0, 3, 1, 2)
    pooled, where = torch.ops.aten.max_pool2d_with_indices(z, [3, 3], [3, 3])
    pooled_t = pooled.permute(0, 2, 3, 1).reshape(m, 4, 2, 2, 8, b).transpose(1, 2).reshape(m * 2, 64, b)
    a = pooled_t.clamp_min(0)  # (M*2, (p, q), B)
    # conv 2 (per group: (80, 64) @ (64, B)), ReLU, GAP, linear
    t2 = _place(w2.reshape(m * 10, 25), i2).view(m * 2, 5, 64, 16).transpose(1, 2).reshape(m * 2, 64, 80)
    u = torch.bmm(t2.transpose(1, 2), a)  # (M*2, (o, p, q), B)
    feats = u.clamp_min(0).view(m, 2, 5, 16, b).mean(3).reshape(m, 10, b)
    if feat_mask is not None:
        feats = feats * feat_mask
    logits = torch.baddbmm(fb[:, :, None], fw, feats)  # (M, 10, B)
    logp = torch.log_softmax(logits, 1)
    loss = -logp.gather(1, y[:, None, :]).squeeze(1).mean(-1)
    # backward
    d = logp.exp_()
    d.scatter_add_(1, y[:, None, :], torch.full((m, 1, b), -1.0, dtype=d.dtype, device=d.device))
    d.div_(b)  # d loss / d logits, (M, 10, B)
    g_fb = d.sum(2)
    g_fw = torch.bmm(d, feats.transpose(1, 2))
    d_feats = torch.bmm(fw.transpose(1, 2), d)  # (M, 10, B)
    if feat_mask is not None:
        d_feats = d_feats * feat_mask
    du = (d_feats.view(m * 2, 5, 1, b) / 16).expand(m * 2, 5, 16, b).reshape(m * 2, 80, b)
    du = torch.ops.aten.threshold_backward(du, u, 0)  # ReLU: pass where u > 0
    g_t2 = torch.bmm(a, du.transpose(1, 2))  # (M*2, 64, 80)
    # summed back onto the kernel: entry (o, ki, kj) collects g_t2[(p + ki, q + kj), (o, p, q)] over (p, q),
    # a strided view (offset 640 ki + 80 kj + 16 o + 644 p + 81 q) summed over its last two axes
    g_w2 = g_t2.as_strided((m * 2, 5, 5, 5, 4, 4), (5120, 16, 640, 80, 644, 81)).sum((4, 5))
    da = torch.ops.aten.threshold_backward(torch.bmm(t2, du), pooled_t, 0)  # (M*2, 64, B)
    da = da.view(m, 2, 4, 2, 8, b).transpose(1, 2).reshape(m * 8, 2, 8, b).permute(0, 3, 1, 2)
    dz = torch.ops.aten.max_pool2d_with_indices_backward(da, z, [3, 3], [3, 3], [0, 0], [1, 1], False, where)
    dz = dz.permute(0, 2, 3, 1).reshape(m * 4, 12, 24 * b)
    # conv 1's weight gradient: dA1 = sum_s dZ_s X_s^T
    g_block = torch.bmm(dz, cols.transpose(1, 2)).view(m, 4, 12 * 36).sum(1)  # (M, (c, r, di, kj))
    g_w1 = _place_grad(g_block.view(m * 2, 6 * 36), i1_block, 16)
    grads = {
        "conv1.weight": g_w1.view(w1.shape),
        "conv2.weight": g_w2.view(w2.shape),
        "fc.weight": g_fw,
        "fc.bias": g_fb,
    }
    return loss, grads


STACKED_GRADS = {"optunet": _optunet_loss_grads}


@contextlib.contextmanager
def _fp32_precision(tf32: bool):
    """Full FP32 products and convolutions on CUDA (PyTorch lets cuDNN use TF32 by default), or TF32 where
    ``tf32`` is set; restores the previous settings. A no-op without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _optunet_loss_grads_conv(
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    feat_mask: torch.Tensor | None = None,
    tf32: bool = False,
) -> tuple[torch.Tensor, Params]:
    r""":func:`_optunet_loss_grads` as grouped convolutions with the models as groups (the CUDA path).

    The ``M`` models' batches are the channels of one batch of ``B`` images, ``(B, M, 28, 28)``: conv 1 is
    one convolution with ``M`` groups (1 -> 2 channels), conv 2 one with ``2M`` groups (1 -> 5), so cuDNN
    runs every model in a handful of kernels; the gradient comes from autograd through these operators
    (the same function as OptuNet, max-pool ties included). Full FP32 unless ``tf32``.
    """
    w1, w2, fw, fb = (params[k] for k in OPTUNET_SHAPES)
    m, b = x.shape[0], x.shape[1]
    leaves = [t.detach().requires_grad_(True) for t in (w1, w2, fw, fb)]
    with torch.enable_grad(), _fp32_precision(tf32):
        h = F.conv2d(x[:, :, 0].transpose(0, 1), leaves[0].reshape(m * 2, 1, 4, 4), groups=m)
        h = F.max_pool2d(F.relu(h), 3)  # (B, 2M, 8, 8)
        h = F.conv2d(h, leaves[1].reshape(m * 10, 1, 5, 5), groups=2 * m)  # (B, 10M, 4, 4)
        feats = F.relu(h).mean((2, 3)).view(b, m, 10).transpose(0, 1)  # (M, B, 10)
        if feat_mask is not None:
            feats = feats * feat_mask.transpose(1, 2)
        logits = torch.baddbmm(leaves[3][:, None, :], feats, leaves[2].transpose(1, 2))  # (M, B, 10)
        loss = F.cross_entropy(logits.reshape(m * b, 10), y.reshape(-1), reduction="none").view(m, b).mean(1)
        grads = torch.autograd.grad(loss.sum(), leaves)
    return loss.detach(), dict(zip(OPTUNET_SHAPES, grads, strict=True))


# Implementations of the stacked step: "native" (the compiled kernel, the CPU default), "matmul" (the
# hand-written PyTorch formulation, its fallback) and "conv" (grouped convolutions + autograd, the CUDA
# default).
def _optunet_loss_grads_native(
    params: Params, x: torch.Tensor, y: torch.Tensor, feat_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, Params]:
    """:func:`_optunet_loss_grads` by the fused, compiled CPU kernel of :mod:`symlib.kernels`."""
    from symlib import kernels

    return kernels.optunet_loss_grads(params, x, y, feat_mask=feat_mask)


STACKED_IMPLS = {
    "matmul": STACKED_GRADS,
    "conv": {"optunet": _optunet_loss_grads_conv},
    "native": {"optunet": _optunet_loss_grads_native},
}


def _native_available() -> bool:
    from symlib import kernels

    return kernels.available()


def _stacked_grads(arch: str, impl: str | None, device: torch.device) -> Callable:
    """The loss-and-gradient function of ``arch`` for ``impl`` (``None`` / ``"auto"``: ``"conv"`` on CUDA;
    on CPU ``"native"`` where the compiled kernel is available for ``arch``, else ``"matmul"``)."""
    if impl in (None, "auto"):
        if device.type == "cuda":
            impl = "conv"
        else:
            impl = "native" if arch in STACKED_IMPLS["native"] and _native_available() else "matmul"
    if impl not in STACKED_IMPLS:
        raise ValueError(f"impl must be one of {sorted(STACKED_IMPLS)} or 'auto', got {impl!r}")
    if impl == "native" and device.type != "cpu":
        raise ValueError(f"impl='native' is the compiled CPU kernel; on {device.type} use 'conv' or 'matmul'")
    if impl == "native" and not _native_available():
        from symlib import kernels

        raise RuntimeError(f"impl='native' is unavailable here: {kernels.unavailable_reason()}; "
                           "use impl='matmul' (the PyTorch path)")
    if arch not in STACKED_IMPLS[impl]:
        raise ValueError(f"no stacked trainer for {arch!r}; stacked architectures: {sorted(STACKED_GRADS)}")
    return STACKED_IMPLS[impl][arch]


def sgd_step(
    params: Params, grads: Params, bufs: Params | None, lr: float, recipe: Recipe
) -> tuple[Params, Params]:
    r"""One ``torch.optim.SGD`` step on stacked tensors (dampening 0): with :math:`d = g + \lambda\theta`,
    :math:`b \leftarrow \mu b + d` (:math:`b = d` at the first step), :math:`d \leftarrow d + \mu b`
    (Nesterov) or :math:`b`, then :math:`\theta \leftarrow \theta - \eta d`.

    Returns new ``(params, bufs)``; the inputs are not modified.
    """
    new_p, new_b = {}, {}
    for k, p in params.items():
        d = grads[k]
        if recipe.weight_decay:
            d = d.add(p, alpha=recipe.weight_decay)
        if recipe.momentum:
            b = d.clone() if bufs is None else bufs[k].mul(recipe.momentum).add_(d)
            new_b[k] = b
            d = d.add(b, alpha=recipe.momentum) if recipe.nesterov else b
        new_p[k] = p.add(d, alpha=-lr)
    return new_p, new_b


def loss_and_grads(
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    arch: str = "optunet",
    feat_mask: torch.Tensor | None = None,
    impl: str | None = None,
    workers: int | None = None,
) -> tuple[torch.Tensor, Params]:
    """Mean cross-entropy of ``M`` stacked models, each on its own batch, and its gradient.

    Args:
        params: stacked parameters ``{name: (M, ...)}``.
        x: ``(M, B, C, H, W)`` images; y: ``(M, B)`` labels.
        arch: a key of :data:`STACKED_GRADS`.
        feat_mask: optional dropout multiplier of the features before the last layer (see
            :func:`_optunet_loss_grads`).
        impl: ``"native"`` (the fused compiled CPU kernel, :mod:`symlib.kernels`), ``"matmul"``
            (hand-written PyTorch products), ``"conv"`` (grouped convolutions) or ``None``: the device's
            default (``"conv"`` on CUDA, ``"native"`` on CPU where a C++ compiler is available, else
            ``"matmul"``).
        workers: on CPU, split the models into this many groups computed side by side by a persistent
            pool of as many threads, one intra-op thread each (default: ``torch.get_num_threads()``; 1 on
            CUDA), as :func:`train_stacked` does. The models are independent: the result does not depend
            on it.

    Returns:
        ``(loss (M,), grads)`` with ``grads`` shaped like ``params``.
    """
    fn = _stacked_grads(arch, impl, x.device)
    extra = {} if feat_mask is None else {"feat_mask": feat_mask}
    m = x.shape[0]
    if workers is None:
        workers = torch.get_num_threads() if x.device.type == "cpu" else 1
    k = max(1, min(workers, m))
    if k == 1:
        return fn(params, x, y, **extra)

    def work(sl: slice) -> tuple[torch.Tensor, Params]:
        return fn({n: v[sl] for n, v in params.items()}, x[sl], y[sl], **{n: v[sl] for n, v in extra.items()})

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        parts = list(_shared_pool(k).map(work, _groups(m, k)))
    finally:
        torch.set_num_threads(before)
    loss = torch.cat([p[0] for p in parts])
    return loss, {n: torch.cat([p[1][n] for p in parts]) for n in parts[0][1]}


def _groups(m: int, k: int) -> list[slice]:
    """``k`` consecutive, near-equal slices covering ``range(m)``."""
    bounds = [m * i // k for i in range(k + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@functools.cache
def _shared_pool(k: int):
    """A process-wide pool of ``k`` threads with one intra-op thread each (see :func:`_model_threads`)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(k, initializer=torch.set_num_threads, initargs=(1,), thread_name_prefix="sym")


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
    """The mini-batches of ``M = len(seeds)`` independent runs, as :func:`train_stacked` sees them.

    Every model draws its own data order and crops from its seed's data stream (:func:`streams`), one
    epoch at a time, so any loop over these batches (SGD, SWAG, VI, SGHMC) sees exactly the batches of
    the plain single-model loop for that seed.

    Args:
        seeds: one seed per model.
        x, y: training images ``(N, C, H, W)`` and labels ``(N,)``, on the device to train on.
        recipe: batch size, augmentation and the learning-rate schedule (reported in :attr:`Batch.lr`).
        fill: value of the padding pixels.
        epochs: number of epochs (default ``recipe.epochs``).

    Yields:
        :class:`Batch` for every step.
    """
    n, size = x.shape[0], x.shape[-1]
    xpad = pad_images(x, recipe.crop_padding, fill)
    cut = _cutter(x, recipe)
    for epoch, step, lr, last, idx, aug in _steps(seeds, n, recipe, epochs, x.device):
        yield Batch(epoch, step, lr, last, cut(xpad, idx, aug, size), y[idx])


def _cutter(x: torch.Tensor, recipe: Recipe) -> Callable:
    return _crop_segments if x.shape[1] == 1 and not recipe.flip else crop


def _steps(seeds: Sequence[int], n: int, recipe: Recipe, epochs: int | None, device: torch.device):
    """``(epoch, step, lr, last_in_epoch, idx (M, B), aug (M, B, 3))`` per step of :func:`minibatches`."""
    step = 0
    for epoch in range(recipe.epochs if epochs is None else epochs):
        lr = recipe.lr_at(epoch)
        perms, augs = epoch_plans(seeds, epoch, n, recipe.crop_padding, recipe.flip, device)
        for start in range(0, n, recipe.batch_size):
            stop = start + recipe.batch_size
            yield epoch, step, lr, stop >= n, perms[:, start:stop], augs[:, start:stop]
            step += 1


class _FlatSGD:
    """:func:`sgd_step` on one flat ``(M, P)`` buffer: a step is a handful of operations on all the
    parameters at once, whatever their number; :meth:`params` are views of a fresh buffer every step
    (never modified afterwards, as :func:`sgd_step` gives new tensors)."""

    def __init__(self, params: Params, recipe: Recipe):
        self.names = list(params)
        self.shapes = [params[k].shape for k in self.names]
        self.m = self.shapes[0][0]
        self.flat = torch.cat([params[k].reshape(self.m, -1) for k in self.names], 1)
        self.sizes = [math.prod(s[1:]) for s in self.shapes]
        self.recipe, self.buf = recipe, None

    def params(self) -> Params:
        parts = self.flat.split(self.sizes, 1)
        return {k: p.view(s) for k, p, s in zip(self.names, parts, self.shapes, strict=True)}

    def step(self, grads: Sequence[Params], lr: float) -> Params:
        """One step from the gradients of consecutive groups of models (together all ``M``)."""
        r = self.recipe
        rows = [torch.cat([g[k].reshape(g[k].shape[0], -1) for k in self.names], 1) for g in grads]
        d = rows[0] if len(rows) == 1 else torch.cat(rows, 0)  # (M, P)
        if r.weight_decay:
            d.add_(self.flat, alpha=r.weight_decay)
        if r.momentum:
            self.buf = d.clone() if self.buf is None else self.buf.mul_(r.momentum).add_(d)
            d = d.add_(self.buf, alpha=r.momentum) if r.nesterov else self.buf
        self.flat = self.flat.add(d, alpha=-lr)
        return self.params()


def train_stacked(
    params: Params,
    seeds: Sequence[int],
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    fill: float | Sequence[float] = 0.0,
    arch: str = "optunet",
    epochs: int | None = None,
    max_steps: int | None = None,
    on_epoch: Callable[[int], None] | None = None,
    on_step: Callable[[int, Params], None] | None = None,
    impl: str | None = None,
    tf32: bool = False,
    workers: int | None = None,
) -> Params:
    """Train ``M = len(seeds)`` models at once, each on its own mini-batches and crops.

    Args:
        params: initial stacked parameters ``{name: (M, ...)}`` (not modified).
        seeds: one seed per model (its data order and augmentation stream, :func:`streams`).
        x, y: training images ``(N, C, H, W)`` and labels ``(N,)``, on the device to train on.
        recipe: optimiser, schedule and augmentation.
        fill: value of the padding pixels (black in the normalised scale).
        arch: a key of :data:`STACKED_GRADS`.
        epochs: train for this many epochs (default ``recipe.epochs``).
        max_steps: stop after this many steps in total (for tests).
        on_epoch: called with the epoch index after every epoch (progress bars).
        on_step: called after every step with the global step index and the updated stacked
            parameters (do not modify them; cheap per-step statistics such as permutation tracking).
        impl: the step's implementation, ``"native"``, ``"matmul"`` or ``"conv"`` (default: ``"conv"`` on
            CUDA, ``"native"`` on CPU where the compiled kernel builds, else ``"matmul"``; all compute the
            same gradient; see :func:`loss_and_grads`).
        tf32: let the CUDA path use TF32 products (faster, about 3 decimal digits); default full FP32.
        workers: on CPU, split the models into this many groups computed side by side by as many
            threads, one intra-op thread each (default: ``torch.get_num_threads()``; 1 on CUDA). The
            models are independent, so the result does not depend on it. Without ``on_step`` each group
            trains on its own thread from start to end (no barrier at every step; ``on_epoch`` then
            follows the first group); with it, the groups advance in lockstep so that the hook sees
            every model after every step.

    Returns:
        The trained stacked parameters.
    """
    fn = _stacked_grads(arch, impl, x.device)
    fused = None  # the kernel's entry with the crop fused into it, where it applies
    if fn is _optunet_loss_grads_native and _cutter(x, recipe) is _crop_segments:
        from symlib import kernels

        fused = kernels.optunet_loss_grads_crop
    if tf32:
        fn = functools.partial(fn, tf32=True)
    m = len(seeds)
    if any(p.shape[0] != m for p in params.values()):
        raise ValueError(
            f"params must be stacked for {m} models; got shapes {[tuple(p.shape) for p in params.values()]}"
        )
    opt = _FlatSGD({k: v.detach().to(x.device) for k, v in params.items()}, recipe)
    theta = opt.params()
    n, size = x.shape[0], x.shape[-1]
    xpad = pad_images(x, recipe.crop_padding, fill)
    cut = _cutter(x, recipe)
    if workers is None:
        workers = torch.get_num_threads() if x.device.type == "cpu" else 1
    groups = _groups(m, max(1, min(workers, m)))

    def work(sl: slice, th: Params, idx: torch.Tensor, aug: torch.Tensor) -> Params:
        part = {k: v[sl] for k, v in th.items()}
        if fused is not None:
            return fused(part, xpad, idx[sl], aug[sl], y[idx[sl]])[1]
        return fn(part, cut(xpad, idx[sl], aug[sl], size), y[idx[sl]])[1]

    if len(groups) > 1 and on_step is None:
        # No per-step hook needs all the models at once: every group trains on its own thread from start
        # to end (its own data plans, which depend on the seed only, and its own SGD buffer), without a
        # barrier at every step. Same results as the lockstep loop below.
        def run_group(i: int) -> Params:
            sl = groups[i]
            opt_g = _FlatSGD({k: v[sl] for k, v in theta.items()}, recipe)
            th = opt_g.params()
            for epoch, step, lr, last, idx, aug in _steps(seeds[sl], n, recipe, epochs, x.device):
                th = opt_g.step([work(slice(None), th, idx, aug)], lr)
                if max_steps is not None and step + 1 >= max_steps:
                    break
                if last and on_epoch is not None and i == 0:
                    on_epoch(epoch)  # progress: the first group's epochs
            return th

        with _model_threads(len(groups)) as pool:
            done = list(pool.map(run_group, range(len(groups))))
        return {k: torch.cat([d[k] for d in done]) for k in theta}

    with _model_threads(len(groups)) as pool:
        for epoch, step, lr, last, idx, aug in _steps(seeds, n, recipe, epochs, x.device):
            if pool is None:
                grads = [work(groups[0], theta, idx, aug)]
            else:
                grads = list(pool.map(lambda sl, th=theta, i=idx, a=aug: work(sl, th, i, a), groups))
            theta = opt.step(grads, lr)
            if on_step is not None:
                on_step(step, theta)
            if max_steps is not None and step + 1 >= max_steps:
                return theta
            if last and on_epoch is not None:
                on_epoch(epoch)
    return theta


@contextlib.contextmanager
def _model_threads(k: int):
    """``k`` worker threads with one intra-op thread each (``None`` for ``k = 1``): the models of a step are
    split into ``k`` groups computed side by side. Each PyTorch operator releases the GIL, and one thread
    per group avoids the intra-op synchronisation that dominates tiny operators on a busy CPU."""
    if k <= 1:
        yield None
        return
    from concurrent.futures import ThreadPoolExecutor

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(k, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            yield pool
    finally:
        torch.set_num_threads(before)


def train_plain(
    model: nn.Module,
    seed: int,
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    fill: float | Sequence[float] = 0.0,
    epochs: int | None = None,
    max_steps: int | None = None,
    on_step: Callable[[int, Params], None] | None = None,
) -> nn.Module:
    """The plain loop: one ``nn.Module``, ``torch.optim.SGD`` and the same batches and crops as
    :func:`train_stacked` for ``seed``. Trains (and returns) a deep copy; ``model`` is not modified.

    This is the reference the stacked trainer is tested and benchmarked against, and the trainer of
    the paper-scale ResNet recipes.

    ``on_step``, if given, is called after every optimiser step with the global step index (from 0)
    and the model's state (``state_dict`` names, parameters and buffers) stacked with a leading axis
    of size 1 and detached, as :func:`train_stacked` passes its models (e.g. a
    :class:`symlib.permfreq.PermutationTracker`). The tensors are views of the live model: read them,
    do not modify them, and copy what you keep.
    """
    import copy

    model = copy.deepcopy(model).to(x.device).train()
    opt = torch.optim.SGD(
        model.parameters(),
        lr=recipe.lr,
        momentum=recipe.momentum,
        weight_decay=recipe.weight_decay,
        nesterov=recipe.nesterov,
    )
    n, size = x.shape[0], x.shape[-1]
    xpad = pad_images(x, recipe.crop_padding, fill)
    step = 0
    for epoch in range(recipe.epochs if epochs is None else epochs):
        for group in opt.param_groups:
            group["lr"] = recipe.lr_at(epoch)
        perms, augs = epoch_plans([seed], epoch, n, recipe.crop_padding, recipe.flip, x.device)
        perm, aug = perms[0], augs[0]
        for start in range(0, n, recipe.batch_size):
            idx = perm[start : start + recipe.batch_size]
            xb = crop(xpad, idx, aug[start : start + recipe.batch_size], size)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xb), y[idx]).backward()
            opt.step()
            if on_step is not None:
                on_step(step, {k: v.detach().unsqueeze(0) for k, v in model.state_dict().items()})
            step += 1
            if max_steps is not None and step >= max_steps:
                return model
    return model


@torch.no_grad()
def evaluate_stacked(
    params: Params, x: torch.Tensor, y: torch.Tensor, arch: str = "optunet", batch_size: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy and mean cross-entropy of every stacked model on ``(x, y)``: two ``(M,)`` tensors."""
    forward = STACKED_FORWARD[arch]
    m = next(iter(params.values())).shape[0]
    correct = torch.zeros(m, dtype=torch.float64, device=x.device)
    loss = torch.zeros(m, dtype=torch.float64, device=x.device)
    for start in range(0, x.shape[0], batch_size):
        logits = forward(params, x[start : start + batch_size])
        yb = y[start : start + batch_size]
        correct += (logits.argmax(-1) == yb).sum(1)
        loss += F.cross_entropy(logits.transpose(1, 2), yb.expand(m, -1), reduction="none").sum(1).double()
    return (correct / x.shape[0]).float(), (loss / x.shape[0]).float()


@torch.no_grad()
def evaluate_model(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of one model (eval mode) on ``(x, y)``."""
    was = model.training
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, x.shape[0], batch_size):
        logits = model(x[start : start + batch_size])
        yb = y[start : start + batch_size]
        correct += int((logits.argmax(-1) == yb).sum())
        loss += float(F.cross_entropy(logits, yb, reduction="sum"))
    model.train(was)
    return correct / x.shape[0], loss / x.shape[0]
