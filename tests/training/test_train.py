"""The stacked trainer against the plain single-model loop, and the recipes against PyTorch's schedulers."""

from __future__ import annotations

import dataclasses

import pytest
import scenarios
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from symlib import models
from symlib import training as T
from symlib.training import plans


def _double_stack(seeds):
    return {k: v.double() for k, v in T.init_params(models.OptuNet, seeds).items()}


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 4), b=st.integers(1, 5), seed=st.integers(0, 2**31), flat=st.booleans())
def test_stacked_forward_is_optunet(m, b, seed, flat):
    """optunet_forward(theta, x)[i] = OptuNet_i(x_i) in float64, per-model and shared inputs, also on images
    with flat regions, where the pooling windows hold ties."""
    seeds = list(range(seed, seed + m))
    theta = _double_stack(seeds)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, b, 1, 28, 28, generator=g, dtype=torch.float64)
    if flat:
        x = x[..., ::7, ::7].repeat_interleave(7, -2).repeat_interleave(7, -1)
    out = T.optunet_forward(theta, x)
    shared = T.optunet_forward(theta, x[0])
    for i, s in enumerate(seeds):
        net = T.init_model(models.OptuNet, s).double()
        torch.testing.assert_close(out[i], net(x[i]), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(shared[i], net(x[0]), rtol=1e-12, atol=1e-12)


def test_stacked_forward_rejects_wrong_images():
    theta = T.init_params(models.OptuNet, [0])
    with pytest.raises(ValueError, match="28, 28"):
        T.optunet_forward(theta, torch.zeros(1, 2, 1, 32, 32))


RECIPES = {
    "paper-optunet": T.OPTUNET_MNIST,
    "momentum-flip": dataclasses.replace(T.OPTUNET_MNIST, momentum=0.9, flip=True),
    "nesterov-cosine": dataclasses.replace(
        T.OPTUNET_MNIST, momentum=0.9, nesterov=True, schedule="cosine", epochs=3
    ),
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_stacked_trainer_equals_plain_loop(name):
    """Same seeds -> same init, batches, crops and SGD updates: the M-model trainer reproduces M runs of
    the plain nn.Module + torch.optim.SGD loop (float64, so agreement is to rounding)."""
    recipe = dataclasses.replace(RECIPES[name], batch_size=16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 1, 28, 28, generator=g, dtype=torch.float64)  # 3 batches, the last one smaller
    y = torch.randint(0, 10, (40,), generator=g)
    seeds = [5, 17, 2]
    fast = T.train_stacked(_double_stack(seeds), seeds, x, y, recipe, fill=-0.4, epochs=3)
    for i, s in enumerate(seeds):
        ref = T.train_plain(T.init_model(models.OptuNet, s).double(), s, x, y, recipe, fill=-0.4, epochs=3)
        for k, v in ref.named_parameters():
            torch.testing.assert_close(fast[k][i], v.detach(), rtol=1e-9, atol=1e-11)
    # negative control: another seed's run differs
    other = T.train_plain(T.init_model(models.OptuNet, 99).double(), 99, x, y, recipe, fill=-0.4, epochs=3)
    assert not torch.allclose(fast["fc.weight"][0], other.fc.weight, atol=1e-4)


def test_models_are_independent_runs():
    """Each seed has its own init and data stream, and the streams of one seed are not the same numbers."""
    a, b = T.streams(0), T.streams(1)
    assert len({*a, *b}) == 4
    p = T.init_params(models.OptuNet, [0, 1])
    assert not torch.equal(p["conv1.weight"][0], p["conv1.weight"][1])
    perms = [T.epoch_plan(torch.Generator().manual_seed(T.streams(s)[1]), 100, 4, False)[0] for s in (0, 1)]
    assert not torch.equal(*perms)
    with pytest.raises(ValueError, match="non-negative"):
        T.streams(-1)


@pytest.mark.parametrize("name", ["step", "cosine"])
def test_recipe_schedule_matches_torch(name):
    recipe = T.OPTUNET_MNIST if name == "step" else T.RESNET18_TINYIMAGENET
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=recipe.lr)
    sched = (
        torch.optim.lr_scheduler.MultiStepLR(opt, list(recipe.milestones), recipe.gamma)
        if name == "step"
        else torch.optim.lr_scheduler.CosineAnnealingLR(opt, recipe.epochs)
    )
    for epoch in range(recipe.epochs):
        assert recipe.lr_at(epoch) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        opt.step()
        sched.step()


def test_scaled_recipe_keeps_milestones_inside():
    r = T.OPTUNET_MNIST.scaled(10)
    assert r.epochs == 10 and r.milestones == (2, 5)
    assert T.OPTUNET_MNIST.scaled(1).milestones == ()
    with pytest.raises(ValueError, match="schedule"):
        T.Recipe(epochs=1, batch_size=1, lr=0.1, schedule="linear")


@pytest.mark.parametrize("channels", [1, 3])
def test_crop_is_a_window_of_the_padded_image(channels):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, channels, 6, 6, generator=g)
    fill = (-1.0, 0.5, 2.0)[:channels]
    xpad = T.pad_images(x, 2, fill=fill)
    assert torch.equal(xpad[:, :, 2:-2, 2:-2], x)
    assert torch.all(xpad[:, -1, 0] == fill[-1]) and torch.all(xpad[:, 0, :, -1] == fill[0])
    idx = torch.tensor([[4, 0], [2, 2]])
    aug = torch.tensor([[[0, 3, 0], [4, 1, 1]], [[2, 2, 0], [1, 0, 1]]])
    out = T.crop(xpad, idx, aug, 6)
    assert out.shape == (2, 2, channels, 6, 6)
    for i in range(2):
        for j in range(2):
            r, c, f = aug[i, j].tolist()
            ref = xpad[idx[i, j], :, r : r + 6, c : c + 6]
            assert torch.equal(out[i, j], ref.flip(-1) if f else ref)
    assert torch.equal(T.crop(xpad, idx, torch.full_like(aug, 2) * torch.tensor([1, 1, 0]), 6), x[idx])


