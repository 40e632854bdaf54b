"""Symmetries of every architecture, stated as mathematics in float64 (paper §3.3-3.4, App. C, D.4).

For each model of :mod:`tests.scenarios` (MLP, OptuNet, ResNet-20, ResNet-18,
grouped convolutions, a residual MLP), with the spec traced by
:func:`symlib.symmetry.trace.spec_of` and BatchNorm in eval mode:

* f(T theta) = f(theta) for random permutations, scalings and both;
* negative controls: a wrong permutation, an untied residual, and a BatchNorm
  variance scaled without its ``eps`` all change the function;
* group laws: inverse, composition, identity;
* canonical forms: canon(T theta) = canon(theta), canon(canon theta) = canon theta;
* counts (paper D.1, D.4): closed forms and brute force on tiny networks.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scenarios import ARCHS, CANONICAL_ARCHS, make
from torch.nn import functional as F

from symlib import models
from symlib.symmetry import canonical, check, counting, keys, ops
from symlib.symmetry.spec import SymmetryError
from symlib.symmetry.trace import spec_of

TOL = 1e-10


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _max_diff(a, b):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


@pytest.fixture(scope="module", params=ARCHS)
def sc(request):
    return make(request.param)


# ------------------------------------------------------------------ invariance
@pytest.mark.parametrize("kind", ["perm", "scale", "both"])
def test_symmetry_keeps_function(sc, kind):
    g = ops.random_element(sc.spec, kind, generator=_gen(1))
    moved = ops.act(g, sc.theta, sc.spec)
    before = check.outputs(sc.spec, sc.theta, sc.x)
    assert float(check.function_error(sc.spec, sc.theta, moved, sc.x)) < TOL
    assert _max_diff(moved, sc.theta) > 1e-3  # the element really moved the weights
    assert torch.equal(check.outputs(sc.spec, sc.theta, sc.x), before)  # theta untouched


def test_batched_elements_act_per_network(sc):
    stack = {k: torch.stack([v] * 3) for k, v in sc.theta.items()}
    g = ops.random_element(sc.spec, "both", batch=(3,), generator=_gen(2))
    moved = ops.act(g, stack, sc.spec)
    for i in range(3):
        gi = ops.Element({k: p[i] for k, p in g.perms.items()}, {k: s[i] for k, s in g.scales.items()})
        one = ops.act(gi, sc.theta, sc.spec)
        assert _max_diff({k: moved[k][i] for k in one}, one) < 1e-12
    assert float(check.function_error(sc.spec, stack, moved, sc.x).max()) < TOL


def test_wrong_permutation_changes_function(sc):
    """Negative control: permuting the rows of the first layer alone (not its consumers) is no symmetry."""
    label = next(iter(sc.spec.perms))
    a = sc.spec.incoming(label, "perm")[0]
    w = sc.theta[a.param]
    swap = torch.arange(w.shape[0])
    swap[[0, 1]] = swap[[1, 0]]
    broken = {**sc.theta, a.param: w[swap]}
    assert float(check.function_error(sc.spec, sc.theta, broken, sc.x)) > 1e-4


# --------------------------------------------------------------- group laws
def test_inverse_undoes(sc):
    g = ops.random_element(sc.spec, "both", generator=_gen(3))
    back = ops.act(ops.inverse(g, sc.spec), ops.act(g, sc.theta, sc.spec), sc.spec)
    assert _max_diff(back, sc.theta) < 1e-12


def test_compose_is_sequential_action(sc):
    g1 = ops.random_element(sc.spec, "both", generator=_gen(4))
    g2 = ops.random_element(sc.spec, "both", generator=_gen(5))
    two = ops.act(g2, ops.act(g1, sc.theta, sc.spec), sc.spec)
    one = ops.act(ops.compose(g2, g1, sc.spec), sc.theta, sc.spec)
    assert _max_diff(one, two) < 1e-12
    e = ops.compose(ops.inverse(g1, sc.spec), g1, sc.spec)
    ident = ops.identity(sc.spec)
    assert all(torch.equal(e.perms[k], ident.perms[k]) for k in ident.perms)
    assert all(torch.allclose(e.scales[k], ident.scales[k], atol=1e-14) for k in ident.scales)


# ----------------------------------------------------------- canonical forms
@pytest.mark.parametrize("arch", CANONICAL_ARCHS)
@pytest.mark.parametrize("key", ["max", "first"])
def test_canonical_form_is_invariant_and_idempotent(arch, key):
    sc = make(arch, seed=1)
    g = ops.random_element(sc.spec, "both", generator=_gen(6))
    canon = canonical.canonicalize(sc.theta, sc.spec, key=key)  # checks the function internally
    assert _max_diff(canonical.canonicalize(ops.act(g, sc.theta, sc.spec), sc.spec, key=key), canon) < 1e-9
    assert _max_diff(canonical.canonicalize(canon, sc.spec, key=key), canon) < 1e-9
    for label in sc.spec.scales:  # unit-norm incoming weights everywhere (gamma for BatchNorm scales)
        norms = canonical.neuron_norms(canon, sc.spec, label)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-12)


@pytest.mark.parametrize("arch", CANONICAL_ARCHS)
def test_sort_by_outgoing_weights_is_invariant(arch):
    """The display order of the paper's Figure 1: last layer first, keyed by outgoing weights."""
    sc = make(arch, seed=3)
    g = ops.random_element(sc.spec, "perm", generator=_gen(12))
    sorted_theta = canonical.sort(sc.theta, sc.spec, by="outgoing")
    assert _max_diff(canonical.sort(ops.act(g, sc.theta, sc.spec), sc.spec, by="outgoing"), sorted_theta) == 0


