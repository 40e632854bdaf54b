"""The ResNet-18 halves of the chapters "Functional collapse" (paper §5.1, App. D.2, Fig. 3 and 8) and
"Permutations during training" (§5.2, Fig. 4 right): the per-step hook of the plain trainer, sorting
permutations of a ResNet-18 (residual streams permute as one), the paper-scale pipelines run end to end
on synthetic images of the right shapes, and the clear errors when a real dataset is missing."""

from __future__ import annotations

import dataclasses
import math

import matplotlib
import numpy as np
import pytest
import torch
from scipy import stats
from scipy.spatial.distance import squareform

from symlib import models, threads, zoo
from symlib import training as train
from symlib.paper import collapse, permfreq
from symlib.plotting import collapse as plotting_collapse
from symlib.stats import pairwise_mi, predict
from symlib.symmetry import canonical, check, ops, trace

matplotlib.use("Agg")
LN2 = math.log(2)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    with threads.single():  # tiny networks: threads only add contention on a shared machine
        yield


def _images(n, classes, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)


def _resnet(width=2, classes=100):
    return models.ResNet18(num_classes=classes, width=width)


# ------------------------------------------------------------------------- the hook of train_plain
def test_train_plain_hook_sees_every_step_with_the_state_after_it():
    x, y = _images(40, 100)
    recipe = train.Recipe(epochs=2, batch_size=16, lr=0.05, momentum=0.9, milestones=(1,), crop_padding=2,
                          flip=True)
    net = train.init_model(_resnet, 3)
    seen = []
    out = train.train_plain(net, 3, x, y, recipe, on_step=lambda s, p: seen.append(
        (s, {k: v.clone() for k, v in p.items()})))
    # 40 images in batches of 16: 3 steps per epoch, 2 epochs; global step index from 0
    assert [s for s, _ in seen] == list(range(6))
    state = out.state_dict()
    for _, p in seen:
        assert set(p) == set(state) and all(p[k].shape == (1, *state[k].shape) for k in state)
        assert not any(v.requires_grad for v in p.values())
    # the hook sees the state right after the step: the last call is the trained model, and the call at
    # step 1 is the model that training for exactly 2 steps returns
    assert all(torch.equal(seen[-1][1][k][0], state[k]) for k in state)
    two = train.train_plain(net, 3, x, y, recipe, max_steps=2).state_dict()
    assert all(torch.equal(seen[1][1][k][0], two[k]) for k in two)
    assert not torch.equal(seen[0][1]["conv1.weight"], seen[1][1]["conv1.weight"])


# ------------------------------------------------------------- sorting permutations of a ResNet-18
def _axis_labels(spec):
    return {(a.param, a.axis): a.perm for a in spec.actions if a.perm is not None}


def test_resnet18_residual_streams_are_one_permutation_label():
    spec = trace.spec_of(_resnet(width=4), (3, 32, 32))
    lab = _axis_labels(spec)
    # every convolution writing into a stage's residual stream (stem or first shortcut, every block's
    # conv2) and every convolution reading from it carries the same label: one permutation per stream
    stem = {lab[("conv1.weight", 0)], lab[("layer1.0.conv2.weight", 0)], lab[("layer1.1.conv2.weight", 0)],
            lab[("layer1.0.conv1.weight", 1)], lab[("layer2.0.shortcut.0.weight", 1)]}
    stage2 = {lab[("layer2.0.conv2.weight", 0)], lab[("layer2.0.shortcut.0.weight", 0)],
              lab[("layer2.1.conv2.weight", 0)], lab[("layer2.1.conv1.weight", 1)],
              lab[("layer3.0.conv1.weight", 1)]}
    assert len(stem) == 1 and len(stage2) == 1 and stem != stage2
    # 4 streams + 8 inner block layers; rank tensors padded to the widest (8 x width)
    assert len(spec.perms) == 12
    theta = {k: v.unsqueeze(0) for k, v in _resnet(width=4).state_dict().items()}
    rk = permfreq.sorting_ranks(theta, spec, "max")
    assert rk.shape == (1, 12, 32)
    for l, n in enumerate(spec.perms.values()):
        assert torch.equal(rk[0, l, :n].sort().values, torch.arange(n))  # a permutation of 0..n-1


