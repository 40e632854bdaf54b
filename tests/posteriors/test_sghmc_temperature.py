"""SGHMC at the temperature it claims: the minibatch noise on a posterior known exactly (Bayesian linear
regression), the effective temperature it predicts, and the correction that removes it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from symlib import models, threads
from symlib import training as T
from symlib.posteriors import sghmc
from symlib.posteriors import temperature as TT
from symlib.posteriors.base import Setup

N, D, B, SIGMA, LAM = 400, 3, 20, 0.5, 1.0


@pytest.fixture(autouse=True)
def _one_thread():
    """Thousands of tiny steps: one thread (intra-op threads only add overhead, a lot on a busy machine)."""
    with threads.single():
        yield


def _regression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64) + SIGMA * torch.randn(N, generator=g,
                                                                                        dtype=torch.float64)
    prec = x.T @ x / SIGMA**2 + LAM * torch.eye(D, dtype=torch.float64)
    cov = torch.linalg.inv(prec)
    mean = cov @ (x.T @ y) / SIGMA**2
    return x, y, mean, cov


def _minibatch_grad(w, x, y, idx):
    r""":math:`\nabla\tilde U = N \cdot` the batch mean of the per-example gradients, plus the prior's,
    for chains ``w (C, D)`` on batches ``idx (C, B)`` (without replacement)."""
    xb, yb = x[idx], y[idx]
    r = yb - (xb * w[:, None]).sum(-1)
    return -N * (r[..., None] * xb).mean(1) / SIGMA**2 + LAM * w


def _batches(gen, c):
    """Independent batches (with replacement), as SGHMC draws them."""
    return torch.randint(0, N, (c, B), generator=gen)


def _noise(w, x, y, gen, k=64):
    """The variance of the minibatch gradient over ``k`` random batches, per chain and coordinate."""
    gs = torch.stack([_minibatch_grad(w, x, y, _batches(gen, w.shape[0])) for _ in range(k)])
    return gs.var(0)


def _run(eta, alpha, correct, batches="iid", chains=100, steps=3000, burn=500, every=25, seed=1):
    x, y, mean, cov = _regression()
    gen = torch.Generator().manual_seed(seed)
    w = mean.expand(chains, D).clone()
    v = torch.zeros_like(w)
    keep, noise_var = [], None
    per_epoch = N // B
    for i in range(steps):
        if i % per_epoch == 0:
            # "epoch": every chain walks its own shuffle of the data, epoch by epoch
            order = torch.rand(chains, N, generator=gen).argsort(1) if batches == "epoch" else None
            if correct:  # the correction's estimate, refreshed every epoch as SGHMC does
                noise_var = {"w": _noise(w, x, y, gen, 16)}
        j = i % per_epoch
        idx = _batches(gen, chains) if order is None else order[:, j * B : (j + 1) * B]
        grad = _minibatch_grad(w, x, y, idx)
        th, vv = sghmc.step({"w": w}, {"w": v}, {"w": grad}, eta, alpha, 1.0, gen, noise_var)
        w, v = th["w"], vv["w"]
        if i >= burn and (i - burn) % every == every - 1:
            keep.append(w)
    draws = torch.cat(keep)
    # per coordinate, T_i = 1 + eta V_i / (2 alpha) with V the noise at the posterior mean
    noise = _noise(mean.expand(1, D), x, y, gen, 2000)
    per_coordinate = torch.stack([TT.effective_temperature(noise[:, i : i + 1], eta, alpha, 1.0)[0]
                                  for i in range(D)])
    return draws, mean, cov, per_coordinate


ETA, ALPHA = 3e-6, 0.1


def test_minibatch_noise_heats_sghmc_as_predicted():
    r"""Without the correction the minibatch noise heats the chain: every marginal variance is the
    posterior's times its coordinate's effective temperature (:math:`1 + \eta V_i / (2 \alpha)`, 1.3-1.5
    here), within 10%:
    10,000 draws 25 steps apart (relaxation time ~ alpha / (eta h) ~ 20 steps) give variances within 2-3%
    (1 standard error) and the discretisation adds ~eta h / alpha ~ 5%."""
    draws, mean, cov, t_eff = _run(ETA, ALPHA, correct=False)
    ratio = draws.var(0) / cov.diagonal()
    assert bool(((t_eff > 1.25) & (t_eff < 1.7)).all())
    assert ((ratio / t_eff - 1).abs() < 0.1).all(), (ratio, t_eff)


def test_epochwise_shuffling_cancels_most_of_the_noise():
    """Why SGHMC draws its batches independently: with epoch-wise shuffling the gradient noise of one
    epoch sums to zero at fixed weights, so the chain (relaxation time ~ one epoch here) is heated far less
    than the per-step variance predicts, and a correction by that variance would cool it below T."""
    draws, mean, cov, t_eff = _run(ETA, ALPHA, correct=False, batches="epoch")
    ratio = draws.var(0) / cov.diagonal()
    assert bool((t_eff > 1.25).all()) and bool((ratio < 1.15).all()), (ratio, t_eff)


def test_corrected_sghmc_samples_the_posterior_with_minibatches():
    """With Chen et al.'s correction (the gradient noise measured on 16 batches every epoch of 20 steps and
    subtracted from the injected noise) the same sampler, minibatches included, samples the exact
    posterior: mean within 5 standard errors, every variance within 10% of the posterior's (the noise of
    the 16-batch estimate and the discretisation, as above)."""
    draws, mean, cov, _ = _run(ETA, ALPHA, correct=True)
    n_eff = draws.shape[0] / 3
    assert ((draws.mean(0) - mean).abs() < 5 * cov.diagonal().sqrt() / math.sqrt(n_eff)).all()
    ratio = draws.var(0) / cov.diagonal()
    assert ((ratio - 1).abs() < 0.1).all(), ratio


def _optunet_setup(batch_size, same=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)
    if same:  # 64 copies of one image and label
        x, y = x[:1].expand(64, 1, 28, 28).contiguous(), y[:1].expand(64).contiguous()
    rec = dataclasses.replace(T.OPTUNET_MNIST, epochs=2, batch_size=batch_size, weight_decay=2e-4)
    return Setup("optunet", models.OptuNet, x, y, rec, name="synthetic", scale="tiny")


def test_gradient_noise_closed_forms():
    """A training set of copies of one image: every batch has the same gradient, no noise without crops,
    some with them; batches of 16 distinct images carry noise."""
    st = _optunet_setup(16, same=True)
    theta = T.init_params(st.make_model, [1, 2])
    assert TT.gradient_noise(st, theta, [5, 9], 4, augment=False).abs().max() < 1e-6
    assert TT.gradient_noise(st, theta, [5, 9], 4, augment=True).mean() > 1e-3
    v = TT.gradient_noise(_optunet_setup(16), theta, [5, 9], 8, augment=False)
    assert v.shape == (2, 392) and bool((v.mean(1) > 1e-3).all())
    with pytest.raises(ValueError, match="n_batches"):
        TT.gradient_noise(st, theta, [5, 9], 1)
    # the effective temperature of the stated noise alone is the stated temperature
    assert torch.allclose(TT.effective_temperature(torch.zeros(2, 5), 1e-3, 0.2, 1.3), torch.full((2,), 1.3))


def test_sghmc_records_its_temperature():
    """Every SGHMC set records per chain its measured effective and kinetic temperatures; the corrected
    default injects less noise than the paper's setting."""
    st = _optunet_setup(16)
    base = T.init_params(st.make_model, [3, 4])
    out = sghmc.sample(st, 2, 2, 0, base=base, progress=False, burn_in=1, noise_batches=4)
    assert out.hyper["setting"] == "corrected" and out.hyper["correction"] and out.hyper["alpha"] == 0.3
    d = out.diagnostics
    assert len(d["effective_temperature"]) == 2 and len(d["kinetic_temperature"]) == 2
    assert all(t > 0 for t in d["effective_temperature"])
    paper = sghmc.sample(st, 2, 2, 0, base=base, progress=False, burn_in=1, noise_batches=4, setting="paper")
    assert paper.hyper["alpha"] == 0.1 and not paper.hyper["correction"]
    assert min(paper.diagnostics["effective_temperature"]) >= 1.0
    with pytest.raises(ValueError, match="setting"):
        sghmc.sample(st, 1, 1, 0, base={k: v[:1] for k, v in base.items()}, progress=False, setting="cold")
