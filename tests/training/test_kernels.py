"""The compiled OptuNet step (symlib.kernels) against autograd and the PyTorch paths."""

from __future__ import annotations

import dataclasses

import pytest
import scenarios
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from symlib import kernels, models
from symlib import training as T
from symlib.stats import pairwise_mi
from symlib.training import optunet

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=f"no native kernel: {kernels.unavailable_reason()}"
)


def _stack(seeds, dtype=torch.float64):
    return {k: v.to(dtype) for k, v in T.init_params(models.OptuNet, seeds).items()}


def _images(m, b, seed, flat, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, b, 1, 28, 28, generator=g, dtype=dtype)
    if flat:  # constant 7 x 7 blocks: pooling windows inside one block are ties (the first maximum wins)
        x = x[..., ::7, ::7].repeat_interleave(7, -2).repeat_interleave(7, -1)
    return x, torch.randint(0, 10, (m, b), generator=g), g


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 3), b=st.integers(1, 37), seed=st.integers(0, 2**31), flat=st.booleans())
def test_native_step_is_autograd(m, b, seed, flat):
    """Loss and gradient of the fused kernel = autograd through nn.Module OptuNets (float64), with and
    without a dropout mask, for batch sizes that are not whole vectors, and with max-pool ties."""
    theta = _stack(list(range(seed % 1000, seed % 1000 + m)))
    x, y, g = _images(m, b, seed, flat)
    mask = (torch.rand(m, 10, b, generator=g, dtype=torch.float64) > 0.25).double() / 0.75
    for fm in (None, mask):
        loss, grads = kernels.optunet_loss_grads(theta, x, y, feat_mask=fm)
        ref, ref_grads = scenarios.optunet_reference(theta, x, y, fm)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        assert grads.keys() == ref_grads.keys()
        for k, rg in ref_grads.items():
            torch.testing.assert_close(grads[k], rg, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("b", [1, 16, 64, 70])
def test_native_float32_equals_matmul_path(b):
    """In float32 the kernel agrees with the hand-written PyTorch step to float32 rounding."""
    theta = _stack(range(4), torch.float32)
    x, y, _ = _images(4, b, 1, False, torch.float32)
    ln, gn = kernels.optunet_loss_grads(theta, x, y)
    lm, gm = T.loss_and_grads(theta, x, y, impl="matmul")
    torch.testing.assert_close(ln, lm, rtol=1e-5, atol=1e-6)
    for k in gm:
        torch.testing.assert_close(gn[k], gm[k], rtol=1e-4, atol=1e-6)


def test_fused_crop_equals_crop_then_step():
    """The crop done inside the kernel = symlib.training.plans.crop followed by the kernel, exactly."""
    g = torch.Generator().manual_seed(5)
    xpad = T.pad_images(torch.randn(9, 1, 28, 28, generator=g, dtype=torch.float64), 4, fill=-0.4)
    m, b = 3, 21
    idx = torch.randint(0, 9, (m, b), generator=g)
    aug = torch.randint(0, 9, (m, b, 3), generator=g)
    aug[..., 2] = 0
    yall = torch.randint(0, 10, (9,), generator=g)
    theta = _stack([7, 8, 9])
    l1, g1 = kernels.optunet_loss_grads_crop(theta, xpad, idx, aug, yall[idx])
    l2, g2 = kernels.optunet_loss_grads(theta, T.crop(xpad, idx, aug, 28), yall[idx])
    assert torch.equal(l1, l2)
    for k in g1:
        assert torch.equal(g1[k], g2[k])
    aug[0, 0, 2] = 1
    with pytest.raises(ValueError, match="flip"):
        kernels.optunet_loss_grads_crop(theta, xpad, idx, aug, yall[idx])
    aug[0, 0, 2], aug[0, 0, 0] = 0, 9
    with pytest.raises(ValueError, match="offsets"):
        kernels.optunet_loss_grads_crop(theta, xpad, idx, aug, yall[idx])


def test_train_stacked_native_equals_matmul():
    """Whole runs (momentum, weight decay, crops fused into the kernel, two worker threads) agree between
    the native and the PyTorch step (float64)."""
    recipe = dataclasses.replace(T.OPTUNET_MNIST, batch_size=16, momentum=0.9)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (40,), generator=g)
    seeds = [3, 4, 5]
    ref = T.train_stacked(_stack(seeds), seeds, x, y, recipe, fill=-0.4, epochs=2, impl="matmul", workers=1)
    out = T.train_stacked(_stack(seeds), seeds, x, y, recipe, fill=-0.4, epochs=2, impl="native", workers=2)
    for k in ref:
        torch.testing.assert_close(out[k], ref[k], rtol=1e-10, atol=1e-12)


def test_native_is_the_cpu_default_and_falls_back(monkeypatch):
    """On CPU the default step is the kernel; without a compiler the trainer falls back to the PyTorch
    step, and asking for the kernel explicitly names the reason."""
    assert T.step_function("optunet", None, torch.device("cpu")) is optunet.optunet_loss_grads_native
    monkeypatch.setattr(kernels, "_load", lambda: (None, "no C++ compiler found"))
    assert T.step_function("optunet", None, torch.device("cpu")) is T.optunet_loss_grads
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler found.*matmul"):
        T.step_function("optunet", "native", torch.device("cpu"))


