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


def test_rotated_removal_keeps_functions_and_finds_a_rotated_copy(vit):
    _, spec, params = vit
    from symlib.symmetry import stream

    ref = unstack(params, 0)
    label = stream.stream_labels(spec)[0]
    q = stream.random_orthogonal(spec.perms[label], fix_ones=True, generator=torch.Generator().manual_seed(2))
    turned = stack([stream.rotate(unstack(params, i), spec, label, q) for i in range(3)])
    out = tf.removals(turned, spec, ref)
    assert float(check.function_error(spec, turned, out["rotated"]).max()) < 1e-10  # same functions
    assert float(tf.distances(out["rotated"], ref)[0]) < 1e-12  # the reference's rotated copy comes back
    assert bool((tf.distances(out["rotated"], ref) <= tf.distances(out["aligned"], ref) + 1e-9).all())


def test_barriers_one_row_per_pair_way_and_point(vit):
    net, spec, params = vit
    x = torch.randn(20, 1, 28, 28, dtype=torch.float64)
    y = torch.randint(0, 10, (20,))
    same = tf.barriers(params, params, spec, net, (x, y), pairs=2, n_points=3)
    assert len(same) == 2 * len(tf.WAYS) * 3 and list(dict.fromkeys(same["alignment"])) == list(tf.WAYS)
    assert same["loss barrier"].abs().max() < 1e-9  # a network with itself: a flat path
    other = {k: v.flip(0) for k, v in params.items()}
    got = tf.barriers(params, other, spec, net, (x, y), pairs=1, n_points=3)
    ends = got[got["t"].isin([0.0, 1.0])].groupby("t")["loss"].agg(["min", "max"])
    assert bool(((ends["max"] - ends["min"]).abs() < 1e-9).all())  # matching keeps b's function


def test_discrete_count_leaves_out_the_permutations_inside_continuous_groups(vit):
    """Closed form for TinyViT (2 blocks, 2 heads of 8 features, 24 MLP units): the heads' order (2! per
    attention) and the MLP units (24! per block) make isolated copies; the stream's permutations are
    orthogonal maps and the in-head ones changes of basis, two components each (the determinant's
    sign), so the stream keeps a factor 2 and each head a factor 2 for its queries and keys and 2 for its
    values: 2^(1 + 2 * 2 * 2). A ReLU CNN keeps every permutation."""
    import math

    from symlib import models
    from symlib.symmetry import counting

    _, spec, _ = vit
    tot = counting.totals(spec)
    want = 2 * math.log10(math.factorial(24)) + 2 * math.log10(math.factorial(2)) + 9 * math.log10(2)
    assert tot["discrete_log10"] == pytest.approx(want, rel=1e-12)
    assert tot["discrete_log10"] < tot["log10_permutations"]
    assert tot["stream_rotations"] == 15 * 14 // 2  # O(d - 1) with d = 16
    cnn = counting.totals(spec_of(models.OptuNet(), (1, 28, 28)))
    assert cnn["discrete_log10"] == pytest.approx(cnn["log10_permutations"], rel=1e-12)
