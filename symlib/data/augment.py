"""Batched data augmentation on tensors (book: "Data").

The zoo trainer updates up to a thousand models in lock-step, each on its own
mini-batch, so augmentation works on stacks ``(*lead, C, H, W)`` (e.g.
``(models, batch, C, H, W)``) and draws an independent transformation for every
image, without a Python loop over images.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _fill_tensor(
    fill: float | Sequence[float] | torch.Tensor, channels: int, like: torch.Tensor
) -> torch.Tensor:
    fill_t = torch.as_tensor(fill, dtype=like.dtype, device=like.device)
    if fill_t.ndim == 0:
        return fill_t
    if fill_t.shape != (channels,):
        raise ValueError(
            f"fill must be a number or one value per channel ({channels}); got shape {tuple(fill_t.shape)}"
        )
    return fill_t.view(channels, 1, 1)


def _pad(flat: torch.Tensor, padding: int, fill: torch.Tensor) -> torch.Tensor:
    """Images ``(n, C, H, W)`` framed by ``padding`` pixels of ``fill`` (a scalar or ``(C, 1, 1)``)."""
    n, c, height, width = flat.shape
    if fill.ndim == 0:
        return F.pad(flat, (padding,) * 4, value=float(fill))
    out = fill.view(1, c, 1, 1).expand(n, c, height + 2 * padding, width + 2 * padding).clone()
    out[..., padding : padding + height, padding : padding + width] = flat
    return out


def random_crop(
    x: torch.Tensor,
    size: int | tuple[int, int],
    padding: int = 0,
    generator: torch.Generator | None = None,
    fill: float | Sequence[float] | torch.Tensor = 0.0,
) -> torch.Tensor:
    r"""Pad every image by ``padding`` pixels and cut a random ``size`` window out of it.

    Image :math:`n` gets its own offset :math:`(o_n, p_n)`, uniform on
    :math:`\{0, \dots, H + 2\,\mathrm{pad} - h\} \times \{0, \dots, W + 2\,\mathrm{pad} - w\}`:

    .. math:: y_n[c, i, j] = \tilde x_n[c, i + o_n, j + p_n],

    where :math:`\tilde x_n` is :math:`x_n` padded with ``fill``. This matches
    ``torchvision.transforms.RandomCrop(size, padding)`` applied image by image;
    on normalised images pass ``fill=Tensors.black`` so the border is black as in torchvision.

    Args:
        x: images ``(*lead, C, H, W)``; any number of leading dimensions (``(batch,)``, ``(models, batch)``).
        size: output height and width (an int for a square crop).
        padding: zero-or-more pixels added on each side before cropping.
        generator: source of the offsets (on ``x``'s device) for reproducible crops.
        fill: the padding value, a number or one value per channel.

    Returns:
        A new tensor ``(*lead, C, h, w)``; ``x`` is not modified.
    """
    if x.ndim < 3:
        raise ValueError(f"random_crop expects images (*lead, C, H, W); got shape {tuple(x.shape)}")
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    if padding < 0:
        raise ValueError(f"padding must be >= 0, got {padding}")
    *lead, c, height, width = x.shape
    hp, wp = height + 2 * padding, width + 2 * padding
    if h > hp or w > wp or h < 1 or w < 1:
        raise ValueError(f"crop size {(h, w)} does not fit in padded images of size {(hp, wp)}")
    flat = x.reshape(-1, c, height, width)
    n = flat.shape[0]
    padded = _pad(flat, padding, _fill_tensor(fill, c, x)) if padding else flat
    rows = torch.randint(0, hp - h + 1, (n,), generator=generator, device=x.device)
    cols = torch.randint(0, wp - w + 1, (n,), generator=generator, device=x.device)
    # all h x w windows as a view (n, C, hp-h+1, wp-w+1, h, w); pick window (rows[k], cols[k]) of image k
    windows = padded.unfold(2, h, 1).unfold(3, w, 1).permute(0, 2, 3, 1, 4, 5)
    out = windows[torch.arange(n, device=x.device), rows, cols]
    return out.view(*lead, c, h, w)


def random_flip(x: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""Mirror each image left-right with probability ``p``: :math:`y_n[c,i,j] = x_n[c,i,W-1-j]`.

    Args:
        x: images ``(*lead, C, H, W)``.
        p: flip probability.
        generator: source of the coin flips (on ``x``'s device).

    Returns:
        A new tensor of the same shape; ``x`` is not modified.
    """
    if x.ndim < 3:
        raise ValueError(f"random_flip expects images (*lead, C, H, W); got shape {tuple(x.shape)}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be a probability in [0, 1], got {p}")
    lead = x.shape[:-3]
    coins = torch.rand(lead, generator=generator, device=x.device) < p
    return torch.where(coins[..., None, None, None], x.flip(-1), x)
