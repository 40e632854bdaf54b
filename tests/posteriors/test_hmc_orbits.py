"""Exact moves along scaling orbits (symlib.posteriors.hmc.orbits): they leave the posterior invariant and
keep the network's function."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from torch import nn

from symlib.params import flatten, unflatten
from symlib.posteriors.hmc.orbits import ScalingMoves
from symlib.symmetry import check
from symlib.symmetry.spec import SymmetryError
from symlib.symmetry.trace import spec_of

LAM = 2.0


def _mlp():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    spec = spec_of(net, (5,))
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    return net, spec, shapes


def test_moves_keep_the_prior_exactly():
    """With no data the posterior is the prior N(0, I / lambda); 40,000 exact prior draws, moved once,
    are still exact prior draws: every weight keeps mean 0 and variance 1 / lambda, and lambda times each
    hidden neuron's squared incoming norm stays chi-squared (a KS test). The orbit's volume term (the
    Jacobian) is what keeps it: without it the first layer's norms shrink."""
    _, spec, shapes = _mlp()
    moves = ScalingMoves(spec, shapes, LAM)
    gen = torch.Generator().manual_seed(1)
    n = 40000
    d = sum(torch.Size(s).numel() for s in shapes.values())
    theta = torch.randn(n, d, generator=gen, dtype=torch.float64) / LAM**0.5
    moved, acc = moves(theta, gen)
    assert float(acc.mean()) > 0.5 and not torch.equal(moved, theta)
    se = (1 / LAM) * (2 / n) ** 0.5  # standard error of a variance estimate
    assert float(moved.mean(0).abs().max()) < 5 / (LAM * n) ** 0.5
    assert float((moved.var(0) - 1 / LAM).abs().max()) < 5 * se
    p = unflatten(moved, shapes)
    w_in = torch.cat([p["0.weight"], p["0.bias"][..., None]], -1)  # (n, 3, 6)
    norms = LAM * (w_in**2).sum(-1)
    for i in range(3):
        assert stats.kstest(norms[:, i].numpy(), stats.chi2(6).cdf).pvalue > 1e-3


def test_moves_keep_the_function_and_change_the_scales():
    net, spec, shapes = _mlp()
    theta = {k: v.detach().clone() for k, v in net.state_dict().items()}
    flat = flatten({k: v[None] for k, v in theta.items()})
    moved, _ = ScalingMoves(spec, shapes, LAM)(flat, torch.Generator().manual_seed(2))
    after = {k: v[0] for k, v in unflatten(moved, shapes).items()}
    x = torch.randn(16, 5, dtype=torch.float64)
    assert float(check.function_error(spec, theta, after, x)) < 1e-12
    assert float((after["0.weight"].norm(dim=1) / theta["0.weight"].norm(dim=1) - 1).abs().max()) > 1e-3


def test_moves_refuse_what_they_cannot_move():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    with pytest.raises(SymmetryError, match="positively homogeneous"):
        ScalingMoves(spec_of(net, (3,)), shapes, LAM)
    _, spec, shapes = _mlp()
    with pytest.raises(SymmetryError, match="do not hold"):
        ScalingMoves(spec, {k: v for k, v in shapes.items() if k != "2.weight"}, LAM)
    with pytest.raises(ValueError, match="prior_precision"):
        ScalingMoves(spec, shapes, 0.0)


def test_hmc_with_moves_samples_a_known_posterior():
    """HMC with a move before every trajectory (run_chains(moves=...)) on the prior alone: the draws
    have the prior's variance, the extra gradient per trajectory is counted and the moves' acceptance
    is reported."""
    from symlib.posteriors.hmc import run_chains, with_prior

    _, spec, shapes = _mlp()
    d = sum(torch.Size(s).numel() for s in shapes.values())

    def nothing(flat):
        return torch.zeros(flat.shape[0], dtype=flat.dtype), torch.zeros_like(flat)

    theta0 = torch.randn(32, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    res = run_chains(with_prior(nothing, LAM), theta0, 20, 100, 5, seed=4, progress=False,
                     moves=ScalingMoves(spec, shapes, LAM))
    assert res.n_grad > 120 * 6  # 5 leapfrog steps and 1 after the move per trajectory
    assert len(res.diagnostics()["orbit_accept"]) == 32 and float(res.orbit_accept.min()) > 0.5
    assert abs(float(res.draws.var((0, 1)).mean()) * LAM - 1) < 0.05