def test_bad_input_is_refused():
    theta = _stack([0, 1])
    x, y, _ = _images(2, 4, 0, False)
    with pytest.raises(ValueError, match="one dtype"):
        kernels.optunet_loss_grads(theta, x.float(), y)
    with pytest.raises(ValueError, match="float32 or float64"):
        kernels.optunet_loss_grads({k: v.half() for k, v in theta.items()}, x.half(), y)
    with pytest.raises(ValueError, match="labels"):
        kernels.optunet_loss_grads(theta, x, y + 10)
    with pytest.raises(ValueError, match="M models"):
        kernels.optunet_loss_grads(theta, x[:1], y[:1])
    with pytest.raises(ValueError, match="1, 28, 28"):
        kernels.optunet_loss_grads(theta, x[..., :27, :27], y)


def test_kernel_cache_is_reused(tmp_path, monkeypatch):
    """The compiled library goes to $SYMLIB_KERNEL_CACHE, once per source/compiler/CPU."""
    monkeypatch.setenv("SYMLIB_KERNEL_CACHE", str(tmp_path))
    cxx = kernels._compiler()
    first = kernels._build(cxx)
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert kernels._build(cxx) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_kernel_built_for_another_march(tmp_path, monkeypatch):
    """$SYMLIB_KERNEL_MARCH builds for a named target (x86-64-v3: the AVX2 machines' 32-byte vectors) under a
    key of its own, with the same results as autograd; a value that is no -march target is refused, not
    silently replaced by the slow path."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("x86-64-v3 is an x86-64 target")
    monkeypatch.setenv("SYMLIB_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(kernels.MARCH_ENV, raising=False)
    native = kernels._build(kernels._compiler())
    monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v3")
    assert "-march=x86-64-v3" in kernels.flags() and "-march=native" not in kernels.flags()
    kernels._load.cache_clear()
    try:
        assert kernels.available() and kernels._build(kernels._compiler()) != native
        theta = _stack([3, 4])
        x, y, _ = _images(2, 19, 5, False)
        loss, grads = kernels.optunet_loss_grads(theta, x, y)
        ref, ref_grads = scenarios.optunet_reference(theta, x, y, None)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        for k, rg in ref_grads.items():
            torch.testing.assert_close(grads[k], rg, rtol=1e-10, atol=1e-12)
        monkeypatch.setenv(kernels.MARCH_ENV, "x86-64-v3; rm")
        kernels._load.cache_clear()
        with pytest.raises(RuntimeError, match="SYMLIB_KERNEL_MARCH.*unset it"):
            kernels.available()
    finally:  # the next call builds (or finds) the library of the environment monkeypatch restores
        kernels._load.cache_clear()


def test_vectorised_log_is_within_an_ulp():
    """The kernels' float32 logarithm against float64 torch.log, over the whole normal range (the kernel's
    callers floor their inputs at the smallest normal float)."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(4000, generator=g) * s for s in (1e-37, 1e-20, 1e-6, 1.0, 1e3, 1e30)])
    x = torch.cat([x, torch.tensor([0.5, 1.0, 2.0, 2**0.5])]).clamp_min(torch.finfo(torch.float32).tiny)
    ref = torch.log(x.double())
    got = kernels.vlog(x).double()
    assert torch.all((got - ref).abs() <= 1.5 * torch.finfo(torch.float32).eps * ref.abs().clamp_min(1.0))
    assert kernels.vlog(torch.tensor([1.0]))[0] == 0


@pytest.mark.parametrize("n_models,n_inputs", [(2, 1), (9, 7), (37, 50)])
def test_native_pairwise_mi_equals_float64_loop(n_models, n_inputs):
    """pairwise_mi through the compiled kernel (float32) = a float64 per-pair loop, for sizes that
    are not whole vectors or row blocks, with exact zeros among the probabilities; and = the numpy path."""

    g = torch.Generator().manual_seed(n_models)
    p = torch.softmax(3 * torch.randn(n_models, n_inputs, 10, generator=g), -1)
    p[0, 0] = torch.nn.functional.one_hot(torch.tensor(3), 10).float()  # zeros: 0 log 0 = 0
    native = pairwise_mi.pairwise_mi(p, workers=2)
    numpy_path = pairwise_mi.pairwise_mi(p, native=False)
    p64 = p.double()
    ref = []
    for i in range(n_models):
        for j in range(i + 1, n_models):
            m = (p64[i] + p64[j]) / 2
            ent = -torch.special.xlogy(m, m).sum(-1)
            ent_i, ent_j = (-torch.special.xlogy(q, q).sum(-1) for q in (p64[i], p64[j]))
            ref.append((ent - (ent_i + ent_j) / 2).mean())
    # float32 probabilities and sums: a few 1e-7 nats (the benchmark's tolerance is 1e-6)
    torch.testing.assert_close(native, torch.stack(ref), rtol=0, atol=5e-7)
    torch.testing.assert_close(native, numpy_path, rtol=0, atol=5e-7)
    assert torch.equal(native, pairwise_mi.pairwise_mi(p, workers=1))