def test_sgd_step_is_pure_and_matches_torch():
    recipe = dataclasses.replace(T.RESNET18_CIFAR100)
    p = {"w": torch.randn(2, 3)}
    grads = [{"w": torch.randn(2, 3)} for _ in range(3)]
    before = p["w"].clone()
    ref = p["w"].clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)
    theta, bufs = p, None
    for g in grads:
        theta, bufs = T.sgd_step(theta, g, bufs, 0.1, recipe)
        ref.grad = g["w"].clone()
        opt.step()
    assert torch.equal(p["w"], before)
    torch.testing.assert_close(theta["w"], ref.detach(), rtol=1e-6, atol=1e-7)


def test_evaluate_stacked_equals_per_model():
    seeds = [0, 1, 2]
    theta = T.init_params(models.OptuNet, seeds)
    x, y = torch.randn(30, 1, 28, 28), torch.randint(0, 10, (30,))
    acc, loss = T.evaluate_stacked(theta, x, y, batch_size=7)
    for i, s in enumerate(seeds):
        a, lo = T.evaluate_model(T.init_model(models.OptuNet, s), x, y, batch_size=7)
        assert acc[i].item() == pytest.approx(a) and loss[i].item() == pytest.approx(lo, rel=1e-5)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "recipe,classes,size", [(T.RESNET18_CIFAR100, 100, 32), (T.RESNET18_TINYIMAGENET, 200, 64)]
)
def test_paper_resnet_recipes_run_on_synthetic_data(recipe, classes, size, device):
    """The paper-scale ResNet-18 recipes (Nesterov/step and cosine) take real steps on images of the right
    shape: the loss is finite, the weights move, and the input model is left alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, size, size, generator=g).to(device)
    y = torch.randint(0, classes, (8,), generator=g).to(device)
    net = T.init_model(lambda: models.ResNet18(num_classes=classes, width=4), 0)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    trained = T.train_plain(net, 0, x, y, dataclasses.replace(recipe, batch_size=4), max_steps=2)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    moved = [
        not torch.equal(v.cpu(), before[k]) for k, v in trained.state_dict().items() if v.is_floating_point()
    ]
    assert all(moved)
    acc, loss = T.evaluate_model(trained, x, y)
    assert 0 <= acc <= 1 and torch.isfinite(torch.tensor(loss))


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 3), b=st.integers(1, 5), seed=st.integers(0, 2**31), flat=st.booleans())
def test_hand_written_gradient_is_autograd(m, b, seed, flat):
    """The stacked trainer's hand-written backward pass = autograd through optunet_forward (float64), also
    on images with flat regions, where the max-pool has ties and must pick the first maximum."""
    theta = _double_stack(list(range(seed, seed + m)))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, b, 1, 28, 28, generator=g, dtype=torch.float64)
    if flat:  # constant blocks: every pooling window that sees only one block is a tie
        x = x[..., ::7, ::7].repeat_interleave(7, -2).repeat_interleave(7, -1)
    y = torch.randint(0, 10, (m, b), generator=g)
    loss, grads = T.optunet_loss_grads(theta, x, y)
    leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
    logits = T.optunet_forward(leaves, x)
    ref = torch.stack([torch.nn.functional.cross_entropy(logits[i], y[i]) for i in range(m)])
    ref_grads = torch.autograd.grad(ref.sum(), list(leaves.values()))
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    for k, rg in zip(leaves, ref_grads, strict=True):
        torch.testing.assert_close(grads[k], rg, rtol=1e-10, atol=1e-12)


def test_fast_crop_equals_crop():
    """The trainer's row-gather crop gives exactly crop()'s windows (one channel, no flips)."""
    g = torch.Generator().manual_seed(3)
    xpad = T.pad_images(torch.randn(6, 1, 28, 28, generator=g), 4, fill=-0.5)
    idx = torch.randint(0, 6, (3, 5), generator=g)
    aug = torch.randint(0, 9, (3, 5, 3), generator=g)
    aug[..., 2] = 0
    assert torch.equal(plans.crop_rows(xpad, idx, aug, 28), T.crop(xpad, idx, aug, 28))


def test_dropout_mask_gradient_is_autograd():
    """loss_and_grads with a dropout mask on the features = autograd through OptuNet with that mask folded
    into the inputs of the last layer (float64)."""
    m, b = 2, 3
    theta = _double_stack([4, 9])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, b, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (m, b), generator=g)
    mask = (torch.rand(m, 10, b, generator=g) > 0.2).double() / 0.8
    loss, grads = T.loss_and_grads(theta, x, y, feat_mask=mask)
    ref, ref_grads = scenarios.optunet_reference(theta, x, y, mask)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    assert grads.keys() == ref_grads.keys()
    for k, rg in ref_grads.items():
        torch.testing.assert_close(grads[k], rg, rtol=1e-10, atol=1e-12)
    unmasked = T.loss_and_grads(theta, x, y)[0]
    assert not torch.allclose(unmasked, loss)


def test_minibatches_hook_sees_every_step():
    """train_stacked's on_step hook is called once per step with the updated parameters."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)
    recipe = dataclasses.replace(T.OPTUNET_MNIST, batch_size=16, epochs=2)
    seen = []
    out = T.train_stacked(T.init_params(models.OptuNet, [0, 1]), [0, 1], x, y, recipe,
                          on_step=lambda s, th: seen.append((s, th["fc.bias"].clone())))
    assert [s for s, _ in seen] == list(range(6))
    assert torch.equal(seen[-1][1], out["fc.bias"])
    batches = list(T.minibatches([0, 1], x, y, recipe))
    assert [b.last_in_epoch for b in batches] == [False, False, True] * 2
    assert batches[0].x.shape == (2, 16, 1, 28, 28) and batches[-1].x.shape == (2, 8, 1, 28, 28)


