"""The symmetry-aware MMD (paper §4, App. B.4; NOTES "MMD as the authors computed it").

Everything runs in float64: the estimator's claims (agreement with a loop reference, invariances, exact
removal of a planted symmetry) are exact up to rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from symlib import models, threads
from symlib.stats import mmd
from symlib.symmetry import ops, trace
from symlib.symmetry.spec import mlp_spec

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These problems are tiny: one thread avoids thread-pool overhead (large on a shared machine)."""
    with threads.single():
        yield


# ------------------------------------------------------------------ loop reference
def ref_bandwidths(d: np.ndarray) -> np.ndarray:
    """MMDAgg's rule, written out: ``d`` holds the cross distances of the first 500 rows of X and Y."""
    d = np.sort(d.ravel())
    if d[0] < 0.1:
        low = max(d[int(np.floor(len(d) * 0.05))], 0.1)
    else:
        low = d[0]
    low, high = low / 2, 2 * max(d[-1], 0.3)
    return np.array([low * (high / low) ** (i / 9) for i in range(10)])


def ref_dist(a: np.ndarray, b: np.ndarray, metric: str) -> np.ndarray:
    """Distances between the rows of ``a`` and ``b``, one row of ``a`` at a time."""
    if metric == "l1":
        return np.array([np.abs(b - r).sum(1) for r in a])
    return np.array([np.sqrt(((b - r) ** 2).sum(1)) for r in a])


def ref_layer(x: np.ndarray, y: np.ndarray, h: np.ndarray | None = None, rule: str = "cross"
              ) -> tuple[np.ndarray, np.ndarray]:
    """MMD^2_u for the 20 kernels, one kernel at a time, from the three blocks of kernel values."""
    m, n = len(x), len(y)
    if h is None:
        h = []
        for metric in ("l1", "l2"):
            if rule == "cross":
                d = ref_dist(x[:500], y[:500], metric)
            else:
                z = np.concatenate([x, y])
                dz = ref_dist(z, z, metric)
                d = dz[np.triu_indices(len(z), 1)]
            h.append(ref_bandwidths(d))
        h = np.concatenate(h)
    out = []
    for kern in range(20):
        metric = "l1" if kern < 10 else "l2"

        def k(a, b, metric=metric, bw=h[kern]):
            r = ref_dist(a, b, metric) / bw
            return np.exp(-r) if metric == "l1" else np.exp(-(r**2))

        kxx, kyy = k(x, x), k(y, y)
        sxx = kxx.sum() - np.trace(kxx)
        syy = kyy.sum() - np.trace(kyy)
        sxy = k(x, y).sum()
        out.append(sxx / (m * (m - 1)) + syy / (n * (n - 1)) - 2 * sxy / (m * n))
    return np.array(out), h


