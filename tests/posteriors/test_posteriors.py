"""Posterior methods: dropout folding, SWAG's moments and sampler, SGHMC on a Gaussian, the stacked OptuNet
and the generic ResNet-18 paths, and bad inputs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import scipy.linalg
import torch

from symlib import models
from symlib import params as params_mod
from symlib import training as T
from symlib.posteriors import Setup, dropout, ensemble, sampling, seeds, sgd, sghmc, swag


def _optunet_setup(n=128, epochs=1, dtype=torch.float32, **rec) -> Setup:
    """A small OptuNet problem on the embedded MNIST digits (no zoo cache: name '')."""
    full = sampling.setup_for("mnist-optunet", "tiny")
    recipe = dataclasses.replace(T.OPTUNET_MNIST.scaled(epochs), batch_size=32, **rec)
    return dataclasses.replace(full, x=full.x[:n].to(dtype), y=full.y[:n], recipe=recipe, name="")


def _resnet_setup(n=8) -> Setup:
    """ResNet-18 at the paper's shapes (CIFAR-100: 3 x 32 x 32, 100 classes) with width 4, random data."""
    g = torch.Generator().manual_seed(0)
    recipe = dataclasses.replace(T.RESNET18_CIFAR100.scaled(1), batch_size=8)
    return Setup(
        arch="resnet18",
        make_model=lambda: models.ResNet18(num_classes=100, width=4),
        x=torch.randn(n, 3, 32, 32, generator=g),
        y=torch.randint(0, 100, (n,), generator=g),
        recipe=recipe,
        fill=(0.0, 0.0, 0.0),
        num_classes=100,
        scale="paper",
    )


# ----------------------------------------------------------------------------- MC dropout


def _masked_output(model, x, mask, p):
    """The network with dropout *on* and the given keep-mask on the features before the last layer."""
    handle = model.dropout.register_forward_hook(lambda mod, inp, out: inp[0] * mask / (1 - p))
    try:
        return model(x)
    finally:
        handle.remove()


