r"""Redundant bias directions outside attention (``Spec.shifts``, :mod:`symlib.symmetry.biases`) on the book's
TinyViT, timm's ViT and DeiT, Hugging Face's ViT and GPT-2 (untied), built from configs at random
initialisation with random norm gains and biases (``transformer_nets``), in float64.

Closed forms, for a stream of width :math:`d`, :math:`L` pre-norm blocks (two LayerNorms each, every one
read only by linear layers with biases: the attention's input projection, the MLP's first layer) and a
final LayerNorm:

* TinyViT (:math:`d = 32, L = 2`): class token against :math:`p_0` (:math:`d`), the patch convolution's
  bias against :math:`p_{1:}` (:math:`d`), :math:`2L + 1` LayerNorms (the final one is read through the
  class token by the classifier, which has a bias): :math:`(2L + 3) d = 224`;
* timm's ViT and Hugging Face's ViT: the same, :math:`224`;
* timm's distilled DeiT: one more token (:math:`d`), the final LayerNorm read by both heads, and the two
  heads' biases summed (:math:`(\mathrm{head} + \mathrm{head}_{dist}) / 2` in eval mode: 5 classes):
  :math:`(2L + 4) d + 5 = 261`;
* GPT-2 (untied): token table against position table (:math:`d`), :math:`2L` LayerNorms; the final one is
  read by the classifier, which has no bias, so none: :math:`(2L + 1) d = 160`.

Every direction keeps the function to 1e-12 while the parameters it moves change by more than their norm;
the counts are ``counting.totals(spec)["bias_shifts"]``, and no permutation count changes.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import transformer_nets

from symlib.paper.transformers import TinyViT
from symlib.symmetry import biases, check, counting
from symlib.symmetry.spec import BiasShift, Spec, SymmetryError
from symlib.symmetry.trace import spec_of

D, L = 32, 2
EXPECTED = {"tinyvit": (2 * L + 3) * D, "hf-vit": (2 * L + 3) * D, "timm-vit": (2 * L + 3) * D,
            "timm-deit": (2 * L + 4) * D + 5, "gpt2": (2 * L + 1) * D}
VIT = {"token": 1, "patch": 1, "norm": 2 * L + 1}
KINDS = {"tinyvit": VIT, "hf-vit": VIT, "timm-vit": VIT, "gpt2": {"table": 1, "norm": 2 * L},
         "timm-deit": {"token": 2, "patch": 1, "norm": 2 * L + 1, "sum": 1}}


def _hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=D, num_hidden_layers=L,
        num_attention_heads=4, intermediate_size=64, num_labels=3))


@functools.cache
def _case(name):
    local = {"tinyvit": (TinyViT, (1, 28, 28)), "hf-vit": (_hf_vit, (3, 16, 16))}
    if name in local:
        make, shape = local[name]
        torch.manual_seed(0)
        model, vocab = transformer_nets._randomize(make().double().eval(), 0), None
    else:
        model, shape, vocab = transformer_nets.build(name, 0)
    spec = spec_of(model, shape, vocab=vocab)
    return spec, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_counts_match_the_closed_form(name):
    spec, _ = _case(name)
    kinds = {}
    for s in spec.shifts:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    assert kinds == KINDS[name]
    tot = counting.totals(spec)
    assert tot["bias_shifts"] == EXPECTED[name] == sum(biases.dims(spec).values())
    assert sum(r["bias_shifts"] for r in counting.count(spec)) == EXPECTED[name]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_shift_keeps_the_function(name):
    spec, theta = _case(name)
    deltas = biases.random_shifts(spec, torch.Generator().manual_seed(1), scale=3.0)
    moved = biases.shift(theta, spec, deltas)
    changed = [k for k in theta if not torch.equal(theta[k], moved[k])]
    assert len(changed) >= len(spec.shifts)
    rel = min(float((moved[k] - theta[k]).norm() / theta[k].norm().clamp_min(1e-12)) for k in changed)
    assert rel > 0.5  # every moved parameter by more than half its norm
    assert float(check.function_error(spec, theta, moved)) < 1e-12


@pytest.mark.parametrize("name", ["tinyvit", "gpt2"])
def test_each_direction_alone_and_negative_controls(name):
    """Each direction alone keeps the function; its plus side alone (the readers' or the minus side left)
    changes it."""
    spec, theta = _case(name)
    for i, s in enumerate(spec.shifts):
        deltas = [torch.zeros_like(x) for x in biases.random_shifts(spec)]
        deltas[i] = torch.randn(deltas[i].shape, generator=torch.Generator().manual_seed(i),
                                dtype=torch.float64)
        assert float(check.function_error(spec, theta, biases.shift(theta, spec, deltas))) < 1e-12
        half = dataclasses.replace(spec, shifts=(BiasShift(s.plus, kind=s.kind),))
        assert float(check.function_error(half, theta, biases.shift(theta, half, [deltas[i]]))) > 1e-6


def test_refusals():
    spec, theta = _case("tinyvit")
    with pytest.raises(SymmetryError, match="one vector per direction"):
        biases.shift(theta, spec, [])
    with pytest.raises(SymmetryError, match="bias shift"):
        Spec(shapes={"a": (3,), "b": (4,)}, perms={}, scales={}, actions=(), weights=frozenset(),
             shifts=(BiasShift((("a", 0, 1),), (("b", 0, 1),)),))


def test_a_class_token_without_position_embedding_gives_no_direction():
    """timm's ``no_embed_class``: position embeddings added to the patch tokens only; the class token
    then has no partner, the patch bias still has one."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8,
                              embed_dim=D, depth=L, num_heads=4, num_classes=5, no_embed_class=True)
    model = transformer_nets._randomize(model.double().eval(), 0)
    spec = spec_of(model, (3, 16, 16))
    assert [s.kind for s in spec.shifts if s.kind != "norm"] == ["patch"]
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = biases.shift(theta, spec, biases.random_shifts(spec, torch.Generator().manual_seed(2)))
    assert float(check.function_error(spec, theta, moved)) < 1e-12
