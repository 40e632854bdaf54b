"""The mass matrix that follows the scaling orbits (symlib.posteriors.hmc.gauge): the gauge is equivariant,
its energy's gradient exact, the GGN moves with the orbit as the metric assumes, and HMC given the gauge,
with the gauge redrawn before every trajectory, samples a known law exactly."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from torch import nn

from symlib import models
from symlib import training as _train
from symlib.params import flatten, unflatten
from symlib.posteriors.hmc import run_chains, with_prior
from symlib.posteriors.hmc.gauge import OrbitGauge, incoming_sets
from symlib.posteriors.hmc.orbits import ScalingMoves
from symlib.symmetry.spec import SymmetryError
from symlib.symmetry.trace import spec_of

LAM = 2.0


def _optunet_moves():
    spec = spec_of(models.OptuNet().double(), (1, 28, 28))
    return ScalingMoves(spec, dict(_train.OPTUNET_SHAPES), LAM)


def _orbit_point(powers, theta, t):
    return theta * torch.exp(t @ powers)


def test_gauge_is_equivariant_on_optunet():
    """s_hat(g_t theta) = s_hat(theta) + t for random networks and random orbit moves t, up to factors of
    e^3 either way."""
    mv = _optunet_moves()
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, mv.powers.shape[1], generator=gen, dtype=torch.float64)
    d = theta.shape[1]
    gauge = OrbitGauge(mv.powers, theta, torch.zeros(5, d, d, dtype=torch.float64), LAM)
    t = 3 * (2 * torch.rand(5, mv.powers.shape[0], generator=gen, dtype=torch.float64) - 1)
    moved = _orbit_point(mv.powers, theta, t)
    assert float((gauge.estimate(moved) - gauge.estimate(theta) - t).abs().max()) < 1e-12


def test_gauge_energy_gradient_and_jacobian_match_autograd():
    mv = _optunet_moves()
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(3, mv.powers.shape[1], generator=gen, dtype=torch.float64)
    d = theta.shape[1]
    gauge = OrbitGauge(mv.powers, theta, torch.zeros(3, d, d, dtype=torch.float64), LAM, sigma=0.3)
    gauge.refresh(theta, gen)
    th = (theta + 0.1 * torch.randn(theta.shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    e, g = gauge.gauge_energy(th.detach())
    e_auto = ((gauge.s - gauge.estimate(th)) ** 2).sum() / (2 * 0.3**2)
    (g_auto,) = torch.autograd.grad(e_auto, th)
    assert float((e.sum() - e_auto.detach()).abs()) < 1e-10
    assert float((g - g_auto).abs().max()) < 1e-10
    jac = torch.autograd.functional.jacobian(lambda x: gauge.estimate(x[None])[0], th.detach()[0])
    assert float((gauge.jacobian(th.detach()[:1])[0] - jac).abs().max()) < 1e-12


def test_the_ggn_moves_with_the_orbit_as_the_metric_assumes():
    """The metric carries the start's GGN along the orbit as D^-1 G D^-1: it is the GGN computed at the
    moved network (the likelihood is invariant along the orbit)."""
    from symlib.posteriors.laplace import curvature

    mv = _optunet_moves()
    torch.manual_seed(2)
    base = _train.init_params(models.OptuNet, [0])
    base = {k: v.double() for k, v in base.items()}
    x = torch.randn(24, 1, 28, 28, dtype=torch.float64)
    y = torch.randint(0, 10, (24,))
    theta = flatten(base)
    g0, _ = curvature.full_curvature(models.OptuNet, base, x, y, arch="optunet")
    conv1, conv2 = [0.7, -0.4], [0.3, -0.2, 0.5, 0.0, -0.6, 0.4, 0.1, -0.3, 0.2, 0.6]
    t = torch.tensor([conv1 + conv2], dtype=torch.float64)
    moved = unflatten(_orbit_point(mv.powers, theta, t), dict(_train.OPTUNET_SHAPES))
    g1, _ = curvature.full_curvature(models.OptuNet, moved, x, y, arch="optunet")
    gauge = OrbitGauge(mv.powers, theta, g0, LAM, sigma=1e6)  # a negligible gauge term
    gauge.s = gauge.s0 + t
    predicted = gauge.precision() - LAM * torch.eye(theta.shape[1], dtype=torch.float64)
    assert float((predicted - g1).abs().max()) < 1e-9 * float(g1.abs().max())


def test_incoming_sets_refuse_mixed_scalings():
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)).double()
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    mv = ScalingMoves(spec_of(net, (3,)), shapes, LAM)
    with pytest.raises(SymmetryError, match="different scalings"):
        incoming_sets(mv.powers)
    theta = torch.zeros(1, mv.powers.shape[1], dtype=torch.float64)
    one_layer = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    shapes1 = {k: tuple(v.shape) for k, v in one_layer.state_dict().items()}
    mv1 = ScalingMoves(spec_of(one_layer, (3,)), shapes1, LAM)
    d = mv1.powers.shape[1]
    with pytest.raises(FloatingPointError, match="all zero"):
        OrbitGauge(mv1.powers, theta[:, :d], torch.zeros(1, d, d, dtype=torch.float64), LAM)
    with pytest.raises(ValueError, match="sigma"):
        zero = torch.zeros(1, d, d, dtype=torch.float64)
        OrbitGauge(mv1.powers, torch.ones(1, d, dtype=torch.float64), zero, LAM, sigma=0.0)


def test_gauged_hmc_samples_the_prior_exactly():
    """With no data the posterior is the prior N(0, I / lambda). HMC on the weights given a gauge, with
    the gauge redrawn and the exact orbit move made before every trajectory, and a mass matrix that
    follows the gauge (built on an arbitrary positive semi-definite 'curvature'), still samples it: every
    weight keeps variance 1 / lambda and lambda times each hidden neuron's squared incoming norm stays
    chi-squared (KS tests). A gauge energy or a redraw that were off would bias the weights' scales."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2)).double()
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    mv = ScalingMoves(spec_of(net, (5,)), shapes, LAM)
    d = mv.powers.shape[1]
    c = 48
    gen = torch.Generator().manual_seed(4)
    theta0 = torch.randn(c, d, generator=gen, dtype=torch.float64) / LAM**0.5
    a = torch.randn(c, d, d, generator=gen, dtype=torch.float64)
    gauge = OrbitGauge(mv.powers, theta0, 3.0 * a @ a.transpose(1, 2) / d, LAM, sigma=0.15)

    def nothing(flat):
        return torch.zeros(flat.shape[0], dtype=flat.dtype), torch.zeros_like(flat)

    def moves(th, g):
        th, acc = mv(th, g)
        gauge.refresh(th, g)
        return th, acc

    res = run_chains(gauge.wrap(with_prior(nothing, LAM)), theta0, 30, 200, 6, jitter=0.2, seed=5,
                     progress=False, metric=gauge.metric(), moves=moves)
    draws = res.draws[:, 20::4].reshape(-1, d)  # thinned: nearly independent draws
    n = draws.shape[0]
    assert float(res.accept_prob.mean()) > 0.6
    assert abs(float(draws.var(0).mean()) * LAM - 1) < 0.03
    assert float((draws.var(0) * LAM - 1).abs().max()) < 6 * (2 / n) ** 0.5 * 2
    p = unflatten(draws, shapes)
    norms = LAM * (torch.cat([p["0.weight"], p["0.bias"][..., None]], -1) ** 2).sum(-1)  # (n, 3)
    for i in range(3):
        assert stats.kstest(norms[:, i].numpy(), stats.chi2(6).cdf).pvalue > 1e-3
    assert len(gauge.history) == 30 + 200
