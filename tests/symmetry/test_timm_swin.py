"""timm's Swin: zero padding of positions (``F.pad``), shifted windows (``torch.roll``) and patch merging
written as a reshape of 2 x 2 positions into the channels are traced; a random group element keeps the
function (float64 and float32) and canonical forms are invariant. Its heads stay in place: the relative
position bias is looked up with an index buffer, which the tracer does not follow."""

from __future__ import annotations

import warnings

import pytest
import torch

import symlib
from symlib.symmetry import canonical, check, ops

timm = pytest.importorskip("timm")


def _swin(dtype):
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, embed_dim=16, depths=(2, 2),
                              num_heads=(2, 4), img_size=56, window_size=7, num_classes=5).to(dtype).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_a_group_element_keeps_the_function(dtype, tol):
    model = _swin(dtype)
    spec = symlib.spec_of(model, (3, 56, 56), scalings="partial")
    assert "patch_embed.proj" in spec.perms and "layers.1.downsample.reduction" in spec.perms
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = ops.act(ops.random_element(spec, "both", generator=torch.Generator().manual_seed(1)), theta, spec)
    assert max(float((moved[k] - theta[k]).abs().max()) for k in theta if theta[k].is_floating_point()) > 1e-2
    assert float(check.function_error(spec, theta, moved)) < tol


def test_canonical_form_is_invariant():
    model = _swin(torch.float64)
    spec = symlib.spec_of(model, (3, 56, 56), scalings="none")
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = ops.act(ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(2)), theta, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error", canonical.AmbiguousCanonicalForm)
        a, b = (canonical.canonicalize(t, spec, key="max", scaling=None) for t in (theta, moved))
    assert all(torch.allclose(a[k], b[k], atol=1e-12) for k in a if a[k].is_floating_point())


def test_padding_or_rolling_the_channels_is_refused():
    class Bad(torch.nn.Module):
        def __init__(self, how):
            super().__init__()
            self.how, self.a, self.b = how, torch.nn.Linear(4, 6), torch.nn.Linear(8, 2)

        def forward(self, x):
            h = self.a(x)
            h = torch.nn.functional.pad(h, (1, 1)) if self.how == "pad" else torch.roll(h, 1, dims=-1)
            return self.b(h) if self.how == "pad" else self.b(torch.cat([h, h[:, :2]], -1))

    for how in ("pad", "roll"):
        with pytest.raises(symlib.SymmetryError, match="labelled channel axis"):
            symlib.spec_of(Bad(how), (4,))