def _plan_reference(seed, epoch, n, padding, flip):
    """The counter-based plan of epoch_plans, recomputed with Python integers (no tensors, no overflow)."""
    mask = 0xFFFFFFFF

    def h32(v):
        v = ((v ^ (v >> 16)) * 0x7FEB352D) & mask
        v = ((v ^ (v >> 15)) * 0x5BD1E995) & mask
        return v ^ (v >> 16)

    key = T.streams(seed)[1]
    base = h32(key & mask) ^ h32((key >> 32) ^ 0x3C6EF372)
    base = h32(base ^ h32((epoch & mask) ^ 0x1B873593))

    def h(k):
        return h32(base ^ k)

    perm = sorted(range(n), key=lambda i: h(i) * n + i)
    aug = [
        [
            (h(n + 3 * t) * (2 * padding + 1)) >> 32 if padding else 0,
            (h(n + 3 * t + 1) * (2 * padding + 1)) >> 32 if padding else 0,
            h(n + 3 * t + 2) >> 31 if flip else 0,
        ]
        for t in range(n)
    ]
    return perm, aug


def test_epoch_plans_are_permutations_with_offsets_in_range():
    """Every model's order is a permutation of 0..n-1 and its offsets lie in 0..2p, the flips in {0, 1};
    different seeds and different epochs give different orders; the integers are exactly those of an
    independent Python-integer recomputation of the hash (so no device-dependent overflow or rounding)."""
    n, pad = 257, 4
    perms, augs = T.epoch_plans([0, 1, 2], 3, n, pad, True)
    assert perms.shape == (3, n) and augs.shape == (3, n, 3)
    for p in perms:
        assert torch.equal(p.sort().values, torch.arange(n))
    assert augs[..., :2].min() == 0 and augs[..., :2].max() == 2 * pad
    assert set(augs[..., 2].unique().tolist()) == {0, 1}
    assert not torch.equal(perms[0], perms[1]) and not torch.equal(perms[1], perms[2])
    assert not torch.equal(perms[0], T.epoch_plans([0], 4, n, pad, True)[0][0])
    for i, s in enumerate([0, 1, 2]):
        perm, aug = _plan_reference(s, 3, n, pad, True)
        assert perms[i].tolist() == perm and augs[i].tolist() == aug
    no_aug = T.epoch_plans([5], 0, 10, 0, False)[1]
    assert torch.equal(no_aug, torch.zeros(1, 10, 3, dtype=torch.int64))


