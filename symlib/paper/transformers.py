r"""A small vision transformer for MNIST, and what the chapter on transformers computes with it (book: chapter
"Transformers: permutations without scalings").

:class:`TinyViT` cuts a 28 x 28 digit into 16 patches of 7 x 7 pixels, embeds them with one linear map (a
convolution of stride 7), prepends a class token, adds learned position embeddings, and runs ``depth``
pre-norm blocks (``nn.MultiheadAttention``, a GELU MLP) and a final LayerNorm before the classifier, which
reads the class token. :func:`symlib.symmetry.trace.spec_of` finds its symmetries by tracing it:
:func:`label_kinds` names what each permutation label is, :func:`tau_by_kind` averages the Kendall taus of
:mod:`symlib.paper.permfreq` over the labels of one kind, :func:`removals` gives a set of checkpoints
raw, sorted, aligned and rotated, for the MMD, :func:`distances` measures how far they are from one
network, :func:`barriers` walks the straight path between two networks after each way of matching them,
and :func:`probs` evaluates a set of checkpoints.
"""

from __future__ import annotations

import pandas as pd
import torch
from torch import nn
from torch.nn import functional as F

from symlib.params import Params, stack, unstack
from symlib.symmetry import align, canonical, merge, stream
from symlib.symmetry.spec import Spec

__all__ = ["KINDS", "WAYS", "Block", "TinyViT", "barriers", "distances", "label_kinds", "probs", "removals",
           "tau_by_kind"]

KINDS = ("stream", "query-key", "value", "MLP")
"""The kinds of permutation labels of a transformer, in the order the chapter reports them."""

