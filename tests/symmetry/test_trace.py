"""Tracing a module into a Spec (symlib.symmetry.trace.spec_of): rules, references and errors.

The hand-written :func:`symlib.symmetry.spec.mlp_spec` is the reference for MLPs: the
traced spec must equal it up to the names of the labels, for random widths,
depths and activations (hypothesis).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scenarios import make
from torch import nn

from symlib import models
from symlib.symmetry import check, ops
from symlib.symmetry.spec import SymmetryError, mlp_spec
from symlib.symmetry.trace import spec_of


def _canonical_actions(spec):
    """Actions with labels renamed by order of first appearance on the weights of each layer."""
    perm_names, scale_names = {}, {}
    for a in spec.actions:
        if a.power > 0 and a.axis == 0:
            if a.perm is not None:
                perm_names.setdefault(a.perm, f"p{len(perm_names)}")
            if a.scale is not None:
                scale_names.setdefault(a.scale, f"s{len(scale_names)}")
    return {
        (a.param, a.axis, perm_names.get(a.perm), scale_names.get(a.scale), a.power, a.groups, a.offset)
        for a in spec.actions
    }


def assert_same_spec(a, b):
    assert a.shapes == b.shapes
    assert sorted(a.perms.values()) == sorted(b.perms.values())
    assert sorted(a.scales.values()) == sorted(b.scales.values())
    assert _canonical_actions(a) == _canonical_actions(b)
    assert a.weights == b.weights
    assert a.output_bias == b.output_bias
    assert dict(a.no_scaling) == dict(b.no_scaling)
    assert a.input_shape == b.input_shape


@settings(max_examples=20, deadline=None)
@given(
    st.lists(st.integers(1, 7), min_size=1, max_size=4),
    st.sampled_from(["relu", "leaky_relu", "tanh", "gelu"]),
    st.booleans(),
)
def test_traced_mlp_equals_hand_written_spec(hidden, activation, bias):
    net = models.MLP([3, *hidden, 2], activation=activation, bias=bias).double()
    traced = spec_of(net, (3,))
    assert_same_spec(traced, mlp_spec(net))
    x = torch.randn(5, 3, dtype=torch.float64)
    theta = dict(net.state_dict())
    assert torch.equal(traced.forward(theta, x), net(x))


def test_spec_of_does_not_change_the_model():
    net = models.ResNet20(width=2)
    net.train()
    net.layer1.eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    spec_of(net, (3, 8, 8))
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert net.training and not net.layer1.training and net.layer2.training
    sc = make("resnet20")
    sc.model.train()
    out = sc.spec.forward(sc.theta, sc.x)  # always eval mode: running statistics, not the batch's
    assert sc.model.training
    assert torch.allclose(out, sc.model.eval()(sc.x))


# ----------------------------------------------------------------- structure
def test_batchnorm_actions():
    """Paper D.4.3: BN is permuted with its channels, absorbs the conv's scale in its running stats
    (mean: power 1, var + eps: power 2) and opens its own scale on weight and bias."""
    spec = make("resnet20").spec
    acts = {(a.param, a.axis): a for a in spec.actions}
    mean, var = acts[("layer1.0.bn1.running_mean", 0)], acts[("layer1.0.bn1.running_var", 0)]
    conv = acts[("layer1.0.conv1.weight", 0)]
    assert mean.scale == var.scale == conv.scale == "layer1.0.conv1"
    assert (mean.power, var.power, var.offset) == (1, 2, 1e-5)
    gamma, beta = acts[("layer1.0.bn1.weight", 0)], acts[("layer1.0.bn1.bias", 0)]
    assert gamma.scale == beta.scale == "layer1.0.bn1" and gamma.perm == conv.perm
    assert acts[("layer1.0.conv2.weight", 1)].scale == "layer1.0.bn1"
    assert "layer1.0.bn1.weight" in spec.weights
    assert not any(a.param.endswith("num_batches_tracked") for a in spec.actions)
    assert "layer1.0.bn1.num_batches_tracked" in spec.shapes


def test_residual_ties():
    """Paper D.4.4: the stem, every block output of a stage and the shortcut share one label."""
    spec = make("resnet20").spec
    acts = {(a.param, a.axis): a for a in spec.actions}
    stream = acts[("conv1.weight", 0)].perm
    for block in ("layer1.0", "layer1.1", "layer1.2"):
        assert acts[(f"{block}.conv2.weight", 0)].perm == stream
        assert acts[(f"{block}.bn2.weight", 0)].scale == acts[("bn1.weight", 0)].scale
        assert acts[(f"{block}.conv1.weight", 1)].perm == stream
    stage2 = acts[("layer2.0.conv2.weight", 0)].perm
    assert acts[("layer2.0.shortcut.0.weight", 0)].perm == stage2 != stream
    assert acts[("layer2.0.shortcut.0.weight", 1)].perm == stream  # the shortcut reads the old stream
    assert acts[("layer2.0.shortcut.1.weight", 0)].scale == acts[("layer2.0.bn2.weight", 0)].scale
    assert ("fc.weight", 0) not in acts and spec.output_bias == "fc.bias"


def test_optunet_grouped_spec():
    spec = spec_of(models.OptuNet(), (1, 28, 28))
    assert spec.blocks == {"conv1": (2, "conv1"), "conv2": (2, "conv1")}
    grouped = [a for a in spec.actions if a.groups != 1]
    assert [(a.param, a.axis, a.perm, a.groups) for a in grouped] == [("conv2.weight", 1, "conv1", 2)]
    assert spec.groups_of("conv2.weight") == 2 and spec.groups_of("fc.weight") == 1


def test_nonhomogeneous_activation_keeps_permutations_only():
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.GELU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(3, 2))
    spec = spec_of(net.double(), (1, 6, 6))
    assert spec.perms == {"0": 3} and spec.scales == {} and list(spec.no_scaling) == ["1"]
    with pytest.raises(SymmetryError, match="positively homogeneous"):
        ops.random_element(spec, "scale")
    theta = dict(net.state_dict())
    g = ops.random_element(spec, "perm")
    assert float(check.function_error(spec, theta, ops.act(g, theta, spec))) < 1e-12


def test_functional_style_model():
    """F.relu, torch.flatten, x.mean(dims), x.view and a += residual are traced like their modules."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
            self.c = nn.Linear(4, 2)

        def forward(self, x):
            h = nn.functional.relu(self.a(x))
            h += self.b(h)
            h = h.relu().mean((2, 3), keepdim=True)
            return self.c(h.view(h.size(0), -1))

    net = Net().double()
    spec = spec_of(net, (2, 5, 5))
    assert spec.perms == {"a": 4} and spec.scales == {"a": 4}
    theta = dict(net.state_dict())
    g = ops.random_element(spec, "both")
    assert float(check.function_error(spec, theta, ops.act(g, theta, spec))) < 1e-12