def test_sort_permutations_are_valid_for_groups():
    sc = make("grouped", seed=2)
    perms = canonical.sort_perms(sc.theta, sc.spec)
    sigma = {k: ops.block_perm(perms[k], sc.spec.blocks[k][0]) for k in sc.spec.blocks}
    assert all(s is not None for s in sigma.values())
    assert torch.equal(sigma["conv1"], sigma["conv2"])


def test_residual_mlp_normalisation_is_refused():
    """A residual branch without BatchNorm makes 'unit incoming norm' circular: a clear error."""
    sc = make("residual_mlp")
    with pytest.raises(SymmetryError, match="cycle"):
        canonical.normalize(sc.theta, sc.spec)
    sorted_theta = canonical.sort(sc.theta, sc.spec)  # permutations alone are fine
    g = ops.random_element(sc.spec, "perm", generator=_gen(7))
    assert _max_diff(canonical.sort(ops.act(g, sc.theta, sc.spec), sc.spec), sorted_theta) < 1e-12


# ------------------------------------------------------- BatchNorm, residuals
@pytest.mark.parametrize("arch", ["resnet20", "resnet18"])
def test_untied_residual_changes_function(arch):
    """Negative control (paper D.4.4): permute a residual stream everywhere but in one block's branch."""
    sc = make(arch)
    stream = next(iter(sc.spec.perms))
    branch = ("layer1.1.conv2.", "layer1.1.bn2.")
    untied = dataclasses.replace(
        sc.spec, actions=tuple(a for a in sc.spec.actions if not a.param.startswith(branch))
    )
    n = sc.spec.perms[stream]
    g = ops.Element(perms={stream: torch.roll(torch.arange(n), 1)})
    assert float(check.function_error(sc.spec, sc.theta, ops.act(g, sc.theta, sc.spec), sc.x)) < TOL
    assert float(check.function_error(sc.spec, sc.theta, ops.act(g, sc.theta, untied), sc.x)) > 1e-4


def test_batchnorm_eps_makes_scaling_exact():
    """Scaling a running variance by lam^2 without eps is only approximately a symmetry."""
    sc = make("resnet20")
    naive = dataclasses.replace(
        sc.spec, actions=tuple(dataclasses.replace(a, offset=0.0) for a in sc.spec.actions)
    )
    g = ops.random_element(sc.spec, "scale", generator=_gen(8))
    exact = check.function_error(sc.spec, sc.theta, ops.act(g, sc.theta, sc.spec), sc.x)
    approx = check.function_error(sc.spec, sc.theta, ops.act(g, sc.theta, naive), sc.x)
    assert float(exact) < TOL < float(approx) < 1e-3


# ---------------------------------------------------------- grouped convolutions
def test_dense_weight_is_the_grouped_convolution():
    sc = make("grouped")
    w, b = sc.theta["conv2.weight"], sc.theta["conv2.bias"]
    h = torch.relu(F.conv2d(sc.x, sc.theta["conv1.weight"], sc.theta["conv1.bias"]))
    dense = ops.dense_weight(sc.theta, sc.spec, "conv2.weight")
    assert dense.shape == (6, 4, 3, 3)
    assert torch.allclose(F.conv2d(h, dense, b), F.conv2d(h, w, b, groups=2), atol=1e-12)
    assert ops.dense_weight(sc.theta, sc.spec, "fc.weight") is sc.theta["fc.weight"]


