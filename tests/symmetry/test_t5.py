r"""T5 encoders (Hugging Face's ``T5EncoderModel`` and ``T5ForTokenClassification``): RMSNorm written out,
no biases, no score scaling, and one relative position bias shared by every layer, found by tracing (book:
chapter "Transformers: permutations without scalings"; page "Architectures").

Each model: d = 32, 2 layers, 4 heads of 8 features, feed-forward of 64 (``"relu"``: ``wo(relu(wi x))``;
``"gated-gelu"``: ``wo(gelu(wi_0 x) * wi_1 x)``), vocabulary 50, 8 relative position buckets, random
initialisation (RMSNorm gains from U(0.5, 1.5)), traced through ``torch.export`` with Hugging Face's
``sdpa`` attention (the bias folded into the mask by ``torch.where``) and with its ``eager`` attention
(the bias added to the scores).

The relative position bias: layer 0 looks a table :math:`E \in \mathbb{R}^{8 \times 4}` up with the bucket
of each offset :math:`k - q` (integers computed from positions alone: no label) and adds
:math:`E_{b(k-q), h}` to the scores of head :math:`h`; Hugging Face returns that tensor from layer 0 and
every later layer adds the same one (not detached). Permuting the heads of a layer by :math:`\pi` (rows of
its queries, keys and values in blocks of 8, columns of its output projection) keeps the function only if
its bias moves with them, i.e. if :math:`E`'s columns are permuted by :math:`\pi`; :math:`E` is shared, so
every layer must use the same :math:`\pi`. The group, derived by hand:

* the heads: :math:`4!` once (all layers and :math:`E`'s columns move together);
* per layer, inside each head: :math:`8!` for queries and keys and :math:`8!` for values and the output
  projection, with :math:`GL(8)` each (no biases, so no redundant bias dimension):
  :math:`2 \cdot 4 \cdot 2 \cdot 64 = 1024` continuous dimensions in all;
* per layer, the feed-forward units: :math:`64!` (``wi_0`` and ``wi_1`` share one permutation);
* scalings: each of the 4 RMSNorm gains inside the layers opens 32 scales (undone by the next
  projections' columns); ``relu``: ``wi``'s 64 units scale, ``gated-gelu``: ``wi_1``'s (the gate's GELU
  fixes ``wi_0``'s): :math:`4 \cdot 32 + 2 \cdot 64 = 256`;
* ``T5EncoderModel`` returns the normalised residual stream: the stream and the final gain are fixed.
  ``T5ForTokenClassification`` reads it with a linear classifier: the stream keeps :math:`32!` and the
  final gain 32 scales (undone by the classifier's columns): 288 scaling dimensions.

So :math:`\log_{10}|G_\mathrm{perm}| = \log_{10} 4! + 2\,(8 \log_{10} 8! + \log_{10} 64!)` (+
:math:`\log_{10} 32!` with the classifier). Not recorded: adding a constant :math:`c_h` to column
:math:`h` of :math:`E` shifts every score of head :math:`h` by :math:`c_h`, which the softmax ignores (4
dimensions, a shift, not a scaling).

A random group element keeps the output: in float32 to 1e-4; in float64 to 1e-9 when the stream is not
permuted, and to 1e-5 when it is: ``T5LayerNorm`` computes the mean of squares in float32 whatever the
model's dtype (``hidden_states.to(torch.float32)``), so a permuted stream sums its squares in another
order, a float32 rounding (about 6e-8 relative) that the network carries to the output.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
import transformer_nets
from torch import nn
from transformer_nets import assert_canonical_invariant, cast, gen, max_diff

from symlib.symmetry import check, continuous, counting, ops
from symlib.symmetry.spec import SymmetryError
from symlib.symmetry.trace import SmallSpecWarning, spec_of

VOCAB = 50
PROJS = ("relu", "gated-gelu")
BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def build(proj, seed=0, head=False, attn="sdpa"):
    """The model of the module docstring in float64 and eval mode, randomly initialised."""
    import transformers

    cfg = transformers.T5Config(
        d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, vocab_size=VOCAB,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, feed_forward_proj=proj,
        dropout_rate=0.0, num_labels=3, attn_implementation=attn)
    torch.manual_seed(seed)
    cls = transformers.T5ForTokenClassification if head else transformers.T5EncoderModel
    model = transformer_nets._randomize(cls(cfg).double().eval(), seed)
    g = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for mod in model.modules():
            if type(mod).__name__ == "T5LayerNorm":
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=g, dtype=torch.float64))
    return model


@functools.cache
def _case(proj, head=False, attn="sdpa"):
    model = build(proj, head=head, attn=attn)
    spec = spec_of(model, (8,), scalings="partial", vocab=VOCAB)
    return spec, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _lf(n):
    return math.lgamma(n + 1) / math.log(10)


def _stream(spec):
    """The stream's label (the token embedding's), when it is not fixed."""
    return next((a.perm for a in spec.actions if a.param.endswith("embed_tokens.weight")), None)


CASES = [(p, h, a) for p in PROJS for h in (False, True) for a in ("sdpa",)] + [("relu", False, "eager")]
IDS = [f"{p}-{'cls' if h else 'enc'}-{a}" for p, h, a in CASES]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("proj", "head", "attn"), CASES, ids=IDS)
def test_group_element_keeps_the_output(proj, head, attn, dtype):
    spec, theta = _case(proj, head, attn)
    theta = cast(theta, dtype)
    g = ops.random_element(spec, "both", generator=gen(1))
    moved = ops.act(g, theta, spec)
    bias = ("transformer." if head else "") + BIAS
    assert max_diff(moved, theta, [bias]) > 1e-2  # the shared bias table's columns moved
    assert max_diff(moved, theta) > 1e-2
    stream = _stream(spec)
    err = float(check.function_error(spec, theta, moved))
    if dtype == torch.float32:
        assert err < 1e-4
        return
    assert err < (1e-5 if stream else 1e-9)  # the stream through float32 RMSNorms
    if stream:  # everything but the stream: exact
        rest = ops.Element({k: v for k, v in g.perms.items() if k != stream}, g.scales)
        moved = ops.act(rest, theta, spec)
        assert max_diff(moved, theta, [bias]) > 1e-2
        assert float(check.function_error(spec, theta, moved)) < 1e-9


def _swap_heads(theta, layers, bias: bool):
    """Heads 0 and 1 swapped in ``layers`` (rows of q, k, v in blocks of 8, columns of o) and, with
    ``bias``, columns 0 and 1 of the shared relative position bias table."""
    out = dict(theta)
    idx = torch.cat([torch.arange(8, 16), torch.arange(8), torch.arange(16, 32)])
    for i in layers:
        p = f"encoder.block.{i}.layer.0.SelfAttention"
        for x in "qkv":
            out[f"{p}.{x}.weight"] = theta[f"{p}.{x}.weight"][idx]
        out[f"{p}.o.weight"] = theta[f"{p}.o.weight"][:, idx]
    if bias:
        out[BIAS] = theta[BIAS][:, [1, 0, 2, 3]]
    return out


@pytest.mark.parametrize("proj", PROJS)
def test_heads_are_tied_across_layers(proj):
    """Swapping two heads in every layer with the bias table's columns keeps the output; in one layer only
    (with or without the table), or without the table, it does not: each layer's attention alone would
    allow it, the shared bias does not."""
    spec, theta = _case(proj)
    assert float(check.function_error(spec, theta, _swap_heads(theta, (0, 1), True))) < 1e-9
    for layers, bias in (((0, 1), False), ((1,), False), ((0,), True), ((1,), True)):
        assert float(check.function_error(spec, theta, _swap_heads(theta, layers, bias))) > 1e-6


def test_tracer_finds_one_tie_of_heads():
    """The queries-keys and values labels of both layers and the bias table's column label (4 entries, one
    per head) form one tie of 4 blocks; the table's columns carry no scale."""
    spec, _ = _case("relu")
    p = "encoder.block.{}.layer.0.SelfAttention"
    labels = {f"{p.format(i)}.{x}" for i in range(2) for x in "qv"} | {BIAS.rsplit(".", 1)[0]}
    assert labels <= set(spec.perms)
    ties = {spec.blocks[x] for x in labels}
    assert len(ties) == 1 and next(iter(ties))[0] == 4 and next(iter(ties))[1] is not None
    assert {(a.axis, a.perm, a.scale) for a in spec.actions if a.param == BIAS} == {
        (1, BIAS.rsplit(".", 1)[0], None)}
    norms = {f"encoder.block.{i}.layer.{j}.layer_norm.weight" for i in range(2) for j in range(2)}
    assert set(spec.norms) == norms | {"encoder.final_layer_norm.weight"}
    assert set(spec.norms.values()) == {"rms"}
    mlp = {a.param for a in _case("gated-gelu")[0].actions
           if a.perm == "encoder.block.0.layer.1.DenseReluDense.wi_0"}
    assert {f"encoder.block.0.layer.1.DenseReluDense.{x}.weight" for x in ("wi_0", "wi_1", "wo")} <= mlp