def _random_bn(model, seed):
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
            m.weight.data.copy_(0.5 + torch.rand(m.weight.shape, generator=g))
            m.bias.data.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    return model


@pytest.mark.parametrize("key", ["max", "first"])
def test_resnet18_sorting_ranks_follow_a_permutation_of_the_network(key):
    """If theta' = P theta (new channel i is old channel perm[i], streams permuted as one), the network
    computes the same function and the rank of new channel i is the rank of old channel perm[i]; the
    tracker's Kendall tau between the two is scipy's tau of the two rank vectors."""
    nets = [_random_bn(train.init_model(lambda: _resnet(width=4).double(), s), s) for s in (0, 1)]
    spec = trace.spec_of(nets[0], (3, 32, 32))
    theta = {k: torch.stack([n.state_dict()[k] for n in nets]) for k in nets[0].state_dict()}
    g = torch.Generator().manual_seed(7)
    perms = {label: torch.stack([torch.randperm(n, generator=g) for _ in range(2)])
             for label, n in spec.perms.items()}
    moved = ops.permute(theta, spec, perms)
    check.assert_same_function(spec, theta, moved, what="a ResNet-18 permutation with tied residual streams")
    rk, rk_moved = permfreq.sorting_ranks(theta, spec, key), permfreq.sorting_ranks(moved, spec, key)
    tracker = permfreq.PermutationTracker(spec, keys=[key], init=theta)
    tracker(0, moved)
    tau = tracker.result().tau[key][0]
    for l, (label, n) in enumerate(spec.perms.items()):
        assert torch.equal(rk_moved[:, l, :n], torch.gather(rk[:, l, :n], -1, perms[label]))
        for m in range(2):
            ref = stats.kendalltau(rk_moved[m, l, :n].numpy(), rk[m, l, :n].numpy()).statistic
            assert tau[m, l].item() == pytest.approx(ref, abs=1e-12)
    assert bool(((tau >= -1) & (tau <= 1)).all())


def test_tracker_motion_keys():
    net = _resnet()
    spec = trace.spec_of(net, (3, 32, 32))
    theta = permfreq.stacked_state(net)
    names = [n for n, _ in net.named_parameters()]
    tracker = permfreq.PermutationTracker(spec, keys=["max"], init=theta, motion_keys=names)
    moved = {k: v.clone() for k, v in theta.items()}
    moved["bn1.running_var"] += 3.0  # a buffer: not a step of the optimiser
    moved["fc.bias"][0, 1] += 0.25
    tracker(0, moved)
    assert tracker.result().motion.item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="motion_keys"):
        permfreq.PermutationTracker(spec, motion_keys=["fc.weights"])


# -------------------------------------------------------------- permutation frequency, paper scale
def test_milestone_steps_from_the_recipes():
    # paper: ResNet-18 on the 50,000 CIFAR-100 images, batch 128 (391 steps per epoch), lr / 10 at
    # epochs 25 and 50
    assert permfreq.milestone_steps(train.RESNET18_CIFAR100, 50_000) == [25 * 391, 50 * 391]
    assert permfreq.milestone_steps(train.RESNET18_TINYIMAGENET, 100_000) == []  # cosine
    rec = train.Recipe(epochs=4, batch_size=10, lr=0.4, milestones=(1, 3, 9), gamma=0.5)
    lr_at = permfreq.lr_schedule(rec, 25)
    ms = permfreq.milestone_steps(rec, 25)
    assert ms == [3, 9]  # milestone 9 lies beyond training
    assert [s for s in range(1, 12) if lr_at(s) != lr_at(s - 1)] == ms


def _tiny_cifar_cfg():
    # the tiny smoke-test preset (random 32x32 images, 100 classes, ResNet-18 of width 4), with the
    # paper's recipe shrunk to 3 epochs (milestones at epochs 1 and 2) and batches of 16: 4 steps/epoch
    cfg = zoo.preset("cifar100-resnet18", "tiny")
    recipe = dataclasses.replace(train.RESNET18_CIFAR100.scaled(3), batch_size=16)
    return dataclasses.replace(cfg, recipe=recipe)


