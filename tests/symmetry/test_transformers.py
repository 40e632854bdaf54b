"""Transformers: the symmetries of attention, LayerNorm and the residual stream, found by tracing (book:
chapter "Transformers: permutations without scalings"; page "Architectures").

For every model of ``transformer_nets`` (``nn.MultiheadAttention`` after an input projection, with GELU,
ReLU and SwiGLU MLPs; torchvision's ViT and Swin; timm's ViT and DeiT; Hugging Face's GPT-2 and BERT),
at random initialisation with random LayerNorm affine parameters, in float64 and float32:

* a random group element (heads, in-head query-key and value permutations, the residual stream, MLP
  hidden units, and the scalings that hold: LayerNorm against the next layer's columns, ReLU and SwiGLU
  value units) keeps the function, to 1e-10 in float64 and 1e-4 (the library's tolerance) in float32;
  so do a random element of the continuous group (GL per head) and shifts of the redundant biases;
* negative controls: permuting the heads of the queries alone, or one head's query features alone,
  changes the function;
* canonical forms are invariant: to 1e-9 in float64; in float32 to 1e-5 on the tensors that no label
  whose margin is below float32 rounding acts on;
* ``counting`` gives the closed forms derived below for the finite group (log10) and the continuous
  dimensions;
* weight matching over all labels brings a randomly permuted copy back to distance 0, and aligns two
  differently initialised ViTs closer than the labels found before attention was traced (MLP units);
* architectures beyond the rules are refused with a SymmetryError naming the node.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import transformer_nets
from transformer_nets import canonical_pair, cast, decided, gen, max_diff

from symlib.symmetry import align, biases, canonical, check, continuous, counting, ops
from symlib.symmetry.spec import SymmetryError
from symlib.symmetry.trace import spec_of

NAMES = transformer_nets.NAMES


@functools.cache
def _case(name, seed=0):
    model, shape, vocab = transformer_nets.build(name, seed)
    spec = spec_of(model, shape, scalings="partial", vocab=vocab)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return spec, theta


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_group_element_keeps_the_function(name, dtype):
    spec, theta = _case(name)
    theta = cast(theta, dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    g = ops.random_element(spec, "both", generator=gen(1))
    moved = ops.act(g, theta, spec)
    assert max_diff(moved, theta) > 1e-2
    assert float(check.function_error(spec, theta, moved)) < tol
    mats = continuous.random_element(spec, gen(2))
    turned = continuous.act(theta, spec, mats)
    assert max_diff(turned, theta) > 1e-3
    assert float(check.function_error(spec, theta, turned)) < tol
    shifted = continuous.shift_biases(theta, spec, continuous.random_shifts(spec, gen(3), dtype))
    assert float(check.function_error(spec, theta, shifted)) < tol
    if spec.shifts:  # the redundant biases outside attention, wherever the trace found them
        moved = biases.shift(theta, spec, biases.random_shifts(spec, gen(4), dtype=dtype))
        assert max_diff(moved, theta) > 1e-2
        assert float(check.function_error(spec, theta, moved)) < tol


def _query_rows(spec, label):
    """The actions of ``label`` on the query side: weights and biases, power +1."""
    return [a for a in spec.actions if a.perm == label and a.power > 0]


@pytest.mark.parametrize("control", ["heads", "features"])
@pytest.mark.parametrize("name", NAMES)
def test_negative_controls_queries_alone(name, control):
    """Swapping heads 0 and 1 of the queries only (their keys, values and outputs left), or two features of
    head 0 of the queries only, changes the function: the keys must move with the queries."""
    spec, theta = _case(name)
    label = next(k for k, (kind, _) in spec.continuous.items() if kind == "qk")
    heads, _ = spec.blocks[label]
    k = spec.perms[label] // heads
    p = torch.arange(spec.perms[label])
    if control == "heads":
        p = torch.cat([p[k:2 * k], p[:k], p[2 * k:]])
    else:
        p[0], p[1] = 1, 0
    broken = dict(theta)
    for a in _query_rows(spec, label):
        start, stop = spec.span(a)
        t = broken[a.param]
        idx = torch.arange(t.shape[a.axis])
        idx[start:stop] = p + start
        broken[a.param] = t.index_select(a.axis, idx)
    assert float(check.function_error(spec, theta, broken)) > 1e-6


# In float32 a "max" key moves by about two roundings relative to the largest key of its label, so
# neighbours whose keys differ by more than 4 * 2^-24 keep their order (as in test_torchvision).


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_canonical_form_is_invariant(name, dtype):
    spec, theta = _case(name)
    theta = cast(theta, dtype)
    canon, other = canonical_pair(theta, spec, seed=4)
    kept = decided(canon, theta, spec, dtype)
    assert len(kept) > len(canon) // 2
    assert max_diff(canon, other, kept) < (1e-9 if dtype == torch.float64 else 1e-5)
    assert max_diff(canonical.canonicalize(canon, spec, check=False), canon, kept) < 1e-12  # idempotent


def _lf(n):
    return math.lgamma(n + 1) / math.log(10)


def _layer(d, h, m, value_bias=True, key_bias=True):
    """One attention block of width d with h heads of d/h features and an MLP of m hidden units:
    (log10 of its permutations, its continuous dimensions). Permutations: h! heads, (d/h)!^h query-key
    and (d/h)!^h value permutations, m! hidden units; continuous: GL(d/h) twice per head, plus d for a
    key bias and d for a value bias."""
    k = d // h
    return _lf(h) + 2 * h * _lf(k) + _lf(m), 2 * h * k * k + d * key_bias + d * value_bias


def _closed_form(name):
    """(log10 permutations, continuous dimensions, scaling DoF) of each model (module docstring)."""
    if name in ("mha", "mha-relu", "swiglu"):  # stream 32! (input projection), one block
        m = 48 if name == "swiglu" else 128
        perm, cont = _layer(32, 4, m)
        extra = {"mha": 0, "mha-relu": 128, "swiglu": 48}[name]  # ReLU units; SwiGLU's value units
        return _lf(32) + perm, cont, 2 * 32 + extra  # + the two norms' affine scales
    if name in ("tv-vit", "timm-vit", "timm-deit", "gpt2"):  # stream 32!, two blocks, 2 * 2 + 1 norms
        perm, cont = _layer(32, 4, 64 if name == "tv-vit" else 128)
        return _lf(32) + 2 * perm, 2 * cont, 5 * 32
    if name == "bert":  # post-norm: only the last norm, read by the pooler alone, keeps its scale
        perm, cont = _layer(32, 4, 64)
        return _lf(32) + 2 * perm + _lf(32), 2 * cont, 32  # + the pooler's 32 units
    # Swin: stage 1 (stream 8!, blocks of 2 heads of 4, MLP 32), patch merging to a new stream of 16,
    # stage 2 (4 heads of 4, MLP 64); norms: 4 x 8, the merging norm over 4 x 8, 4 x 16, the last 16
    p1, c1 = _layer(8, 2, 32)
    p2, c2 = _layer(16, 4, 64)
    return _lf(8) + 2 * p1 + _lf(16) + 2 * p2, 2 * c1 + 2 * c2, 4 * 8 + 32 + 4 * 16 + 16


@pytest.mark.parametrize("name", NAMES)
def test_counts_match_the_closed_form(name):
    spec, _ = _case(name)
    tot = counting.totals(spec)
    log10, cont, sdof = _closed_form(name)
    assert tot["log10_permutations"] == pytest.approx(log10, abs=1e-9)
    assert tot["continuous"] == cont == sum(continuous.dims(spec).values())
    assert tot["scaling_dof"] == sdof
    frame = counting.table(spec)
    assert int(frame["continuous"].iloc[-1]) == cont


@pytest.mark.parametrize("name", NAMES)
def test_weight_matching_recovers_a_permuted_copy(name):
    spec, theta = _case(name)
    g = ops.random_element(spec, "perm", generator=gen(5))
    moved = ops.act(g, theta, spec)
    r = align.align(theta, moved, spec, cost="weights")  # attention: the stream goes first by default
    assert r.costs[0] > 1.0 and r.cost < 1e-18
    assert max_diff(r.mean, theta) < 1e-12


def _before_attention(spec):
    """The spec restricted to the labels found before attention was traced: MLP hidden units."""
    keep = {k for k in spec.perms if k not in spec.continuous and k not in spec.blocks
            and any(a.perm == k and "mlp" in a.param for a in spec.actions)
            and not any(a.perm == k and "conv_proj" in a.param for a in spec.actions)}
    actions = tuple(a for a in spec.actions if a.perm in keep)
    return dataclasses.replace(spec, perms={k: spec.perms[k] for k in keep}, scales={}, actions=actions,
                               blocks={}, continuous={}, no_scaling={})


def test_two_vits_align_closer_with_the_new_labels():
    """Two independently initialised ViTs: weight matching over every label (stream, heads, in-head
    features, MLP units) ends at a lower squared distance than over the MLP units alone, and both are
    below the raw distance; every tensor counts in all three."""
    spec, a = _case("tv-vit", 0)
    _, b = _case("tv-vit", 1)
    names = [k for k in a if a[k].is_floating_point()]
    raw = sum(float(((a[k] - b[k]) ** 2).sum()) for k in names)
    full = align.align(a, b, spec, cost="weights", names=names, widest_first=True)
    old = align.align(a, b, _before_attention(spec), cost="weights", names=names, widest_first=True)
    assert full.costs[0] == pytest.approx(raw) and old.costs[0] == pytest.approx(raw)
    assert full.cost < old.cost < raw
    assert float(check.function_error(spec, b, full.mean)) < 1e-10  # the aligned copy is the same network


def test_tracer_finds_the_labels_of_an_attention_block():
    """A pre-LayerNorm block (input projection, nn.MultiheadAttention, GELU MLP): the residual stream,
    heads as blocks of the query-key and value labels (one tie), keys on the far side of the queries."""
    spec, _ = _case("mha")
    assert list(spec.perms) == ["inp", "attn.query", "attn.value", "fc1"]
    assert spec.blocks == {"attn.query": (4, "attn.query"), "attn.value": (4, "attn.query")}
    assert spec.continuous == {"attn.query": ("qk", 32), "attn.value": ("vo", 32)}
    powers = {(a.start, a.power) for a in spec.actions if a.param == "attn.in_proj_weight" and a.axis == 0}
    assert powers == {(0, 1), (32, -1), (64, 1)}  # queries, keys (the far side), values
    stream = {a.param for a in spec.actions if a.perm == "inp"}
    assert {"inp.weight", "norm1.weight", "attn.in_proj_weight", "attn.out_proj.weight", "fc1.weight",
            "fc2.weight", "head.weight"} <= stream


def test_swin_position_bias_tables_move_with_the_heads():
    spec, theta = _case("tv-swin")
    label = "features.3.0.attn.heads"
    assert spec.perms[label] == 4 and spec.blocks[label] == (4, "features.3.0.attn.qkv.query")
    table = "features.3.0.attn.relative_position_bias_table"
    assert [(a.param, a.axis) for a in spec.actions if a.perm == label] == [(table, 1)]
    broken = {**theta, table: theta[table].roll(1, dims=1)}  # the tables alone moved: not a symmetry
    assert float(check.function_error(spec, theta, broken)) > 1e-6


def test_tied_embedding_and_classifier_move_together():
    """GPT-2 with its default tied weights: the graph reads the table under one name, the state dict holds
    both; the stream permutes both names alike, and the table, read as rows and as columns, keeps no
    scale."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=30, n_positions=8,
                                       use_cache=False, bos_token_id=0, eos_token_id=0)).double().eval()
    spec = spec_of(model, (6,), scalings="partial", vocab=30)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    table = {a.param: a for a in spec.actions if a.param in ("lm_head.weight", "transformer.wte.weight")}
    assert set(table) == {"lm_head.weight", "transformer.wte.weight"}
    assert all(a.axis == 1 and a.scale is None for a in table.values())
    moved = ops.act(ops.random_element(spec, "both", generator=gen(6)), theta, spec)
    assert torch.equal(moved["lm_head.weight"], moved["transformer.wte.weight"])
    assert max_diff(moved, theta) > 1e-2
    assert float(check.function_error(spec, theta, moved)) < 1e-10
    assert spec.aliases == {"lm_head.weight": "transformer.wte.weight"}
    assert counting.totals(spec)["parameters"] == sum(p.numel() for p in model.parameters())  # tied: once


