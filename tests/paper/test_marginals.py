"""The posterior's marginals (paper App. D.1, D.3): training, symmetry removal, KS, PCA, mean shift."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.spatial.distance import pdist

from symlib import models
from symlib.paper import marginals
from symlib.symmetry import ops
from symlib.symmetry import spec as spec_mod

WIDTHS = (10, 6, 5, 1)


@pytest.fixture(scope="module")
def trained():
    data = marginals.regression_data(dtype=torch.float64)
    res = marginals.train_mlps(data, 24, widths=WIDTHS, epochs=3, batch_size=64, progress=False)
    return data, res


def test_regression_data_is_standardised_diabetes():
    d = marginals.regression_data()
    assert d.x.shape == (442, 10) and d.y.shape == (442,) and d.name == "diabetes"
    assert torch.allclose(d.x.double().mean(0), torch.zeros(10, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(d.x.double().std(0, unbiased=False), torch.ones(10, dtype=torch.float64), atol=1e-5)
    with pytest.raises(ValueError, match="shipped with scikit-learn"):
        marginals.regression_data("energy-efficiency")


def test_stacked_training_lowers_the_loss_and_evaluates_like_nn_module(trained):
    data, res = trained
    assert set(res.theta) == set(models.MLP(WIDTHS).state_dict())
    assert res.theta["2.weight"].shape == (24, 5, 6)
    # the training loss went down from the initialisation's
    init = marginals.init_mlps(WIDTHS, 24, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert float(res.mse.mean()) < float(marginals.mse(init, data.x, data.y).mean())
    # the per-model MSE equals an nn.Module evaluation of model 3
    net = models.MLP(WIDTHS).double()
    net.load_state_dict({k: v[3] for k, v in res.theta.items()})
    with torch.no_grad():
        ref = (net(data.x)[:, 0] - data.y).pow(2).mean()
    assert float(res.mse[3]) == pytest.approx(float(ref), rel=1e-10)


def test_training_gradient_is_each_models_own():
    # a reference SGD step with nn.Module + torch.optim.SGD on model 1's batch
    data = marginals.regression_data(dtype=torch.float64)
    res = marginals.train_mlps(data, 3, widths=WIDTHS, epochs=1, batch_size=442, lr=0.05, momentum=0.9,
                               weight_decay=1e-3, progress=False)
    init = marginals.init_mlps(WIDTHS, 3, torch.Generator().manual_seed(0), dtype=torch.float64)
    net = models.MLP(WIDTHS).double()
    net.load_state_dict({k: v[1] for k, v in init.items()})
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    torch.nn.functional.mse_loss(net(data.x)[:, 0], data.y).backward()  # full batch: order irrelevant
    opt.step()
    for k, v in net.state_dict().items():
        assert torch.allclose(res.theta[k][1], v, atol=1e-12)


def test_canonicalisation_makes_a_planted_permutation_disappear(trained):
    _, res = trained
    spec = spec_mod.mlp_spec(models.MLP(WIDTHS).double())
    g = ops.random_element(spec, "both", batch=(24,), generator=torch.Generator().manual_seed(1))
    moved = ops.act(g, res.theta, spec)
    a, b = marginals.stages(res.theta, spec), marginals.stages(moved, spec)
    assert not torch.allclose(a["raw"]["0.weight"], b["raw"]["0.weight"])
    for k in res.theta:
        assert torch.allclose(a[marginals.STAGES[2]][k], b[marginals.STAGES[2]][k], atol=1e-10)
    # sorting alone removes a pure permutation (no scaling)
    p = ops.random_element(spec, "perm", batch=(24,), generator=torch.Generator().manual_seed(2))
    pm = marginals.stages(ops.act(p, res.theta, spec), spec)
    for k in res.theta:
        assert torch.equal(pm[marginals.STAGES[1]][k], a[marginals.STAGES[1]][k])


def test_neuron_values_picks_one_weight_per_neuron():
    theta = {"w": torch.arange(2 * 3 * 4, dtype=torch.float64).reshape(2, 3, 4)}
    assert torch.equal(marginals.neuron_values(theta, "w", 0, 1), theta["w"][:, :, 1])
    assert torch.equal(marginals.neuron_values(theta, "w", 1, 2), theta["w"][:, 2, :])


def test_ks_between_neurons_equals_scipy_pair_by_pair():
    rng = np.random.default_rng(0)
    v = rng.normal(size=(41, 5)) + np.array([0, 0, 0, 1.5, 3.0])
    res = marginals.ks_between_neurons(v)
    assert res.pairs.shape == (10, 2) and (res.n1, res.n2) == (20, 21)
    for (i, j), d, p in zip(res.pairs, res.statistic, res.pvalue, strict=True):
        ref = stats.ks_2samp(v[:20, i], v[20:, j])
        assert d == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue)
    mat = res.matrix()
    assert np.isnan(mat[0, 0]) and mat[1, 4] == mat[4, 1] == res.pvalue[(res.pairs == [1, 4]).all(1)][0]
    unsplit = marginals.ks_between_neurons(v, split=False)
    assert unsplit.statistic[0] == pytest.approx(stats.ks_2samp(v[:, 0], v[:, 1]).statistic)


def test_ks_detects_unequal_marginals_and_accepts_exchangeable_ones():
    # exchangeable neurons (each checkpoint a random relabelling of one sorted draw) share a marginal;
    # the same draws sorted (permutation removed) do not
    rng = np.random.default_rng(1)
    sorted_draws = np.sort(rng.normal(size=(400, 4)), axis=1)
    shuffled = np.take_along_axis(sorted_draws, rng.permuted(np.tile(np.arange(4), (400, 1)), axis=1), 1)
    assert marginals.ks_between_neurons(shuffled).pvalue.min() > 0.01
    assert marginals.ks_between_neurons(sorted_draws).pvalue.max() < 1e-6


def test_pca_explained_matches_numpy_eigenvalues():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(30, 7)) @ rng.normal(size=(7, 7))
    ratio = marginals.pca_explained(torch.from_numpy(x))
    eig = np.sort(np.linalg.eigvalsh(np.cov(x, rowvar=False)))[::-1]
    np.testing.assert_allclose(ratio.numpy(), eig / eig.sum(), rtol=1e-10, atol=1e-14)
    assert marginals.components_for(ratio, 1.0) <= 7
    assert marginals.components_for(ratio, ratio[0].item()) == 1
    # rank-2 data: two components explain everything
    low = rng.normal(size=(30, 2)) @ rng.normal(size=(2, 7))
    assert marginals.components_for(marginals.pca_explained(torch.from_numpy(low)), 0.999999) == 2


def test_flatten_and_condensed_distances_match_scipy():
    theta = {"a": torch.randn(6, 2, 3, dtype=torch.float64), "b": torch.randn(6, 4, dtype=torch.float64)}
    flat = marginals.flatten(theta)
    assert flat.shape == (6, 10) and torch.equal(flat[2, 6:], theta["b"][2])
    np.testing.assert_allclose(marginals.condensed_distances(flat).numpy(), pdist(flat.numpy()), rtol=1e-12)


def test_mean_shift_agrees_with_scikit_learn():
    from sklearn.cluster import MeanShift

    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(c, 0.3, (25, 2)) for c in [(0, 0), (3, 0), (0, 3)]])
    for h in (0.5, 2.0):
        ours, _ = marginals.mean_shift(x, h)
        ref = MeanShift(bandwidth=h).fit(x).cluster_centers_
        assert len(ours) == len(ref)
        ours_sorted = ours.numpy()[np.lexsort(ours.numpy().T)]
        np.testing.assert_allclose(ours_sorted, ref[np.lexsort(ref.T)], atol=1e-2 * h)
    assert marginals.meanshift_counts(x, [1.0, 6.0], standardize=False).tolist() == [3, 1]


def test_log10_modes_counts_hidden_permutations():
    assert marginals.log10_modes([10, 3, 4, 1]) == pytest.approx(np.log10(6 * 24))
