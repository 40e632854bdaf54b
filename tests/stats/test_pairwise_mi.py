"""symlib.stats.pairwise_mi: the mutual information of every pair of checkpoints, against a per-pair loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial.distance import squareform

from symlib.stats import metrics as M
from symlib.stats import pairwise_mi as PM


def _probs(s, n, c, seed, temperature=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(temperature * torch.randn(s, n, c, generator=g, dtype=dtype), -1)


def _pairwise_loop(p):
    n = p.shape[0]
    return torch.tensor([float(M.mutual_information(p[[i, j]])) for i in range(n) for j in range(i + 1, n)],
                        dtype=torch.float64)


@pytest.mark.parametrize("block", [None, 37, 1])
def test_pairwise_mi_equals_a_loop_over_pairs(block):
    """Every block / chunk layout (block=1: one pair and one feature at a time) gives each pair's two-member
    ensemble MI, in squareform's condensed order; the square form is symmetric with a zero diagonal."""
    p = _probs(7, 13, 4, 5, 3.0)
    p[2, 0] = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # zeros: 0 log 0 = 0
    condensed = PM.pairwise_mi(p, block=block)
    torch.testing.assert_close(condensed, _pairwise_loop(p), rtol=1e-12, atol=1e-14)
    sq = PM.pairwise_mi(p, square=True, block=block)
    np.testing.assert_allclose(squareform(sq.numpy(), checks=False), condensed.numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(squareform(condensed.numpy()), sq.numpy(), rtol=0, atol=0)


def test_pairwise_mi_float32_blocks_agree_with_float64():
    p = _probs(9, 200, 10, 6, 4.0, dtype=torch.float32)
    ref = PM.pairwise_mi(p, dtype=torch.float64)
    torch.testing.assert_close(PM.pairwise_mi(p, block=5000), ref, rtol=1e-4, atol=1e-6)


def test_pairwise_mi_padded_chunks_are_exact():
    """52 features in chunks of 18 (block 20): the last chunk is padded with halves 1/2, where q = 1 and
    q log q = 0 exactly, so the float64 values still equal the loop's."""
    p = _probs(6, 13, 4, 7, 3.0)
    assert PM._layout(52, 20, PM.CPU_MAX_WIDTH)[:2] == (3, 18)
    torch.testing.assert_close(PM.pairwise_mi(p, block=20), _pairwise_loop(p), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pairwise_mi_does_not_depend_on_the_number_of_workers(dtype):
    """Row blocks split over 1, 2 or 3 threads: every pair is computed by the same block whichever thread
    runs it, so the results are bitwise equal (float32 blocks included)."""
    p = _probs(23, 40, 10, 8, 3.0, dtype=dtype)
    one = PM.pairwise_mi(p, block=700, workers=1)  # 1 pair per block, 22 row blocks
    for workers in (2, 3):
        assert torch.equal(PM.pairwise_mi(p, block=700, workers=workers), one)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(one, _pairwise_loop(p.double()), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pairwise_mi_torch_path_equals_numpy_path(dtype):
    """The torch path (CUDA's, here run on the CPU) gives the same sums of q log q and mean entropies as the
    numpy path of the CPU, on 3 chunks of 47 features (the last padded by one) and blocks of 10 x 10 pairs."""
    p = _probs(9, 28, 5, 9, 2.0)
    layout = PM._layout(140, 5000, 64)
    assert layout == (3, 47, 10, 10)
    sums = {path: torch.zeros(9 * 8 // 2, dtype=torch.float64) for path in ("numpy", "torch")}
    no_bar = PM._progress.bar(enabled=False)
    h_np = PM._pairwise_sums_cpu(p, dtype, *layout, sums["numpy"].numpy(), 2, no_bar)
    h_torch = PM._pairwise_sums_torch(p, dtype, *layout, sums["torch"], no_bar)
    torch.testing.assert_close(torch.from_numpy(h_np), h_torch, rtol=1e-13, atol=0)
    torch.testing.assert_close(h_torch, M.entropy(p).mean(1), rtol=1e-13, atol=0)
    tol = dict(rtol=1e-6, atol=0) if dtype == torch.float32 else dict(rtol=1e-13, atol=0)
    torch.testing.assert_close(sums["torch"], sums["numpy"], **tol)
    i, j = torch.triu_indices(9, 9, 1)
    q = (p[i] + p[j]) / 2
    torch.testing.assert_close(sums["numpy"], torch.special.xlogy(q, q).sum((1, 2)), **tol)


def test_pairwise_mi_validates_like_check_probs():
    """pairwise_mi's fast validation takes the same decisions as check_probs: row sums off by 0.9e-3 pass,
    1.1e-3 fail (SUM_ATOL = 1e-3); NaN, inf, negative values and half-precision inputs too."""
    p = _probs(3, 5, 4, 10, dtype=torch.float32)
    for off, ok in ((0.9e-3, True), (-0.9e-3, True), (1.1e-3, False), (-1.1e-3, False)):
        q = p.clone()
        q[1, 2] *= 1 + off
        if ok:
            PM.pairwise_mi(q)
        else:
            with pytest.raises(ValueError, match="does not sum to one"):
                PM.pairwise_mi(q)
    for bad, match in ((float("nan"), "non-finite"), (float("inf"), "non-finite"), (-0.1, "negative")):
        q = p.clone()
        q[0, 0, 0] = bad
        with pytest.raises(ValueError, match=match):
            PM.pairwise_mi(q)
    half = PM.pairwise_mi(p.half(), dtype=torch.float64)
    torch.testing.assert_close(half, PM.pairwise_mi(p.half().double()))


# ---------------------------------------------------------------------------------------- bad input


def test_pairwise_mi_worker_threads_run_one_blas_thread():
    """Thread budget: inside pairwise_mi's worker threads numpy's BLAS runs one thread (the entropies'
    dot products exceed OpenBLAS's threading threshold), so workers x BLAS threads stays at the workers;
    the BLAS thread count is restored afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return {i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}

    before = blas_threads()
    seen = []
    real = PM._mean_entropies
    mp = pytest.MonkeyPatch()
    mp.setattr(PM, "_mean_entropies", lambda *a: (seen.append(blas_threads()), real(*a))[1])
    try:
        PM.pairwise_mi(_probs(23, 40, 10, 8, 3.0), block=700, workers=2)
    finally:
        mp.undo()
    assert seen and all(s == {1} for s in seen), seen
    assert blas_threads() == before