def stacked(make, count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    nets = [make().double().state_dict() for _ in range(count)]
    return {k: torch.stack([n[k] for n in nets]) for k in nets[0]}


def gaussian_sets(m, n, d=3, shift=0.0, seed=0, layers=2):
    g = torch.Generator().manual_seed(seed)
    t = {f"l{i}.weight": torch.randn(m, d, generator=g, dtype=F64) for i in range(layers)}
    s = {f"l{i}.weight": torch.randn(n, d, generator=g, dtype=F64) + shift for i in range(layers)}
    return t, s


# ------------------------------------------------------------------------- tests
@pytest.mark.parametrize("rule", ["cross", "pooled"])
@pytest.mark.parametrize("spread", [0.01, 1.0, 30.0])
def test_agrees_with_loop_reference(spread, rule):
    """Per-layer, per-kernel MMD^2_u and bandwidths equal a loop-based numpy implementation to 1e-10,
    in both branches of the bandwidth rule (smallest distance below / above 0.1)."""
    g = np.random.default_rng(1)
    t = {"a.weight": g.normal(size=(9, 2, 2)) * spread, "a.bias": g.normal(size=(9, 2)) * spread,
         "b.weight": g.normal(size=(9, 3)) * spread}
    s = {k: v[:6] * 1.3 + 0.2 * spread for k, v in t.items()}
    pair = mmd.prepare({k: torch.tensor(v) for k, v in t.items()}, {k: torch.tensor(v) for k, v in s.items()})
    res = mmd.mmd(pair, rule=rule)
    assert pair.names == ("a", "b") and pair.sizes == (6, 3)
    for i, names in enumerate((("a.weight", "a.bias"), ("b.weight",))):
        x = np.concatenate([t[k].reshape(9, -1) for k in names], 1)
        y = np.concatenate([s[k].reshape(6, -1) for k in names], 1)
        want, h = ref_layer(x, y, rule=rule)
        np.testing.assert_allclose(res.bandwidths[i].numpy(), h, rtol=1e-12)
        np.testing.assert_allclose(res.values[i].numpy(), want, rtol=1e-10, atol=1e-12)


def test_bandwidths_use_first_500_rows():
    """Only the first 500 rows of each set enter the bandwidths; the statistic uses every row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(503, 2, generator=g, dtype=F64)
    y = torch.randn(4, 2, generator=g, dtype=F64) + 1
    x[500:] += 100.0  # far away rows, beyond the 500: they would change the largest cross distance
    vals, h = mmd.estimate(x, y)
    cross1 = torch.cdist(x[:500], y, p=1).numpy()
    np.testing.assert_allclose(h[:10].numpy(), ref_bandwidths(cross1), rtol=1e-12)
    want, _ = ref_layer(x.numpy(), y.numpy(), h.numpy())
    np.testing.assert_allclose(vals.numpy(), want, rtol=1e-10, atol=1e-12)


def test_invariant_to_sample_order():
    """Reordering the checkpoints of either set leaves every value unchanged (U-statistic, and the
    bandwidth rule only sees the multiset of cross distances when both sets have at most 500 rows)."""
    t, s = gaussian_sets(25, 11, shift=0.3)
    base = mmd.mmd(mmd.prepare(t, s)).values
    g = torch.Generator().manual_seed(3)
    pt, ps = torch.randperm(25, generator=g), torch.randperm(11, generator=g)
    shuffled = mmd.mmd(mmd.prepare({k: v[pt] for k, v in t.items()}, {k: v[ps] for k, v in s.items()}))
    torch.testing.assert_close(shuffled.values, base, rtol=1e-12, atol=1e-14)


def test_closed_form_two_gaussians():
    r"""The estimator is unbiased: its mean over repeats matches the closed form.

    For :math:`x, x' \sim N(\mu_a, s^2 I_d)` independent, :math:`z = x - x' \sim N(\delta, 2 s^2 I_d)` with
    :math:`\delta = \mu_a - \mu_b`. Per coordinate,
    :math:`E\, e^{-z^2/h^2} = (1 + 2\sigma^2/h^2)^{-1/2} e^{-\delta^2/(h^2 + 2\sigma^2)}` with
    :math:`\sigma^2 = 2 s^2` (complete the square in the Gaussian integral). Hence with
    :math:`c = (1 + 4 s^2/h^2)^{-d/2}`,
    :math:`E k(x, x') = E k(y, y') = c` and
    :math:`E k(x, y) = c\, e^{-\lVert\mu_1-\mu_2\rVert^2/(h^2 + 4 s^2)}`:

    .. math:: \mathrm{MMD}^2 = 2c\,\big(1 - e^{-\lVert \mu_1 - \mu_2 \rVert^2 / (h^2 + 4 s^2)}\big).

    The bandwidths are held fixed (the data-driven rule would make them random); the tolerance is 4
    standard errors of the mean over the repeats.
    """
    d, s, reps, m, n = 3, 0.7, 300, 12, 9
    mu = torch.tensor([0.8, -0.3, 0.5], dtype=F64)
    h = torch.cat([torch.full((10,), 2.0, dtype=F64), torch.linspace(0.5, 5.0, 10, dtype=F64)])
    g = torch.Generator().manual_seed(0)
    vals = torch.stack([
        mmd.estimate(s * torch.randn(m, d, generator=g, dtype=F64),
                     s * torch.randn(n, d, generator=g, dtype=F64) + mu, h)[0]
        for _ in range(reps)
    ])
    hg = h[10:]
    c = (1 + 4 * s**2 / hg**2) ** (-d / 2)
    closed = 2 * c * (1 - torch.exp(-(mu**2).sum() / (hg**2 + 4 * s**2)))
    mean, se = vals[:, 10:].mean(0), vals[:, 10:].std(0) / math.sqrt(reps)
    assert bool((closed > 5 * se).all())  # the claim has power: the expected value is far from 0
    assert bool(((mean - closed).abs() < 4 * se).all()), (mean, closed, se)


def test_null_statistic_is_centred_and_p_values_uniform():
    """Under one distribution (unbalanced sets, as in Table 1): every kernel's MMD^2_u averages 0 within 4
    standard errors with pooled-distance bandwidths (exactly centred: averaged over the re-splits of a
    pool, each pair of checkpoints counts +1/(N(N-1)) twice and -2/(N(N-1)) once), and the permutation
    p-values of the per-layer and aggregate statistics are uniform: type-I error near alpha."""
    reps, alpha = 150, 0.1
    vals, p_agg, p_layer = [], [], []
    for r in range(reps):
        t, s = gaussian_sets(20, 6, seed=100 + r)
        res = mmd.mmd(mmd.prepare(t, s), n_permutations=59, seed=r, rule="pooled")
        vals.append(res.values)
        p_agg.append(float(res.p_value()))
        p_layer.append(res.p_value(layers=None))
    vals = torch.stack(vals)
    mean, se = vals.mean(0), vals.std(0) / math.sqrt(reps)
    assert bool((mean.abs() < 4 * se).all())
    p_agg, p_layer = torch.tensor(p_agg), torch.stack(p_layer)
    band = 3 * math.sqrt(alpha * (1 - alpha) / reps)
    for p in (p_agg, p_layer[:, 0], p_layer[:, 1]):
        assert abs(float((p <= alpha).to(F64).mean()) - alpha) < band
        assert abs(float((p <= 0.5).to(F64).mean()) - 0.5) < 3 * math.sqrt(0.25 / reps)


def test_power_clearly_different():
    """A shift of one standard deviation in every coordinate is detected: smallest possible p-value,
    bootstrap intervals above 0, and a positive aggregate."""
    t, s = gaussian_sets(30, 20, d=4, shift=1.0)
    res = mmd.mmd(mmd.prepare(t, s), n_permutations=199, n_bootstrap=200)
    assert float(res.p_value()) == pytest.approx(1 / 200)
    assert bool((res.p_value(layers=None) <= 1 / 200 + 1e-12).all())
    assert float(res.interval()[0]) > 0
    assert float(res.value()) > 0


def test_permutation_and_bootstrap_paths_agree_with_direct_computation():
    """A permuted statistic equals the estimator on the re-split pool (same bandwidths); a bootstrap
    replicate equals the loop estimator on the resampled sets with pairs of copies left out; the
    identity split and unit counts give back the observed values."""
    t, s = gaussian_sets(7, 5, shift=0.4)
    pair = mmd.prepare(t, s)
    res = mmd.mmd(pair)
    x, y = pair.x[0], pair.y[0]
    dxx, dyy, dxy = mmd.compare._distances(pair, 0)
    h = res.bandwidths[0]
    k = mmd.kernels.pooled_kernel(dxx, dyy, dxy, h)
    ident = torch.arange(12)[None]
    torch.testing.assert_close(mmd.kernels.permuted(k, 7, ident)[:, 0], res.values[0], rtol=1e-12, atol=1e-14)
    ones_a, ones_b = torch.ones(7, 1, dtype=F64), torch.ones(5, 1, dtype=F64)
    torch.testing.assert_close(mmd.kernels.resampled(k, 7, ones_a, ones_b)[:, 0], res.values[0], rtol=1e-12,
                               atol=1e-14)
    # a permutation
    z = torch.cat([x, y])
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    want, _ = ref_layer(z[perm[:7]].numpy(), z[perm[7:]].numpy(), h.numpy())
    got = mmd.kernels.permuted(k, 7, perm[None])[:, 0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    # a resample: copies of one checkpoint are distinct rows, but their pairs do not count
    ia, ib = [0, 0, 2, 3, 3, 3, 6], [1, 1, 4, 0, 2]
    ca = torch.bincount(torch.tensor(ia), minlength=7).to(F64)[:, None]
    cb = torch.bincount(torch.tensor(ib), minlength=5).to(F64)[:, None]
    got = mmd.kernels.resampled(k, 7, ca, cb)[:, 0]
    xs, ys = x[ia].numpy(), y[ib].numpy()
    for kern in (0, 13):
        bw = float(h[kern])

        def kf(a, b, kern=kern, bw=bw):
            if kern < 10:
                return math.exp(-np.abs(a - b).sum() / bw)
            return math.exp(-((a - b) ** 2).sum() / bw**2)

        def within(rows, idx):
            pairs = [(i, j) for i in range(len(idx)) for j in range(len(idx)) if idx[i] != idx[j]]
            return sum(kf(rows[i], rows[j]) for i, j in pairs) / len(pairs)

        cross = sum(kf(a, b) for a in xs for b in ys) / (len(xs) * len(ys))
        assert float(got[kern]) == pytest.approx(within(xs, ia) + within(ys, ib) - 2 * cross, rel=1e-10)


@pytest.mark.parametrize("m, n", [(30, 4), (4, 30), (12, 10)])
def test_permuted_matches_recomputation(m, n):
    """Every re-split's statistic (quadratic forms of one kernel matrix) equals the estimator recomputed on
    the re-split pool with the same bandwidths, for X larger, smaller or close to Y in size."""
    t, s = gaussian_sets(m, n, shift=0.2, layers=1)
    pair = mmd.prepare(t, s)
    dxx, dyy, dxy = mmd.compare._distances(pair, 0)
    h = mmd.kernels.layer_bandwidths(dxx, dyy, dxy, "pooled")
    k = mmd.kernels.pooled_kernel(dxx, dyy, dxy, h)
    order = torch.rand(5, m + n, generator=torch.Generator().manual_seed(1)).argsort(-1)
    z = torch.cat([pair.x[0], pair.y[0]])
    got = mmd.kernels.permuted(k, m, order)
    for b in range(5):
        want, _ = mmd.estimate(z[order[b, :m]], z[order[b, m:]], h)
        torch.testing.assert_close(got[:, b], want, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("rule", ["cross", "pooled"])
def test_values_beside_the_tests_agree_with_loop_reference(rule):
    """With a permutation test and a bootstrap, the observed values are the block sums of the pooled kernel
    matrices (one buffer for every layer): they equal the loop reference and the values computed without
    any test, and so does the permutation test's statistic (pooled bandwidths)."""
    t, s = gaussian_sets(9, 6, shift=0.3, layers=2)
    pair = mmd.prepare(t, s)
    res = mmd.mmd(pair, n_permutations=20, n_bootstrap=20, rule=rule)
    plain = mmd.mmd(pair, rule=rule)
    for i in range(2):
        x, y = pair.x[i].numpy(), pair.y[i].numpy()
        np.testing.assert_allclose(res.values[i].numpy(), ref_layer(x, y, rule=rule)[0], rtol=1e-10,
                                   atol=1e-12)
        np.testing.assert_allclose(res.test_values[i].numpy(), ref_layer(x, y, rule="pooled")[0], rtol=1e-10,
                                   atol=1e-12)
    torch.testing.assert_close(res.values, plain.values, rtol=1e-12, atol=1e-14)


def test_kernel_buffer_of_another_shape_is_not_used():
    """pooled_kernel writes into a previous result of the same shape and ignores one of another shape (two
    comparisons of different sizes, as in a difference without a shared target)."""
    t, s = gaussian_sets(7, 5, shift=0.4, layers=1)
    dxx, dyy, dxy = mmd.compare._distances(mmd.prepare(t, s), 0)
    h = mmd.kernels.layer_bandwidths(dxx, dyy, dxy)
    fresh = mmd.kernels.pooled_kernel(dxx, dyy, dxy, h)
    small = torch.zeros(20, 3, 3, dtype=F64)
    same = torch.full_like(fresh, float("nan"))
    assert torch.equal(mmd.kernels.pooled_kernel(dxx, dyy, dxy, h, small), fresh)
    out = mmd.kernels.pooled_kernel(dxx, dyy, dxy, h, same)
    assert out.data_ptr() == same.data_ptr() and torch.equal(out, fresh)
    torch.testing.assert_close(mmd.kernels.observed_pooled(fresh, 7), mmd.kernels.observed(dxx, dyy, dxy, h),
                               rtol=1e-12, atol=1e-14)


def test_reduce_median_weighted_max():
    """Median over 20 kernels is the mean of the 10th and 11th values; "weighted" weighs layers by size."""
    v = torch.stack([torch.arange(20, dtype=F64), 10 + torch.arange(20, dtype=F64).flip(0)])
    sizes = (30, 10)
    assert reduce_eq(mmd.reduce(v, sizes, "median", None), [9.5, 19.5])
    assert reduce_eq(mmd.reduce(v, sizes, "median"), [(30 * 9.5 + 10 * 19.5) / 40])
    assert reduce_eq(mmd.reduce(v, sizes, "mean", "mean"), [(9.5 + 19.5) / 2])
    assert reduce_eq(mmd.reduce(v, sizes, "max", "max"), [29.0])
    with pytest.raises(ValueError, match="kernels must be"):
        mmd.reduce(v, sizes, "min")


def reduce_eq(a, b):
    return torch.allclose(torch.as_tensor(a, dtype=F64).reshape(-1), torch.tensor(b, dtype=F64))


def test_layers_of_optunet_and_buffers():
    """OptuNet's layers are conv1 (32), conv2 (250) and fc with its bias (110): 392 parameters; BatchNorm
    running statistics are not compared."""
    spec = trace.spec_of(models.OptuNet(), (1, 28, 28))
    layers = mmd.layers_of(spec)
    assert layers == {"conv1": ("conv1.weight",), "conv2": ("conv2.weight",), "fc": ("fc.weight", "fc.bias")}
    theta = stacked(models.OptuNet, 3)
    pair = mmd.prepare(theta, theta, spec)
    assert pair.sizes == (32, 250, 110) and sum(pair.sizes) == 392
    bn = ["c.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert mmd.layers_of(bn) == {"c": ("c.weight",), "bn": ("bn.weight", "bn.bias")}
    assert list(mmd.layers_of(bn, by="tensor")) == ["c.weight", "bn.weight", "bn.bias"]


@pytest.mark.parametrize("arch", ["optunet", "mlp"])
@pytest.mark.parametrize("how", ["ns", "minmass"])
def test_ns_removes_planted_symmetries(arch, how):
    """After removing symmetries, the MMD of a set against a randomly permuted and rescaled copy of
    itself equals the MMD against itself; on raw weights it does not (negative control)."""
    if arch == "optunet":
        make, spec = models.OptuNet, trace.spec_of(models.OptuNet().double(), (1, 28, 28))
    else:
        make = lambda: models.MLP([4, 6, 5, 3])  # noqa: E731
        spec = mlp_spec(make().double())
    theta = stacked(make, 12, seed=1)
    g = ops.random_element(spec, "both", batch=(12,), generator=torch.Generator().manual_seed(2))
    moved = ops.act(g, theta, spec)
    same = mmd.mmd(mmd.prepare(theta, theta, spec, how)).values
    planted = mmd.mmd(mmd.prepare(theta, moved, spec, how)).values
    tol = 1e-10 if how == "ns" else 1e-6  # min-mass: an iterative solver, balanced to ~1e-12 relative
    torch.testing.assert_close(planted, same, rtol=tol, atol=tol)
    raw_same = mmd.mmd(mmd.prepare(theta, theta)).values
    raw_planted = mmd.mmd(mmd.prepare(theta, moved)).values
    assert float((raw_planted - raw_same).abs().max()) > 1e-3


def test_remove_symmetries_names():
    spec = trace.spec_of(models.OptuNet().double(), (1, 28, 28))
    theta = stacked(models.OptuNet, 2)
    for how in mmd.SYMMETRIES:
        out = mmd.remove_symmetries(theta, spec, how)
        assert set(out) == set(theta)
    with pytest.raises(ValueError, match="unknown symmetry removal"):
        mmd.remove_symmetries(theta, spec, "canonical")
    with pytest.raises(ValueError, match="needs the spec"):
        mmd.remove_symmetries(theta, None, "ns")


def test_table_shares_target_work():
    """table() gives the same values as one prepare()/mmd() per method (the cached target distances)."""
    spec = mlp_spec(models.MLP([3, 4, 2]).double())
    target = stacked(lambda: models.MLP([3, 4, 2]), 15, seed=0)
    methods = {"a": stacked(lambda: models.MLP([3, 4, 2]), 6, seed=1),
               "b": {k: v[:6] * 2 for k, v in target.items()}}
    tab = mmd.table(target, methods, spec, n_permutations=20, n_bootstrap=20, progress=False)
    for (name, sym), res in tab.items():
        alone = mmd.mmd(mmd.prepare(target, methods[name], spec, sym), 20, 20)
        torch.testing.assert_close(res.values, alone.values, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(res.permuted, alone.permuted, rtol=1e-12, atol=1e-14)
        assert set(res.summary()) >= {"median", "median_lo", "median_hi", "median_p", "mean", "max"}


def test_difference_paired_bootstrap():
    """The same comparison against itself differs by exactly 0 in every paired replicate (p = 1); a method
    far from the target is worse than a near one, with an interval above 0."""
    t, near = gaussian_sets(25, 12, shift=0.1, seed=0)
    _, far = gaussian_sets(25, 12, shift=1.5, seed=1)
    p_near, p_far = mmd.prepare(t, near), mmd.prepare(t, far)
    self_diff = mmd.difference(p_near, p_near, n_bootstrap=100, share_samples=True)
    assert self_diff.value == 0 and bool((self_diff.boot == 0).all()) and self_diff.p_value == 1.0
    d = mmd.difference(p_far, p_near, n_bootstrap=200, seed=1)
    assert d.value == pytest.approx(d.first - d.second)
    assert d.first == pytest.approx(float(mmd.mmd(p_far).value()))
    assert d.interval[0] > 0 and d.p_value < 0.05
    with pytest.raises(ValueError, match="share_target"):
        mmd.difference(p_near, mmd.prepare({k: v[:20] for k, v in t.items()}, near), n_bootstrap=10)


def test_errors_name_the_fix():
    t, s = gaussian_sets(5, 1)
    with pytest.raises(ValueError, match="at least 2 samples"):
        mmd.prepare(t, s)
    t, s = gaussian_sets(5, 4)
    with pytest.raises(ValueError, match="no permutation test"):
        mmd.mmd(mmd.prepare(t, s)).p_value()


@pytest.mark.parametrize("where", ["target", "method"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_not_significant(where, value):
    """A NaN or infinite weight used to give an MMD of NaN with a p-value at its floor (it looked
    significant); prepare, table and layered refuse it, naming the tensor, the samples and the fix."""
    t, s = gaussian_sets(10, 6)
    bad = {k: v.clone() for k, v in (t if where == "target" else s).items()}
    next(iter(bad.values()))[3].view(-1)[0] = value
    t, s = (bad, s) if where == "target" else (t, bad)
    with pytest.raises(ValueError, match=r"NaN or infinite weights \(samples \[3\] of .*drop these samples"):
        mmd.prepare(t, s)
    with pytest.raises(ValueError, match="NaN or infinite weights"):
        mmd.two_sample(t, s, n_permutations=10)
    with pytest.raises(ValueError, match="NaN or infinite weights"):
        mmd.table(t, {"m": s}, symmetries=("raw",), progress=False)
    with pytest.raises(ValueError, match="NaN or infinite weights"):
        mmd.layered({"target": t, "m": s}, symmetries=("raw",))


def test_table_refuses_a_set_of_one_sample_and_empty_sets():
    """table skipped prepare's size check and returned NaN silently for a method set of one sample."""
    t, s = gaussian_sets(10, 6)
    one = {k: v[:1] for k, v in s.items()}
    empty = {k: v[:0] for k, v in s.items()}
    with pytest.raises(ValueError, match="method 'one' holds only 1 sample.*at least 2 samples"):
        mmd.table(t, {"ok": s, "one": one}, symmetries=("raw",), progress=False)
    with pytest.raises(ValueError, match="no samples \\(an empty set\\)"):
        mmd.prepare(t, empty)
    with pytest.raises(ValueError, match="target set holds no samples"):
        mmd.table(empty, {"ok": s}, symmetries=("raw",), progress=False)
    with pytest.raises(ValueError, match="at least one method"):
        mmd.table(t, {}, progress=False)


def test_negative_counts_and_a_difference_without_bootstrap_are_refused():
    t, s = gaussian_sets(10, 6)
    pair = mmd.prepare(t, s)
    with pytest.raises(ValueError, match="n_permutations must be >= 0, got -1 \\(0: no test"):
        mmd.mmd(pair, n_permutations=-1)
    with pytest.raises(ValueError, match="n_bootstrap must be >= 0, got -2 \\(0: no intervals"):
        mmd.mmd(pair, n_bootstrap=-2)
    with pytest.raises(TypeError, match="n_permutations must be an integer"):
        mmd.mmd(pair, n_permutations=1.5)
    with pytest.raises(ValueError, match="n_bootstrap must be >= 0"):
        mmd.table(t, {"m": s}, symmetries=("raw",), n_bootstrap=-1, progress=False)
    with pytest.raises(ValueError, match="n_bootstrap must be >= 1, got 0.*pass e.g. n_bootstrap=1000"):
        mmd.difference(pair, pair, n_bootstrap=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    t, s = gaussian_sets(40, 10, shift=0.2)
    cpu = mmd.mmd(mmd.prepare(t, s), n_permutations=30, n_bootstrap=30)
    gpu = mmd.mmd(mmd.prepare({k: v.cuda() for k, v in t.items()}, {k: v.cuda() for k, v in s.items()}),
                  n_permutations=30, n_bootstrap=30)
    assert gpu.values.device.type == "cuda"
    torch.testing.assert_close(gpu.values.cpu(), cpu.values, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gpu.permuted.cpu(), cpu.permuted, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gpu.boot.cpu(), cpu.boot, rtol=1e-10, atol=1e-12)
