r"""Llama-style decoders (Hugging Face's Llama, Mistral, Qwen2): RMSNorm written out, SwiGLU, rotary position
embeddings and grouped-query attention, found by tracing (book: chapter "Transformers: permutations without
scalings"; page "Architectures").

Each model: d = 32, 2 layers, 4 query heads of 8 features in 2 key-value groups (grouped-query attention),
SwiGLU MLP of 64, vocabulary 50, untied output embedding, random initialisation (RMSNorm gains from
U(0.5, 1.5)), traced through ``torch.export``. Its group, derived by hand:

* the residual stream: :math:`32!` (embedding, every RMSNorm, every projection's input, the output
  projections, the classifier's columns);
* per layer, the heads: :math:`g!\,(r!)^g = 2!\,(2!)^2 = 8` (the 2 key-value groups move with their query
  heads, and the 2 query heads of a group swap); rotary embeddings leave no permutation inside a
  query-key head, and grouped-query attention none inside a value head (``symlib.symmetry.trace.heads``);
* per layer, SwiGLU: :math:`64!` (gate and up share one permutation);
* scalings: each of the 5 RMSNorm gains opens 32 scales (undone by the next layer's columns), each
  SwiGLU's up projection 64 (the gate's SiLU fixes its own): :math:`5 \cdot 32 + 2 \cdot 64 = 288`;
* continuous: per key-value head, the rotary group :math:`(\mathbb{C}^\times)^{4}` (one rotation and one
  scale per pair of its 8 query-key features, acting alike on its 2 query heads), ``Spec.rotary``:
  :math:`2 \cdot 2 \cdot 8 = 32` dimensions; it holds no permutation, so the heads' order stays discrete.

A random group element keeps the logits: in float32 to 1e-4; in float64 to 1e-9 when the stream is not
permuted, and to 1e-5 when it is, since Hugging Face's RMSNorm computes in float32 whatever the model's
dtype (``hidden_states.to(torch.float32)``), so a permuted stream sums its squares in another order, a
float32 rounding (about 6e-8 relative) that the network carries to the logits.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import transformer_nets
from torch import nn
from transformer_nets import assert_canonical_invariant, cast, gen, max_diff

from symlib.symmetry import check, continuous, counting, ops
from symlib.symmetry.spec import SymmetryError
from symlib.symmetry.trace import spec_of

NAMES = ("llama", "mistral", "qwen2")
VOCAB = 50


def _config(name, **more):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[name]
    kw = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
              tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return cls(**{**kw, **more})


def build(name, seed=0, **more):
    """The model ``name`` (module docstring) in float64 and eval mode, randomly initialised."""
    import transformers

    torch.manual_seed(seed)
    cls = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}[name]
    model = transformer_nets._randomize(cls(_config(name, **more)).double().eval(), seed)
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__.endswith("RMSNorm"):
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=g, dtype=torch.float64))
    return model


@functools.cache
def _case(name):
    model = build(name)
    spec = spec_of(model, (8,), scalings="partial", vocab=VOCAB)
    return spec, {k: v.detach().clone() for k, v in model.state_dict().items()}


STREAM = "model.embed_tokens"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_group_element_keeps_the_logits(name, dtype):
    spec, theta = _case(name)
    theta = cast(theta, dtype)
    g = ops.random_element(spec, "both", generator=gen(1))
    moved = ops.act(g, theta, spec)
    assert max_diff(moved, theta) > 1e-2
    err = float(check.function_error(spec, theta, moved))
    assert err < (1e-5 if dtype == torch.float64 else 1e-4)  # the stream through float32 RMSNorms
    if dtype == torch.float64:  # everything but the stream: exact
        rest = ops.Element({k: v for k, v in g.perms.items() if k != STREAM}, g.scales)
        moved = ops.act(rest, theta, spec)
        assert max_diff(moved, theta) > 1e-2
        assert float(check.function_error(spec, theta, moved)) < 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_negative_controls(name):
    """Swapping two query heads of different key-value groups (their keys left), or two features inside a
    query head and the same two of its key head (a permutation that rotary embeddings break), changes the
    logits."""
    spec, theta = _case(name)
    for layer in ("q_proj", "qk"):
        broken = dict(theta)
        q, k = (f"model.layers.0.self_attn.{p}_proj" for p in "qk")
        for p in ([q] if layer == "q_proj" else [q, k]):
            t = broken[f"{p}.weight"]
            idx = torch.arange(t.shape[0])
            if layer == "q_proj":  # heads 0 and 2 (groups 0 and 1)
                idx = torch.cat([idx[16:24], idx[8:16], idx[:8], idx[24:]])
            else:  # features 0 and 1 of head 0 (pairs of different frequencies)
                idx[0], idx[1] = 1, 0
            broken[f"{p}.weight"] = t[idx]
        assert float(check.function_error(spec, theta, broken)) > 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", NAMES)
def test_canonical_form_is_invariant(name, dtype):
    spec, theta = _case(name)
    assert_canonical_invariant(spec, theta, dtype, 1e-5 if dtype == torch.float64 else 1e-4)


def _lf(n):
    return math.lgamma(n + 1) / math.log(10)


@pytest.mark.parametrize("name", NAMES)
def test_counts_match_the_closed_form(name):
    spec, _ = _case(name)
    tot = counting.totals(spec)
    heads = _lf(2) + 2 * _lf(2)  # g! (r!)^g with g = r = 2
    assert tot["log10_permutations"] == pytest.approx(_lf(32) + 2 * (heads + _lf(64)), abs=1e-9)
    assert tot["scaling_dof"] == 5 * 32 + 2 * 64
    assert tot["continuous"] == 2 * 2 * 8 == sum(continuous.dims(spec).values())
    # the stream's permutations lie in O(32), two components: only the parity of a permutation stays discrete
    want = tot["log10_permutations"] - _lf(32) + math.log10(2)
    assert tot["discrete_log10"] == pytest.approx(want, abs=1e-9)


def test_tracer_finds_the_labels_of_a_llama_layer():
    """Query heads: 2 blocks (the key-value groups) of 2, tied with the key and value heads; each head label
    acts on its projection's rows in blocks of 8, the query heads also on the output projection's columns;
    gate and up share one label; every RMSNorm gain is recorded as an RMSNorm."""
    spec, _ = _case("llama")
    p = "model.layers.0.self_attn"
    q, k, v = (f"{p}.{x}_proj.heads" for x in "qkv")
    assert {x: spec.perms[x] for x in (q, k, v)} == {q: 4, k: 2, v: 2}
    assert {x: spec.blocks[x] for x in (q, k, v)} == {q: (2, q), k: (2, q), v: (2, q)}
    assert {(a.param, a.axis, a.inner) for a in spec.actions if a.perm == q} == {
        (f"{p}.q_proj.weight", 0, 8), (f"{p}.o_proj.weight", 1, 8)}
    mlp = {a.param for a in spec.actions if a.perm == "model.layers.0.mlp.gate_proj"}
    assert {f"model.layers.0.mlp.{x}_proj.weight" for x in ("gate", "up", "down")} <= mlp
    norms = ("input_layernorm", "post_attention_layernorm")
    assert set(spec.norms) == {"model.norm.weight"} | {
        f"model.layers.{i}.{n}.weight" for i in range(2) for n in norms}
    assert set(spec.norms.values()) == {"rms"}


def test_without_grouped_query_attention_values_keep_their_group():
    """With as many key-value heads as query heads (no repeat_kv), queries and keys keep only their heads
    (rotary embeddings), and values keep their in-head permutations and GL(8) per head."""
    model = build("llama", num_key_value_heads=4)
    spec = spec_of(model, (8,), scalings="partial", vocab=VOCAB)
    p = "model.layers.0.self_attn"
    q = f"{p}.q_proj.heads"
    assert spec.perms[q] == 4 and spec.blocks[q] == (4, q)
    assert spec.continuous[f"{p}.v_proj"] == ("vo", 0) and spec.blocks[f"{p}.v_proj"] == (
        4, f"{p}.q_proj.heads")
    tot = counting.totals(spec)
    assert tot["log10_permutations"] == pytest.approx(_lf(32) + 2 * (_lf(4) + 4 * _lf(8) + _lf(64)), abs=1e-9)
    assert tot["continuous"] == 2 * 4 * 8 * 8 + 2 * 4 * 8  # GL(8) per value head, rotary per query-key head
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = ops.random_element(spec, "both", generator=gen(1))
    g = ops.Element({k: v for k, v in g.perms.items() if k != STREAM}, g.scales)
    mats = continuous.random_element(spec, gen(2))
    for moved in (ops.act(g, theta, spec), continuous.act(theta, spec, mats)):
        assert max_diff(moved, theta) > 1e-3
        assert float(check.function_error(spec, theta, moved)) < 1e-9


class _RMSBlock(nn.Module):
    """An input projection, an RMSNorm (``nn.RMSNorm`` or Hugging Face's written-out ``LlamaRMSNorm``), a
    ReLU MLP and a classifier."""

    def __init__(self, hf: bool):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.inp = nn.Linear(5, 16)
        self.norm = LlamaRMSNorm(16) if hf else nn.RMSNorm(16)
        self.fc = nn.Linear(16, 24)
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.norm(self.inp(x)))))


@pytest.mark.parametrize("hf", [False, True], ids=["nn.RMSNorm", "LlamaRMSNorm"])
@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_rmsnorm_written_out_is_a_norm(hf, tracer):
    """Both RMSNorms, traced by torch.fx or torch.export, give one spec: the input projection's 16 units
    permute with the norm's gain, whose scale (16) is undone by fc's columns; fc's 24 ReLU units scale."""
    model = transformer_nets._randomize(_RMSBlock(hf).double().eval(), 0)
    with torch.no_grad():
        model.norm.weight.copy_(torch.linspace(0.5, 1.5, 16, dtype=torch.float64))
    spec = spec_of(model, (5,), tracer=tracer, scalings="partial")
    assert spec.perms == {"inp": 16, "fc": 24}
    assert list(spec_of(model, (5,), tracer=tracer).no_scaling) == ["norm"]
    assert counting.totals(spec)["scaling_dof"] == 16 + 24
    assert spec.norms == {"norm.weight": "rms"}
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moved = ops.act(ops.random_element(spec, "both", generator=gen(1)), theta, spec)
    assert max_diff(moved, theta) > 1e-2
    assert float(check.function_error(spec, theta, moved)) < (1e-6 if hf else 1e-10)  # HF: float32 inside


class _Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        return torch.cumsum(self.fc(x), -1)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(_Unknown())
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.block(x))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_refusal_names_the_module(tracer):
    """An operation without a rule inside a submodule: the refusal names the module's path and class besides
    the node."""
    with pytest.raises(SymmetryError, match=r"at node 'cumsum' .* in module 'block\.0' \(_Unknown\)"):
        spec_of(_Outer().double(), (4,), tracer=tracer)


