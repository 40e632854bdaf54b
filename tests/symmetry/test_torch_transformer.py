"""PyTorch's own ``nn.TransformerEncoder`` and ``nn.TransformerEncoderLayer`` are traced through their plain
forward (``symlib.symmetry.trace.plain``), pre-norm and post-norm, batch first or not: a random group
element keeps the function in float64 and float32, canonical forms are invariant, and the count equals the
closed form."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import symlib
from symlib.symmetry import canonical, check, counting, ops

D, HEADS, FF, LAYERS = 16, 2, 32, 2


class Encoder(nn.Module):
    def __init__(self, norm_first: bool, batch_first: bool, final_norm: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(6, D)
        layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=batch_first,
                                           norm_first=norm_first, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, LAYERS, norm=nn.LayerNorm(D) if final_norm else None,
                                             enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, x):  # x: (batch, positions, 6)
        h = self.embed(x)
        h = self.encoder(h if self.batch_first else h.transpose(0, 1))
        h = h if self.batch_first else h.transpose(0, 1)
        return self.head(h.mean(1))


CASES = [(True, True, True), (True, False, True), (False, True, False)]


def _model(norm_first, batch_first, final_norm, dtype):
    torch.manual_seed(0)
    model = Encoder(norm_first, batch_first, final_norm).to(dtype).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("norm_first, batch_first, final_norm", CASES)
def test_a_group_element_keeps_the_function(norm_first, batch_first, final_norm, dtype, tol):
    model = _model(norm_first, batch_first, final_norm, dtype)
    spec = symlib.spec_of(model, (5, 6), scalings="partial")
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    moved = ops.act(ops.random_element(spec, "both", generator=gen), theta, spec)
    assert max(float((moved[k] - theta[k]).abs().max()) for k in theta) > 1e-2
    assert float(check.function_error(spec, theta, moved)) < tol
    names = {k for k in spec.perms}
    assert any(k.endswith("self_attn.query") for k in names) and any(k.endswith("linear1") for k in names)
    assert spec.blocks[next(k for k in names if k.endswith("self_attn.query"))][0] == HEADS


@pytest.mark.parametrize("norm_first, batch_first, final_norm", CASES)
def test_canonical_form_is_invariant(norm_first, batch_first, final_norm):
    model = _model(norm_first, batch_first, final_norm, torch.float64)
    spec = symlib.spec_of(model, (5, 6), scalings="none")
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = ops.act(ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(2)), theta, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error", canonical.AmbiguousCanonicalForm)
        a, b = (canonical.canonicalize(t, spec, key="max", scaling=None) for t in (theta, moved))
    assert all(torch.allclose(a[k], b[k], atol=1e-12) for k in a)


def test_the_count_equals_the_closed_form():
    """Pre-norm: the stream (16!), per layer the heads' order (2!) with 8! query-key and 8! value features
    in each head, and the feed-forward units (32!)."""
    spec = symlib.spec_of(_model(True, True, True, torch.float64), (5, 6), scalings="none")
    lf = lambda n: math.log10(math.factorial(n))  # noqa: E731
    want = lf(D) + LAYERS * (math.log10(math.factorial(HEADS)) + 2 * HEADS * lf(D // HEADS) + lf(FF))
    assert counting.totals(spec)["log10_permutations"] == pytest.approx(want, rel=1e-12)
