"""The chapter "Aligning variational posteriors": the marginalised predictive along a path
(symlib.paper.interp) and the chapter's figures (symlib.plotting.align)."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from symlib import models
from symlib.paper import interp
from symlib.plotting import align as plotting_align
from symlib.symmetry import align, ops
from symlib.symmetry.spec import mlp_spec
from symlib.symmetry.trace import spec_of

matplotlib.use("Agg")
F64 = dict(dtype=torch.float64)


def _mlp(widths, seed):
    torch.manual_seed(seed)
    net = models.MLP(widths).double()
    mean = {k: v.detach().clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 100)
    std = {k: 0.05 + 0.2 * torch.rand(v.shape, generator=g, **F64) for k, v in mean.items()}
    return net, mlp_spec(net), mean, std


def test_point_estimate_predictive_is_the_softmax_of_the_network():
    net, _, mean, _ = _mlp([5, 7, 3], 0)
    x = torch.randn(20, 5, **F64)
    p = interp.predictive(net, mean, None, x)
    assert torch.allclose(p, F.softmax(net(x), -1), rtol=0, atol=1e-14)
    # zero standard deviations give the same predictive whatever the number of samples
    zero = {k: torch.zeros_like(v) for k, v in mean.items()}
    assert torch.allclose(interp.predictive(net, mean, zero, x, n_samples=3), p, rtol=0, atol=1e-14)


def test_monte_carlo_predictive_matches_gauss_hermite_quadrature():
    r"""Two classes, one stochastic bias: p(y=1) = E[sigmoid(z + b1 - b0)], b ~ N(m, diag s^2), so the
    logit difference is N(mu, s0^2 + s1^2) and the expectation is a 1-D integral (Gauss-Hermite)."""
    net = models.MLP([1, 2]).double()
    mean = {"0.weight": torch.tensor([[1.5], [-0.5]], **F64), "0.bias": torch.tensor([0.2, -0.1], **F64)}
    std = {"0.bias": torch.tensor([0.8, 0.6], **F64)}
    x = torch.tensor([[-1.0], [0.0], [0.7]], **F64)
    s = 1000
    p = interp.predictive(net, mean, std, x, n_samples=s, seed=3)[:, 1].numpy()
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    weights = weights / np.sqrt(2 * np.pi)
    mu = (x[:, 0] * (-0.5 - 1.5) + (-0.1 - 0.2)).numpy()
    sd = np.sqrt(0.8**2 + 0.6**2)
    sig = 1 / (1 + np.exp(-(mu[:, None] + sd * nodes[None])))
    exact, second = sig @ weights, sig**2 @ weights
    se = np.sqrt((second - exact**2) / s)  # the Monte-Carlo standard error, from the same quadrature
    assert np.all(np.abs(p - exact) < 5 * se)
    assert np.all(se < 0.01)


def test_predictive_is_invariant_under_a_permutation_of_the_posterior():
    net, spec, mean, std = _mlp([4, 6, 6, 3], 1)
    x = torch.randn(30, 4, **F64)
    g = ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(2))
    noise = interp._noise(std, 5, seed=7)
    p = interp.predictive(net, mean, std, x, noise=noise)
    pm, ps = ops.permute(mean, spec, g.perms), ops.permute(std, spec, g.perms)
    pn = [ops.permute(e, spec, g.perms) for e in noise]  # the same draws, moved with their neurons
    assert torch.allclose(interp.predictive(net, pm, ps, x, noise=pn), p, rtol=0, atol=1e-12)
    # a negative control: the same noise left in place gives a different predictive
    assert not torch.allclose(interp.predictive(net, pm, ps, x, noise=noise), p, rtol=0, atol=1e-6)


def test_path_of_a_posterior_to_itself_is_flat_and_the_ends_are_the_posteriors():
    net, _, mean, std = _mlp([4, 5, 3], 3)
    x, y = torch.randn(40, 4, **F64), torch.randint(0, 3, (40,))
    flat = interp.path(net, mean, std, mean, std, x, y, ts=5, n_samples=4, seed=1)
    assert np.all(flat.nll == flat.nll[0]) and flat.barrier == 0.0 and flat.acc_drop == 0.0
    _, _, mean1, std1 = _mlp([4, 5, 3], 4)
    ends = {}
    p = interp.path(net, mean, std, mean1, std1, x, y, ts=[0.0, 0.3, 1.0], n_samples=4, seed=1, ends=ends)
    for t, (m, s) in ((0.0, (mean, std)), (1.0, (mean1, std1))):
        ref = interp.scores(interp.predictive(net, m, s, x, 4, seed=1), y)
        assert ends[t] == pytest.approx(ref, abs=1e-14)
    assert p.nll[0] == ends[0.0][0] and p.nll[-1] == ends[1.0][0]
    # the cached ends are reused, not recomputed
    ends[0.0] = (123.0, 0.5)
    again = interp.path(net, mean, std, mean1, std1, x, y, ts=[0.0, 1.0], n_samples=4, seed=1, ends=ends)
    assert again.nll[0] == 123.0


def test_path_of_point_estimates_is_the_network_at_the_interpolated_weights():
    net, _, m0, _ = _mlp([3, 4, 2], 5)
    _, _, m1, _ = _mlp([3, 4, 2], 6)
    x, y = torch.randn(25, 3, **F64), torch.randint(0, 2, (25,))
    res = interp.path(net, m0, None, m1, None, x, y, ts=3)
    mid = {k: 0.5 * m0[k] + 0.5 * m1[k] for k in m0}
    net.load_state_dict(mid)
    with torch.no_grad():
        assert res.nll[1] == pytest.approx(float(F.cross_entropy(net(x), y)), rel=1e-12)
    # the ends count too (their excess is 0), so a barrier is never negative
    assert res.barrier == pytest.approx(max(0.0, res.nll[1] - 0.5 * (res.nll[0] + res.nll[2])), abs=1e-14)


def test_barrier_on_any_grid():
    ts = np.array([0.0, 0.1, 0.5, 1.0])
    v = np.array([1.0, 1.5, 2.5, 2.0])
    assert interp._barrier(ts, v) == pytest.approx(max(v - (1 - ts) * 1.0 - ts * 2.0))
    even = np.linspace(0, 1, 5)
    w = np.array([0.3, 0.9, 1.2, 0.4, 0.5])
    assert interp._barrier(even, w) == align.barrier(w)


def test_batchnorm_statistics_are_recomputed_per_sample():
    torch.manual_seed(0)
    net = models.ResNet20(width=2).double().eval()
    x = torch.randn(16, 3, 8, 8, **F64)
    interp._reset_batchnorm(net, x, chunk=16)
    with torch.no_grad():
        z = net.conv1(x)
    assert torch.allclose(net.bn1.running_mean, z.mean((0, 2, 3)), rtol=0, atol=1e-12)
    assert torch.allclose(net.bn1.running_var, z.var((0, 2, 3), unbiased=True), rtol=1e-12, atol=1e-12)
    assert not net.training


def test_resnet20_aligned_to_a_permuted_copy_has_no_barrier():
    """The chapter's ResNet-20 path on tiny sizes: align a permuted copy back, then the path is flat."""
    torch.manual_seed(1)
    net = models.ResNet20(width=2).double()
    models.randomize_batchnorm(net, torch.Generator().manual_seed(2))
    net.eval()
    spec = spec_of(net, (3, 8, 8))
    mean = {k: v.detach().clone() for k, v in net.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    std = {k: 0.01 + 0.05 * torch.rand(v.shape, generator=gen, **F64) for k, v in mean.items()
           if k.endswith("conv1.weight") or k.endswith("conv2.weight") or k.startswith("fc.")}
    g = ops.random_element(spec, "perm", generator=torch.Generator().manual_seed(4))
    pm = ops.permute(mean, spec, g.perms)
    ps = {k: v for k, v in ops.permute({**mean, **std}, spec, g.perms).items() if k in std}
    r = align.align(mean, pm, spec, std, ps, cost="wasserstein")
    assert r.cost == pytest.approx(0.0, abs=1e-10)
    x, y = torch.randn(12, 3, 8, 8, **F64), torch.randint(0, 10, (12,))
    bn_x = torch.randn(24, 3, 8, 8, **F64)
    res = interp.path(net, mean, std, r.mean, r.std, x, y, ts=3, n_samples=2, bn_x=bn_x)
    assert np.allclose(res.nll, res.nll[0], rtol=0, atol=1e-10) and abs(res.barrier) < 1e-10


def test_clear_errors():
    net, _, mean, std = _mlp([2, 3, 2], 0)
    x, y = torch.randn(4, 2, **F64), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="from 0 to 1"):
        interp.path(net, mean, std, mean, std, x, y, ts=[0.2, 1.0])
    with pytest.raises(KeyError, match="full state dict"):
        interp.predictive(net, {k: v for k, v in mean.items() if k != "0.bias"}, std, x)


def test_figures_draw_what_they_are_given():
    ts = np.linspace(0, 1, 5)
    nll = {"none": np.random.rand(2, 5), "wasserstein": np.random.rand(2, 5)}
    fig = plotting_align.barrier_paths(ts, nll, nll)
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 2
    fig = plotting_align.timings([8, 16], {"a": [0.1, 0.2], "b": [0.2, 0.5]}, {"trained": (16, 0.4)})
    assert len(fig.axes[0].lines) == 3
    vals = {"A vs B": {"raw": 0.1, "perm": 0.2}, "A vs C": {"raw": 3.0, "perm": 4.0}}
    fig = plotting_align.mmd_removals(vals, vals)
    assert len(fig.axes[0].patches) == 4
