"""Alignment of networks and mean-field Gaussian posteriors by permutations (symlib.symmetry.align).

The claims: aligning a posterior to a permuted copy of itself recovers the inverse permutation
exactly, on every architecture the tracer gives a spec (residual ties, BatchNorm, grouped
convolutions); the coordinate descent never increases its cost, which equals the closed-form
distance of the aligned pair; alignment keeps the function; W2 between diagonal Gaussians matches the
general Gaussian formula; the appendix's Figure A1 (stds swapped, equal means) defeats the mean-only
KL cost but not the Wasserstein (or the exact KL) cost.
"""

from __future__ import annotations

import numpy as np
import pytest
import scenarios
import scipy.linalg
import torch

from symlib import models, threads
from symlib.symmetry import align, check, ops
from symlib.symmetry.spec import SymmetryError, mlp_spec
from symlib.symmetry.trace import spec_of


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small matrices: one thread avoids oversubscription on a shared machine (restored after)."""
    with threads.single():
        yield


ARCHS = ("mlp", "optunet", "resnet20", "grouped", "grouped_head", "residual_mlp")


def _std_like(theta, seed):
    """Standard deviations in [0.05, 0.15] for every floating tensor: a mean-field posterior whose
    stds are small next to its means, as after variational training. (With stds spread over
    [0.05, 1.05] the precision-weighted KL costs stall in local optima on narrow layers.)"""
    g = torch.Generator().manual_seed(seed)
    return {k: 0.05 + 0.1 * torch.rand(v.shape, generator=g, dtype=torch.float64)
            for k, v in theta.items() if v.is_floating_point()}


def _make(arch, seed):
    """``(spec, theta)`` in float64: the shared scenarios, with the MLPs a little wider (widths 8-12)
    so that a coordinate descent from the identity reaches the global optimum of a self-alignment."""
    if arch not in ("mlp", "residual_mlp"):
        s = scenarios.make(arch, seed=seed)
        return s.spec, s.theta
    torch.manual_seed(seed)
    model = models.MLP([4, 12, 12, 3]) if arch == "mlp" else scenarios.ResidualMLP(4, 8, 10, 3)
    model = model.to(torch.float64).eval()
    return spec_of(model, (4,)), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mlp(widths, seed):
    torch.manual_seed(seed)
    model = models.MLP(widths).to(torch.float64)
    return model, mlp_spec(model), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cost", align.COSTS)
def test_recovers_the_inverse_of_a_random_permutation(arch, cost):
    spec, theta = _make(arch, seed=0)
    std = _std_like(theta, seed=1)
    g = ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(2))
    mean1 = ops.permute(theta, spec, g.perms)
    std1 = ops.permute({**theta, **std}, spec, g.perms)
    std1 = {k: std1[k] for k in std}
    r = align.align(theta, mean1, spec, std, std1, cost=cost)
    for label, p in g.perms.items():
        assert torch.equal(r.perms[label], ops.invert_perm(p)), label
    for k in theta:
        assert torch.equal(r.mean[k], theta[k]), k
    for k in std:
        assert torch.equal(r.std[k], std[k]), k
    assert r.converged
    assert abs(r.cost) < 1e-9 * max(1.0, abs(r.costs[0]))  # the aligned pair is identical: distance 0


def test_grouped_blocks_are_moved_back():
    """OptuNet with the two groups of its grouped convolution swapped: the block step undoes it."""
    s = scenarios.make("optunet", seed=0)
    for seed in range(50):
        g = ops.random_element(s.spec, "perm", generator=torch.Generator().manual_seed(seed))
        if int(ops.block_perm(g.perms["conv2"], 2)[0]) == 1:
            break
    assert int(ops.block_perm(g.perms["conv2"], 2)[0]) == 1  # a block-swapping element was drawn
    r = align.align(s.theta, ops.permute(s.theta, s.spec, g.perms), s.spec, cost="weights")
    assert any(step.startswith("blocks:") for step in r.steps)
    assert all(torch.equal(r.perms[k], ops.invert_perm(p)) for k, p in g.perms.items())


class FiveGroups(torch.nn.Module):
    """conv 2->10, ReLU, conv 10->15 with 5 groups, ReLU, pool, linear: 5! block permutations, more
    than the block step enumerates, so it takes its assignment-over-blocks path."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(2, 10, 3)
        self.conv2 = torch.nn.Conv2d(10, 15, 3, groups=5)
        self.fc = torch.nn.Linear(15, 3)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x)))).mean(dim=(2, 3))
        return self.fc(x)


