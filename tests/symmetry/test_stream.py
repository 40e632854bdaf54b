r"""The rotations of the residual stream (:mod:`symlib.symmetry.stream`) on pre-norm transformers at random
initialisation with random norm gains (``transformer_nets``): the book's TinyViT, Hugging Face's GPT-2
(untied), ViT and Llama, timm's DeiT, torchvision's Swin, and a small RMSNorm transformer.

* a random rotation of the stream keeps the function, to 1e-10 in float64 and 1e-4 in float32, while the
  weights move by more than half their norm;
* negative controls: under LayerNorm a rotation that moves the all-ones vector is refused, and forced, it
  changes the function (RMSNorm accepts it and keeps the function); the reader map without the gains,
  :math:`W \to WQ^\top`, changes the function too;
* Procrustes recovers a rotation exactly (:math:`Q^\top`), and ``align_stream`` brings an independently
  initialised network closer without changing its function, to a local minimum of the folded distance;
* dimensions: :math:`(d-1)(d-2)/2` under LayerNorm, :math:`d(d-1)/2` under RMSNorm, derived by hand below
  for each model, also from ``counting``;
* streams without rotations are refused, naming why: a head that reads the stream without a norm, a
  post-norm transformer, a tied embedding, a spec without scalings, a ReLU between norm and reader
  (caught numerically).
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformer_nets
from torch import nn

from symlib.paper.transformers import TinyViT
from symlib.symmetry import check, counting, stream
from symlib.symmetry.spec import SymmetryError
from symlib.symmetry.trace import spec_of


class RMSNet(nn.Module):
    """Input projection, one pre-RMSNorm block (attention, GELU MLP), a final RMSNorm, mean pool, head; with
    ``relu``, a ReLU between the first norm and the attention instead (not a rotation symmetry)."""

    def __init__(self, d: int = 16, relu: bool = False):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.norm1, self.norm2, self.norm = nn.RMSNorm(d), nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 3)
        self.relu = relu

    def forward(self, x):
        x = self.inp(x)
        y = self.norm1(x)
        y = torch.relu(y) if self.relu else y
        x = x + self.attn(y, y, y, need_weights=False)[0]
        x = x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm(x).mean(1))


def _hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=16, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=3))


def _build(name, seed):
    """``(model, input_shape, vocab)`` in float64 with random gains (``transformer_nets``)."""
    local = {"tinyvit": (TinyViT, (1, 28, 28)), "hf-vit": (_hf_vit, (3, 16, 16)), "rms": (RMSNet, (6, 5)),
             "rms-relu": (lambda: RMSNet(relu=True), (6, 5))}
    if name not in local:
        return transformer_nets.build(name, seed)
    make, shape = local[name]
    torch.manual_seed(seed)
    return transformer_nets._randomize(make().double().eval(), seed), shape, None


@functools.cache
def _case(name, seed=0):
    model, shape, vocab = _build(name, seed)
    spec = spec_of(model, shape, vocab=vocab)
    return spec, {k: v.detach().clone() for k, v in model.state_dict().items()}


# name -> (stream label, width d, LayerNorm?): Swin's first stage has no rotations (its embedding norm's
# output is the stream itself), its second stage (opened by the patch merging's reduction) has.
STREAMS = {
    "tinyvit": ("embed", 32, True),
    "gpt2": ("transformer.wte", 32, True),
    "hf-vit": ("vit.embeddings.patch_embeddings.projection", 32, True),
    "timm-deit": ("patch_embed.proj", 32, True),
    "tv-swin": ("features.2.reduction", 16, True),
    "rms": ("inp", 16, False),
}
NAMES = list(STREAMS)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _floats(theta, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in theta.items()}


def _max_diff(a, b):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def _rel_move(a, b):
    keys = [k for k in a if a[k].is_floating_point()]
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in keys)
    return (num / sum(float((a[k].double() ** 2).sum()) for k in keys)) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_rotation_keeps_the_function(name, dtype):
    spec, theta = _case(name)
    label, d, layer = STREAMS[name]
    assert stream.stream_labels(spec) == [label]
    theta = _floats(theta, dtype)
    q = stream.random_orthogonal(d, fix_ones=layer, generator=_gen(1), dtype=dtype)
    assert float((q.double().sum(1) - 1).abs().max()) < 1e-6 if layer else True
    moved = stream.rotate(theta, spec, label, q)
    assert _rel_move(theta, moved) > 0.5
    err = float(check.function_error(spec, theta, moved))
    assert err < (1e-10 if dtype == torch.float64 else 1e-4)


def test_layernorm_needs_the_all_ones_vector_fixed():
    """A Haar rotation of O(d) (it moves the all-ones vector) is refused under LayerNorm and, forced,
    changes the function; the same kind of rotation keeps an RMSNorm network's function."""
    spec, theta = _case("tinyvit")
    q = stream.random_orthogonal(32, fix_ones=False, generator=_gen(2))
    with pytest.raises(SymmetryError, match="fix the all-ones vector"):
        stream.rotate(theta, spec, "embed", q)
    forced = stream._rotate(theta, spec, stream._structure(spec, "embed"), q)
    assert float(check.function_error(spec, theta, forced)) > 1e-3
    rms_spec, rms_theta = _case("rms")
    q = stream.random_orthogonal(16, fix_ones=False, generator=_gen(2))
    assert float((q.sum(1) - 1).abs().max()) > 0.1
    turned = stream.rotate(rms_theta, rms_spec, "inp", q)
    assert float(check.function_error(rms_spec, rms_theta, turned)) < 1e-10


