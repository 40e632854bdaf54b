"""Small transformers for the symmetry tests, at random initialisation (nothing downloads).

``build(name, seed)`` returns ``(model, input_shape, vocab)``: the model in float64 and eval mode, every
LayerNorm (RMSNorm) weight drawn from U(0.5, 1.5), every matrix from N(0, 1/fan_in) (libraries initialise
some to 0 or to std 0.02, which makes attention nearly uniform and hides what a wrong permutation does),
and every other parameter that its library initialises to a constant (zero biases, zero class tokens and
position embeddings) drawn from N(0, 0.2^2), so that no symmetry is hidden by a constant tensor. ``vocab``
is the vocabulary size of the models that read token ids (``None`` for the others).

* ``mha``: a pre-LayerNorm block written with ``nn.MultiheadAttention`` (d = 32, 4 heads, MLP 4d with
  GELU) after an input projection ``Linear(5, 32)``, mean-pooled into ``Linear(32, 3)``;
* ``mha-relu``: the same block with a ReLU MLP (whose hidden units scale exactly);
* ``swiglu``: the block with RMSNorm and a SwiGLU MLP (one fused ``Linear(32, 2 * 48)`` split into gate
  and value);
* ``tv-vit``: torchvision's ``VisionTransformer`` (16 x 16 images, patches of 8, 2 layers, d = 32, 4
  heads, MLP 64);
* ``tv-swin``: torchvision's ``SwinTransformer`` (16 x 16 images, patches of 2, embedding 8, depths
  (2, 2), heads (2, 4), windows of 2: shifted windows in the second block of each stage);
* ``timm-vit``, ``timm-deit``: ``vit_tiny_patch16_224`` and ``deit_tiny_distilled_patch16_224`` of timm
  with 16 x 16 images, patches of 8, 2 layers, d = 32, 4 heads (DeiT adds a distillation token and head);
* ``gpt2``: Hugging Face's ``GPT2LMHeadModel`` (d = 32, 2 layers, 4 heads, 40 tokens, untied output
  embedding, no cache), traced through ``torch.export``;
* ``bert``: Hugging Face's ``BertForSequenceClassification`` (d = 32, 2 layers, 4 heads, MLP 64, 40
  tokens, 3 classes), traced through ``torch.export``.
"""

from __future__ import annotations

import torch
from torch import nn

NAMES = ("mha", "mha-relu", "swiglu", "tv-vit", "tv-swin", "timm-vit", "timm-deit", "gpt2", "bert")


class Block(nn.Module):
    """Input projection, a pre-norm attention block and a pre-norm MLP block, mean pool, classifier."""

    def __init__(self, act: str = "gelu", d: int = 32, heads: int = 4):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.norm1 = nn.RMSNorm(d) if act == "swiglu" else nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.RMSNorm(d) if act == "swiglu" else nn.LayerNorm(d)
        self.act = act
        hidden = 48 if act == "swiglu" else 4 * d
        self.fc1 = nn.Linear(d, 2 * hidden if act == "swiglu" else hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        h = self.fc1(self.norm2(x))
        if self.act == "swiglu":
            gate, value = h.chunk(2, dim=-1)
            h = nn.functional.silu(gate) * value
        else:
            h = nn.functional.gelu(h) if self.act == "gelu" else torch.relu(h)
        x = x + self.fc2(h)
        return self.head(x.mean(1))


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)) and mod.weight is not None:
                mod.weight.copy_(0.5 + torch.rand(mod.weight.shape, generator=g, dtype=torch.float64))
        for p in model.parameters():
            if p.ndim >= 2 and p.shape[0] > 1:  # N(0, 1/fan_in): activations and attention of order 1
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / fan_in**0.5)
            elif p.numel() == 1 or bool((p == p.reshape(-1)[0]).all()):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def build(name: str, seed: int = 0):
    """``(model, input_shape, vocab)`` of the transformer ``name`` (module docstring), float64, eval mode."""
    torch.manual_seed(seed)
    vocab = None
    if name in ("mha", "mha-relu", "swiglu"):
        model, shape = Block({"mha": "gelu", "mha-relu": "relu", "swiglu": "swiglu"}[name]), (6, 5)
    elif name == "tv-vit":
        from torchvision.models.vision_transformer import VisionTransformer

        model = VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32,
                                  mlp_dim=64, num_classes=5)
        shape = (3, 16, 16)
    elif name == "tv-swin":
        from torchvision.models.swin_transformer import SwinTransformer

        model = SwinTransformer(patch_size=[2, 2], embed_dim=8, depths=[2, 2], num_heads=[2, 4],
                                window_size=[2, 2], num_classes=5, stochastic_depth_prob=0.0)
        shape = (3, 16, 16)
    elif name in ("timm-vit", "timm-deit"):
        import timm

        arch = "vit_tiny_patch16_224" if name == "timm-vit" else "deit_tiny_distilled_patch16_224"
        model = timm.create_model(arch, pretrained=False, img_size=16, patch_size=8, embed_dim=32, depth=2,
                                  num_heads=4, num_classes=5)
        shape = (3, 16, 16)
    elif name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        vocab = 40
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=vocab, n_positions=16,
                                           tie_word_embeddings=False, use_cache=False, bos_token_id=0,
                                           eos_token_id=0, pad_token_id=0))
        shape = (8,)
    elif name == "bert":
        from transformers import BertConfig, BertForSequenceClassification

        vocab = 40
        model = BertForSequenceClassification(BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            vocab_size=vocab, max_position_embeddings=16, num_labels=3, pad_token_id=0))
        shape = (8,)
    else:
        raise ValueError(f"unknown transformer {name!r}; choose one of {NAMES}")
    return _randomize(model.double().eval(), seed), shape, vocab