@pytest.mark.parametrize(
    "make, x_shape",
    [
        (lambda: models.OptuNet(dropout=0.2), (5, 1, 28, 28)),
        (lambda: models.ResNet18(num_classes=100, width=4, dropout=0.5), (3, 3, 32, 32)),
    ],
)
def test_folded_mask_computes_the_masked_network(make, x_shape):
    r"""W diag(m / (1 - p)) h + b = W (h * m / (1 - p)) + b: the folded weights, evaluated without dropout,
    give the masked network's outputs (float64, to rounding); a different mask gives other outputs."""
    torch.manual_seed(0)
    model = models.randomize_batchnorm(make().double()).eval()
    p = model.dropout.p
    x = torch.randn(*x_shape, dtype=torch.float64)
    width = model.fc.weight.shape[1]
    masks = (torch.rand(4, width) >= p).double()
    folded = dropout.fold(params_mod.state_of(model), masks, p)
    for s in range(4):
        sample_model = make().double()
        sample_model.load_state_dict(params_mod.unstack(folded, s))
        sample_model.eval()
        want = _masked_output(model, x, masks[s], p)
        assert torch.allclose(sample_model(x), want, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(sample_model(x), _masked_output(model, x, 1 - masks[s], p))
    others = [k for k in folded if k != "fc.weight"]
    assert all(torch.equal(folded[k][1], model.state_dict()[k]) for k in others)


def test_dropout_samples_share_their_network():
    st = _optunet_setup()
    s = dropout.sample(st, 2, 3, 0, progress=False)
    assert s.n_samples == 6 and s.hyper["p"] == 0.2
    for mode in range(2):
        idx = slice(3 * mode, 3 * mode + 3)
        assert torch.equal(s.params["conv1.weight"][idx][0], s.params["conv1.weight"][idx][2])
        w = s.params["fc.weight"][idx]
        dead = (w == 0).all(1)  # dropped features: whole zero columns, the kept ones scaled by 1 / (1 - p)
        assert dead.any() and not dead.all()
    assert not torch.equal(s.params["conv1.weight"][0], s.params["conv1.weight"][3])  # two networks


def test_dropout_rejects_a_model_without_dropout():
    st = dataclasses.replace(_optunet_setup(), arch="mlp", make_model=lambda: models.MLP([4, 3, 2]))
    with pytest.raises(ValueError, match="no dropout layer before its last layer"):
        dropout.sample(st, 1, 2, progress=False)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        dropout.sample(_optunet_setup(), 1, 2, progress=False, p=0.0)


# ----------------------------------------------------------------------------- SWAG


def test_swag_moments_are_the_snapshot_statistics():
    r"""Running updates = direct formulas: mean_K = (1/K) sum theta_k, var = mean(theta^2) - mean^2, and the
    kept deviations are theta_k - mean_k (running mean up to k), the last R of them."""
    g = torch.Generator().manual_seed(0)
    snaps = torch.randn(7, 3, 5, generator=g, dtype=torch.float64) * 2 + 1  # (K, M, d)
    mom = swag.Moments(rank=4)
    for s in snaps:
        mom.collect(s)
    assert torch.allclose(mom.mean, snaps.mean(0), atol=1e-14)
    assert torch.allclose(mom.var, snaps.var(0, unbiased=False), atol=1e-12)
    running = torch.stack([snaps[: k + 1].mean(0) for k in range(7)])
    dev = (snaps - running)[-4:].transpose(0, 1)  # (M, R, d)
    assert torch.allclose(mom.dev, dev, atol=1e-14)


def test_swag_sampler_covariance():
    r"""Cov[theta] = s (diag(var) + D D^T / (R - 1)) (SWAG's sampler). With n = 40,000 draws the entries of
    the empirical covariance have standard errors <= sqrt(2 / n) * max variance ~ 0.7%; we allow 5%."""
    g = torch.Generator().manual_seed(1)
    mom = swag.Moments(rank=3)
    for _ in range(3):
        mom.collect(torch.randn(1, 4, generator=g, dtype=torch.float64))
    s = 0.1
    x = swag.draw(mom, 40_000, torch.Generator().manual_seed(2), scale=s)[0]
    d = mom.dev[0]
    cov = s * (torch.diag(mom.var[0]) + d.T @ d / (3 - 1))
    emp = torch.cov(x.T)
    assert torch.allclose(x.mean(0), mom.mean[0], atol=5 * math.sqrt(cov.diag().max() / 40_000))
    assert (emp - cov).abs().max() < 0.05 * cov.diag().max()


def test_swag_schedule():
    lrs, snaps = swag.schedule(100, 20, lr=0.04, lr_start=0.01)
    assert snaps == [5 * k - 1 for k in range(1, 21)] and len(lrs) == 100
    assert (
        lrs[0] == pytest.approx(0.01 + 0.03 / 5) and lrs[4] == pytest.approx(0.04) and set(lrs[5:]) == {0.04}
    )
    assert all(a < b for a, b in zip(lrs[:5], lrs[1:5], strict=False))


def test_swag_run_collects_its_snapshots_stacked():
    """A stacked SWAG run on two OptuNets: its moments are those of the snapshots it took, and the samples
    scatter around the SWA mean (their mean over many draws is close to it)."""
    st = _optunet_setup(dtype=torch.float64)
    base = {k: v.double() for k, v in sgd.train_models(st, [11, 12], progress=False).items()}
    snaps = []
    mom, names, _ = swag.fit(
        st, base, [1, 2], lr=0.04, epochs=2, n_snapshots=4, rank=4, progress=False, snapshots=snaps
    )
    k = torch.stack(snaps)  # (K, M, d)
    assert k.shape == (4, 2, 392) and names == list(T.OPTUNET_SHAPES)
    assert torch.allclose(mom.mean, k.mean(0), atol=1e-12) and torch.allclose(
        mom.var, k.var(0, unbiased=False)
    )
    s = swag.sample(st, 2, 5, 0, base=base, progress=False, epochs=2, n_snapshots=4, rank=4)
    assert s.n_samples == 10 and s.hyper["scale"] == 0.1 and s.diagnostics["snapshots"] == 4
    assert not torch.equal(s.params["fc.weight"][0], s.params["fc.weight"][1])


# ----------------------------------------------------------------------------- SGHMC


def _gaussian_chains(temperature, n_chains=1000, steps=6000, burn=1000, every=250):
    mu = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    sig = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    eta, alpha = 0.0025, 0.1
    gen = torch.Generator().manual_seed(0)
    theta = {"w": torch.zeros(n_chains, 3, dtype=torch.float64)}
    v = {"w": torch.zeros_like(theta["w"])}
    keep = []
    for i in range(steps):
        grad_u = {"w": (theta["w"] - mu) / sig**2}  # U = sum (theta - mu)^2 / (2 sigma^2)
        theta, v = sghmc.step(theta, v, grad_u, eta, alpha, temperature, gen)
        if i >= burn and (i - burn) % every == every - 1:
            keep.append(theta["w"])
    return torch.cat(keep), mu, sig, eta, alpha


def test_sghmc_samples_a_gaussian():
    r"""SGHMC on U = sum_i (theta_i - mu_i)^2 / (2 sigma_i^2) (exact gradients, T = 1) samples N(mu, sigma^2).

    Tolerances: (a) discretisation: the exact stationary variance of the linear recursion (discrete
    Lyapunov equation) is within 0.3% of sigma^2 at eta = 0.0025, alpha = 0.1; (b) Monte Carlo: n = 20,000
    draws (1,000 chains x 20, 250 steps apart, at most ~0.3 autocorrelated at the slowest coordinate's
    relaxation time ~ alpha sigma^2 / eta = 160 steps), counted as n / 3 independent ones: 5 standard errors
    are 0.06 sigma for the mean and 8.7% for the variance."""
    x, mu, sig, eta, alpha = _gaussian_chains(1.0)
    for s in sig.tolist():
        a = np.array([[1 - eta / s**2, 1 - alpha], [-eta / s**2, 1 - alpha]])
        stat = scipy.linalg.solve_discrete_lyapunov(a, 2 * alpha * eta * np.ones((2, 2)))
        assert abs(stat[0, 0] / s**2 - 1) < 0.003
    n_eff = x.shape[0] / 3
    assert ((x.mean(0) - mu).abs() < 5 * sig / math.sqrt(n_eff)).all()
    assert ((x.var(0) / sig**2 - 1).abs() < 5 * math.sqrt(2 / n_eff)).all()
    cold, *_ = _gaussian_chains(1e-4, n_chains=200)  # noise shrunk 100-fold: an optimiser, not a sampler
    assert (cold.var(0) / sig**2 < 0.05).all()


def test_sghmc_on_optunet_chains_stacked():
    st = _optunet_setup()
    base = sgd.train_models(st, [3, 4], progress=False)
    s = sghmc.sample(st, 2, 3, 0, base=base, progress=False, burn_in=0)
    assert s.n_samples == 6 and s.hyper["start"] == "base models"
    # the stated noise sqrt(2 alpha eta T) with the default (corrected) setting's friction 0.3
    assert s.hyper["alpha"] == 0.3 and s.hyper["correction"]
    assert s.hyper["noise_std"] == pytest.approx(math.sqrt(2 * 0.3 * s.hyper["lr"] / st.n_train))
    assert s.hyper["prior_precision"] == pytest.approx(st.n_train * st.recipe.weight_decay)
    # consecutive samples of a chain differ (it moves), chains stay near their base models
    assert not torch.equal(s.params["fc.weight"][0], s.params["fc.weight"][1])
    d_own = (s.params["fc.weight"][0] - base["fc.weight"][0]).norm()
    d_other = (s.params["fc.weight"][0] - base["fc.weight"][1]).norm()
    assert d_own < d_other


# ----------------------------------------------------------------------------- ensembles, ResNet-18


def test_ensemble_members_are_independent_base_seeds():
    st = _optunet_setup(n=64)
    s = ensemble.sample(st, 1, 3, 5, progress=False)
    member_seeds = seeds.base_seeds(3, 5)
    assert s.hyper["member_seeds"] == member_seeds
    ref = sgd.train_models(st, member_seeds[1:2], progress=False)  # member 1 alone: the same network
    assert all(torch.allclose(s.params[k][1], ref[k][0], atol=1e-6) for k in ref)


@pytest.mark.parametrize("workers", [1, 2])
def test_stacked_training_is_the_update_rule_loop_bit_for_bit(workers):
    """train_models trains stacked OptuNets with the zoo trainer (crops fused into the compiled step, groups
    of models on their own threads); the weights are those of the update-rule loop that the methods with
    dropout or a per-step rule use, exactly, with momentum and a schedule."""
    st = _optunet_setup(n=96, epochs=3, momentum=0.9)
    member_seeds = seeds.base_seeds(5, 2)
    before = torch.get_num_threads()
    torch.set_num_threads(workers)
    try:
        fast = sgd.train_models(st, member_seeds, progress=False)
    finally:
        torch.set_num_threads(before)
    rule = T.loop.StackedSGD(st.recipe, st.arch)
    state = rule.init(sgd.init_stacked(st, member_seeds))
    (ref, _), = [T.loop.run(rule, state, member_seeds, st.x, st.y, st.recipe, fill=st.fill[0])]
    assert all(torch.equal(fast[k], ref[k]) for k in ref)


def test_resnet18_paths_on_synthetic_data():
    """Every method runs the generic nn.Module path on ResNet-18 (width 4, CIFAR-100 shapes, 1-2 steps)."""
    st = _resnet_setup()
    ref = models.ResNet18(num_classes=100, width=4).state_dict()
    base = sgd.train_models(st, [1], progress=False)
    assert set(base) == set(ref)
    d = dropout.sample(st, 1, 2, 0, progress=False)
    assert d.hyper["p"] == 0.5 and d.params["fc.weight"].shape == (2, 100, 32)
    sw = swag.sample(st, 1, 2, 0, base=base, progress=False, epochs=2, n_snapshots=2, rank=2)
    assert sw.n_samples == 2 and sw.hyper["bn_update"]
    bn = "layer1.0.bn1.running_mean"
    assert not torch.equal(sw.params[bn][0], base[bn][0])  # BatchNorm statistics recomputed per sample
    sg = sghmc.sample(st, 1, 1, 0, base=base, progress=False, burn_in=0)
    for s in (d, sw, sg):  # (ensembles train with train_models, as ``base`` above)
        model = models.ResNet18(num_classes=100, width=4)
        model.load_state_dict(params_mod.unstack(s.params, 0))
        assert torch.isfinite(model.eval()(st.x[:2])).all()


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs_have_clear_errors():
    st = _optunet_setup(n=64)
    base = sgd.train_models(st, [1], progress=False)
    resnet_base = params_mod.stack([models.ResNet18(num_classes=100, width=4).state_dict()])
    with pytest.raises(ValueError, match="not 'optunet' networks"):
        swag.sample(st, 1, 2, base=resnet_base, progress=False)
    with pytest.raises(ValueError, match="expected \\(2, "):
        swag.sample(st, 2, 2, base=base, progress=False)
    with pytest.raises(ValueError, match="starts from trained base models"):
        swag.sample(st, 1, 2, progress=False)
    with pytest.raises(ValueError, match="scale must be a finite positive"):
        swag.sample(st, 1, 2, base=base, progress=False, scale=-1.0)
    with pytest.raises(ValueError, match="lr must be a finite positive"):
        sghmc.sample(st, 1, 2, base=base, progress=False, lr=0.0)
    with pytest.raises(ValueError, match="temperature must be"):
        sghmc.sample(st, 1, 2, base=base, progress=False, temperature=float("nan"))
    with pytest.raises(ValueError, match="weight decay"):
        sghmc.sample(dataclasses.replace(st, recipe=dataclasses.replace(st.recipe, weight_decay=0.0)), 1, 1)
    with pytest.raises(ValueError, match="do not pass base"):
        ensemble.sample(st, 1, 2, base=base, progress=False)
    with pytest.raises(ValueError, match="n_per_mode must be >= 1"):
        ensemble.sample(st, 1, 0, progress=False)
    diverge = dataclasses.replace(st, recipe=dataclasses.replace(st.recipe, lr=1e30))
    with pytest.raises(FloatingPointError, match=r"non-finite loss at step \d+ .*seed\(s\) \[1000000000\]"):
        ensemble.sample(diverge, 1, 1, progress=False)
    nan_data = dataclasses.replace(_resnet_setup(), x=torch.full((8, 3, 32, 32), float("nan")))
    with pytest.raises(ValueError, match=r"8 training image\(s\) hold NaN or infinite pixels"):
        sgd.train_models(nan_data, [5], progress=False)


def test_multi_mode_ten_by_ten():
    """The paper's multi-mode sets: 10 base models trained stacked, 10 samples around each, mode-major;
    every SWAG sample is nearer its own base model than any other base model."""
    st = _optunet_setup(n=64)
    base = sgd.train_models(st, seeds.base_seeds(10, 0), progress=False)
    s = swag.sample(st, 10, 10, 0, base=base, progress=False, epochs=1, n_snapshots=2, rank=2)
    assert s.n_samples == 100 and torch.equal(s.modes, torch.arange(10).repeat_interleave(10))
    flat = torch.cat([s.params[k].flatten(1) for k in T.OPTUNET_SHAPES], 1)
    flat_base = torch.cat([base[k].flatten(1) for k in T.OPTUNET_SHAPES], 1)
    assert torch.equal(torch.cdist(flat, flat_base).argmin(1), s.modes)
    d = dropout.sample(st, 10, 10, 0, progress=False)
    assert (
        d.n_samples == 100
        and len({float(d.params["conv1.weight"][i].sum()) for i in range(0, 100, 10)}) == 10
    )
