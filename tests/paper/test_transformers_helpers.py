"""The helpers of the chapter on transformers (symlib.paper.transformers): the small ViT traces into the
labels the chapter describes, and every helper computes what it says on untrained networks."""

from __future__ import annotations

import pytest
import torch

from symlib.paper import transformers as tf
from symlib.params import stack, unstack
from symlib.symmetry import check, ops
from symlib.symmetry.trace import spec_of


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    net = tf.TinyViT(dim=16, depth=2, heads=2, mlp=24).double()
    spec = spec_of(net, (1, 28, 28))
    sets = []
    for s in range(3):
        torch.manual_seed(s)
        sets.append({k: v.detach().clone() for k, v in tf.TinyViT(dim=16, depth=2, heads=2, mlp=24).double()
                     .state_dict().items()})
    return net, spec, stack(sets)


def test_labels_and_kinds(vit):
    _, spec, _ = vit
    kinds = tf.label_kinds(spec)
    assert list(kinds.values()) == ["stream", "query-key", "value", "MLP", "query-key", "value", "MLP"]
    assert spec.blocks["blocks.0.attn.query"] == (2, "blocks.0.attn.query")
    tau = torch.rand(5, 3, len(spec.perms))
    by = tf.tau_by_kind(tau, spec)
    assert set(by) == set(tf.KINDS)
    assert torch.allclose(by["MLP"], tau[..., [3, 6]].mean(-1)) and torch.allclose(by["stream"], tau[..., 0])


def test_removals_distances_and_probs(vit):
    net, spec, params = vit
    ref = unstack(params, 0)
    g = ops.random_element(spec, "perm", batch=(3,), generator=torch.Generator().manual_seed(1))
    moved = ops.act(g, params, spec)
    out = tf.removals(moved, spec, ref)
    sorted_first = tf.removals(params, spec, ref)["sorted"]
    assert all(torch.allclose(out["sorted"][k], sorted_first[k]) for k in params)  # sorting undoes g
    assert float(tf.distances(out["aligned"], ref)[0]) < 1e-20  # the reference's own copy is found back
    assert bool((tf.distances(out["aligned"], ref) <= tf.distances(moved, ref) + 1e-9).all())
    x = torch.randn(5, 1, 28, 28, dtype=torch.float64)
    p = tf.probs(params, x, lambda: tf.TinyViT(dim=16, depth=2, heads=2, mlp=24).double())
    assert p.shape == (3, 5, 10) and torch.allclose(p.sum(-1), torch.ones(3, 5, dtype=torch.float64))
    direct = torch.softmax(torch.func.functional_call(net.eval(), unstack(params, 1), (x,)), -1)
    assert torch.allclose(p[1], direct)
    assert float(check.function_error(spec, params, moved).max()) < 1e-10
