r"""The OptuNet forward and backward passes of ``M`` stacked networks (book: "Checkpoint zoos").

On a CPU, a 392-parameter network is far too small to keep the arithmetic units busy: a plain training
step is dominated by per-operator overhead and by convolution kernels that are inefficient for 1 or 2
channels. :func:`optunet_forward` therefore evaluates ``M`` OptuNets, each on its own mini-batch, with a
few batched matrix products:

* conv 1 (1 -> 2 channels, 4x4) as a Toeplitz product: for output row ``i``,
  :math:`z[c, i, :] = \sum_{k} x[i + k, :]\, T_{c,k}` with
  :math:`T_{c,k}[j', j] = w[c, k, j' - j]` (zero outside the kernel), so the
  whole layer is one ``(B \cdot 24, 112) \times (112, 48)`` product per model;
* max-pool 3 as two reductions over that product's output (ReLU and max commute, so
  the ReLU runs on the pooled, nine-times smaller tensor);
* grouped conv 2 (2 groups of 1 -> 5, 5x5) as a dense ``(64, 80)`` product per group;
* global average pool and the linear layer as a batched ``baddbmm``.

The structured matrices are built from the weights by a constant index pattern (exact, :func:`place`).

**The gradient** has three implementations that compute the same numbers (:data:`STACKED_IMPLS`,
chosen by :func:`step_function`):

* ``"native"``: one fused C++ function per step (:mod:`symlib.kernels`), the CPU default;
* ``"matmul"``: a hand-written backward pass in PyTorch (softmax, products, ReLU masks, the max-pool's
  recorded maxima, :func:`optunet_loss_grads`), in a layout that keeps the images of a mini-batch
  innermost (``(model, feature, ..., image)``), the CPU fallback without a compiler;
* ``"conv"``: grouped convolutions with the models as groups, differentiated by autograd (full FP32
  unless ``tf32=True``), the CUDA default.

Tests check the gradients against autograd and the implementations against each other in float64.

:data:`STACKED_GRADS` also registers ``"mlp-classifier"``, the stacked ReLU MLP classifiers of
:mod:`symlib.training.mlp` (batched products, the same function on every device).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from symlib.params import Params
from symlib.training import mlp as _mlp

__all__ = [
    "OPTUNET_SHAPES",
    "STACKED_FORWARD",
    "STACKED_GRADS",
    "STACKED_IMPLS",
    "conv_matrix_index",
    "optunet_forward",
    "optunet_loss_grads",
    "place",
    "place_grad",
    "step_function",
]

OPTUNET_SHAPES = {
    "conv1.weight": (2, 1, 4, 4),
    "conv2.weight": (10, 1, 5, 5),
    "fc.weight": (10, 10),
    "fc.bias": (10,),
}


def _toeplitz_index(width: int, k: int, out: int) -> torch.Tensor:
    """``(width, out)`` index into a kernel row padded by a zero: ``j' - j`` inside the kernel, else ``k``."""
    d = torch.arange(width)[:, None] - torch.arange(out)[None, :]
    return torch.where((d >= 0) & (d < k), d, torch.full_like(d, k))


def conv_matrix_index(side: int, k: int, outs: int) -> torch.Tensor:
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

    Differentiable by autograd; where a pooling window holds tied maxima its gradient is shared among them
    (``amax``), where ``nn.MaxPool2d`` and the hand-written backward pass route it to the first.

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
    t = place(w1.reshape(m * 2, 16), toeplitz1).view(m, 2, 112, 24).transpose(1, 2).reshape(m, 112, 48)
    rows = x[..., 0, :, :].unfold(-2, 4, 1)[..., :24, :, :].transpose(-1, -2)  # (..., 24, 4, 28)
    # max-pool 3 (windows never straddle the two channels, 24 = 8 * 3) as two reductions over the product's
    # own layout (columns, then rows: no copy of the nine-times larger map), then ReLU (they commute).
    if x.ndim == 4:
        b = x.shape[0]
        z = rows.reshape(b * 24, 112) @ t.permute(1, 0, 2).reshape(112, m * 48)
        z = F.relu(z.view(b, 8, 3, m * 16, 3).amax(-1).amax(2))  # (B, 8, M*16): rows i, columns (m, c, j)
        h = z.view(b, 8, m, 2, 8).permute(2, 3, 0, 1, 4)
    else:
        b = x.shape[1]
        z = torch.bmm(rows.reshape(m, b * 24, 112), t)
        z = F.relu(z.view(m, b, 8, 3, 16, 3).amax(-1).amax(3))  # (M, B, 8, 16): rows i, columns (c, j)
        h = z.view(m, b, 8, 2, 8).permute(0, 3, 1, 2, 4)
    # grouped conv 2 (2 groups of 1 -> 5 channels, 5x5) as one dense (64, 80) product per (model, group).
    h = h.reshape(m * 2, b, 64)  # (M*2, B, 8*8)
    # t2: (M*2, 64, 80), rows (i, j), columns (o, p, q)
    t2 = place(w2.reshape(m * 10, 25), i2).view(m * 2, 5, 64, 16).transpose(1, 2).reshape(m * 2, 64, 80)
    h2 = F.relu(torch.bmm(h, t2)).view(m, 2, b, 5, 16).mean(-1)  # GAP: (M, 2, B, 5)
    feats = h2.permute(0, 2, 1, 3).reshape(m, b, 10)
    return torch.baddbmm(fb[:, None, :], feats, fw.transpose(1, 2))


