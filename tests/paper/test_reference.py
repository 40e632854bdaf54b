"""The gentle example's Bayesian posterior: replica exchange on a small MLP, cached; the helpers the chapter
reads it with."""

from __future__ import annotations

import numpy as np
import torch

from symlib import models
from symlib.paper import reference, toy
from symlib.posteriors.hmc import potentials
from symlib.stats import convergence
from symlib.symmetry import spec as spec_mod


def test_posterior_is_cached_and_reloaded(tmp_path):
    data = toy.two_gaussians(20, seed=0)
    settings = reference.Settings(2, 3, 0.1, 5, 8, 4)
    a = reference.posterior(data.x, data.y, "perceptron", settings=settings, cache_dir=tmp_path)
    b = reference.posterior(data.x, data.y, "perceptron", settings=settings, cache_dir=tmp_path)
    assert not a.cached and b.cached
    assert set(a.draws) == set(potentials.mlp_shapes((2, 2, 1)))
    assert a.draws["0.weight"].shape == (2, 8, 2, 2) and a.potential.shape == (2, 8)
    for k in a.draws:
        torch.testing.assert_close(a.draws[k], b.draws[k])
    torch.testing.assert_close(a.nll, b.nll)
    # U = L + |theta|^2 / 2 (prior N(0, 1)), L the summed BCE of the draws
    flat = a.flat()
    f = reference.outputs(flat, data.x.double())
    y = data.y.double().expand_as(f)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(f, y, reduction="none")
    torch.testing.assert_close(a.nll.flatten(), bce.sum(1))
    norm = sum((v**2).flatten(1).sum(1) for v in flat.values())
    torch.testing.assert_close(a.potential.flatten(), a.nll.flatten() + 0.5 * norm)
    assert b.sampler == a.sampler and len(a.sampler["swap_accept"]) == 2


def test_outputs_equal_the_module_and_noise_sd_is_the_ols_residual_sd():
    g = torch.Generator().manual_seed(1)
    net = models.MLP([3, 4, 1]).double()
    x = torch.randn(7, 3, generator=g, dtype=torch.float64)
    params = {k: v.detach()[None] for k, v in net.named_parameters()}
    torch.testing.assert_close(reference.outputs(params, x)[0], net(x)[:, 0].detach())
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 3.0
    assert reference.noise_sd(x, y) < 1e-10  # an exact linear relation leaves no residual
    noise = torch.tensor([1.0, -1.0] * 3 + [0.0], dtype=torch.float64)
    sd = reference.noise_sd(torch.zeros(7, 0, dtype=torch.float64), noise)  # intercept only
    assert abs(sd - float(noise.std())) < 1e-12


def test_local_chains_and_describe(tmp_path):
    data = toy.two_gaussians(20, seed=0)
    settings = reference.Settings(2, 2, 0.5, 3, 4, 3)
    ref = reference.posterior(data.x, data.y, settings=settings, cache_dir=tmp_path)
    start = {k: v[:, 0] for k, v in ref.draws.items()}
    loc = reference.local_chains(data.x, data.y, start, n_warmup=3, n_samples=6, n_leapfrog=3)
    assert loc.draws["2.weight"].shape == (2, 6, 1, 2) and loc.settings["tempering"] is False
    spec = spec_mod.mlp_spec(models.MLP([2, 2, 1]).double())
    rep = convergence.diagnose(loc.draws, spec, {"potential": loc.potential})
    assert set(rep.scales) == {"raw", "canonical", "invariant"}
    d = reference.describe(loc.flat(), data.x, data.y, data.x, data.y)
    assert 0 <= d["share with a dead hidden neuron"] <= 1 and np.isfinite(d["test NLL (averaged prediction)"])
