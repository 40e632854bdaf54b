"""The Params helpers: stacks of networks and casts."""

from __future__ import annotations

import torch

from symlib import params
from symlib.symmetry import check, ops
from symlib.symmetry.trace import spec_of


def _bn_net():
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 2))


def test_cast_floats_only_and_keeps_the_input():
    theta = params.state_of(_bn_net())
    wide = params.cast(theta, torch.float64)
    assert set(wide) == set(theta)
    for k, v in wide.items():
        if theta[k].is_floating_point():
            assert v.dtype == torch.float64 and torch.equal(v, theta[k].double())
            assert theta[k].dtype == torch.float32  # the input is not modified
        else:  # BatchNorm's num_batches_tracked stays an integer
            assert v.dtype == theta[k].dtype == torch.int64
    assert params.cast(theta)["0.weight"] is theta["0.weight"]  # nothing asked, nothing copied


def test_cast_float64_makes_symmetries_exact_to_rounding():
    """A float32 model's spec evaluates a float64 cast of its weights in float64: the group action is then
    exact to 1e-12, where float32 gives about 1e-7."""
    torch.manual_seed(0)
    net = _bn_net().eval()
    spec = spec_of(net, (1, 4, 4))
    theta = params.cast(params.state_of(net), torch.float64)
    g = ops.random_element(spec, generator=torch.Generator().manual_seed(0))
    assert float(check.function_error(spec, theta, ops.act(g, theta, spec)).max()) < 1e-12


def test_stack_unstack_round_trip():
    states = [params.state_of(_bn_net()) for _ in range(3)]
    st = params.stack(states)
    assert params.n_stacked(st) == 3
    for i in range(3):
        for k, v in params.unstack(st, i).items():
            assert torch.equal(v, states[i][k])