STACKED_FORWARD = {"optunet": optunet_forward}


@functools.cache
def _optunet_pattern_indices(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the kernel weights go in the matrices of :func:`optunet_loss_grads` and
    :func:`optunet_forward`, flattened: entry ``e`` of a matrix is weight ``idx[e]`` of the flattened
    kernel, or zero where ``idx[e]`` is the kernel size (see :func:`place`).

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
    i2 = conv_matrix_index(8, 5, 1).reshape(-1)
    toe = _toeplitz_index(28, 4, 24).view(1, 28, 24)  # (j', j) -> kernel column, or 4 outside
    k = torch.arange(4).view(-1, 1, 1)
    toeplitz = torch.where(toe < 4, k * 4 + toe, 16).reshape(-1)
    return full.to(device), block.to(device), i2.to(device), toeplitz.to(device)


def place(w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows of ``w`` (R, K) placed into the pattern ``idx`` (values 0..K, K: zero): ``(R, idx.numel())``."""
    return F.pad(w, (0, 1)).index_select(1, idx)


def place_grad(g: torch.Tensor, idx: torch.Tensor, k: int) -> torch.Tensor:
    """Adjoint of :func:`place`: the entries of ``g`` (R, idx.numel()) summed back onto ``k`` weights."""
    out = torch.zeros(g.shape[0], k + 1, dtype=g.dtype, device=g.device)
    return out.index_add_(1, idx, g)[:, :k]


def optunet_loss_grads(
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
    the structured matrices are summed back onto the kernels (:func:`place_grad`).

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
    a1 = place(w1.reshape(m * 2, 16), i1_block).view(m, 1, 12, 36)
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
    t2 = place(w2.reshape(m * 10, 25), i2).view(m * 2, 5, 64, 16).transpose(1, 2).reshape(m * 2, 64, 80)
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
    g_w1 = place_grad(g_block.view(m * 2, 6 * 36), i1_block, 16)
    grads = {
        "conv1.weight": g_w1.view(w1.shape),
        "conv2.weight": g_w2.view(w2.shape),
        "fc.weight": g_fw,
        "fc.bias": g_fb,
    }
    return loss, grads


STACKED_GRADS = {"optunet": optunet_loss_grads, "mlp-classifier": _mlp.mlp_loss_grads}


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
    r""":func:`optunet_loss_grads` as grouped convolutions with the models as groups (the CUDA path).

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
def optunet_loss_grads_native(
    params: Params, x: torch.Tensor, y: torch.Tensor, feat_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, Params]:
    """:func:`optunet_loss_grads` by the fused, compiled CPU kernel of :mod:`symlib.kernels`."""
    from symlib import kernels

    return kernels.optunet_loss_grads(params, x, y, feat_mask=feat_mask)


STACKED_IMPLS = {
    "matmul": STACKED_GRADS,
    "conv": {"optunet": _optunet_loss_grads_conv, "mlp-classifier": _mlp.mlp_loss_grads},
    "native": {"optunet": optunet_loss_grads_native},
}


def _native_available() -> bool:
    from symlib import kernels

    return kernels.available()


def step_function(arch: str, impl: str | None, device: torch.device) -> Callable:
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