def test_epoch_plans_are_uniform():
    """Chi-square checks at a loose level: the image at a given position, and the crop offsets, are
    uniform over models (a biased hash fails these by a wide margin)."""
    n, pad, m = 16, 4, 2000
    perms, augs = T.epoch_plans(range(m), 0, n, pad, True)
    counts = torch.bincount(perms[:, 0], minlength=n).double()
    chi2 = ((counts - m / n) ** 2 / (m / n)).sum()
    assert chi2 < 45  # 15 degrees of freedom: P(chi2 > 45) ~ 1e-4
    counts = torch.bincount(augs[:, :, 0].reshape(-1), minlength=9).double()
    e = m * n / 9
    assert ((counts - e) ** 2 / e).sum() < 35  # 8 degrees of freedom


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_epoch_plans_same_on_cuda():
    p, a = T.epoch_plans(range(8), 2, 1000, 4, True)
    pc, ac = T.epoch_plans(range(8), 2, 1000, 4, True, device="cuda")
    assert torch.equal(p, pc.cpu()) and torch.equal(a, ac.cpu())


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 3), b=st.integers(1, 4), seed=st.integers(0, 2**31), flat=st.booleans())
def test_conv_path_equals_matmul_path(m, b, seed, flat):
    """The grouped-convolution step (the CUDA default) gives the hand-written step's loss and gradient
    (float64 on CPU), with and without a dropout mask, also on images with max-pool ties."""
    theta = _double_stack(list(range(seed, seed + m)))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, b, 1, 28, 28, generator=g, dtype=torch.float64)
    if flat:
        x = x[..., ::7, ::7].repeat_interleave(7, -2).repeat_interleave(7, -1)
    y = torch.randint(0, 10, (m, b), generator=g)
    mask = (torch.rand(m, 10, b, generator=g) > 0.3).double() / 0.7
    for fm in (None, mask):
        lm, gm = T.loss_and_grads(theta, x, y, feat_mask=fm, impl="matmul")
        lc, gc = T.loss_and_grads(theta, x, y, feat_mask=fm, impl="conv")
        torch.testing.assert_close(lc, lm, rtol=1e-12, atol=1e-12)
        for k in gm:
            torch.testing.assert_close(gc[k], gm[k], rtol=1e-10, atol=1e-12)