# -------------------------------------------------------------------- errors
class _ChannelShuffle(nn.Module):
    """ShuffleNet's channel shuffle: a view that splits the channel axis, then a transpose."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 4, 1), nn.Conv2d(4, 2, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        n, c, height, width = h.shape
        h = h.view(n, 2, c // 2, height, width).transpose(1, 2).reshape(n, c, height, width)
        return self.b(h)


class _Split(nn.Module):
    """A flattened 2 x 3 x 3 map cut into pieces of 6 features: the cut falls inside channel 0's block."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 2, 3), nn.Linear(6, 1)

    def forward(self, x):
        h1, h2, h3 = torch.flatten(torch.relu(self.a(x)), 1).chunk(3, dim=1)
        return self.b(h1 * h2)


class _Outer(nn.Module):
    """The outer product of a layer's features with themselves: neither queries times keys nor
    attention weights times values."""

    def __init__(self):
        super().__init__()
        self.a, self.out = nn.Linear(3, 4), nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.out(torch.flatten(h.unsqueeze(2) @ h.unsqueeze(1), 1))


class _ControlFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


class _RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.w = nn.Linear(3, 4), nn.Parameter(torch.randn(2, 4))

    def forward(self, x):
        return torch.relu(self.fc(x)) + self.w.sum(0)


@pytest.mark.parametrize(
    "net, shape, match",
    [
        (_ChannelShuffle(), (1, 4, 4), "split it"),
        (_Split(), (1, 5, 5), "cut through the block"),
        (_Outer(), (3,), "matrix product of labelled tensors"),
        (nn.Sequential(nn.Conv2d(1, 2, 3), nn.LayerNorm([2, 3, 3]), nn.Flatten(), nn.Linear(18, 2)),
         (1, 5, 5), "LayerNorm '1' over"),
        (_ControlFlow(), (3,), "could not trace"),
        (_RawParameter(), (3,), "outside a layer"),
        (nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, track_running_stats=False)), (1, 5, 5),
         "track_running_stats"),
        (models.OptuNet(), (1, 8, 8), "fails on an input"),
        (nn.Sequential(nn.Conv2d(1, 4, 1), nn.Conv2d(4, 4, 1, groups=2), nn.Conv2d(4, 4, 1, groups=4)),
         (1, 3, 3), "one group count"),
    ],
    ids=["shuffle", "split", "outer-product", "layernorm-map", "control-flow", "raw-param", "bn-no-stats",
         "bad-shape", "groups"],
)
def test_clear_errors(net, shape, match):
    with pytest.raises(SymmetryError, match=match):
        spec_of(net, shape)


def test_error_names_the_layer():
    net = nn.Sequential(nn.Conv2d(1, 4, 1), nn.ChannelShuffle(2), nn.Conv2d(4, 2, 1))
    with pytest.raises(SymmetryError, match="module '1' of type ChannelShuffle"):
        spec_of(net, (1, 3, 3))


def test_unknown_operations_outside_the_symmetries_are_fine():
    """Operations on the raw input or on the output carry no labels, so they need no rule."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            x = torch.cat([x[:, :2], x[:, 2:] * 2], dim=1)
            return torch.log_softmax(self.b(torch.relu(self.a(x))), dim=1)

    spec = spec_of(Net().double(), (3,))
    assert spec.perms == {"a": 4} and spec.output_bias == "b.bias"


def test_unknown_layers_on_the_input_or_output_are_fine():
    net = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2), nn.LayerNorm(2))
    spec = spec_of(net.double(), (3,))
    assert spec.perms == {"1": 4}
    theta = dict(net.state_dict())
    g = ops.random_element(spec, "both")
    assert float(check.function_error(spec, theta, ops.act(g, theta, spec))) < 1e-12
