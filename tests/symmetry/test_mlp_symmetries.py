"""The symmetry group of ReLU MLPs, stated as mathematics (float64, random widths and elements)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from symlib import models
from symlib.symmetry import canonical, check, ops, spec
from symlib.symmetry.spec import SymmetryError

F64 = torch.float64  # every claim here is exact: float64 throughout, passed explicitly

widths_st = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(lambda h: [3, *h, 2])
seed_st = st.integers(0, 2**31 - 1)
BATCH = (2, 3)


def make(widths, seed, batch=()):
    """A random MLP spec and parameters (optionally a stack of ``batch`` networks)."""
    torch.manual_seed(seed)
    net = models.MLP(widths).double()
    sp = spec.mlp_spec(net)
    gen = torch.Generator().manual_seed(seed)
    theta = {k: torch.randn(*batch, *v.shape, generator=gen, dtype=F64) for k, v in net.state_dict().items()}
    return sp, theta, gen


def assert_params_close(a, b, tol=1e-10):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol)


@settings(max_examples=25, deadline=None)
@given(widths_st, seed_st, st.sampled_from(["perm", "scale", "both"]))
def test_symmetry_keeps_function(widths, seed, kind):
    sp, theta, gen = make(widths, seed, BATCH)
    g = ops.random_element(sp, kind, batch=BATCH, generator=gen)
    assert float(check.function_error(sp, theta, ops.act(g, theta, sp)).max()) < 1e-12


@settings(max_examples=25, deadline=None)
@given(widths_st, seed_st)
def test_inverse_and_compose(widths, seed):
    sp, theta, gen = make(widths, seed, BATCH)
    g = ops.random_element(sp, batch=BATCH, generator=gen)
    h = ops.random_element(sp, batch=BATCH, generator=gen)
    assert_params_close(ops.act(ops.inverse(g, sp), ops.act(g, theta, sp), sp), theta)
    assert_params_close(ops.act(ops.compose(h, g, sp), theta, sp), ops.act(h, ops.act(g, theta, sp), sp))
    # the inverse is a two-sided inverse: g o g^-1 is the identity element
    e = ops.compose(g, ops.inverse(g, sp), sp)
    for k, p in e.perms.items():
        assert torch.equal(p, torch.arange(sp.perms[k]).expand_as(p))
    for s in e.scales.values():
        torch.testing.assert_close(s, torch.ones_like(s))


@settings(max_examples=25, deadline=None)
@given(widths_st, seed_st, st.sampled_from(["first", "max"]), st.sampled_from([2.0, 3.0]))
def test_canonical_form_is_invariant_and_idempotent(widths, seed, key, p):
    sp, theta, gen = make(widths, seed, BATCH)
    g = ops.random_element(sp, batch=BATCH, generator=gen)
    c = canonical.canonicalize(theta, sp, p=p, key=key)
    assert_params_close(canonical.canonicalize(ops.act(g, theta, sp), sp, p=p, key=key), c, 1e-9)
    assert_params_close(canonical.canonicalize(c, sp, p=p, key=key), c, 1e-9)


@settings(max_examples=15, deadline=None)
@given(widths_st, seed_st)
def test_normalize_gives_unit_norms_and_is_scale_invariant(widths, seed):
    sp, theta, gen = make(widths, seed)
    out = canonical.normalize(theta, sp, p=2)
    for label in sp.scales:
        ones = torch.ones(sp.scales[label], dtype=F64)
        torch.testing.assert_close(canonical.neuron_norms(out, sp, label), ones)
    g = ops.random_element(sp, "scale", generator=gen)
    assert_params_close(canonical.normalize(ops.act(g, theta, sp), sp), out, 1e-9)


def test_sort_orders_keys_and_outgoing_order():
    sp, theta, _ = make([3, 5, 4, 2], 0)
    out = canonical.sort(theta, sp, key="first")
    assert bool((out["0.weight"][:, 0].diff() >= 0).all())
    assert bool((out["2.weight"][:, 0].diff() >= 0).all())
    out = canonical.sort(theta, sp, key="max", by="outgoing")
    assert bool((out["4.weight"].amax(0).diff() >= 0).all())


def test_wrong_permutation_changes_the_function():
    """Negative control: permuting rows of one layer without the next layer's columns breaks f."""
    sp, theta, _ = make([3, 5, 4, 2], 1)
    bad = dict(theta)
    bad["0.weight"] = theta["0.weight"][[1, 0, 2, 3, 4]]
    bad["0.bias"] = theta["0.bias"][[1, 0, 2, 3, 4]]
    assert float(check.function_error(sp, theta, bad)) > 1e-3
    with pytest.raises(check.FunctionalMismatch, match="changed the network's function"):
        check.assert_same_function(sp, theta, bad)