def test_grouped_action_is_the_dense_action():
    """On the dense weight, a valid element acts as rows permuted/scaled by the output label and
    columns by the input label: W' = P_out diag(lam_out) D diag(lam_in)^-1 P_in^T."""
    sc = make("grouped")
    g = ops.random_element(sc.spec, "both", batch=(5,), generator=_gen(9))
    stack = {k: torch.stack([v] * 5) for k, v in sc.theta.items()}
    moved = ops.dense_weight(ops.act(g, stack, sc.spec), sc.spec, "conv2.weight")
    d = ops.dense_weight(stack, sc.spec, "conv2.weight")
    d = d * g.scales["conv2"][:, :, None, None, None] / g.scales["conv1"][:, None, :, None, None]
    rows = g.perms["conv2"][:, :, None, None, None].expand(d.shape)
    d = torch.gather(d, 1, rows)
    cols = g.perms["conv1"][:, None, :, None, None].expand(d.shape)
    assert torch.allclose(torch.gather(d, 2, cols), moved, atol=1e-13)


@pytest.mark.parametrize("groups, width", [(2, 4), (4, 8), (8, 8)])
def test_grouped_sort_keys_are_those_of_the_dense_weight(groups, width):
    """The sort keys of a grouped convolution's input channels, computed from the stored weight, equal the
    maximum, sum and sum of magnitudes of the dense weight's columns (zeros of the other groups included),
    for a stack of networks; the depthwise case (groups == channels) too."""
    torch.manual_seed(groups)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3), torch.nn.ReLU(), torch.nn.Conv2d(width, 2 * width, 3, groups=groups),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(2 * width * 25, 5))
    spec = spec_of(model, (3, 9, 9))
    theta = {k: v.detach().double().expand(3, *v.shape) + torch.randn(3, *v.shape, dtype=torch.float64)
             for k, v in model.state_dict().items()}
    grouped = [a for a in spec.actions if a.groups != 1]
    assert grouped
    for a in grouped:
        dense = ops.dense_weight(theta, spec, a.param).movedim(1 + a.axis, 1).flatten(2)
        for how, ref in (("max", dense.amax(-1)), ("abs", dense.abs().sum(-1)), ("sum", dense.sum(-1))):
            got = keys._reduce(theta, spec, a, 1, how)
            torch.testing.assert_close(got, ref, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("arch", CANONICAL_ARCHS)
def test_spec_index_answers_as_a_scan(arch):
    """The per-label and per-parameter lookups of a spec (built once) return what a scan over every action
    returns, in the same order."""
    spec = make(arch).spec
    for kind in ("perm", "scale"):
        for label in (spec.perms if kind == "perm" else spec.scales):
            assert spec.of_label(label, kind) == tuple(a for a in spec.actions if getattr(a, kind) == label)
            assert spec.incoming(label, kind) == [a for a in spec.actions if getattr(a, kind) == label
                                                  and a.param in spec.weights and a.power > 0]
            assert spec.outgoing(label, kind) == [a for a in spec.actions if getattr(a, kind) == label
                                                  and a.param in spec.weights and a.power < 0]
    for param in spec.shapes:
        assert spec.on_param(param) == tuple(a for a in spec.actions if a.param == param)
    assert spec.of_label("no such label", "perm") == () and spec.on_param("no.such") == ()


def test_random_grouped_elements_are_valid():
    sc = make("grouped")
    g = ops.random_element(sc.spec, "perm", batch=(200,), generator=_gen(10))
    s1 = ops.block_perm(g.perms["conv1"], 2)
    s2 = ops.block_perm(g.perms["conv2"], 2)
    assert s1 is not None and torch.equal(s1, s2)
    assert 0 < int((s1[:, 0] == 1).sum()) < 200  # both group orders occur
    head = make("grouped_head")
    gh = ops.random_element(head.spec, "perm", batch=(50,), generator=_gen(11))
    assert head.spec.blocks == {"conv1": (2, None)}
    assert torch.equal(ops.block_perm(gh.perms["conv1"], 2), torch.arange(2).expand(50, 2))


def test_invalid_grouped_permutations_are_refused():
    sc = make("grouped")
    mixing = torch.tensor([0, 2, 1, 3])  # sends one channel of group 0 into group 1
    with pytest.raises(SymmetryError, match="mixes"):
        ops.permute(sc.theta, sc.spec, {"conv1": mixing})
    swap = torch.tensor([2, 3, 0, 1])  # moves groups, but conv2's output groups stay
    with pytest.raises(SymmetryError, match="together"):
        ops.permute(sc.theta, sc.spec, {"conv1": swap})
    ok = ops.permute(sc.theta, sc.spec, {"conv1": swap, "conv2": torch.tensor([3, 4, 5, 0, 1, 2])})
    assert float(check.function_error(sc.spec, sc.theta, ok, sc.x)) < TOL
    head = make("grouped_head")
    with pytest.raises(SymmetryError, match="output"):
        ops.permute(head.theta, head.spec, {"conv1": swap})


def test_grouped_counts_match_brute_force():
    """Count pairs (pi, rho) of input/output permutations keeping the block-diagonal pattern of the
    grouped weight, P_rho M P_pi^T = M, by enumerating S_4 x S_6; compare with counting."""
    sc = make("grouped")
    mask = ops.dense_weight({"w": torch.ones(6, 2)}, _one_param_spec(), "w") != 0
    pis = torch.tensor(list(itertools.permutations(range(4))))
    rhos = torch.tensor(list(itertools.permutations(range(6))))
    moved = mask[rhos][:, None, :, :].expand(len(rhos), len(pis), 6, 4)
    moved = torch.gather(moved, 3, pis[None, :, None, :].expand(len(rhos), len(pis), 6, 4))
    keep = (moved == mask).flatten(2).all(-1)
    rows = {r["label"]: r["permutations"] for r in counting.count(sc.spec)}
    assert int(keep.sum()) == rows["conv1"] * rows["conv2"] == 2 * 2 * 6 * 6 * 2
    valid_pi = torch.tensor([ops.block_perm(p, 2) is not None for p in pis])
    assert torch.equal(keep.any(0), valid_pi)  # exactly the block-respecting input permutations


def _one_param_spec():
    from symlib.symmetry.spec import Action, Spec

    return Spec(
        shapes={"w": (6, 2)}, perms={"i": 4}, scales={}, actions=(Action("w", 1, "i", None, -1, groups=2),),
        weights=frozenset({"w"}),
    )


# ------------------------------------------------------------------- counting
def test_mlp_counts_are_factorials():
    spec = spec_of(models.MLP([784, 512, 512, 512, 10]), (784,))
    tot = counting.totals(spec)
    assert tot["permutations"] == math.factorial(512) ** 3
    assert tot["log10_permutations"] == pytest.approx(3 * math.log10(math.factorial(512)))
    assert tot["scaling_dof"] == 3 * 512
    assert tot["parameters"] == models.num_parameters(models.MLP([784, 512, 512, 512, 10]))


def test_optunet_counts():
    """Paper D.4.2: conv1's 2 channels feed 2 groups of 1: no permutation inside groups, one group
    swap that conv2's two output groups of 5 follow; 5! * 5! orders inside them; 2 + 10 sDoF."""
    spec = spec_of(models.OptuNet(), (1, 28, 28))
    rows = {r["label"]: r for r in counting.count(spec)}
    assert rows["conv1"]["permutations"] == 2 and rows["conv2"]["permutations"] == 120**2
    tot = counting.totals(spec)
    assert tot["permutations"] == 2 * 120**2 and tot["scaling_dof"] == 12 and tot["parameters"] == 392


@pytest.mark.parametrize(
    "model, blocks, widths",
    [(models.ResNet20(), 3, (16, 32, 64)), (models.ResNet18(), 2, (64, 128, 256, 512))],
    ids=["resnet20", "resnet18"],
)
def test_resnet_counts_closed_form(model, blocks, widths):
    """Per stage of width w: one free permutation per block (inside the block) and one for the
    residual stream; sDoF 3w per block (conv1, bn1, conv2), w per shortcut conv, w for the stream's
    shared BatchNorm scale, w for the stem conv."""
    spec = spec_of(model, (3, 32, 32))
    tot = counting.totals(spec)
    lf = [math.lgamma(w + 1) / math.log(10) for w in widths]
    assert tot["log10_permutations"] == pytest.approx(sum((blocks + 1) * x for x in lf))
    shortcuts = sum(widths[1:])
    assert tot["scaling_dof"] == sum(3 * w * blocks + w for w in widths) + shortcuts + widths[0]
    assert tot["permutations"] == math.prod(math.factorial(w) ** (blocks + 1) for w in widths)
    assert tot["parameters"] == models.num_parameters(model)
    assert tot["untied_log10"] > tot["log10_permutations"]  # residual ties remove permutations
    frame = counting.table(spec)
    assert list(frame["label"])[-1] == "total" and int(frame["scaling_dof"].iloc[-1]) == tot["scaling_dof"]


class _ManualBatchNorm(torch.nn.BatchNorm2d):
    """Eval-mode BatchNorm written out, so autograd can differentiate through the running variance."""

    def forward(self, x):
        shape = (1, -1, 1, 1)
        z = (x - self.running_mean.view(shape)) / torch.sqrt(self.running_var.view(shape) + self.eps)
        return z * self.weight.view(shape) + self.bias.view(shape)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.func internals
@pytest.mark.parametrize("arch, seed, n", [("mlp", 0, 1024), ("optunet", 1, 256)])
def test_scaling_dof_is_the_dimension_of_the_function_preserving_rescalings(arch, seed, n):
    """Independent check of the sDoF count: rescale every parameter entry, theta_i -> e^{u_i} theta_i;
    the directions u that leave the outputs unchanged to first order form the null space of
    J diag(theta), J the output Jacobian on many inputs. Its dimension must equal the counted sDoF.
    Running means are set to zero and held fixed (with the BatchNorm bias they carry a translation,
    not a scaling). Needs a network without dead units (OptuNet's seed 0 has dead channels, which
    add spurious null directions: that degeneracy is real, paper Def. C.7)."""
    sc = make(arch, n=n, seed=seed)
    model = copy.deepcopy(sc.model)
    for mod in model.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.__class__ = _ManualBatchNorm
    x = 3 * sc.x
    theta = dict(sc.theta)
    for k in theta:
        if k.endswith("running_mean"):
            theta[k] = torch.zeros_like(theta[k])
    names = [k for k in theta if theta[k].is_floating_point() and not k.endswith("running_mean")]
    flat = torch.cat([theta[k].reshape(-1) for k in names])

    def f(u):
        out, i = dict(theta), 0
        for k in names:
            n = theta[k].numel()
            out[k] = theta[k] * torch.exp(u[i:i + n]).reshape(theta[k].shape)
            i += n
        return torch.func.functional_call(model, out, (x,)).reshape(-1)

    jac = torch.func.jacfwd(f)(torch.zeros_like(flat))
    sv = torch.linalg.svdvals(jac)
    null = flat.numel() - int((sv > sv[0] * 1e-9).sum())
    assert jac.shape[0] > flat.numel()
    assert null == counting.totals(sc.spec)["scaling_dof"]


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_random_grouped_networks(groups, per_in, per_out, seed):
    """Random grouped convolutions: symmetries keep the function and canonical forms are invariant."""
    torch.manual_seed(seed)
    c_in, c_out = groups * per_in, groups * per_out
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, c_in, 3), torch.nn.ReLU(), torch.nn.Conv2d(c_in, c_out, 3, groups=groups),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(c_out, 2),
    ).double()
    spec = spec_of(net, (2, 7, 7))
    theta = {k: v + 0.1 * torch.randn_like(v) for k, v in net.state_dict().items()}
    g = ops.random_element(spec, "both", generator=_gen(seed))
    moved = ops.act(g, theta, spec)
    assert float(check.function_error(spec, theta, moved)) < TOL
    assert counting.totals(spec)["permutations"] == (
        math.factorial(per_in) ** groups * math.factorial(per_out) ** groups * math.factorial(groups)
    )
    canon = canonical.canonicalize(theta, spec)
    assert _max_diff(canonical.canonicalize(moved, spec), canon) < 1e-9


