"""The min-mass problem (paper §3.6, Prop. 2): optimality, uniqueness, agreement with cvxpy."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from symlib import models
from symlib.symmetry import check, minmass, ops
from symlib.symmetry.spec import Action, Spec, SymmetryError, functional_forward, mlp_spec


@pytest.fixture(autouse=True, scope="module")
def _float64():
    """Every claim here is exact: this module runs in float64, and restores the default afterwards."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def mlp(widths, seed=0):
    torch.manual_seed(seed)
    m = models.MLP(widths).double()
    return m, mlp_spec(m), _params(m)


class ConvNet(nn.Sequential):
    """conv 2->3 3x3, ReLU, conv 3->4 3x3 (no bias), ReLU, avg-pool, flatten, linear 4->2."""

    def __init__(self, bn: bool = False):
        layers = [nn.Conv2d(2, 3, 3, bias=not bn)] + ([nn.BatchNorm2d(3)] if bn else []) + [nn.ReLU()]
        layers += [nn.Conv2d(3, 4, 3, bias=False)] + ([nn.BatchNorm2d(4)] if bn else []) + [nn.ReLU()]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)]
        super().__init__(*layers)


def conv_spec(model: nn.Sequential) -> Spec:
    """Hand-written spec of a BN-free ConvNet (a test reference, independent of tracing)."""
    names = [n for n, m in model.named_children() if isinstance(m, (nn.Conv2d, nn.Linear))]
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    actions, scales = [], {}
    for i, (a, b) in enumerate(zip(names[:-1], names[1:], strict=False)):
        lab = f"c{i}"
        scales[lab] = shapes[f"{a}.weight"][0]
        actions.append(Action(f"{a}.weight", 0, lab, lab, 1))
        if f"{a}.bias" in shapes:
            actions.append(Action(f"{a}.bias", 0, lab, lab, 1))
        actions.append(Action(f"{b}.weight", 1, lab, lab, -1))
    spec = Spec(shapes, dict(scales), scales, tuple(actions), frozenset(f"{n}.weight" for n in names))
    return spec.with_forward(functional_forward(model), (2, 7, 7))


def convnet(seed=0):
    torch.manual_seed(seed)
    m = ConvNet().double()
    return m, conv_spec(m), _params(m)


def random_orbit_point(theta, spec, seed, log_range=2.0794415416798357):  # log 8
    g = ops.random_element(spec, "scale", batch=spec.batch_shape(theta), log_range=log_range,
                           generator=torch.Generator().manual_seed(seed))
    return ops.scale(theta, spec, g.scales)


# cvxpy (clarabel at 1e-10 tolerances) gets the optimal mass to ~1e-11 but the scales, along which the
# optimum is flat to second order, only to a few 1e-6: the scales are compared at this looser tolerance.
SCALES_RTOL = 2e-5

NETS = {"mlp": lambda: mlp([5, 7, 6, 3]), "conv": convnet}


# ------------------------------------------------------------------------------------ optimality


@pytest.mark.parametrize("arch", list(NETS))
def test_same_function_and_lower_mass(arch):
    _, spec, theta = NETS[arch]()
    theta = random_orbit_point(theta, spec, seed=1)
    r = minmass.minmass(theta, spec)
    assert check.function_error(spec, theta, r.theta).max() < 1e-10
    assert r.mass_after <= r.mass_before
    assert r.mass_after < 0.99 * r.mass_before  # a random orbit point is far from the optimum
    assert torch.allclose(minmass.mass(r.theta, spec), r.mass_after, rtol=1e-12)
    assert bool(r.converged)


@pytest.mark.parametrize("arch", list(NETS))
def test_no_rescaling_of_the_optimum_is_lighter(arch):
    _, spec, theta = NETS[arch]()
    r = minmass.minmass(theta, spec)
    for log_range in (1e-3, 0.1, 2.0):
        g = ops.random_element(spec, "scale", batch=(200,), log_range=log_range,
                               generator=torch.Generator().manual_seed(3))
        stacked = {k: v.expand(200, *v.shape) for k, v in r.theta.items()}
        m = minmass.mass(ops.scale(stacked, spec, g.scales), spec)
        assert bool((m >= r.mass_after * (1 - 1e-12)).all())


