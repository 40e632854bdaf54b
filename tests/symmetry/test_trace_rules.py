"""Tracing rules beyond chains of layers (symlib.symmetry.trace): flattened maps, concatenations, gating
products, LayerNorm with a layer-scale parameter, channels-last layers, and the ``scalings`` option.

Each rule is checked as mathematics in float64: a random group element keeps the function, the canonical
form is invariant, and a negative control (the labels laid out the wrong way) changes the function.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from symlib import models
from symlib.symmetry import canonical, check, counting, minmass, ops
from symlib.symmetry.spec import Action, SymmetryError
from symlib.symmetry.trace import spec_of

TOL = 1e-10


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _build(net, shape, seed=0, scalings="auto"):
    torch.manual_seed(seed)
    net = models.randomize_batchnorm(net.double().eval(), _gen(seed))
    spec = spec_of(net, shape, scalings=scalings)
    theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
    x = torch.randn(8, *shape, generator=_gen(seed + 1), dtype=torch.float64)
    return spec, theta, x


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a if a[k].is_floating_point())


def _assert_symmetries(spec, theta, x, key="max"):
    """Random elements keep the function and the canonical form (which they change) is invariant."""
    for seed in (1, 2):
        g = ops.random_element(spec, "both", generator=_gen(seed))
        moved = ops.act(g, theta, spec)
        assert _max_diff(moved, theta) > 1e-3
        assert float(check.function_error(spec, theta, moved, x)) < TOL
        canon = canonical.canonicalize(theta, spec, key=key)
        assert _max_diff(canonical.canonicalize(moved, spec, key=key), canon) < 1e-9


# ----------------------------------------------------------------------------------- flatten
class FlattenNet(nn.Sequential):
    """conv 2->3, ReLU, conv 3->4, ReLU, flatten of the 4 x 3 x 3 map, linear 36->5, ReLU, linear 5->2."""

    def __init__(self):
        super().__init__(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(36, 5), nn.ReLU(), nn.Linear(5, 2))


@pytest.mark.parametrize("key", ["max", "first", "sum"])
def test_flatten_labels_act_on_blocks_of_features(key):
    """A channel of the flattened C x H x W map is a block of H*W consecutive inputs of the next layer
    (git-re-basin's VGG spec); its permutation and scale act on the whole block."""
    spec, theta, x = _build(FlattenNet(), (2, 7, 7))
    (a,) = [a for a in spec.actions if a.param == "5.weight" and a.axis == 1]
    assert (a.perm, a.scale, a.inner, a.start) == ("2", "2", 9, 0)
    _assert_symmetries(spec, theta, x, key)


def test_flatten_negative_control_channels_last_blocks():
    """The same channel permutation applied to the features as if the map were flattened channels-last
    (feature = position * C + channel) is no symmetry."""
    spec, theta, x = _build(FlattenNet(), (2, 7, 7))
    p = torch.tensor([2, 0, 3, 1])
    right = ops.permute(theta, spec, {"2": p})
    wrong = dict(right)
    wrong["5.weight"] = theta["5.weight"][:, (torch.arange(9)[:, None] * 4 + p[None, :]).flatten()]
    assert float(check.function_error(spec, theta, right, x)) < TOL
    assert float(check.function_error(spec, theta, wrong, x)) > 1e-3


# ----------------------------------------------------------------------------------- concatenation
class ConcatNet(nn.Module):
    """Two branches (conv 2->3, conv 2->2) concatenated, BatchNorm over the 5 channels, conv 5->4, pooled,
    linear 4->2: the DenseNet / Inception pattern."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 3, 3), nn.Conv2d(2, 2, 3)
        self.bn = nn.BatchNorm2d(5)
        self.c = nn.Conv2d(5, 4, 3)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], dim=1)
        h = torch.relu(self.c(torch.relu(self.bn(h))))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


def test_concatenation_carries_the_product_of_its_parts_permutations():
    spec, theta, x = _build(ConcatNet(), (2, 8, 8))
    cols = sorted((a.start, a.perm, spec.perms[a.perm]) for a in spec.actions
                  if (a.param, a.axis) == ("c.weight", 1))
    assert cols == [(0, "a", 3), (3, "b", 2)]
    bn_scales = {a.scale for a in spec.actions if a.param == "bn.weight"}
    assert len(bn_scales) == 2  # BatchNorm opens one scale per concatenated part
    tot = counting.totals(spec)
    assert tot["permutations"] == math.factorial(3) * math.factorial(2) * math.factorial(4)
    assert tot["scaling_dof"] == (3 + 2) + (3 + 2) + 4  # convs a, b; the BatchNorm; conv c
    _assert_symmetries(spec, theta, x)


def test_concatenation_negative_control_parts_swapped():
    """Labels laid on the wrong slices (the parts in the other order) break the function."""
    spec, theta, x = _build(ConcatNet(), (2, 8, 8))
    starts = {"a": 2, "b": 0}
    swapped = dataclasses.replace(spec, actions=tuple(
        dataclasses.replace(a, start=starts[a.perm]) if (a.param, a.axis) == ("c.weight", 1) else a
        for a in spec.actions
    ))
    g = ops.Element(perms={"a": torch.tensor([2, 0, 1]), "b": torch.tensor([1, 0])})
    assert float(check.function_error(spec, theta, ops.act(g, theta, spec), x)) < TOL
    assert float(check.function_error(spec, theta, ops.act(g, theta, swapped), x)) > 1e-4


def test_overlapping_or_oversized_slices_are_refused():
    spec, _, _ = _build(ConcatNet(), (2, 8, 8))
    moved = tuple(dataclasses.replace(a, start=1) if a.param == "c.weight" and a.perm == "a" else a
                  for a in spec.actions)
    with pytest.raises(SymmetryError, match="overlap"):
        dataclasses.replace(spec, actions=moved)
    with pytest.raises(SymmetryError, match="has size"):
        dataclasses.replace(spec, actions=spec.actions + (Action("fc.weight", 1, "a", None, -1, start=2),))


def test_minmass_on_concatenations_and_flattens_agrees_with_cvxpy():
    """The min-mass terms of a weight read by several labels (one term per pair of slices) give the
    optimum of the cvxpy formulation."""
    for net, shape in ((ConcatNet(), (2, 8, 8)), (FlattenNet(), (2, 7, 7))):
        torch.manual_seed(0)
        net = net.double().eval()
        theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
        if any(k.startswith("bn.") for k in theta):  # BatchNorm after a concatenation cannot be folded
            net.bn = nn.Identity()
            theta = {k: v for k, v in theta.items() if not k.startswith("bn.")}
        spec = spec_of(net, shape)
        g = ops.random_element(spec, "scale", log_range=2.0, generator=_gen(4))
        theta = ops.scale(theta, spec, g.scales)
        r = minmass.minmass(theta, spec, tol=1e-12)
        _, ref = minmass.reference(theta, spec, mode="lse")
        assert float(r.mass_after) == pytest.approx(ref, rel=1e-7)
        assert float(r.mass_after) < 0.9 * float(r.mass_before)


# ----------------------------------------------------------------------------------- gates
class SENet(nn.Module):
    """conv 2->4, BatchNorm, ReLU, squeeze-and-excitation (pool, conv 4->2, ReLU, conv 2->4, sigmoid,
    product), conv 4->3, ReLU, pool, linear 3->2: RegNet-Y's block, in small."""

    def __init__(self):
        super().__init__()
        self.a, self.bn = nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4)
        self.fc1, self.fc2 = nn.Conv2d(4, 2, 1), nn.Conv2d(2, 4, 1)
        self.b, self.fc = nn.Conv2d(4, 3, 3), nn.Linear(3, 2)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(h.mean((2, 3), keepdim=True)))))
        h = torch.relu(self.b(h * gate))
        return self.fc(h.mean((2, 3)))