def _five_groups(seed):
    torch.manual_seed(seed)
    model = FiveGroups().to(torch.float64).eval()
    return spec_of(model, (2, 8, 8)), {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("seed", range(3))
def test_five_groups_recovered_by_assignment_over_blocks(seed):
    spec, theta = _five_groups(seed)
    std = _std_like(theta, seed + 1)
    g = ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(seed + 2))
    assert not torch.equal(ops.block_perm(g.perms["conv2"], 5), torch.arange(5))
    r = align.align(theta, ops.permute(theta, spec, g.perms), spec, std, ops.permute(std, spec, g.perms))
    assert any(step.startswith("blocks:") for step in r.steps)
    assert all(torch.equal(r.perms[k], ops.invert_perm(p)) for k, p in g.perms.items())


def test_block_matrix_is_the_exact_cost_of_moving_blocks():
    """c(sigma) = const + sum_g M[g, sigma(g)] for block moves of a tie, inner arrangements held."""
    spec, mean0 = _five_groups(0)
    _, mean1 = _five_groups(1)
    std0, std1 = _std_like(mean0, 2), _std_like(mean1, 3)
    names = sorted({a.param for a in spec.actions if a.perm is not None})
    acts = align.costs.touched(spec, names)
    d = align.descent.Descent(spec, *align.costs.features("kl", mean0, std0, mean1, std1, names), acts)
    labels = spec.tie_classes()["conv1"]
    inner = ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(4)).perms
    move = align.descent._block_move
    inner = {q: inner[q][move(ops.invert_perm(ops.block_perm(inner[q], 5)), spec.perms[q] // 5)]
             for q in labels}  # block-preserving: side 1's blocks stay in place
    m = d.block_matrix(labels, 5, inner, {k: torch.arange(n) for k, n in spec.perms.items()})
    values = []
    for seed in range(4):
        sigma = torch.randperm(5, generator=torch.Generator().manual_seed(seed))
        perms = {q: inner[q][align.descent._block_move(sigma, spec.perms[q] // 5)] for q in labels}
        r = align.align(mean0, mean1, spec, std0, std1, cost="kl", init=perms, max_rounds=0)
        values.append((r.cost, float(m[torch.arange(5), sigma].sum())))
    for (c, s), (c0, s0) in zip(values[1:], values[:1] * 3, strict=True):
        assert c - c0 == pytest.approx(s - s0, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("cost", align.COSTS)
def test_descent_never_increases_and_reports_the_closed_form(cost):
    _, spec, mean0 = _mlp([6, 16, 16, 3], seed=0)
    _, _, mean1 = _mlp([6, 16, 16, 3], seed=1)
    std0, std1 = _std_like(mean0, 2), _std_like(mean1, 3)
    start = ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(4)).perms
    r = align.align(mean0, mean1, spec, std0, std1, cost=cost, init=start, seed=5)
    c = np.array(r.costs)
    assert len(c) == len(r.steps) + 1 >= 3  # several accepted steps
    assert np.all(np.diff(c) <= 1e-12 * abs(c[0]))  # monotone up to rounding
    assert r.cost < c[0]
    # The cost counts the tensors a permutation acts on (the output bias only adds a constant).
    names = sorted({a.param for a in spec.actions if a.perm is not None})
    m0, s0 = {k: mean0[k] for k in names}, {k: std0[k] for k in names}
    m1, s1 = {k: r.mean[k] for k in names}, {k: r.std[k] for k in names}
    if cost == "weights":
        ref = sum(((m0[k] - m1[k]) ** 2).sum() for k in names)
    elif cost == "wasserstein":
        ref = align.w2_diag(m0, s0, m1, s1) ** 2
    elif cost == "kl":
        ref = align.kl_diag(m1, s1, m0, s0)
    else:
        ref = sum(((m0[k] - m1[k]) ** 2 / (2 * s0[k] ** 2)).sum() for k in names)
    assert float(ref) == pytest.approx(r.cost, rel=1e-12)
    # A fixed point: restarting from the result changes nothing.
    again = align.align(mean0, mean1, spec, std0, std1, cost=cost, init=r.perms, seed=6)
    assert again.steps == [] and again.converged


@pytest.mark.parametrize("arch", ARCHS)
def test_aligned_network_computes_the_same_function(arch):
    spec, theta0 = _make(arch, seed=0)
    _, theta1 = _make(arch, seed=3)  # an independent network: alignment really permutes it
    r = align.align(theta0, theta1, spec, _std_like(theta0, 1), _std_like(theta1, 2), cost="wasserstein")
    assert r.cost < r.costs[0]
    assert check.assert_same_function(spec, theta1, r.mean, what="alignment") < 1e-9
    # Negative control: the permutations without their counterparts on the next layer break it.
    moved = [k for k, p in r.perms.items() if not torch.equal(p, torch.arange(len(p)))]
    if moved and arch != "grouped_head":
        label = moved[0]
        a = next(a for a in spec.actions if a.perm == label and a.power > 0 and a.groups == 1)
        broken = dict(theta1)
        broken[a.param] = r.mean[a.param]
        with pytest.raises(check.FunctionalMismatch):
            check.assert_same_function(spec, theta1, broken)


def test_w2_closed_form_matches_the_general_gaussian_formula():
    g = torch.Generator().manual_seed(0)
    m0 = torch.randn(7, generator=g, dtype=torch.float64)
    m1 = torch.randn(7, generator=g, dtype=torch.float64)
    s0 = 0.1 + torch.rand(7, generator=g, dtype=torch.float64)
    s1 = 0.1 + torch.rand(7, generator=g, dtype=torch.float64)
    c0, c1 = np.diag(s0.numpy() ** 2), np.diag(s1.numpy() ** 2)
    r0 = scipy.linalg.sqrtm(c0)
    cross = scipy.linalg.sqrtm(r0 @ c1 @ r0).real
    w2sq = float(np.sum((m0 - m1).numpy() ** 2) + np.trace(c0 + c1 - 2 * cross))
    assert float(align.w2_diag(m0, s0, m1, s1)) ** 2 == pytest.approx(w2sq, rel=1e-12)
    # Dicts sum over tensors.
    d = align.w2_diag({"a": m0[:3], "b": m0[3:]}, {"a": s0[:3], "b": s0[3:]},
                      {"a": m1[:3], "b": m1[3:]}, {"a": s1[:3], "b": s1[3:]})
    assert float(d) ** 2 == pytest.approx(w2sq, rel=1e-12)


def test_kl_diag_matches_the_general_gaussian_formula():
    g = torch.Generator().manual_seed(1)
    mp = torch.randn(5, generator=g, dtype=torch.float64)
    mq = torch.randn(5, generator=g, dtype=torch.float64)
    sp = 0.2 + torch.rand(5, generator=g, dtype=torch.float64)
    sq = 0.2 + torch.rand(5, generator=g, dtype=torch.float64)
    cp, cq = np.diag(sp.numpy() ** 2), np.diag(sq.numpy() ** 2)
    iq = np.linalg.inv(cq)
    dm = (mq - mp).numpy()
    ref = 0.5 * (np.trace(iq @ cp) + dm @ iq @ dm - 5 + np.log(np.linalg.det(cq) / np.linalg.det(cp)))
    assert float(align.kl_diag(mp, sp, mq, sq)) == pytest.approx(ref, rel=1e-12)


def test_interpolation_is_the_w2_geodesic():
    _, _, m0 = _mlp([3, 4, 2], 0)
    _, _, m1 = _mlp([3, 4, 2], 1)
    s0, s1 = _std_like(m0, 2), _std_like(m1, 3)
    total = align.w2_diag(m0, s0, m1, s1)
    for t in (0.0, 0.3, 0.5, 1.0):
        mt, st = align.interpolate(m0, s0, m1, s1, t)
        assert float(align.w2_diag(m0, s0, mt, st)) == pytest.approx(t * float(total), rel=1e-12, abs=1e-12)
        assert float(align.w2_diag(mt, st, m1, s1)) == pytest.approx((1 - t) * float(total), rel=1e-12)


def test_figure_a1_mean_only_kl_misses_a_swap_of_stds():
    """Two hidden neurons with equal means and swapped stds (mirror images across y = x)."""
    model = models.MLP([2, 2, 1]).to(torch.float64)
    spec = mlp_spec(model)
    mean = {"0.weight": torch.tensor([[0.5, -0.2], [0.5, -0.2]], dtype=torch.float64),
            "0.bias": torch.tensor([0.1, 0.1], dtype=torch.float64),
            "2.weight": torch.tensor([[0.7, 0.7]], dtype=torch.float64),
            "2.bias": torch.tensor([0.0], dtype=torch.float64)}
    std0 = {"0.weight": torch.tensor([[0.1, 0.1], [0.4, 0.4]], dtype=torch.float64),
            "0.bias": torch.tensor([0.1, 0.4], dtype=torch.float64),
            "2.weight": torch.tensor([[0.1, 0.4]], dtype=torch.float64),
            "2.bias": torch.tensor([0.2], dtype=torch.float64)}
    swap = {"h0": torch.tensor([1, 0])}
    std1 = ops.permute(std0, spec, swap)  # means are swap-invariant, so q1 is q0 mirrored
    both = {c: align.align(mean, mean, spec, std0, std1, cost=c) for c in align.COSTS}
    # The mean-only KL cost is blind to the stds: both permutations cost 0, it keeps the identity.
    assert torch.equal(both["kl-mean"].perms["h0"], torch.tensor([0, 1]))
    assert both["kl-mean"].costs == [0.0]
    # The Wasserstein cost (and the exact KL, whose variance-ratio term depends on P) find the swap.
    for c in ("wasserstein", "kl"):
        assert torch.equal(both[c].perms["h0"], torch.tensor([1, 0])), c
        assert both[c].cost == pytest.approx(0.0, abs=1e-12) and both[c].costs[0] > 0.1
    assert all(torch.equal(both["wasserstein"].std[k], std0[k]) for k in std0)


def test_align_many_aligns_each_sample_to_the_reference():
    _, spec, mean = _mlp([4, 6, 6, 2], 0)
    std = _std_like(mean, 1)
    gs = ops.random_element(spec, "perm", batch=(3,), generator=torch.Generator().manual_seed(2))
    stack_m = ops.permute({k: v.expand(3, *v.shape) for k, v in mean.items()}, spec, gs.perms)
    stack_s = ops.permute({k: v.expand(3, *v.shape) for k, v in std.items()}, spec, gs.perms)
    m, s = align.align_many(mean, stack_m, spec, std, stack_s, cost="wasserstein")
    for k in mean:
        assert torch.equal(m[k], mean[k].expand(3, *mean[k].shape))
        assert torch.equal(s[k], std[k].expand(3, *std[k].shape))


def test_barrier_closed_forms():
    assert align.barrier([1.0, 2.0, 3.0]) == pytest.approx(0.0)  # linear path: no barrier
    assert align.barrier([0.0, 1.5, 1.0]) == pytest.approx(1.0)  # 1.5 above the chord's 0.5


def test_clear_errors():
    _, spec, mean = _mlp([3, 4, 2], 0)
    with pytest.raises(ValueError, match="unknown cost"):
        align.align(mean, mean, spec, cost="l2")
    with pytest.raises(ValueError, match="std0"):
        align.align(mean, mean, spec, cost="kl")
    stacked = {k: v[None] for k, v in mean.items()}
    with pytest.raises(SymmetryError, match="one network at a time"):
        align.align(stacked, stacked, spec)


@pytest.mark.parametrize("side", ["mean0", "mean1", "std1"])
def test_non_finite_weights_and_empty_stacks_are_refused(side):
    """NaN weights used to reach scipy ("matrix contains invalid numeric entries"); align names the side and
    the tensor, align_many the networks of the stack, and an empty stack is refused (it failed in
    torch.stack)."""
    _, spec, mean = _mlp([3, 4, 2], 0)
    std = _std_like(mean, 1)
    sides = {"mean0": dict(mean), "mean1": dict(mean), "std0": dict(std), "std1": dict(std)}
    sides[side] = {k: v.clone() for k, v in sides[side].items()}
    sides[side]["0.weight"][1, 2] = float("nan")
    with pytest.raises(ValueError, match=rf"{side}: tensor '0.weight' holds NaN or infinite.*drop or fix"):
        align.align(sides["mean0"], sides["mean1"], spec, sides["std0"], sides["std1"], cost="wasserstein")
    stack = {k: v.expand(3, *v.shape).clone() for k, v in mean.items()}
    stack["2.bias"][2, 0] = float("inf")
    with pytest.raises(ValueError, match=r"means: tensor '2.bias' holds NaN or inf.* \(networks \[2\]\)"):
        align.align_many(mean, stack, spec)
    with pytest.raises(ValueError, match="empty stack \\(0 networks\\)"):
        align.align_many(mean, {k: v[:0] for k, v in stack.items()}, spec)


def test_spec_from_tracing_an_mlp_agrees():
    """The traced spec (not the hand-written one) drives the same alignment."""
    model, spec, mean0 = _mlp([5, 8, 8, 3], 0)
    traced = spec_of(model, (5,))
    _, _, mean1 = _mlp([5, 8, 8, 3], 1)
    a = align.align(mean0, mean1, spec, cost="weights")
    b = align.align(mean0, mean1, traced, cost="weights")
    assert a.cost == pytest.approx(b.cost, rel=1e-12)
    assert all(torch.equal(a.mean[k], b.mean[k]) for k in mean0)
