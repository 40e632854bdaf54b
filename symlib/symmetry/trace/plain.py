r"""PyTorch's own transformer layers traced through by ``torch.fx`` (book: page "Architectures").

``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` choose at run time between a fused kernel and
their submodules, which ``torch.fx`` cannot trace. :class:`PlainTracer` traces the composition of their
submodules instead (``self_attn``, ``linear1``, the activation, ``linear2``, the norms, pre-norm or
post-norm), the function both paths compute; :func:`symbolic_trace` is ``torch.fx.symbolic_trace`` with
it, which :func:`symlib.symmetry.trace.spec_of` uses on the ``torch.fx`` path.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

__all__ = ["PlainTracer", "symbolic_trace"]


def _encoder_layer(mod: nn.TransformerEncoderLayer, src, src_mask=None, src_key_padding_mask=None,
                   is_causal: bool = False):
    """``nn.TransformerEncoderLayer.forward`` without its fast path."""

    def attend(x):
        out = mod.self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                            need_weights=False, is_causal=is_causal)[0]
        return mod.dropout1(out)

    def feed_forward(x):
        return mod.dropout2(mod.linear2(mod.dropout(mod.activation(mod.linear1(x)))))

    x = src
    if mod.norm_first:
        x = x + attend(mod.norm1(x))
        return x + feed_forward(mod.norm2(x))
    x = mod.norm1(x + attend(x))
    return mod.norm2(x + feed_forward(x))


def _encoder(mod: nn.TransformerEncoder, src, mask=None, src_key_padding_mask=None, is_causal=None):
    """``nn.TransformerEncoder.forward`` without its fast path (no nested tensors)."""
    x = src
    for layer in mod.layers:
        x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
    return x if mod.norm is None else mod.norm(x)


_PLAIN = {nn.TransformerEncoderLayer: _encoder_layer, nn.TransformerEncoder: _encoder}
"""PyTorch's layers traced through by their plain forward (``PlainTracer``) instead of as one call."""


class PlainTracer(torch.fx.Tracer):
    """``torch.fx``'s tracer, which traces the modules of ``_PLAIN`` through their plain forward."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return type(m) not in _PLAIN and super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward, args, kwargs):
        plain = _PLAIN.get(type(m))
        if plain is not None:
            def forward(*a, **k):  # noqa: F811 (the plain forward replaces the module's own)
                return plain(m, *a, **k)
        return super().call_module(m, forward, args, kwargs)


def symbolic_trace(model: nn.Module) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace`` with ``PlainTracer``."""
    tracer = PlainTracer()
    graph = tracer.trace(model)
    name = model.__class__.__name__ if isinstance(model, nn.Module) else model.__name__
    return torch.fx.GraphModule(tracer.root, graph, name)
