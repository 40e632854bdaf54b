"""Permutation frequency during training (paper §5.2): Kendall's tau and the per-step hook."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats

from symlib import models
from symlib import training as train
from symlib.paper import permfreq
from symlib.symmetry import canonical, trace
from symlib.symmetry import spec as spec_mod


def _random_perms(shape, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, n, generator=g).argsort(-1)


@pytest.mark.parametrize("n", [2, 3, 10, 33])
def test_kendall_tau_equals_scipy_on_random_permutations(n):
    r, s = _random_perms((4, 5), n, 0), _random_perms((4, 5), n, 1)
    tau = permfreq.kendall_tau(r, s)
    assert tau.shape == (4, 5) and tau.dtype == torch.float64
    for i in range(4):
        for j in range(5):
            ref = stats.kendalltau(r[i, j].numpy(), s[i, j].numpy()).statistic
            assert tau[i, j].item() == pytest.approx(ref, abs=1e-12)


def test_kendall_tau_identity_is_one_and_reversal_minus_one():
    for n in (2, 5, 64):
        p = _random_perms((3,), n, n)
        assert torch.equal(permfreq.kendall_tau(p, p), torch.ones(3, dtype=torch.float64))
        rev = (n - 1) - p  # every pair of neurons in the opposite order
        assert torch.allclose(permfreq.kendall_tau(p, rev), -torch.ones(3, dtype=torch.float64))


def test_kendall_tau_one_adjacent_swap():
    # (1 - tau) / 2 is the fraction of pairs that swapped: one swap among n(n-1)/2 pairs
    n = 7
    r = torch.arange(n)
    s = r.clone()
    s[[2, 3]] = s[[3, 2]]
    assert permfreq.kendall_tau(r, s).item() == pytest.approx(1 - 2 / (n * (n - 1) / 2))


def test_kendall_tau_padded_layers_match_separate_calls():
    # layers of widths 2, 5, 9 stacked with padding give the same taus as one call per layer
    widths = [2, 5, 9]
    rs = [_random_perms((6,), n, 10 + n) for n in widths]
    ss = [_random_perms((6,), n, 20 + n) for n in widths]
    pad = lambda ts: torch.stack([torch.nn.functional.pad(t, (0, 9 - t.shape[-1]), value=7) for t in ts], 1)  # noqa: E731
    tau = permfreq.kendall_tau(pad(rs), pad(ss), torch.tensor(widths))
    for l in range(len(widths)):
        assert torch.allclose(tau[:, l], permfreq.kendall_tau(rs[l], ss[l]), atol=1e-12)
    with pytest.raises(ValueError, match="lengths"):
        permfreq.kendall_tau(pad(rs), pad(ss), torch.tensor([1, 5, 9]))


def test_kendall_tau_vectorised_over_steps_equals_scipy():
    # a sequence of steps x runs x layers: tau between successive steps, one call
    seq = _random_perms((5, 3, 2), 6, 3)
    tau = permfreq.kendall_tau(seq[1:], seq[:-1])
    ref = np.array([[[stats.kendalltau(seq[t + 1, m, l], seq[t, m, l]).statistic for l in range(2)]
                     for m in range(3)] for t in range(4)])
    np.testing.assert_allclose(tau.numpy(), ref, atol=1e-12)


def _optunet_spec():
    return trace.spec_of(models.OptuNet(), (1, 28, 28))


def test_sorting_ranks_invert_the_canonical_permutations():
    spec = _optunet_spec()
    theta = train.init_params(models.OptuNet, [0, 1, 2])
    rk = permfreq.sorting_ranks(theta, spec, "max")
    perms = canonical.sort_perms(theta, spec, key="max")
    assert rk.shape == (3, 2, 10)
    for l, (label, n) in enumerate(spec.perms.items()):
        # rank[perm[i]] = i: the neuron placed at position i has rank i
        assert torch.equal(torch.gather(rk[:, l, :n], -1, perms[label]), torch.arange(n).expand(3, n))


def test_tracker_taus_are_one_when_weights_do_not_change():
    spec = _optunet_spec()
    theta = train.init_params(models.OptuNet, [0, 1])
    tracker = permfreq.PermutationTracker(spec, init=theta, lr_at=lambda s: 0.5)
    for step in range(3):
        tracker(step, {k: v.clone() for k, v in theta.items()})
    res = tracker.result()
    for k in permfreq.KEYS:
        assert res.tau[k].shape == (3, 2, 2)
        assert torch.equal(res.tau[k], torch.ones(3, 2, 2, dtype=torch.float64))
        assert int(res.changed[k].sum()) == 0
    assert res.lr.tolist() == [0.5] * 3 and res.steps.tolist() == [0, 1, 2]


def test_tracker_inside_the_stacked_trainer_with_zero_learning_rate():
    # lr = 0: SGD leaves the weights as they are, so no layer may register a permutation
    spec = _optunet_spec()
    seeds = [0, 1]
    theta = train.init_params(models.OptuNet, seeds)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g)
    recipe = train.Recipe(epochs=1, batch_size=16, lr=0.0)
    tracker = permfreq.PermutationTracker(spec, init=theta, lr_at=permfreq.lr_schedule(recipe, 64))
    train.train_stacked(theta, seeds, x, y, recipe, on_step=tracker)
    res = tracker.result()
    assert res.tau["max"].shape == (4, 2, 2) and bool((res.tau["max"] == 1).all())
    assert bool((res.tau["first"] == 1).all()) and res.lr.tolist() == [0.0] * 4


def test_tracker_records_a_planted_swap_like_scipy():
    # an MLP 3-6-2: overwrite one neuron's incoming weights so that its max key moves in the order
    net = models.MLP([3, 6, 2]).double()
    spec = spec_mod.mlp_spec(net)
    theta = {k: v.detach().clone().unsqueeze(0) for k, v in net.state_dict().items()}
    tracker = permfreq.PermutationTracker(spec, keys=["max"], init=theta)
    moved = {k: v.clone() for k, v in theta.items()}
    w = moved["0.weight"][0]
    lo = int(w.amax(1).argmin())
    w[lo] = w[lo] + (w.amax() - w[lo].amax()) + 1.0  # the smallest key becomes the largest
    tracker(0, moved)
    res = tracker.result()
    before = permfreq.sorting_ranks(theta, spec, "max")[0, 0].numpy()
    after = permfreq.sorting_ranks(moved, spec, "max")[0, 0].numpy()
    assert res.tau["max"][0, 0, 0].item() == pytest.approx(stats.kendalltau(after, before).statistic)
    assert res.tau["max"][0, 0, 0].item() == pytest.approx(1 - 2 * 5 / 15)  # it overtook 5 neurons
    assert int(res.changed["max"][0, 0, 0]) == 6  # every neuron's rank moved by one or five


def test_tracker_errors_are_clear():
    spec = _optunet_spec()
    with pytest.raises(ValueError, match="keys"):
        permfreq.PermutationTracker(spec, keys=["median"])
    with pytest.raises(ValueError, match="no step recorded"):
        permfreq.PermutationTracker(spec).result()


def test_phase_means_and_lr_schedule():
    recipe = train.Recipe(epochs=4, batch_size=10, lr=0.4, milestones=(1, 3), gamma=0.5)
    lr_at = permfreq.lr_schedule(recipe, 25)  # 3 steps per epoch
    lr = torch.tensor([lr_at(s) for s in range(12)], dtype=torch.float64)
    assert lr.tolist() == [0.4] * 3 + [0.2] * 6 + [0.1] * 3
    vals = torch.arange(12, dtype=torch.float64)
    assert permfreq.phase_means(vals, lr) == {0.4: 1.0, 0.2: 5.5, 0.1: 10.0}


def test_tracker_records_the_size_of_each_step():
    spec = _optunet_spec()
    theta = train.init_params(models.OptuNet, [0, 1])
    tracker = permfreq.PermutationTracker(spec, keys=["max"], init=theta)
    moved = {k: v.clone() for k, v in theta.items()}
    moved["fc.bias"][1, 0] += 0.5
    tracker(0, moved)
    assert torch.allclose(tracker.result().motion, torch.tensor([[0.0, 0.5]], dtype=torch.float64))


def test_key_gaps_by_hand():
    # two runs of a layer of three neurons with two incoming weights each
    w = torch.tensor([[[0.0, 1.0], [0.5, 0.2], [2.0, -1.0]],
                      [[0.1, 0.4], [0.3, 0.0], [0.9, 0.9]]])
    theta = {"fc.weight": w}
    # max keys: (1.0, 0.5, 2.0) and (0.4, 0.3, 0.9): sorted gaps 0.5, 1.0, 0.1, 0.5 -> median 0.5
    assert permfreq.key_gaps(theta, ["fc.weight"], "max") == pytest.approx(0.5)
    # first keys: (0.0, 0.5, 2.0) and (0.1, 0.3, 0.9): gaps 0.5, 1.5, 0.2, 0.6 -> lower median 0.5
    assert permfreq.key_gaps(theta, ["fc.weight"], "first") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="key must be"):
        permfreq.key_gaps(theta, ["fc.weight"], "sum")


def test_noise_flips_grow_with_the_noise():
    spec = trace.spec_of(models.OptuNet(), (1, 28, 28))
    theta = train.init_params(models.OptuNet, [0, 1, 2, 3])
    frame = permfreq.noise_flips(theta, spec, [0.0, 1e-4, 10.0], repeats=3, seed=0)
    assert list(frame.columns) == list(permfreq.KEYS) and list(frame.index) == [0.0, 1e-4, 10.0]
    assert (frame.loc[0.0] == 0).all()  # no noise, no change of order
    assert ((frame >= 0) & (frame <= 1)).all().all()
    assert (frame.loc[10.0] > frame.loc[1e-4]).all()  # noise far above the gaps reorders most layers
    assert frame.loc[10.0].min() > 0.5
    again = permfreq.noise_flips(theta, spec, [0.0, 1e-4, 10.0], repeats=3, seed=0)
    pd.testing.assert_frame_equal(frame, again)