def test_softmax_shift_keeps_probabilities_and_is_removed():
    sp, theta, _ = make([3, 4, 5], 2)
    x = check.random_inputs(sp)
    shifted = ops.shift_logits(theta, sp, 3.7)
    f = sp.forward
    torch.testing.assert_close(f(shifted, x).softmax(-1), f(theta, x).softmax(-1))
    assert not torch.allclose(f(shifted, x), f(theta, x))
    assert_params_close(canonical.fix_softmax_shift(shifted, sp), canonical.fix_softmax_shift(theta, sp))
    total = canonical.fix_softmax_shift(theta, sp)["2.bias"].sum()
    torch.testing.assert_close(total, torch.tensor(1.0, dtype=F64))


def test_non_relu_networks_refuse_scaling_but_permute():
    net = models.MLP([3, 4, 2], activation="tanh").double()
    sp = spec.mlp_spec(net)
    theta = dict(net.state_dict())
    with pytest.raises(SymmetryError, match="Tanh, which is not positively homogeneous"):
        canonical.normalize(theta, sp)
    with pytest.raises(SymmetryError, match="positively homogeneous"):
        ops.random_element(sp, "scale")
    g = ops.random_element(sp, "perm", generator=torch.Generator().manual_seed(0))
    assert float(check.function_error(sp, theta, ops.act(g, theta, sp))) < 1e-12
    canonical.canonicalize(theta, sp, scaling=None)


def test_bad_inputs_get_clear_errors():
    sp, theta, _ = make([3, 4, 2], 3)
    nan = {**theta, "0.weight": theta["0.weight"].clone()}
    nan["0.weight"][0, 0] = float("nan")
    with pytest.raises(SymmetryError, match="NaN or infinite"):
        canonical.canonicalize(nan, sp)
    other = make([3, 5, 2], 3)[1]
    with pytest.raises(SymmetryError, match="another architecture"):
        canonical.canonicalize(other, sp)
    with pytest.raises(SymmetryError, match="missing"):
        canonical.sort({"0.weight": theta["0.weight"]}, sp)
    dead = {**theta, "0.weight": theta["0.weight"].clone()}
    dead["0.weight"][1] = 0.0
    with pytest.raises(SymmetryError, match="dead"):
        canonical.normalize(dead, sp)
    with pytest.raises(SymmetryError, match="non-positive"):
        ops.scale(theta, sp, {"h0": -torch.ones(4, dtype=F64)})
    with pytest.raises(SymmetryError, match="nn.Sequential"):
        spec.mlp_spec(models.OptuNet())
    with pytest.raises(ValueError, match="widths"):
        models.MLP([3])


def test_inputs_are_never_mutated():
    sp, theta, gen = make([3, 4, 2], 4)
    before = {k: v.clone() for k, v in theta.items()}
    g = ops.random_element(sp, generator=gen)
    ops.act(g, theta, sp)
    canonical.canonicalize(theta, sp)
    assert_params_close(theta, before, 0)


@pytest.mark.parametrize("arch", ["mlp", "optunet"])
def test_minmass_canonical_form_is_invariant(arch):
    """canon(T theta) = canon(theta) with min-mass as the scaling removal (unique optimum, Prop. 2)."""
    from symlib.symmetry import trace

    gen = torch.Generator().manual_seed(11)
    if arch == "mlp":
        sp, theta, _ = make([4, 6, 5, 3], 11, (3,))
    else:
        net = models.OptuNet().double()
        sp = trace.spec_of(net, (1, 28, 28))
        theta = {k: torch.randn(3, *v.shape, generator=gen, dtype=F64) for k, v in net.state_dict().items()}
    g = ops.random_element(sp, batch=(3,), generator=gen)
    c = canonical.canonicalize(theta, sp, scaling="minmass")
    assert_params_close(canonical.canonicalize(ops.act(g, theta, sp), sp, scaling="minmass"), c, 1e-7)
    assert_params_close(canonical.canonicalize(c, sp, scaling="minmass"), c, 1e-7)