def test_train_stacked_conv_path_equals_matmul_path():
    """Whole runs (momentum, weight decay, crops) agree between the two step implementations (float64),
    and a wrong impl is refused with the valid names."""
    recipe = dataclasses.replace(T.OPTUNET_MNIST, batch_size=16, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (40,), generator=g)
    seeds = [3, 8]
    a = T.train_stacked(_double_stack(seeds), seeds, x, y, recipe, fill=-0.4, epochs=2, impl="matmul")
    b = T.train_stacked(
        _double_stack(seeds), seeds, x, y, recipe, fill=-0.4, epochs=2, impl="conv", tf32=True
    )
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-9, atol=1e-11)
    with pytest.raises(ValueError, match="matmul"):
        T.train_stacked(_double_stack(seeds), seeds, x, y, recipe, impl="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_zoo_equals_cpu_zoo():
    """Same seeds -> the same models on CUDA (default path: grouped convolutions, FP32) as on CPU, within
    float32 tolerance after a few steps."""
    recipe = dataclasses.replace(T.OPTUNET_MNIST, batch_size=32)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g)
    seeds = list(range(6))
    cpu = T.train_stacked(T.init_params(models.OptuNet, seeds), seeds, x, y, recipe, epochs=1)
    gpu = T.train_stacked(T.init_params(models.OptuNet, seeds), seeds, x.cuda(), y.cuda(), recipe, epochs=1)
    for k in cpu:
        torch.testing.assert_close(gpu[k].cpu(), cpu[k], rtol=1e-3, atol=1e-4)


def test_worker_groups_do_not_change_the_result():
    """Splitting the models into groups computed by parallel threads gives the same run as one group
    (the models are independent), with the on_step hook seeing all models every step."""
    recipe = dataclasses.replace(T.OPTUNET_MNIST, batch_size=16, momentum=0.9)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (40,), generator=g)
    seeds = [1, 2, 3, 4, 5]
    seen = []
    one = T.train_stacked(_double_stack(seeds), seeds, x, y, recipe, epochs=2, workers=1)
    three = T.train_stacked(_double_stack(seeds), seeds, x, y, recipe, epochs=2, workers=3,
                            on_step=lambda s, th: seen.append(th["fc.bias"].shape[0]))
    assert seen == [5] * 6
    for k in one:
        torch.testing.assert_close(three[k], one[k], rtol=1e-12, atol=1e-14)
    # without a per-step hook every group trains on its own thread, start to end: same weights
    epochs_seen = []
    free = T.train_stacked(_double_stack(seeds), seeds, x, y, recipe, epochs=2, workers=3,
                           on_epoch=epochs_seen.append)
    assert epochs_seen == [0, 1]
    for k in one:
        torch.testing.assert_close(free[k], one[k], rtol=1e-12, atol=1e-14)
    short = T.train_stacked(_double_stack(seeds), seeds, x, y, recipe, epochs=2, workers=3, max_steps=4)
    ref = T.train_stacked(_double_stack(seeds), seeds, x, y, recipe, epochs=2, workers=1, max_steps=4)
    for k in ref:
        torch.testing.assert_close(short[k], ref[k], rtol=1e-12, atol=1e-14)