@pytest.mark.parametrize("arch", list(NETS))
def test_neurons_are_balanced_at_the_optimum(arch):
    """Stationarity: every hidden neuron's incoming mass equals its outgoing mass."""
    _, spec, theta = NETS[arch]()
    r = minmass.minmass(theta, spec, tol=1e-12)
    prob = minmass.problem(r.theta, spec)
    zero = {k: torch.zeros(1, n) for k, n in prob.labels.items()}
    inc, out = minmass._in_out(prob, zero)
    for k in prob.labels:
        assert torch.allclose(inc[k], out[k], rtol=1e-10)


@pytest.mark.parametrize("arch", list(NETS))
def test_unique_optimum_from_any_orbit_point(arch):
    """Prop. 2: the minimiser is unique, so every member of the orbit reaches the same network."""
    _, spec, theta = NETS[arch]()
    ref = minmass.minmass(theta, spec).theta
    for seed in range(4):
        other = minmass.minmass(random_orbit_point(theta, spec, seed, log_range=math.log(100.0)), spec).theta
        for k in spec.weights:
            assert torch.allclose(other[k], ref[k], rtol=1e-8, atol=1e-12), k


@settings(max_examples=15, deadline=None)
@given(
    widths=st.lists(st.integers(1, 6), min_size=3, max_size=5),
    seed=st.integers(0, 2**16),
    log_range=st.floats(0.0, 4.0),
)
def test_random_mlps(widths, seed, log_range):
    _, spec, theta = mlp(widths, seed)
    theta = random_orbit_point(theta, spec, seed, log_range=log_range)
    r = minmass.minmass(theta, spec)  # checks the function itself
    assert bool(r.converged) and r.mass_after <= r.mass_before * (1 + 1e-12)
    # the scaled network is a fixed point: min-mass of the optimum does nothing
    again = minmass.minmass(r.theta, spec)
    for k, s in again.scales.items():
        assert torch.allclose(s, torch.ones_like(s), atol=1e-7), k


def test_batched_equals_one_by_one():
    _, spec, theta = mlp([4, 6, 5, 3])
    stack = {k: torch.stack([random_orbit_point(theta, spec, s)[k] * (1 + 0.3 * s) for s in range(6)])
             for k in theta}
    stack = {k: v.reshape(2, 3, *v.shape[1:]) for k, v in stack.items()}
    r = minmass.minmass(stack, spec)
    assert r.mass_after.shape == (2, 3) and r.scales["h0"].shape == (2, 3, 6)
    for i in range(2):
        for j in range(3):
            one = minmass.minmass({k: v[i, j] for k, v in stack.items()}, spec)
            assert torch.allclose(one.mass_after, r.mass_after[i, j], rtol=1e-12)
            for k in one.scales:
                assert torch.allclose(one.scales[k], r.scales[k][i, j], rtol=1e-8)


def test_inputs_are_not_mutated():
    _, spec, theta = mlp([3, 4, 2])
    before = {k: v.clone() for k, v in theta.items()}
    minmass.minmass(theta, spec)
    assert all(torch.equal(before[k], theta[k]) for k in theta)


def test_float32_input_keeps_dtype_and_function():
    _, spec, theta = mlp([6, 8, 8, 3])
    t32 = {k: v.float() for k, v in random_orbit_point(theta, spec, 0).items()}
    r = minmass.minmass(t32, spec)
    assert all(v.dtype == torch.float32 for v in r.theta.values())
    assert r.mass_after <= r.mass_before


# ------------------------------------------------------------------------------------- cvxpy


@pytest.mark.parametrize("arch", list(NETS))
@pytest.mark.parametrize("mode", ["gp", "lse"])
def test_agrees_with_cvxpy(arch, mode):
    _, spec, theta = NETS[arch]()
    theta = random_orbit_point(theta, spec, seed=2)
    r = minmass.minmass(theta, spec, tol=1e-12)
    scales, value = minmass.reference(theta, spec, mode=mode)
    assert abs(value / float(r.mass_after) - 1) < 1e-6
    for k in scales:
        assert torch.allclose(scales[k], r.scales[k], rtol=SCALES_RTOL), k