@pytest.mark.parametrize("name", NAMES)
def test_rotary_group_keeps_the_logits(name):
    """A random element of the rotary groups (one complex number per pair of features and key-value head:
    queries times z, keys times 1/conj(z)) keeps the logits in float64 to 1e-9 (the stream is not
    permuted, so the float32 RMSNorm sees the same numbers) while the query and key rows move by more than
    half their norm; the same numbers on the interleaved pairs (2i, 2i + 1) (another rotary convention)
    change them."""
    spec, theta = _case(name)
    assert len(spec.rotary) == 2
    zs = {k: v for k, v in continuous.random_element(spec, gen(3), spread=0.5).items() if k in spec.rotary}
    moved = continuous.act(theta, spec, zs)
    rows = [p for r in spec.rotary.values() for p, _, _ in r.queries + r.keys]
    assert set(rows) == {k for k in theta if not torch.equal(theta[k], moved[k])}
    assert min(float((moved[k] - theta[k]).norm() / theta[k].norm()) for k in rows) > 0.5
    assert float(check.function_error(spec, theta, moved)) < 1e-9
    half = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # row j of the half layout reads interleaved row half[j]
    perm = torch.cat([h * 8 + half for h in range(4)])
    inv = torch.argsort(perm)

    def reorder(t, idx):
        return {k: (v[idx[: v.shape[0]]] if k in rows else v) for k, v in t.items()}

    broken = reorder(continuous.rotate(reorder(theta, perm), spec, zs), inv)
    assert float(check.function_error(spec, theta, broken)) > 1e-6
