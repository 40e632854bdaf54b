r"""Predicted probabilities of a whole weight-sample set (book: chapter "Table 1").

Every posterior method of :mod:`symlib.posteriors` returns full weight samples
:math:`\theta_1, \dots, \theta_S` stacked as one state dict ``{name: (S, ...)}``.
The uncertainty metrics of :mod:`symlib.stats.metrics` and the functional-collapse
study (§5.1) need, for every sample and every input, the softmax output

.. math:: p_s(y \mid x_n) = \mathrm{softmax}(f_{\theta_s}(x_n))_y,
          \qquad P \in [0, 1]^{S \times N \times C},

from which the Bayesian model average is the mean over ``s``. :func:`probs`
computes ``P`` in chunks of samples and batches of inputs, so that memory stays
bounded whatever ``S`` and ``N``:

* OptuNet (``arch="optunet"``) runs through the stacked forward pass of
  :func:`symlib.training.optunet.optunet_forward` (all samples of a chunk at once);
* any other architecture (ResNet-18 with its BatchNorm buffers, MLPs, ...) is
  given as a module factory (or a template module); every sample's state dict is
  evaluated in eval mode with :func:`torch.func.functional_call`, vectorised
  over the samples of a chunk by :func:`torch.vmap`, with a per-sample loop as
  the fallback for modules that ``vmap`` cannot batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from symlib import progress as _progress
from symlib import training as _train
from symlib.params import Params

__all__ = ["probs"]

Arch = str | Callable[[], nn.Module] | nn.Module

# BatchNorm's step counter does not change what an eval-mode network computes.
_IGNORABLE = ("num_batches_tracked",)


def _n_samples(params: Params) -> int:
    if not isinstance(params, dict) or not params:
        raise ValueError(
            "params must be a non-empty stacked state dict {name: (S, ...)}; got "
            f"{type(params).__name__} {'(empty)' if isinstance(params, dict) else ''}".rstrip()
        )
    sizes = {k: (int(v.shape[0]) if v.ndim else None) for k, v in params.items()}
    if len(set(sizes.values())) != 1 or None in sizes.values():
        raise ValueError(
            "every tensor of a stacked state dict carries the S samples along its first axis; got first "
            f"dimensions {sizes}. Stack the samples' state dicts with torch.stack (zoo.load does)."
        )
    s = next(iter(sizes.values()))
    if s == 0:
        raise ValueError("params holds no sample (S = 0); pass at least one weight sample")
    return s


def _template(arch: Arch) -> nn.Module:
    if isinstance(arch, nn.Module):
        return copy.deepcopy(arch)
    if callable(arch):
        model = arch()
        if not isinstance(model, nn.Module):
            raise TypeError(f"arch() must build an nn.Module, got {type(model).__name__}")
        return model
    raise ValueError(
        f"unknown arch {arch!r}: use 'optunet' (stacked fast path) or a factory that builds the "
        "nn.Module, e.g. arch=lambda: models.ResNet18(num_classes=100)"
    )


def _check_keys(model: nn.Module, params: Params) -> None:
    expected = model.state_dict()
    unknown = sorted(set(params) - set(expected))
    missing = sorted(k for k in set(expected) - set(params) if not k.endswith(_IGNORABLE))
    if unknown or missing:
        raise ValueError(
            f"the stacked state dict does not match the architecture: unknown keys {unknown[:5]}, missing "
            f"keys {missing[:5]} (BatchNorm running statistics count). Pass the full state dict of every "
            "sample, as zoo.load(..., as_='stacked') returns it, with the matching arch."
        )
    for k, v in params.items():
        if tuple(v.shape[1:]) != tuple(expected[k].shape):
            raise ValueError(
                f"{k}: samples of shape {tuple(v.shape[1:])}, but the architecture has "
                f"{tuple(expected[k].shape)}"
            )


def _module_logits(model: nn.Module, chunk: Params, x: torch.Tensor, use_vmap: bool) -> torch.Tensor:
    """Logits ``(M, B, C)`` of the ``M`` samples of ``chunk`` on the shared inputs ``x``."""

    def one(p: Params) -> torch.Tensor:
        return torch.func.functional_call(model, p, (x,))

    if use_vmap:
        return torch.vmap(one, randomness="error")(chunk)
    m = next(iter(chunk.values())).shape[0]
    return torch.stack([one({k: v[i] for k, v in chunk.items()}) for i in range(m)])


@torch.no_grad()
def probs(
    params: Params,
    x: torch.Tensor,
    arch: Arch = "optunet",
    batch_size: int = 256,
    chunk: int | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    vmap: bool | None = None,
    progress: bool = False,
) -> torch.Tensor:
    r"""Softmax outputs :math:`p_s(\cdot \mid x_n)` of every weight sample on every input.

    Args:
        params: stacked state dicts ``{name: (S, ...)}`` (a :class:`~symlib.posteriors.base.SampleSet`'s
            ``params``, or ``zoo.load(path)[0]``), BatchNorm buffers included.
        x: inputs ``(N, ...)``.
        arch: ``"optunet"`` for the stacked OptuNet fast path, else a factory ``() -> nn.Module`` (or a
            template module; its own weights are not used) of the architecture the samples belong to.
        batch_size: inputs per forward pass.
        chunk: samples per forward pass (default 64 for OptuNet, 8 for a module); memory grows with
            ``chunk * batch_size`` (a ResNet-18 holds its activations for that many images at once).
        device: where to compute (default: the device of ``params``); the result stays there.
        dtype: ``torch.float32`` (default) or ``torch.float64`` (weights, inputs and softmax).
        vmap: for module architectures, ``True`` batches the samples of a chunk with ``torch.vmap``,
            ``False`` loops over them; ``None`` tries ``vmap`` and falls back to the loop if it fails.
        progress: show a progress bar over the chunks.

    Returns:
        ``(S, N, C)`` probabilities in ``dtype`` on ``device``.

    Raises:
        ValueError: empty or ragged ``params``, keys or shapes that do not match ``arch``, empty ``x``,
            non-positive ``batch_size`` / ``chunk``, an unsupported ``dtype``.
    """
    s = _n_samples(params)
    if chunk is None:
        chunk = 64 if isinstance(arch, str) and arch == "optunet" else 8
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if not isinstance(x, torch.Tensor) or x.ndim < 2 or x.shape[0] == 0:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a non-empty batch of inputs (N, ...), got {shape}")
    for name, value in (("batch_size", batch_size), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    dev = torch.device(device) if device is not None else next(iter(params.values())).device

    def cast(v: torch.Tensor) -> torch.Tensor:
        return v.to(dev, dtype) if v.is_floating_point() else v.to(dev)

    if isinstance(arch, str) and arch == "optunet":
        if set(params) != set(_train.OPTUNET_SHAPES):
            raise ValueError(
                f"arch='optunet' takes the keys {sorted(_train.OPTUNET_SHAPES)}, got {sorted(params)}; "
                "for another architecture pass its module factory as arch"
            )
        for k, shape in _train.OPTUNET_SHAPES.items():
            if tuple(params[k].shape[1:]) != shape:
                raise ValueError(f"{k}: OptuNet samples have shape {shape}, got {tuple(params[k].shape[1:])}")

        def logits(p: Params, xb: torch.Tensor) -> torch.Tensor:
            return _train.optunet_forward(p, xb)

    else:
        model = _template(arch)
        _check_keys(model, params)
        model = model.to(dev, dtype).eval()
        use_vmap = vmap

        def logits(p: Params, xb: torch.Tensor) -> torch.Tensor:
            nonlocal use_vmap
            if use_vmap is None:
                try:
                    out = _module_logits(model, p, xb, True)
                    use_vmap = True
                    return out
                except Exception:  # noqa: BLE001 - any vmap limitation: fall back to the plain loop
                    use_vmap = False
            return _module_logits(model, p, xb, use_vmap)

    n = x.shape[0]
    out = None
    starts = range(0, s, chunk)
    with _progress.bar(total=len(starts), desc="predict", enabled=progress) as pbar:
        for a in starts:
            p = {k: cast(v[a : a + chunk]) for k, v in params.items()}
            for b in range(0, n, batch_size):
                z = logits(p, x[b : b + batch_size].to(dev, dtype))
                if out is None:
                    out = torch.empty(s, n, z.shape[-1], device=dev, dtype=dtype)
                out[a : a + chunk, b : b + batch_size] = torch.softmax(z, dim=-1)
            pbar.update(1)
    return out