def test_gate_carries_the_permutation_and_keeps_the_streams_scale():
    """``x * sigmoid(...)``: the gate's channels move with ``x``'s; ``x``'s scale passes through the product
    (the gate reads ``x`` through a linear layer that undoes it); the gate's own scale is fixed."""
    auto, _, _ = _build(SENet(), (2, 8, 8))
    assert list(auto.no_scaling) == ["sigmoid"]
    spec, theta, x = _build(SENet(), (2, 8, 8), scalings="partial")
    acts = {(a.param, a.axis): a for a in spec.actions}
    assert acts[("fc2.weight", 0)].perm == acts[("a.weight", 0)].perm
    assert acts[("fc2.weight", 0)].scale is None
    assert acts[("b.weight", 1)].scale == acts[("bn.weight", 0)].scale == "bn"
    _assert_symmetries(spec, theta, x)


def test_gate_negative_control_untied():
    """Permuting the stream without the gate's channels changes the function."""
    spec, theta, x = _build(SENet(), (2, 8, 8), scalings="partial")
    untied = dataclasses.replace(spec, actions=tuple(a for a in spec.actions
                                                     if not a.param.startswith("fc2")))
    g = ops.random_element(spec, "perm", generator=_gen(5))
    assert float(check.function_error(spec, theta, ops.act(g, theta, untied), x)) > 1e-4