# ----------------------------------------------------------------------- helpers the transformer tests share
DECIDED = 4 * 2.0**-24
"""float32 neighbours whose sort keys are closer than this (relative) may swap under a group element."""


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cast(theta: dict, dtype) -> dict:
    """``theta`` with its floating tensors in ``dtype``."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in theta.items()}


def max_diff(a: dict, b: dict, keys=None) -> float:
    """The largest absolute difference between the floating tensors of ``a`` and ``b`` (over ``keys``)."""
    return max(float((a[k].double() - b[k].double()).abs().max())
               for k in (keys or a) if a[k].is_floating_point())


def decided(canon: dict, theta: dict, spec, dtype) -> list[str]:
    """The floating tensors of a canonical form whose order float32 rounding cannot flip: all in float64;
    in float32, those no label with a sort-key margin below :data:`DECIDED` acts on."""
    from symlib.symmetry import canonical

    skip = set()
    if dtype == torch.float32:
        ambiguous = {k for k, m in canonical.margins(theta, spec).items() if float(m) < DECIDED}
        skip = {a.param for a in spec.actions if a.perm in ambiguous}
    return [k for k in canon if k not in skip and canon[k].is_floating_point()]


def canonical_pair(theta: dict, spec, seed: int, check: bool = True) -> tuple[dict, dict]:
    """The canonical forms of ``theta`` and of ``theta`` moved by a random group element (``seed``), with
    ``AmbiguousCanonicalForm`` silenced: the tests check the tensors whose order is decided (:func:`decided`).
    ``check=False`` skips canonicalize's own float64 function check, which float32 RMSNorms fail by
    rounding (the tests check the function with their own tolerance)."""
    import warnings

    from symlib.symmetry import canonical, ops

    moved = ops.act(ops.random_element(spec, "both", generator=gen(seed)), theta, spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", canonical.AmbiguousCanonicalForm)
        return tuple(canonical.canonicalize(t, spec, check=check) for t in (theta, moved))


def assert_canonical_invariant(spec, theta: dict, dtype, function_tol: float) -> None:
    """The canonical form of ``theta`` (in ``dtype``) keeps its function to ``function_tol``, is that of
    ``theta`` moved by a random group element on every decided tensor (:func:`decided`, more than half of
    them), and is its own canonical form. canonicalize's own float64 check is skipped: its tolerance (1e-9)
    is below a float32 RMSNorm's rounding."""
    from symlib.symmetry import canonical, check

    theta = cast(theta, dtype)
    canon, other = canonical_pair(theta, spec, seed=4, check=False)
    assert float(check.function_error(spec, theta, canon)) < function_tol
    kept = decided(canon, theta, spec, dtype)
    assert len(kept) > len(canon) // 2
    assert max_diff(canon, other, kept) < (1e-9 if dtype == torch.float64 else 1e-5)
    assert max_diff(canonical.canonicalize(canon, spec, check=False), canon, kept) < 1e-12
