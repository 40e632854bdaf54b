"""Non-reversible parallel tempering down to the prior (symlib.posteriors.hmc.ladder): the schedule update,
exactness on targets known in closed form, and a resumed run that equals an uninterrupted one."""

from __future__ import annotations

import math

import pytest
import torch

from symlib.posteriors.hmc import ladder as L
from symlib.stats import diagnostics


def _gaussian_likelihood(a: float, mu: torch.Tensor):
    """L(theta) = a/2 |theta - mu|^2 (the posterior with a N(0, 1/lam) prior is Gaussian)."""

    def lik(th):
        r = th - mu
        return 0.5 * a * (r * r).sum(1), a * r

    return lik


def _bimodal_likelihood(a: float, m: float):
    """L(theta) = -log(exp(-a (theta - m)^2 / 2) + exp(-a (theta + m)^2 / 2)) in one dimension: two modes
    separated by a barrier of a m^2 / 2 nats."""

    def lik(th):
        x = th[:, 0]
        la, lb = -0.5 * a * (x - m) ** 2, -0.5 * a * (x + m) ** 2
        lse = torch.logaddexp(la, lb)
        wa = torch.exp(la - lse)
        g = wa * a * (x - m) + (1 - wa) * a * (x + m)
        return -lse, g[:, None]

    return lik


def test_schedule_update_keeps_an_equalised_schedule_and_counts_levels():
    betas = torch.linspace(1, 0, 6, dtype=torch.float64)
    same = L.schedule_from_rejections(betas, torch.full((5,), 0.3), n_levels=6)
    torch.testing.assert_close(same, betas)
    # a barrier concentrated near beta = 1 pulls the levels there; "auto" gives ceil(2 Lambda) + 1 levels
    rej = torch.tensor([0.9, 0.9, 0.1, 0.1, 0.1], dtype=torch.float64)
    new = L.schedule_from_rejections(betas, rej)
    assert len(new) == math.ceil(2 * 2.1) + 1
    assert float(new[0]) == 1.0 and float(new[-1]) == 0.0 and bool((new[1:] < new[:-1]).all())
    assert float(new[1]) > 0.8  # most levels sit where the rejections were
    assert float(L.barrier(betas, rej)[0]) == pytest.approx(2.1)


def test_bad_schedules_and_settings_are_refused():
    lik = _gaussian_likelihood(1.0, torch.zeros(2, dtype=torch.float64))
    th = torch.zeros(2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="decrease strictly from 1 to 0"):
        L.Ladder(lik, 1.0, th, torch.tensor([1.0, 0.5]))
    with pytest.raises(ValueError, match="mass must be one of"):
        L.Ladder(lik, 1.0, th, torch.tensor([1.0, 0.0]), mass="full")


@pytest.mark.parametrize("mass", ["diag", "dense"])
def test_gaussian_posterior_is_sampled_exactly(mass):
    """With L = a/2 |theta - mu|^2 and the prior N(0, 1/lam), the level beta = 1 is N(a mu / (a + lam),
    1 / (a + lam)): every coordinate's mean within 5 Monte-Carlo standard errors and its variance within
    20% (4 chains, 600 rounds after adaptation)."""
    a, lam = 9.0, 1.0
    mu = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    lad = L.Ladder(_gaussian_likelihood(a, mu), lam, torch.zeros(4, 3, dtype=torch.float64),
                   torch.tensor([1.0, 0.5, 0.2, 0.0], dtype=torch.float64), seed=3, n_leapfrog=5, mass=mass)
    lad.adapt(100)
    lad.retune()
    lad.adapt(100)
    seg = lad.sample(600)
    x = seg.draws.numpy()
    mean, var = a * mu / (a + lam), 1.0 / (a + lam)
    ess = diagnostics.ess_bulk(x)
    se = torch.as_tensor(math.sqrt(var) / ess ** 0.5)
    assert ((torch.as_tensor(x.mean((0, 1))) - mean).abs() < 5 * se).all()
    assert ((torch.as_tensor(x.var((0, 1))) / var - 1).abs() < 0.2).all()
    # the recorded potential is U = L + lam/2 |theta|^2 of the kept draws
    d = seg.draws.reshape(-1, 3)
    u = _gaussian_likelihood(a, mu)(d)[0] + 0.5 * lam * (d * d).sum(1)
    torch.testing.assert_close(seg.potential.reshape(-1), u)


def test_swaps_carry_the_chains_between_two_modes():
    """Two modes at +-2 separated by a barrier of 100 nats: HMC alone never crosses it, the ladder does;
    every chain spends about half its draws in each mode and makes round trips to the prior."""
    lad = L.Ladder(_bimodal_likelihood(50.0, 2.0), 0.25, torch.full((4, 1), 2.0, dtype=torch.float64),
                   torch.tensor([1.0, 0.3, 0.1, 0.03, 0.0], dtype=torch.float64), seed=5, n_leapfrog=5)
    for n in (50, 100):
        lad.adapt(n)
        lad.retune()
    lad.adapt(100)
    seg = lad.sample(1500)
    right = (seg.draws[..., 0] > 0).double().mean(1)
    assert ((right > 0.3) & (right < 0.7)).all(), right
    assert min(lad.stats()["round_trips"]) >= 5
    # plain HMC at beta = 1 from the same start stays in its mode
    from symlib.posteriors.hmc import potentials, sampler

    pot = potentials.with_prior(_bimodal_likelihood(50.0, 2.0), 0.25)
    alone = sampler.run_chains(pot, torch.full((4, 1), 2.0, dtype=torch.float64), 50, 300, 5, seed=5,
                               progress=False)
    assert bool((alone.draws > 0).all())