# --------------------------------------------------------------------------- LayerNorm, channels last
class ConvNeXtBlock(nn.Module):
    """stem conv 2->4; a residual block: depthwise conv, channels last, LayerNorm, linear 4->8, GELU,
    linear 8->4, channels first, times a layer-scale parameter; pool, linear 4->2 (ConvNeXt, in small)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 2, stride=2)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.norm, self.up, self.down = nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 4)
        self.gamma = nn.Parameter(torch.rand(4, 1, 1) + 0.5)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.stem(x)
        y = self.dw(h).permute(0, 2, 3, 1)
        y = self.down(nn.functional.gelu(self.up(self.norm(y)))).permute(0, 3, 1, 2)
        h = h + self.gamma * y
        return self.fc(h.mean((2, 3)))


def test_layernorm_channels_last_and_layer_scale():
    spec, theta, x = _build(ConvNeXtBlock(), (2, 8, 8), scalings="partial")
    acts = {(a.param, a.axis): a for a in spec.actions}
    stream = acts[("stem.weight", 0)].perm
    assert acts[("gamma", 0)].perm == acts[("down.weight", 0)].perm == stream  # the residual stream
    assert acts[("gamma", 0)].scale is None and acts[("down.weight", 0)].scale == stream
    assert acts[("norm.weight", 0)].perm == "dw" and "norm.weight" in spec.weights
    assert acts[("dw.weight", 0)].scale is None  # the LayerNorm fixes the depthwise conv's scale
    assert spec.blocks == {stream: (4, stream), "dw": (4, stream)}  # depthwise: in and out move together
    _assert_symmetries(spec, theta, x)
    wrong = {**theta, "gamma": theta["gamma"][torch.tensor([1, 0, 2, 3])]}  # negative control
    assert float(check.function_error(spec, theta, wrong, x)) > 1e-4


# ----------------------------------------------------------------------------------- scalings option
def _mixed_mlp():
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))


def test_scalings_option():
    """``auto`` refuses scalings with a message naming both ways out; ``partial`` keeps the scalings
    that hold (the ReLU layer); ``none`` is the permutation-only spec."""
    auto, theta, x = _build(_mixed_mlp(), (3,))
    with pytest.raises(SymmetryError, match="scalings='none'.*scalings='partial'"):
        ops.random_element(auto, "both")
    with pytest.raises(SymmetryError, match="'1' uses Tanh"):
        canonical.canonicalize(theta, auto)
    partial, _, _ = _build(_mixed_mlp(), (3,), scalings="partial")
    assert partial.scales == {"2": 4} and partial.perms == auto.perms and not partial.no_scaling
    _assert_symmetries(partial, theta, x)
    none, _, _ = _build(_mixed_mlp(), (3,), scalings="none")
    assert none.scales == {} and none.perms == auto.perms and all(a.scale is None for a in none.actions)
    assert not ops.random_element(none, "both").scales
    _assert_symmetries(none, theta, x)
    assert none == auto.without_scalings() and partial == auto.with_partial_scalings()
    with pytest.raises(ValueError, match="scalings"):
        spec_of(_mixed_mlp(), (3,), scalings="some")


def test_scaling_a_fixed_layer_is_no_symmetry():
    """Negative control for ``partial``: scaling the tanh layer's neurons as if it were ReLU changes the
    function."""
    partial, theta, x = _build(_mixed_mlp(), (3,), scalings="partial")
    fake = dataclasses.replace(partial, scales={**partial.scales, "0": 5}, actions=tuple(
        dataclasses.replace(a, scale="0") if a.perm == "0" else a for a in partial.actions))
    g = ops.random_element(fake, "scale", generator=_gen(6))
    assert float(check.function_error(partial, theta, ops.act(g, theta, fake), x)) > 1e-4


# ----------------------------------------------------------------------------------- margins
def test_margins_report_ties_and_gaps():
    """A duplicated neuron has margin 0 (no order can be canonical); distinct random neurons have a
    positive margin equal to the smallest relative gap of their sorted keys."""
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
    spec = spec_of(net, (3,))
    m = canonical.margins(theta, spec, key="max")
    keys = canonical._normalize64(theta, spec, 2.0)["0.weight"].amax(-1).sort().values
    assert float(m["0"]) == pytest.approx(float((keys[1:] - keys[:-1]).min() / keys.abs().max()), rel=1e-12)
    rows = [0, 0, 2, 3]
    dup = {**theta, "0.weight": theta["0.weight"][rows], "0.bias": theta["0.bias"][rows],
           "2.weight": theta["2.weight"][:, rows]}
    assert float(canonical.margins(dup, spec)["0"]) == 0.0


def test_margins_of_a_tie_include_the_order_of_its_groups():
    """A depthwise convolution's channels move with the stream that feeds it (one tie): the stream's
    sort decides their order, so their margin is that order's, not ``inf`` (one neuron per group), and a
    float32 near-tie of the stream shows on the depthwise layer too (EfficientNet-B1's SE layers)."""
    spec, theta, _ = _build(ConvNeXtBlock(), (2, 8, 8), scalings="partial")
    stream = spec.blocks["dw"][1]
    m = canonical.margins(theta, spec, scaling=None)
    assert 0 < float(m[stream]) < float("inf") and float(m["dw"]) == float(m[stream])


@pytest.mark.parametrize("arch", ["flatten", "concat"])
def test_alignment_handles_labels_on_slices_and_blocks(arch):
    """Weight matching of a randomly permuted copy finds the permutation back (distance 0), though labels
    act on slices (a concatenation) or on blocks of features (a flatten) of the next layer's inputs."""
    from symlib.symmetry import align

    net, shape = (FlattenNet(), (2, 7, 7)) if arch == "flatten" else (ConcatNet(), (2, 8, 8))
    spec, theta, _ = _build(net, shape)
    moved = ops.act(ops.random_element(spec, "perm", generator=_gen(4)), theta, spec)
    r = align.align(theta, moved, spec, cost="weights")
    assert r.costs[0] > 1e-2 and r.cost < 1e-20


@pytest.mark.parametrize("arch", ["flatten", "concat"])
def test_group_laws_and_batched_elements_on_slices(arch):
    """Labels on slices and blocks: a batch of elements acts network by network (the gather path), the
    inverse undoes an element, and composing two elements is acting with one then the other."""
    net, shape = (FlattenNet(), (2, 7, 7)) if arch == "flatten" else (ConcatNet(), (2, 8, 8))
    spec, theta, x = _build(net, shape)
    stack = {k: torch.stack([v] * 3) for k, v in theta.items()}
    g = ops.random_element(spec, "both", batch=(3,), generator=_gen(7))
    moved = ops.act(g, stack, spec)
    for i in range(3):
        gi = ops.Element({k: p[i] for k, p in g.perms.items()}, {k: s[i] for k, s in g.scales.items()})
        assert _max_diff({k: moved[k][i] for k in theta}, ops.act(gi, theta, spec)) < 1e-12
    assert float(check.function_error(spec, stack, moved, x).max()) < TOL
    g1, g2 = (ops.random_element(spec, "both", generator=_gen(s)) for s in (8, 9))
    assert _max_diff(ops.act(ops.inverse(g1, spec), ops.act(g1, theta, spec), spec), theta) < 1e-12
    two = ops.act(g2, ops.act(g1, theta, spec), spec)
    assert _max_diff(ops.act(ops.compose(g2, g1, spec), theta, spec), two) < 1e-12


def test_pooling_in_torch_namespace_traces_like_its_functional_form():
    """``torch.max_pool2d(x, 2)`` is the function ``F.max_pool2d`` itself calls; it was refused while
    ``nn.MaxPool2d`` traced."""
    import torch.nn.functional as F
    from torch import nn

    import symlib

    class Net(nn.Module):
        def __init__(self, pool):
            super().__init__()
            self.conv, self.fc, self.pool = nn.Conv2d(1, 4, 3), nn.Linear(4 * 3 * 3, 2), pool

        def forward(self, x):
            return self.fc(self.pool(torch.relu(self.conv(x)), 2).flatten(1))

    shape = (1, 8, 8)
    specs = [symlib.spec_of(Net(pool).double(), shape) for pool in (F.max_pool2d, torch.max_pool2d)]
    assert specs[0].perms == specs[1].perms == {"conv": 4}
    assert specs[0].actions == specs[1].actions