def test_track_zoo_recipe_end_to_end_on_synthetic_cifar_shapes():
    cfg = _tiny_cifar_cfg()
    out = permfreq.track_zoo_recipe(cfg, [10_000, 10_001], progress=False)
    res = out.record
    assert out.epoch_steps == 4 and out.milestones == [4, 8]
    assert res.steps.tolist() == list(range(12)) and len(res.layers) == 12
    assert res.lr.tolist() == pytest.approx([0.1] * 4 + [0.01] * 4 + [0.001] * 4)
    for k in permfreq.KEYS:
        assert res.tau[k].shape == (12, 2, 12)
        assert bool(((res.tau[k] >= -1) & (res.tau[k] <= 1)).all())
        assert bool(((res.tau[k] == 1) == (res.changed[k] == 0)).all())
        assert res.mean_tau(k).shape == (12,)
    assert bool((res.motion > 0).all()) and res.motion.shape == (12, 2)
    # the step size follows the learning rate: the lr / 10 phases move the weights much less
    assert float(res.motion[8:].mean()) < float(res.motion[:4].mean()) / 3
    assert len(out.test_acc) == 2 and all(0 <= a <= 1 for a in out.test_acc)
    # runs are independent: the second run alone gives the second column
    d = zoo.load_data(cfg)
    alone, _ = permfreq.track_plain(cfg.make_model, [10_001], d.x, d.y, cfg.recipe,
                                    trace.spec_of(cfg.make_model(), (3, 32, 32)), fill=d.fill)
    assert torch.equal(alone.tau["max"][:, 0], res.tau["max"][:, 1])
    assert torch.equal(alone.motion[:, 0], res.motion[:, 1])
    taus = {k: res.mean_tau(k).numpy() for k in res.tau}
    fig = plotting_collapse.kendall_tau(res.steps.numpy(), taus, res.lr.numpy(), epoch_steps=out.epoch_steps,
                                        milestones=out.milestones)
    marked = [ln for ln in fig.axes[0].lines if list(ln.get_xdata()) in ([4, 4], [8, 8])]
    assert len(marked) == 2
    with pytest.raises(ValueError, match="other layers or steps"):
        permfreq.concat_runs([res, dataclasses.replace(res, steps=res.steps + 1)])


# ------------------------------------------------------------------- functional collapse, paper scale
def test_pairwise_study_duplicates_have_zero_mi_and_r_is_pearsons():
    theta = train.init_params(models.OptuNet, [0, 1, 2, 3])
    theta = {k: torch.cat([v, v[:1]]).double() for k, v in theta.items()}  # model 4 = model 0
    g = torch.Generator().manual_seed(0)
    x_id, x_ood = torch.randn(30, 1, 28, 28, generator=g), 3 * torch.rand(30, 1, 28, 28, generator=g)
    st = collapse.pairwise_study(theta, x_id, x_ood, dtype=torch.float64)
    assert st.n_models == 5 and st.n_pairs == 10 and st.mi_id.dtype == np.float64
    sq = squareform(st.mi_id, checks=False)
    assert sq[0, 4] == pytest.approx(0, abs=1e-12)  # a network with itself: no disagreement
    assert (np.delete(st.mi_id, 3) > 1e-6).all()  # condensed index of (0, 4) is 3
    for v in (st.mi_id, st.mi_ood):
        assert (v > -1e-12).all() and (v < LN2).all()
    ref = stats.pearsonr(st.mi_id, st.mi_ood)
    assert st.r == pytest.approx(ref.statistic) and st.p_value == pytest.approx(ref.pvalue)
    assert st.ci[0] < st.r < st.ci[1]


