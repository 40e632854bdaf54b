r"""Stacked ReLU MLP classifiers: forward and backward passes of ``M`` networks at once (book: chapter
"Against the true posterior").

The networks are :class:`symlib.models.MLPClassifier`: hidden layers ``hidden.0, hidden.2, ...``
(``Linear`` then ReLU), a dropout slot, and the output layer ``fc``. Every pass is a handful of batched
matrix products over the model axis, so a thousand small networks train in the time PyTorch spends on the
Python overhead of a few (the architecture ``"mlp-classifier"`` of
:data:`symlib.training.optunet.STACKED_GRADS`, used by the posterior methods and their training loops).

With :math:`h_0 = x`, :math:`z_l = h_{l-1} W_l^\top + b_l`, :math:`h_l = \mathrm{relu}(z_l)` for the
hidden layers and logits :math:`\ell = (h_{L-1} \odot m) W_L^\top + b_L` (:math:`m` an optional dropout
multiplier), the loss is the mean cross-entropy over the batch and the backward pass is written out:
:math:`\partial \ell = (\mathrm{softmax}(\ell) - e_y) / B`, :math:`\partial W_l = \partial z_l^\top
h_{l-1}`, :math:`\partial b_l = \sum_b \partial z_l`, :math:`\partial h_{l-1} = \partial z_l W_l`,
:math:`\partial z_{l-1} = \partial h_{l-1} \odot 1[z_{l-1} > 0]`.
"""

from __future__ import annotations

import re

import torch

from symlib.params import Params

__all__ = ["layer_names", "mlp_forward", "mlp_loss_grads", "shapes"]

_HIDDEN = re.compile(r"^hidden\.(\d+)\.weight$")


def layer_names(params: Params) -> list[tuple[str, str]]:
    """``[(weight, bias), ...]`` of an :class:`~symlib.models.MLPClassifier` state dict, input layer first
    and ``fc`` last (a clear error for other keys)."""
    idx = sorted(int(m.group(1)) for k in params if (m := _HIDDEN.match(k)))
    names = [(f"hidden.{i}.weight", f"hidden.{i}.bias") for i in idx] + [("fc.weight", "fc.bias")]
    expected = {k for pair in names for k in pair}
    if set(params) != expected:
        raise ValueError(
            f"not the state dict of an MLPClassifier (hidden.<i>.weight/bias and fc.weight/bias): missing "
            f"{sorted(expected - set(params))[:4]}, unexpected {sorted(set(params) - expected)[:4]}"
        )
    return names


def shapes(widths) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the parameters of ``MLPClassifier(widths)``, in ``named_parameters`` order."""
    widths = [int(w) for w in widths]
    if len(widths) < 2:
        raise ValueError(f"widths must hold the inputs and the classes at least, got {widths}")
    out = {}
    for j, (a, b) in enumerate(zip(widths[:-2], widths[1:-1], strict=False)):
        out[f"hidden.{2 * j}.weight"], out[f"hidden.{2 * j}.bias"] = (b, a), (b,)
    out["fc.weight"], out["fc.bias"] = (widths[-1], widths[-2]), (widths[-1],)
    return out


def _forward(params: Params, x: torch.Tensor, feat_mask: torch.Tensor | None):
    """Activations with the batch innermost, ``(M, features, B)`` (as the OptuNet passes: the softmax and
    the elementwise operations then run over contiguous runs of ``B`` values)."""
    names = layer_names(params)
    m = params["fc.weight"].shape[0]
    dtype = params["fc.weight"].dtype
    if x.ndim == 2:  # one batch shared by every model: a stride-0 view, no copy
        h = x.to(dtype).T.expand(m, *x.shape[::-1])
    else:
        h = x.to(dtype).transpose(1, 2)
    acts, zs = [h], []
    for w, b in names[:-1]:
        z = torch.baddbmm(params[b].unsqueeze(2), params[w], h)  # (M, out, B)
        zs.append(z)
        h = z.clamp_min(0)
        acts.append(h)
    if feat_mask is not None:
        h = h * feat_mask
    logits = torch.baddbmm(params["fc.bias"].unsqueeze(2), params["fc.weight"], h)  # (M, classes, B)
    return names, acts, zs, h, logits


def mlp_forward(params: Params, x: torch.Tensor) -> torch.Tensor:
    """Logits ``(M, B, classes)`` of ``M`` stacked networks ``{name: (M, ...)}`` on their own inputs
    ``x (M, B, d)`` or on shared inputs ``(B, d)``."""
    return _forward(params, x, None)[-1].transpose(1, 2)


def mlp_loss_grads(
    params: Params, x: torch.Tensor, y: torch.Tensor, feat_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, Params]:
    r"""Mean cross-entropy of ``M`` stacked MLP classifiers on their own batches and its gradient (the
    backward pass of the module docstring, no autograd graph).

    Args:
        params: stacked ``MLPClassifier`` parameters ``{name: (M, ...)}``.
        x: ``(M, B, d)`` inputs (or ``(B, d)`` shared by every model); y: ``(M, B)`` labels (or ``(B,)``).
        feat_mask: optional ``(M, width, B)`` multiplier of the last hidden layer's features (dropout:
            entries 0 or ``1 / (1 - p)``), the convention of
            :func:`~symlib.training.optunet.optunet_loss_grads`.

    Returns:
        ``(loss (M,), grads)`` with ``grads`` shaped like ``params``.
    """
    names, acts, zs, feats, logits = _forward(params, x, feat_mask)
    m, b = logits.shape[0], logits.shape[2]
    if y.ndim == 1:
        y = y.expand(m, b)
    logp = torch.log_softmax(logits, 1)
    loss = -logp.gather(1, y[:, None, :]).squeeze(1).mean(1)
    d = logp.exp_()
    d.scatter_add_(1, y[:, None, :], torch.full((m, 1, b), -1.0, dtype=d.dtype, device=d.device))
    d.div_(b)  # d loss / d logits, (M, classes, B)
    grads = {"fc.weight": torch.bmm(d, feats.transpose(1, 2)), "fc.bias": d.sum(2)}
    dh = torch.bmm(params["fc.weight"].transpose(1, 2), d)  # (M, width, B)
    if feat_mask is not None:
        dh = dh * feat_mask
    for i in range(len(names) - 2, -1, -1):
        w, bias = names[i]
        dz = dh * (zs[i] > 0)
        grads[w] = torch.bmm(dz, acts[i].transpose(1, 2))
        grads[bias] = dz.sum(2)
        if i:
            dh = torch.bmm(params[w].transpose(1, 2), dz)
    return loss, {k: grads[k] for k in params}