def test_negative_control_cvxpy_sees_a_different_network():
    _, spec, theta = mlp([5, 7, 6, 3])
    r = minmass.minmass(theta, spec)
    other = {**theta, "0.weight": theta["0.weight"] * 1.5}
    _, value = minmass.reference(other, spec)
    assert abs(value / float(r.mass_after) - 1) > 1e-3


# ---------------------------------------------------------------------------------- degeneracy


def test_dead_neurons_are_fixed_and_reported():
    _, spec, theta = mlp([5, 6, 6, 3])
    theta = random_orbit_point(theta, spec, 0)
    theta["0.weight"][2] = 0.0  # neuron h0[2]: no incoming weights (dead ReLU unit)
    theta["4.weight"][:, 4] = 0.0  # neuron h1[4]: no outgoing weights
    r = minmass.minmass(theta, spec)
    assert r.degenerate["h0"].tolist() == [False, False, True, False, False, False]
    assert r.degenerate["h1"].tolist() == [False, False, False, False, True, False]
    assert r.scales["h0"][2] == 1.0 and r.scales["h1"][4] == 1.0
    assert all(bool(torch.isfinite(s).all()) for s in r.scales.values())
    assert bool(r.converged) and r.mass_after <= r.mass_before
    scales, value = minmass.reference(theta, spec)  # same restricted problem
    assert abs(value / float(r.mass_after) - 1) < 1e-6


def test_neuron_fed_only_by_a_dead_neuron_is_degenerate():
    """Non-zero incoming and outgoing weights, yet no path from the input: Def. C.7 degeneracy."""
    _, spec, theta = mlp([4, 5, 5, 2])
    theta["0.weight"][1] = 0.0
    theta["2.weight"][3] = 0.0
    theta["2.weight"][3, 1] = 0.7  # h1[3] listens only to the dead h0[1]
    r = minmass.minmass(theta, spec)
    assert r.degenerate["h0"][1] and r.degenerate["h1"][3]
    assert r.n_degenerate == 2
    assert all(bool(torch.isfinite(s).all()) for s in r.scales.values())


def test_all_dead_network():
    _, spec, theta = mlp([3, 4, 2])
    theta = {k: torch.zeros_like(v) for k, v in theta.items()}
    r = minmass.minmass(theta, spec)
    assert r.n_degenerate == 4 and float(r.mass_after) == 0.0
    assert torch.equal(r.scales["h0"], torch.ones(4))


# ------------------------------------------------------------------------------------- errors


def test_refuses_tanh():
    torch.manual_seed(0)
    m = models.MLP([3, 4, 2], activation="tanh").double()
    with pytest.raises(SymmetryError, match="positively homogeneous"):
        minmass.minmass(_params(m), mlp_spec(m))


def test_refuses_nan():
    _, spec, theta = mlp([3, 4, 2])
    theta["0.weight"][0, 0] = float("nan")
    with pytest.raises(SymmetryError, match="NaN"):
        minmass.minmass(theta, spec)


def test_refuses_label_without_outgoing_weights():
    """A conv whose scale BatchNorm absorbs: the mass shrinks forever along it."""
    _, spec, theta = mlp([3, 4, 2])
    acts = tuple(a for a in spec.actions if not (a.param == "2.weight"))
    bad = Spec(spec.shapes, spec.perms, spec.scales, acts, spec.weights)
    with pytest.raises(SymmetryError, match="fold_batchnorm"):
        minmass.minmass(theta, bad)


# ------------------------------------------------------------------------------------- BatchNorm


def _bn_model(seed=0):
    torch.manual_seed(seed)
    m = ConvNet(bn=True).double()
    for mod in m.modules():  # non-trivial running statistics and affine parameters
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.uniform_(-1, 1)
    return m.eval()