def test_loss_and_grads_worker_groups_do_not_change_the_result():
    """loss_and_grads split over a pool of threads (with and without a dropout mask) = one group, and
    restores the caller's intra-op thread count."""
    m, b = 5, 4
    theta = _double_stack([3, 1, 4, 1, 5])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, b, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (m, b), generator=g)
    mask = (torch.rand(m, 10, b, generator=g) > 0.2).double() / 0.8
    before = torch.get_num_threads()
    for fm in (None, mask):
        loss1, g1 = T.loss_and_grads(theta, x, y, feat_mask=fm, workers=1)
        loss3, g3 = T.loss_and_grads(theta, x, y, feat_mask=fm, workers=3)
        assert torch.get_num_threads() == before
        torch.testing.assert_close(loss3, loss1, rtol=1e-13, atol=0)
        assert g3.keys() == g1.keys()
        for k in g1:
            torch.testing.assert_close(g3[k], g1[k], rtol=1e-13, atol=1e-15)


def test_non_finite_images_are_refused_before_training():
    """The compiled step does not see NaN pixels (its max-pool's ``v > best`` skips them, so the loss
    stays finite) while the PyTorch path propagates them: train_stacked and the posterior methods' loop
    refuse such data once, before the first step, naming the images."""
    from symlib import kernels
    from symlib.training import loop

    recipe = dataclasses.replace(T.OPTUNET_MNIST, batch_size=8)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    x[5, 0, 3, 4] = float("nan")
    x[9, 0, 0, 0] = float("inf")
    theta = T.init_params(models.OptuNet, [1, 2])
    msg = r"2 training image\(s\) hold NaN or infinite pixels \(indices \[5, 9\]\)"
    if kernels.available():  # the hazard the check guards against
        loss, _ = T.loss_and_grads(theta, x[None, :8].expand(2, -1, -1, -1, -1), y[None, :8].expand(2, -1),
                                   impl="native", workers=1)
        assert bool(torch.isfinite(loss).all())
    for impl in ("native", "matmul") if kernels.available() else ("matmul",):
        with pytest.raises(ValueError, match=msg):
            T.train_stacked(theta, [1, 2], x, y, recipe, impl=impl, max_steps=1)
    rule = loop.StackedSGD(recipe)
    with pytest.raises(ValueError, match="swag: 2 training image.*fix or drop them"):
        loop.run(rule, rule.init(theta), [1, 2], x, y, recipe, what="swag")


def test_worker_threads_do_not_oversubscribe_the_cores(monkeypatch):
    """Thread budget: the trainer's worker threads (one group of models each) run one intra-op thread
    each, and the caller drops to one while they run, so torch threads x worker threads stays at the
    caller's thread count (the cores by default); the caller's count is restored afterwards."""
    from symlib.training import stacked

    before = torch.get_num_threads()
    seen = []
    real = stacked.step_function

    def counting(*a, **k):
        fn = real(*a, **k)
        return lambda *a, **k: (seen.append(torch.get_num_threads()), fn(*a, **k))[1]

    monkeypatch.setattr(stacked, "step_function", counting)
    recipe = dataclasses.replace(T.OPTUNET_MNIST, batch_size=8)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)
    for hook in (None, lambda step, theta: seen.append(torch.get_num_threads())):
        seen.clear()
        T.train_stacked(T.init_params(models.OptuNet, [1, 2, 3]), [1, 2, 3], x, y, recipe, impl="matmul",
                        workers=2, max_steps=2, on_step=hook)
        assert seen and set(seen) == {1}, seen  # the groups' steps, and the caller during the run
        assert torch.get_num_threads() == before
    seen.clear()
    T.loss_and_grads(T.init_params(models.OptuNet, [1, 2]), x[None, :8].expand(2, -1, -1, -1, -1),
                     y[None, :8].expand(2, -1), impl="matmul", workers=2)
    assert set(seen) == {1} and torch.get_num_threads() == before