def test_readers_need_the_gains():
    r"""The reader map without the norm's gains (:math:`W \to WQ^\top`, :math:`\beta \to Q\beta`) is not a
    symmetry: the gains sit between the rotated normalised stream and the reader."""
    spec, theta = _case("tinyvit")
    st = stream._structure(spec, "embed")
    q = stream.random_orthogonal(32, fix_ones=True, generator=_gen(3))
    naive = stream.rotate(theta, spec, "embed", q)
    for a, _ in st.readers:
        naive[a.param] = theta[a.param] @ q.T  # TinyViT's readers are Linear weights (out, d)
    for _, bias in st.norms:
        naive[bias] = q @ theta[bias]
    assert float(check.function_error(spec, theta, naive)) > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_procrustes_recovers_a_rotation(name):
    spec, a = _case(name)
    label, d, layer = STREAMS[name]
    q = stream.random_orthogonal(d, fix_ones=layer, generator=_gen(4))
    b = stream.rotate(a, spec, label, q)
    found = stream.procrustes(a, b, spec)
    assert list(found) == [label]
    assert float((found[label] - q.T).abs().max()) < 1e-8
    assert _max_diff(stream.rotate(b, spec, label, found[label]), a) < 1e-8
    assert _max_diff(stream.align_stream(a, b, spec), a) < 1e-8


def test_procrustes_of_a_stack():
    """One network against a stack of two rotated copies: one rotation per copy, each recovered."""
    spec, a = _case("tinyvit")
    qs = torch.stack([stream.random_orthogonal(32, True, _gen(s)) for s in (5, 6)])
    stacked = stream.rotate({k: torch.stack([v, v]) for k, v in a.items()}, spec, "embed", qs)
    for i in range(2):
        one = stream.rotate(a, spec, "embed", qs[i])
        assert _max_diff({k: v[i] for k, v in stacked.items()}, one) < 1e-12
    found = stream.procrustes(a, stacked, spec)["embed"]
    assert found.shape == (2, 32, 32)
    assert float((found - qs.mT).abs().max()) < 1e-8


def _folded_distance(a, b, spec, label):
    st = stream._structure(spec, label)
    return sum(float(((x - y) ** 2).sum()) for x, y in zip(stream._folded(a, spec, st),
                                                              stream._folded(b, spec, st), strict=True))


def test_align_stream_brings_another_network_closer():
    """Two independently initialised TinyViTs: the aligned copy of the second computes its function, is
    closer to the first in the folded coordinates, and no small rotation of it is closer still."""
    spec, a = _case("tinyvit", 0)
    _, b = _case("tinyvit", 1)
    aligned = stream.align_stream(a, b, spec)
    assert float(check.function_error(spec, b, aligned)) < 1e-10
    before, after = _folded_distance(a, b, spec, "embed"), _folded_distance(a, aligned, spec, "embed")
    assert after < 0.95 * before
    basis = stream._ones_basis(32)
    for seed in range(4):
        x = torch.randn(31, 31, generator=_gen(10 + seed), dtype=torch.float64)
        r = torch.linalg.matrix_exp(0.01 * (x - x.T))
        near = basis @ r @ basis.T + torch.full((32, 32), 1 / 32, dtype=torch.float64)
        assert _folded_distance(a, stream.rotate(aligned, spec, "embed", near), spec, "embed") >= after