def test_fold_batchnorm_keeps_the_function():
    m = _bn_model()
    theta = _params(m)
    f = minmass.fold_batchnorm(theta, m, input_shape=(2, 7, 7))
    assert f.pairs == (("0", "1"), ("3", "4"))
    assert f.error < 1e-12
    assert not any(k.startswith(("1.", "4.")) for k in f.theta)
    x = torch.randn(5, 2, 7, 7)
    assert torch.allclose(torch.func.functional_call(f.model, f.theta, (x,)), m(x), rtol=1e-12, atol=1e-12)
    # the folded network is an ordinary conv net: min-mass applies
    spec = conv_spec(f.model)
    r = minmass.minmass(f.theta, spec)
    assert r.mass_after <= r.mass_before and bool(r.converged)


def test_fold_batchnorm_batched():
    m = _bn_model()
    thetas = [_params(_bn_model(s)) for s in range(3)]
    stack = {k: torch.stack([t[k] for t in thetas]) for k in thetas[0]}
    f = minmass.fold_batchnorm(stack, m, input_shape=(2, 7, 7))
    for i in range(3):
        one = minmass.fold_batchnorm(thetas[i], m, check=False)
        for k in one.theta:
            if one.theta[k].is_floating_point():
                assert torch.allclose(f.theta[k][i], one.theta[k], rtol=1e-12)


def test_batchnorm_scale_direction_has_no_minimiser():
    """Why we fold: with BN after a conv, shrinking the conv's output scale keeps the function and the
    mass decreases without bound (exactly so with BN's epsilon at 0)."""
    m = _bn_model()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.eps = 0.0
    theta = _params(m)
    x = torch.randn(4, 2, 7, 7)
    y = torch.func.functional_call(m, theta, (x,))
    for c in (1e-1, 1e-4):
        shrunk = {**theta, "0.weight": theta["0.weight"] * c, "1.running_mean": theta["1.running_mean"] * c,
                  "1.running_var": theta["1.running_var"] * c**2}
        y2 = torch.func.functional_call(m, shrunk, (x,))
        assert torch.allclose(y, y2, rtol=1e-10, atol=1e-12)
        assert shrunk["0.weight"].square().sum() < theta["0.weight"].square().sum() * c


# ------------------------------------------------------------------------ traced architectures


def _randomise_bn(model):
    g = torch.Generator().manual_seed(5)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(torch.rand(mod.num_features, generator=g) * 2 - 1)
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) * 1.5 + 0.5)
            mod.weight.data.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
            mod.bias.data.copy_(torch.rand(mod.num_features, generator=g) * 2 - 1)
    return model.eval()


def test_optunet_grouped_conv_agrees_with_cvxpy():
    from symlib.symmetry import trace

    torch.manual_seed(0)
    net = models.OptuNet().double()
    spec = trace.spec_of(net, (1, 28, 28))
    theta = random_orbit_point(_params(net), spec, 4)
    r = minmass.minmass(theta, spec, tol=1e-12)  # checks the function
    # the grouped conv's mass counts only its stored (block-diagonal) weights
    assert torch.allclose(r.mass_before, sum(theta[k].square().sum() for k in spec.weights), rtol=1e-12)
    scales, value = minmass.reference(theta, spec, mode="gp")
    assert abs(value / float(r.mass_after) - 1) < 1e-6
    for k in scales:
        assert torch.allclose(scales[k], r.scales[k], rtol=SCALES_RTOL)