@pytest.mark.parametrize(("proj", "head", "attn"), CASES, ids=IDS)
def test_counts_match_the_closed_form(proj, head, attn):
    spec, _ = _case(proj, head, attn)
    tot = counting.totals(spec)
    per_layer = 8 * _lf(8) + _lf(64)
    stream = _lf(32) if head else 0.0
    assert tot["log10_permutations"] == pytest.approx(_lf(4) + 2 * per_layer + stream, abs=1e-9)
    assert tot["scaling_dof"] == 4 * 32 + 2 * 64 + (32 if head else 0)
    assert tot["continuous"] == 2 * 4 * 2 * 8 * 8 == sum(continuous.dims(spec).values())


@pytest.mark.parametrize("head", [False, True], ids=["enc", "cls"])
def test_discrete_count_and_stream_rotations(head):
    """The isolated copies: the MLP units (64! per layer), the heads' order (4!, one tie for both layers) and
    the parity of every head's queries and keys and of its values (GL(8) has two components: 2^(4 * 2
    * 2)), and the parity of the stream where it is free (with the classifier: O(32), RMSNorm, two
    components). T5's two names of the input table (``shared``, ``encoder.embed_tokens``) both write
    the stream, so it rotates: a random rotation keeps the logits to float32 rounding (T5LayerNorm
    computes in float32) while the table moves by more than its norm, and both names stay equal."""
    from symlib.symmetry import stream

    spec, theta = _case("relu", head)
    tot = counting.totals(spec)
    want = 2 * _lf(64) + _lf(4) + 16 * math.log10(2) + (math.log10(2) if head else 0.0)
    assert tot["discrete_log10"] == pytest.approx(want, abs=1e-9)
    assert tot["stream_rotations"] == (32 * 31 // 2 if head else 0)
    if not head:
        return
    (label,) = stream.stream_labels(spec)
    turned = stream.rotate(theta, spec, label, stream.random_orthogonal(32, False, gen(5)))
    table = "transformer.shared.weight"
    assert torch.equal(turned[table], turned["transformer.encoder.embed_tokens.weight"])
    assert float((turned[table] - theta[table]).norm() / theta[table].norm()) > 1
    x = torch.randint(0, VOCAB, (4, 8), generator=gen(6))
    assert float(check.function_error(spec, theta, turned, x)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("proj", "head", "attn"), CASES[:4], ids=IDS[:4])
def test_canonical_form_is_invariant(proj, head, attn, dtype):
    spec, theta = _case(proj, head, attn)
    exact = dtype == torch.float64 and not head
    tol = 1e-9 if exact else 1e-5 if dtype == torch.float64 else 1e-4
    assert_canonical_invariant(spec, theta, dtype, tol)


# ------------------------------------------------------------------------------------ torch.where
class _Select(nn.Module):
    """A linear layer, ``torch.where`` with a mask over positions or over channels, a ReLU, a classifier."""

    def __init__(self, per_channel: bool, other: float):
        super().__init__()
        self.fc = nn.Linear(5, 6)
        self.head = nn.Linear(6, 2)
        self.per_channel, self.other = per_channel, other

    def forward(self, x):  # x: (batch, positions, 5)
        h = self.fc(x)
        pos = torch.arange(x.shape[1])[:, None]
        mask = (pos + torch.arange(6)[None, :]) % 2 == 0 if self.per_channel else pos % 2 == 0
        return self.head(torch.relu(torch.where(mask, h, self.other)))


@pytest.mark.parametrize(("per_channel", "other"), [(False, 0.0), (False, -1.0), (True, 0.0)])
def test_where_passes_labels_under_a_mask_over_positions(per_channel, other):
    """A mask over positions keeps fc's 6 units and, selecting 0, their scales; selecting -1 fixes the
    scales; a mask that differs between channels fixes the units."""
    model = _Select(per_channel, other).double().eval()
    with warnings.catch_warnings():  # with the mask over channels, fc has hidden units but no symmetry
        warnings.simplefilter("ignore", SmallSpecWarning)
        spec = spec_of(model, (4, 5), scalings="partial")
    assert spec.perms == ({} if per_channel else {"fc": 6})
    assert counting.totals(spec)["scaling_dof"] == (6 if (not per_channel and other == 0) else 0)
    if spec.perms:
        theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
        moved = ops.act(ops.random_element(spec, "both", generator=gen(1)), theta, spec)
        assert max_diff(moved, theta) > 1e-2
        assert float(check.function_error(spec, theta, moved)) < 1e-12


class _Scores(nn.Module):
    """Two-head attention whose scores get a labelled tensor that is not a per-head bias (a linear layer's
    output, one entry per position)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24, bias=False)
        self.pos = nn.Linear(8, 4)
        self.o = nn.Linear(8, 3)

    def forward(self, x):  # (batch, 4, 8)
        qkv = self.qkv(x).view(-1, 4, 3, 2, 4)
        q, k, v = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        scores = q @ k.transpose(-1, -2) + self.pos(x)[:, None]
        out = torch.softmax(scores, -1) @ v
        return self.o(out.transpose(1, 2).reshape(-1, 4, 8))


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Scores()

    def forward(self, x):
        return self.attn(x)


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_a_labelled_tensor_added_to_scores_is_refused(tracer):
    """A labelled tensor added to the scores along positions: refused, naming the module and the fix."""
    with pytest.raises(SymmetryError, match=r"labelled features added to attention scores.* in module "
                       r"'attn' \(_Scores\): add to the scores only tensors indexed by heads and positions"):
        spec_of(_Outer().double(), (4, 8), tracer=tracer)


class _MaskedAttention(nn.Module):
    """Two-head attention whose scores are masked by ``torch.where``: causally (the same mask for both
    heads), or with one mask per head."""

    def __init__(self, per_head: bool):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(8, 8, bias=False) for _ in range(3))
        self.o = nn.Linear(8, 3)
        self.per_head = per_head

    def forward(self, x):  # (batch, 4, 8)
        q, k, v = (f(x).view(-1, 4, 2, 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        pos = torch.arange(4)
        mask = pos[None, :] <= pos[:, None]
        if self.per_head:
            mask = torch.stack([mask, torch.ones(4, 4, dtype=torch.bool)])
        scores = torch.where(mask, q @ k.transpose(-1, -2), -1e9)
        out = torch.softmax(scores, -1) @ v
        return self.o(out.transpose(1, 2).reshape(-1, 4, 8))


@pytest.mark.parametrize("per_head", [False, True], ids=["shared-mask", "per-head-mask"])
def test_where_on_scores_keeps_or_pins_the_heads(per_head):
    """A mask selected with torch.where on the scores keeps the heads when it is the same for every head
    (2! head permutations), and pins them when it differs between heads; the in-head permutations stay."""
    model = transformer_nets._randomize(_MaskedAttention(per_head).double().eval(), 0)
    spec = spec_of(model, (4, 8), tracer="export", scalings="partial")
    heads = 0.0 if per_head else _lf(2)
    assert counting.totals(spec)["log10_permutations"] == pytest.approx(heads + 4 * _lf(4), abs=1e-9)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for seed in (1, 2, 3):
        moved = ops.act(ops.random_element(spec, "both", generator=gen(seed)), theta, spec)
        assert float(check.function_error(spec, theta, moved)) < 1e-10
    swapped = dict(theta)  # heads swapped against a per-head mask: the output changes
    idx = torch.cat([torch.arange(4, 8), torch.arange(4)])
    for p in "qkv":
        swapped[f"{p}.weight"] = theta[f"{p}.weight"][idx]
    swapped["o.weight"] = theta["o.weight"][:, idx]
    assert (float(check.function_error(spec, theta, swapped)) > 1e-6) == per_head