def _closed_form(d, layer):
    """O(d-1) for LayerNorm: rotations of the d-1 directions orthogonal to the all-ones vector, one per
    pair of them; O(d) for RMSNorm: one per pair of the d directions."""
    k = d - 1 if layer else d
    return k * (k - 1) // 2


@pytest.mark.parametrize("name", NAMES)
def test_dimensions_match_the_closed_form(name):
    spec, _ = _case(name)
    label, d, layer = STREAMS[name]
    expected = {"tinyvit": 465, "gpt2": 465, "hf-vit": 465, "timm-deit": 465, "tv-swin": 105,
                "rms": 120}[name]
    assert _closed_form(d, layer) == expected
    assert stream.dims(spec) == {label: expected}
    assert counting.totals(spec)["stream_rotations"] == expected
    rows = {r["label"]: r["stream_rotations"] for r in counting.count(spec)}
    assert rows[label] == expected and sum(rows.values()) == expected


def test_a_cnn_has_no_stream():
    from symlib import models

    spec = spec_of(models.ResNet20(num_classes=10), (3, 32, 32))
    assert stream.stream_labels(spec) == [] and counting.totals(spec)["stream_rotations"] == 0
    with pytest.raises(SymmetryError, match="no residual stream"):
        stream.procrustes({}, {}, spec)


def _tied_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=30, n_positions=8,
                                       use_cache=False, bos_token_id=0, eos_token_id=0)).double().eval()
    return spec_of(model, (6,), vocab=30), "lm_head"  # the stream takes the name of the graph's table


@pytest.mark.parametrize("case, match", [
    ("mha", "'head.weight' reads the stream 'inp' without a LayerNorm or RMSNorm"),
    ("bert", "is not read by linear layers alone"),
    ("tied", "is tied to another tensor"),
    ("no-scalings", "scalings='auto' or 'partial'"),
], ids=["head-without-norm", "post-norm", "tied-embedding", "no-scalings"])
def test_streams_without_rotations_are_refused(case, match):
    if case == "tied":
        spec, label = _tied_gpt2()
    elif case == "no-scalings":
        spec, label = _case("tinyvit")[0].without_scalings(), "embed"
    else:
        spec, label = _case(case)[0], next(iter(_case(case)[0].perms))
    assert stream.stream_labels(spec) == [] and stream.dims(spec) == {}
    with pytest.raises(SymmetryError, match=match):
        stream.rotate(_case("tinyvit")[1], spec, label, torch.eye(spec.perms[label], dtype=torch.float64))


def test_a_relu_between_norm_and_reader_is_caught_numerically():
    """The ReLU passes the norm's scaling label to the attention, so the spec alone takes the stream for a
    rotating one; with the weights, the numerical check refuses it."""
    spec, theta = _case("rms-relu")
    assert stream.stream_labels(spec) == ["inp"]
    with pytest.raises(SymmetryError, match="changed the function"):
        stream.stream_labels(spec, theta)
    assert stream.stream_labels(*_case("rms")) == ["inp"]


def test_llama_stream_rotates_in_o_d():
    """Hugging Face's Llama (RMSNorm written out, untied head): the stream rotates in O(d), 32 * 31 / 2 =
    496 dimensions, the all-ones vector free. Its RMSNorm computes in float32 whatever the model's dtype,
    so the float64 logits move by float32 roundings (about 1e-7), not by 1e-15."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = transformer_nets._randomize(LlamaForCausalLM(LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=50, max_position_embeddings=32, use_cache=False,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)).double().eval(), 0)
    with torch.no_grad():  # gains from U(0.5, 1.5), as transformer_nets draws those of nn.RMSNorm
        for mod in model.modules():
            if type(mod).__name__ == "LlamaRMSNorm":
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=_gen(8), dtype=torch.float64))
    spec = spec_of(model, (8,), vocab=50)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert stream.stream_labels(spec, theta) == ["model.embed_tokens"]
    assert stream.dims(spec) == {"model.embed_tokens": 496} and set(spec.norms.values()) == {"rms"}
    q = stream.random_orthogonal(32, fix_ones=False, generator=_gen(7))
    moved = stream.rotate(theta, spec, "model.embed_tokens", q)
    assert _rel_move(theta, moved) > 0.5
    assert float(check.function_error(spec, theta, moved)) < 1e-5
    found = stream.procrustes(theta, moved, spec)["model.embed_tokens"]
    assert float((found - q.T).abs().max()) < 1e-8