def test_summary_table():
    named = {"optunet": (models.OptuNet(), (1, 28, 28)), "mlp": (models.MLP([3, 4, 2]), (3,))}
    frame = counting.summary(named)
    assert list(frame["model"]) == ["optunet", "mlp"]
    assert list(frame["scaling_dof"]) == [12, 4] and list(frame["parameters"]) == [392, 26]
    assert frame["log10_permutations"].iloc[1] == pytest.approx(math.log10(24), abs=0.05)
    assert set(counting.paper_models()) >= {"OptuNet (MNIST)", "ResNet-18 (CIFAR-100)"}


def test_counts_of_any_size_print():
    """A wide network's group has more than 4,300 digits, which Python refuses to print as an int; the
    counts stay exact integers and print in scientific form with their number of digits."""
    import math

    from symlib.models import MLP
    from symlib.symmetry.trace import spec_of

    spec = spec_of(MLP([2, 2000, 2000, 2]).double(), (2,))
    tot = counting.totals(spec)
    assert tot["permutations"] == math.factorial(2000) ** 2  # exact
    text = str(tot)  # a plain int of 11,470 digits would raise ValueError here
    exp = math.floor(math.log10(math.factorial(2000) ** 2))
    assert f"e+{exp} ({exp + 1} digits)" in text and exp + 1 > 4300
    assert repr(counting.Count(12345)) == "12345" and counting.Count(10) * 3 == 30