def test_a_resumed_ladder_continues_exactly():
    """Saving the state between two calls of sample and resuming from it gives the draws of one
    uninterrupted run, bit for bit (same generator state, same counters)."""
    lik = _bimodal_likelihood(20.0, 1.5)

    def fresh():
        lad = L.Ladder(lik, 0.5, torch.ones(3, 1, dtype=torch.float64),
                       torch.tensor([1.0, 0.4, 0.0], dtype=torch.float64), seed=11, n_leapfrog=4,
                       mass="dense")
        lad.adapt(30)
        return lad

    whole = fresh().sample(40).draws
    first = fresh()
    a = first.sample(15).draws
    resumed = L.Ladder.from_state({k: v.clone() for k, v in first.state_dict().items()}, lik, 0.5,
                                  n_leapfrog=4, mass="dense")
    b = resumed.sample(25).draws
    assert torch.equal(torch.cat([a, b], 1), whole)
    assert resumed.stats()["rounds"] == first.stats()["rounds"] + 25


def test_softmax_shift_is_an_exact_gibbs_step():
    """SoftmaxShift: an orthonormal basis of the last layer's shift directions; a move adds the same number
    to every logit of every input (the likelihood does not change), keeps the component outside the
    subspace, and redraws the one inside from the prior N(0, 1/lam): over 4,000 moves its mean is within 5
    standard errors of 0 and its variance within 10% of 1/lam, whatever the state it started from."""
    from symlib.params import unflatten
    from symlib.posteriors.hmc.orbits import SoftmaxShift
    from symlib.training import mlp

    shapes = mlp.shapes([4, 3, 10])
    lam = 4.0
    move = SoftmaxShift(shapes, lam)
    u = move.basis
    torch.testing.assert_close(u.T @ u, torch.eye(u.shape[1], dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    theta = 3.0 * torch.randn(4000, u.shape[0], generator=gen, dtype=torch.float64) + 2.0
    moved, acc = move(theta, gen)
    assert (acc == 1).all()
    torch.testing.assert_close(move.project_out(moved), move.project_out(theta))
    x = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    before = mlp.mlp_forward(unflatten(theta[:50], shapes), x)
    after = mlp.mlp_forward(unflatten(moved[:50], shapes), x)
    shift = after - before
    torch.testing.assert_close(shift, shift[..., :1].expand_as(shift))  # the same number on every logit
    assert shift.abs().max() > 0.1  # and not nothing
    torch.testing.assert_close(torch.softmax(after, -1), torch.softmax(before, -1))
    comp = moved @ u
    n = comp.shape[0]
    assert (comp.mean(0).abs() < 5 / math.sqrt(lam * n)).all()
    assert ((comp.var(0) * lam - 1).abs() < 0.1).all()
    with pytest.raises(ValueError, match="no last layer"):
        SoftmaxShift({"w": (3, 2)}, lam)


def test_exact_directions_keep_the_ladder_exact():
    """A Gaussian likelihood flat along e_3 with an exact Gibbs move there (the ladder's ``exact``
    directions, left out of its mass matrices): the level beta = 1 is still N(a mu / (a + lam), 1 / (a +
    lam)) in the constrained coordinates and the prior N(0, 1/lam) along e_3."""
    a, lam = 9.0, 1.0
    mu = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)

    def lik(th):
        r = (th - mu) * mask
        return 0.5 * a * (r * r).sum(1), a * r

    e3 = torch.tensor([[0.0], [0.0], [1.0]], dtype=torch.float64)

    def redraw(th, gen):
        fresh = torch.randn(th.shape[0], generator=gen, dtype=torch.float64) / math.sqrt(lam)
        out = th.clone()
        out[:, 2] = fresh
        return out, torch.ones(th.shape[0], dtype=torch.float64)

    lad = L.Ladder(lik, lam, torch.full((4, 3), 5.0, dtype=torch.float64),
                   torch.tensor([1.0, 0.5, 0.2, 0.0], dtype=torch.float64), seed=5, n_leapfrog=5,
                   moves=redraw, exact=e3)
    lad.adapt(100)
    lad.retune()
    lad.adapt(100)
    x = lad.sample(600).draws.numpy()
    mean = (a * mu / (a + lam)) * mask
    var = torch.tensor([1 / (a + lam), 1 / (a + lam), 1 / lam], dtype=torch.float64)
    se = (var / torch.as_tensor(diagnostics.ess_bulk(x))).sqrt()
    assert ((torch.as_tensor(x.mean((0, 1))) - mean).abs() < 5 * se).all()
    assert ((torch.as_tensor(x.var((0, 1))) / var - 1).abs() < 0.2).all()