def test_resnet_with_batchnorm_folded():
    """ResNet-20 (residual ties, 1x1 shortcuts, BatchNorm): refused as is, solved once folded."""
    from symlib.symmetry import trace

    torch.manual_seed(0)
    net = _randomise_bn(models.ResNet20(width=4).double())
    theta = _params(net)
    with pytest.raises(SymmetryError, match="fold_batchnorm"):
        minmass.minmass(theta, trace.spec_of(net, (3, 8, 8)))
    folded = minmass.fold_batchnorm(theta, net, input_shape=(3, 8, 8))
    assert folded.error < 1e-10 and len(folded.pairs) == sum(
        isinstance(m, nn.BatchNorm2d) for m in net.modules())
    spec = trace.spec_of(folded.model, (3, 8, 8))
    start = random_orbit_point(folded.theta, spec, 0)
    r = minmass.minmass(start, spec, tol=1e-12)  # checks the function
    assert bool(r.converged) and r.mass_after < r.mass_before
    other = minmass.minmass(random_orbit_point(folded.theta, spec, 1), spec).theta
    for k in spec.weights:
        assert torch.allclose(other[k], r.theta[k], rtol=1e-7, atol=1e-12)
    _, value = minmass.reference(start, spec, mode="lse")
    assert abs(value / float(r.mass_after) - 1) < 1e-6


@pytest.mark.parametrize("arch", ["conv", "mlp"])
def test_sweeps_only_path_reaches_the_same_optimum(arch):
    """Networks too large for a dense Newton step use sweeps with coarse corrections and Anderson
    acceleration (or, asked to, plain sweeps): the same optimum as Newton's, and the acceleration takes
    fewer iterations than plain sweeps."""
    _, spec, theta = NETS[arch]()
    theta = random_orbit_point(theta, spec, 7)
    newton = minmass.minmass(theta, spec, tol=1e-11)
    fast = minmass.minmass(theta, spec, tol=1e-11, max_dense=0)
    plain = minmass.minmass(theta, spec, tol=1e-11, max_dense=0, coarse=False, anderson=0)
    assert fast.iterations < plain.iterations
    for r in (fast, plain):
        assert torch.allclose(r.mass_after, newton.mass_after, rtol=1e-12)
        for k in spec.scales:
            assert torch.allclose(r.scales[k], newton.scales[k], rtol=1e-8)


def test_accelerated_sweeps_on_a_deep_residual_network():
    """Plain sweeps converge slowly on deep residual networks (torchvision's ResNet-50: 1,415 sweeps); the
    coarse corrections and Anderson acceleration reach the same optimum (Newton's, cvxpy's) in a
    fraction of the iterations. ResNet-20, BatchNorm folded, at a random point of its scaling orbit."""
    torch.manual_seed(0)
    net = models.ResNet20(num_classes=10, width=4).double().eval()
    models.randomize_batchnorm(net, torch.Generator().manual_seed(0))
    folded = minmass.fold_batchnorm(_params(net), net, input_shape=(3, 8, 8))
    spec, theta = folded.spec, random_orbit_point(folded.theta, folded.spec, 9, log_range=math.log(4.0))
    newton = minmass.minmass(theta, spec, tol=1e-11)
    fast = minmass.minmass(theta, spec, tol=1e-11, max_dense=0)
    plain = minmass.minmass(theta, spec, tol=1e-11, max_dense=0, coarse=False, anderson=0)
    assert 5 * fast.iterations < plain.iterations
    _, ref = minmass.reference(theta, spec, mode="lse")
    for r in (fast, plain):
        assert torch.allclose(r.mass_after, newton.mass_after, rtol=1e-12)
        assert float(r.mass_after) == pytest.approx(ref, rel=1e-8)
        assert check.function_error(spec, theta, r.theta).max() < 1e-10


def test_accelerated_sweeps_on_a_batch_with_dead_neurons():
    """Batched networks, some with dead neurons: the accelerated path agrees with Newton per network."""
    _, spec, theta = mlp([5, 7, 6, 3], seed=4)
    stack = {k: torch.stack([v] * 3) for k, v in theta.items()}
    stack = random_orbit_point(stack, spec, 8)
    stack["2.weight"][1, :, 2] = 0.0  # network 1: neuron 2 of the first hidden layer has no outgoing weight
    newton = minmass.minmass(stack, spec, tol=1e-11)
    fast = minmass.minmass(stack, spec, tol=1e-11, max_dense=0)
    assert bool(fast.degenerate["h0"][1, 2]) and int(fast.degenerate["h0"].sum()) >= 1
    assert torch.allclose(fast.mass_after, newton.mass_after, rtol=1e-12)
    for k in spec.scales:
        assert torch.allclose(fast.scales[k], newton.scales[k], rtol=1e-8)