class _QKNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import timm

        self.vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8,
                                     embed_dim=32, depth=1, num_heads=4, num_classes=3, qk_norm=True)

    def forward(self, x):
        return self.vit(x)


def _swin_v2():
    from torchvision.models.swin_transformer import PatchMergingV2, SwinTransformer, SwinTransformerBlockV2

    return SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[2], num_heads=[2], window_size=[2, 2],
                           num_classes=3, block=SwinTransformerBlockV2, downsample_layer=PatchMergingV2)


@pytest.mark.parametrize("make, shape, match", [
    (_swin_v2, (3, 8, 8), "_get_relative_position_bias|cosine attention"),  # its bias comes from an MLP
    (_QKNorm, (3, 16, 16), "on features split into heads"),
], ids=["swin-v2", "qk-norm"])
def test_unsupported_attention_is_refused_by_name(make, shape, match):
    with pytest.raises(SymmetryError, match=match) as err:
        spec_of(make().double().eval(), shape)
    assert "at node" in str(err.value)


@pytest.mark.parametrize("kwargs", [False, True], ids=["fx", "export"])
def test_a_vocab_larger_than_the_embedding_is_refused(kwargs):
    """The functional checks draw token ids below ``vocab``: a larger ``vocab`` than the embedding's rows
    was an IndexError inside them; it is refused where it is given, naming the embedding and the fix."""

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(30, 8)
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, ids):
            return self.fc(torch.relu(self.emb(ids))).mean(1)

    class TokensKw(Tokens):  # **kwargs: torch.fx refuses it, torch.export traces it
        def forward(self, ids, **kw):
            return super().forward(ids)

    model = (TokensKw if kwargs else Tokens)().double()
    assert spec_of(model, (6,), vocab=30).vocab == 30
    with pytest.raises(SymmetryError, match=r"vocab=50000 is larger than the 30 rows of the embedding .*=30"):
        spec_of(model, (6,), vocab=50000)