WAYS: dict[str, dict] = {
    "none": {"align": "none"},
    "permutations": {"align": "weights"},
    "permutations + rotations": {"align": "weights", "orthogonal": True},
    "activation matching": {"align": "activations"},
}
"""The ways :func:`barriers` matches the second network of a pair to the first: not at all, by weight
matching over every permutation label, by weight matching then the rotations of the residual stream
and of every attention head (:func:`symlib.merge` with ``orthogonal=True``), and by activation matching
on a batch of inputs (heads moved as blocks)."""


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + fc2(gelu(fc1(norm2(x))))``."""

    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    """A vision transformer for small grey images (module docstring).

    Args:
        image_size: side of the (square) input images.
        patch: side of the square patches (it must divide ``image_size``).
        channels: input channels.
        dim: width of the residual stream.
        depth: number of blocks.
        heads: attention heads per block (they must divide ``dim``).
        mlp: hidden units of each block's MLP.
        num_classes: outputs of the classifier.
    """

    def __init__(self, image_size: int = 28, patch: int = 7, channels: int = 1, dim: int = 32, depth: int = 2,
                 heads: int = 4, mlp: int = 64, num_classes: int = 10):
        super().__init__()
        if image_size % patch or dim % heads:
            raise ValueError(f"the patch ({patch}) must divide the image ({image_size}) and the heads "
                             f"({heads}) the width ({dim})")
        tokens = (image_size // patch) ** 2 + 1
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def label_kinds(spec: Spec) -> dict[str, str]:
    """What each permutation label of a transformer's spec is (one of :data:`KINDS`): the residual stream
    (the label that touches the most tensors), the queries and keys or the values of an attention
    (``Spec.continuous``), or the hidden units of an MLP (the others)."""
    touched = {label: {a.param for a in spec.actions if a.perm == label} for label in spec.perms}
    stream = max(touched, key=lambda k: len(touched[k]))
    out = {}
    for label in spec.perms:
        kind = spec.continuous.get(label, (None,))[0]
        out[label] = "stream" if label == stream else {"qk": "query-key", "vo": "value"}.get(kind, "MLP")
    return out


def tau_by_kind(tau: torch.Tensor, spec: Spec) -> dict[str, torch.Tensor]:
    """Kendall taus ``(S, M, L)`` of :class:`symlib.paper.permfreq.PermFreq` (one column per label, in the
    order of ``spec.perms``) averaged over the labels of each kind: ``kind -> (S, M)``."""
    kinds = list(label_kinds(spec).values())
    return {k: tau[..., [i for i, x in enumerate(kinds) if x == k]].mean(-1) for k in KINDS if k in kinds}


def removals(params: Params, spec: Spec, reference: Params, seed: int = 0) -> dict[str, Params]:
    """A stacked set ``{name: (S, ...)}`` raw, with its permutations removed by sorting (the canonical form
    without scalings, largest incoming weight, :func:`symlib.symmetry.canonical.canonicalize`), aligned
    to ``reference`` by weight matching over every label
    (:func:`symlib.symmetry.align.align_many`, the residual stream first) and, for a network with a
    residual stream that only norms read, aligned then rotated onto ``reference`` (``"rotated"``: the
    stream's orthogonal group and one orthogonal matrix per attention head, in turn,
    :func:`symlib.symmetry.merge.rotate_onto`)."""
    aligned = align.align_many(reference, params, spec, cost="weights", seed=seed, widest_first=True)[0]
    out = {"raw": dict(params), "sorted": canonical.canonicalize(params, spec, key="max", scaling=None),
           "aligned": aligned}
    if stream.stream_labels(spec):
        n = spec.batch_shape(aligned)[0]
        out["rotated"] = stack([merge.rotate_onto(reference, unstack(aligned, i), spec) for i in range(n)])
    return out


def barriers(set_a: Params, set_b: Params, spec: Spec, model: nn.Module, data, pairs: int,
             ways: dict[str, dict] = WAYS, n_points: int = 11, seed: int = 0,
             batch: torch.Tensor | None = None) -> pd.DataFrame:
    """The loss and accuracy along the straight path from network ``i`` of ``set_a`` to network ``i`` of
    ``set_b`` (``i < pairs``), after each way of matching ``b`` to ``a`` (:data:`WAYS`:
    :func:`symlib.stats.barrier.barrier`'s arguments), one row per pair, way and point ``t``, with the
    pair's barriers (loss in nats, accuracy in points). Activation matching records its features on
    ``batch`` (default: the inputs of ``data``; pass training inputs to keep the evaluation data out of
    the matching)."""
    from symlib.stats.barrier import barrier

    rows = []
    for i in range(pairs):
        a, b = unstack(set_a, i), unstack(set_b, i)
        for way, kwargs in ways.items():
            extra = {"batch": batch} if kwargs.get("align") == "activations" and batch is not None else {}
            r = barrier(a, b, model, data, spec=spec, n_points=n_points, seed=seed, **kwargs, **extra)
            rows += [{"pair": i, "alignment": way, "t": t, "loss": lo, "accuracy": 100 * acc,
                      "loss barrier": r.loss_barrier, "accuracy barrier": 100 * r.accuracy_barrier}
                     for t, lo, acc in zip(r.t, r.loss, r.accuracy, strict=True)]
    return pd.DataFrame(rows)


@torch.no_grad()
def probs(params: Params, x: torch.Tensor, make_model=TinyViT) -> torch.Tensor:
    """Predicted class probabilities ``(S, N, classes)`` of every network of a stacked set on images ``x``,
    one network at a time in eval mode (``nn.MultiheadAttention``'s fused kernel has no batching rule for
    ``torch.func.vmap``, so :func:`symlib.stats.predict.probs` would fall back to a slow loop anyway)."""
    model = make_model().to(x.device).eval()
    n = next(iter(params.values())).shape[0]
    return torch.stack([F.softmax(torch.func.functional_call(model, unstack(params, i), (x,)), -1)
                        for i in range(n)])


def distances(params: Params, one: Params) -> torch.Tensor:
    """Squared distance ``(S,)`` from every network of a stacked set to one network, over every floating
    tensor (float64)."""
    return sum(((params[k].double() - one[k].double()) ** 2).flatten(1).sum(1)
               for k in one if one[k].is_floating_point())