@pytest.mark.parametrize("name, size, classes, labels", [
    ("cifar100-resnet18", 32, 100, ("CIFAR-100 (synthetic)", "SVHN (synthetic)")),
    ("tinyimagenet-resnet18", 64, 200, ("TinyImageNet (synthetic)", "Textures (synthetic)")),
])
def test_zoo_collapse_end_to_end_on_synthetic_resnets(name, size, classes, labels, tmp_path):
    cfg = dataclasses.replace(zoo.preset(name, "tiny"), n_models=4)
    st, manifest = collapse.zoo_collapse(cfg, cache_dir=tmp_path, n_images=24, dtype=torch.float64,
                                         progress=False)
    assert st.labels == labels and st.n_models == 4 and st.n_pairs == 6 and st.n_id == st.n_ood == 24
    assert len(manifest["models"]) == 4
    for v in (st.mi_id, st.mi_ood):
        assert np.isfinite(v).all() and (v > -1e-9).all() and (v < LN2 + 1e-9).all()
    # the same numbers as the chapter's route: probabilities of every checkpoint, the square MI matrix
    params, _ = zoo.load(zoo.cache_path(cfg, tmp_path))
    x_id, x_ood, _ = collapse.eval_sets(cfg, 24)
    assert x_id.shape == x_ood.shape == (24, 3, size, size)
    p = predict.probs(params, x_ood, arch=cfg.make_model, dtype=torch.float64)
    assert p.shape == (4, 24, classes)
    sq = pairwise_mi.pairwise_mi(p, square=True).numpy()
    assert np.allclose(sq, sq.T) and np.allclose(np.diag(sq), 0)
    np.testing.assert_allclose(squareform(sq, checks=False), st.mi_ood, rtol=1e-10, atol=1e-14)

    def h(q):
        return -(q * q.log()).sum(-1)

    direct = float((h((p[1] + p[3]) / 2) - (h(p[1]) + h(p[3])) / 2).mean())  # pair (1, 3): index 4
    assert st.mi_ood[4] == pytest.approx(direct, rel=1e-9, abs=1e-14)
    assert st.r == pytest.approx(stats.pearsonr(st.mi_id, st.mi_ood).statistic)


def test_too_few_checkpoints_or_pairs_are_refused():
    with pytest.raises(ValueError, match="at least 4"):
        collapse.zoo_collapse(zoo.preset("cifar100-resnet18", "tiny"))  # 2 checkpoints
    with pytest.raises(ValueError, match="at least 4 pairs"):
        collapse.correlation(np.array([0.1, 0.2, 0.3]), np.array([0.2, 0.1, 0.3]))
    with pytest.raises(ValueError, match="constant"):
        collapse.correlation(np.full(6, 0.1), np.arange(6.0))


@pytest.mark.parametrize("name, missing", [
    ("cifar100-resnet18", "cifar-100-python"), ("tinyimagenet-resnet18", "tiny-imagenet-200"),
])
def test_paper_scale_without_the_datasets_raises_the_data_error(name, missing, tmp_path, monkeypatch):
    monkeypatch.setenv("SYMLIB_DATA", str(tmp_path / "nodata"))
    monkeypatch.setenv("SYMLIB_CACHE", str(tmp_path / "cache"))
    cfg = zoo.preset(name, "paper")
    with pytest.raises(FileNotFoundError, match=f"{missing}.*download=True"):
        collapse.zoo_collapse(cfg)
    assert not (tmp_path / "cache").exists()  # failed before training anything
    with pytest.raises(FileNotFoundError, match=f"{missing}.*download=True"):
        permfreq.track_zoo_recipe(cfg, [10_000], progress=False)



@pytest.mark.parametrize("make, shape", [
    (lambda: models.ResNet18(num_classes=10, width=4), (3, 32, 32)),
    (lambda: models.MLP([5, 9, 7, 3]), (5,)),
])
def test_fast_max_ranks_equal_the_canonical_sort(make, shape):
    # the per-step path reads the ranks off the unpermuted weights; canonical.sort_perms permutes layer
    # after layer: both must give the same ranks, including exact ties of the largest weight
    nets = [_random_bn(train.init_model(make, s), s) for s in range(3)]
    spec = trace.spec_of(nets[0], shape)
    theta = {k: torch.stack([n.state_dict()[k] for n in nets]) for k in nets[0].state_dict()}
    first = next(iter(spec.perms))
    w = spec.incoming(first, "perm")[0].param
    theta[w][0, 1] = theta[w][0, 0]  # neurons 0 and 1 of the first layer tie on every key but the bias
    perms = canonical.sort_perms(theta, spec, key="max")
    fast = permfreq.sorting_ranks(theta, spec, "max")
    for l, (label, n) in enumerate(spec.perms.items()):
        assert torch.equal(fast[:, l, :n], perms[label].argsort(-1))
    bad = {k: v.clone() for k, v in theta.items()}
    bad[w][1, 0] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        permfreq.sorting_ranks(bad, spec, "max")