def test_not_converged_is_an_error_unless_asked():
    _, spec, theta = mlp([4, 6, 5, 3])
    theta = random_orbit_point(theta, spec, 0)
    with pytest.raises(RuntimeError, match="did not converge"):
        minmass.minmass(theta, spec, sweeps=1, max_newton=0)
    r = minmass.minmass(theta, spec, sweeps=1, max_newton=0, strict=False)
    assert not bool(r.converged) and r.mass_after < r.mass_before  # one sweep already helps


@pytest.mark.parametrize(
    "device,dtype", [("meta", torch.float64), ("cpu", torch.float32), ("meta", torch.float32)]
)
def test_fold_batchnorm_keeps_device_and_dtype(device, dtype):
    """Folding keeps the device and dtype of what it is given: every folded parameter and every tensor of
    the new model (the biases it creates included) lives on ``device`` in ``dtype`` ("meta" stands in for
    an accelerator: a CPU default anywhere would show)."""
    m = _bn_model().to(device=device, dtype=dtype)
    theta = {k: v.detach() for k, v in m.state_dict().items()}
    f = minmass.fold_batchnorm(theta, m, check=False)
    assert f.pairs == (("0", "1"), ("3", "4"))
    for k, v in f.theta.items():
        assert v.device.type == device, k
        if v.is_floating_point():
            assert v.dtype == dtype, k
    for k, v in [*f.model.named_parameters(), *f.model.named_buffers()]:
        assert v.device.type == device, k
        if v.is_floating_point():
            assert v.dtype == dtype, k
    assert "0.bias" in dict(f.model.named_parameters())  # created by the folding, on the right device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_minmass_end_to_end_on_cuda_resnet18():
    """A CUDA ResNet-18 folds into a CUDA network, traces on CUDA, and min-mass runs there, matching the
    CPU result."""
    from symlib.symmetry import trace

    torch.manual_seed(0)
    net = _randomise_bn(models.ResNet18(num_classes=5, width=2)).eval()
    cpu_theta = _params(net)
    gpu_net = net.cuda()
    theta = {k: v.cuda() for k, v in cpu_theta.items()}
    folded = minmass.fold_batchnorm(theta, gpu_net, input_shape=(3, 16, 16))
    assert all(v.is_cuda for v in folded.theta.values())
    assert all(p.is_cuda for p in folded.model.parameters())
    spec = trace.spec_of(folded.model, (3, 16, 16), device="cuda")
    r = minmass.minmass(folded.theta, spec)
    assert bool(r.converged) and r.mass_after < r.mass_before
    assert all(v.is_cuda for v in r.theta.values())
    cpu_spec = trace.spec_of(folded.model.cpu(), (3, 16, 16))
    ref = minmass.minmass({k: v.cpu() for k, v in folded.theta.items()}, cpu_spec)
    torch.testing.assert_close(r.mass_after.cpu(), ref.mass_after, rtol=1e-6, atol=0)


def test_fold_batchnorm_returns_the_folded_spec():
    """With input_shape, fold_batchnorm also traces the folded model: min-mass is then one call on it, and
    the refusal of an unfolded network names that path."""
    import symlib
    from symlib.symmetry import trace

    torch.manual_seed(1)
    net = _randomise_bn(models.ResNet20(width=4).double())
    theta = _params(net)
    with pytest.raises(SymmetryError, match=r"symlib\.minmass\(folded\.theta, folded\.spec\)"):
        symlib.minmass(theta, trace.spec_of(net, (3, 8, 8)))
    folded = symlib.fold_batchnorm(theta, net, (3, 8, 8))
    assert folded.spec == trace.spec_of(folded.model, (3, 8, 8))
    r = symlib.minmass(folded.theta, folded.spec)
    assert bool(r.converged) and r.mass_after < r.mass_before
    assert check.function_error(folded.spec, folded.theta, r.theta).max() < 1e-10
    assert minmass.fold_batchnorm(theta, net, check=False).spec is None  # no input shape, no spec
