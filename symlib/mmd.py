r"""Symmetry-aware maximum mean discrepancy between weight samples (book: chapter "Table 1"; paper §4,
App. B.4).

The paper compares a posterior approximation to the target posterior (1,000 independently trained
checkpoints) through the MMD between their weights, layer by layer, on raw weights and after removing
symmetries ("NS"). The text never defines the estimator; this module computes what the authors' code
did (``shared/paper/NOTES.md``, "MMD as the authors computed it"), then adds what the paper lacks: a
permutation test and bootstrap confidence intervals.

**Estimator.** For one layer, ``X`` (``m`` rows) and ``Y`` (``n`` rows) are the flattened weights of that
layer in the two sample sets, one row per checkpoint. For a kernel ``k``,

.. math:: \widehat{\mathrm{MMD}}{}^2_u = \frac{S_{XX}}{m(m-1)} + \frac{S_{YY}}{n(n-1)}
          - \frac{2 S_{XY}}{mn}, \quad S_{XX} = \sum_{i \ne j} k(x_i, x_j),\
          S_{XY} = \sum_{i,j} k(x_i, y_j),

unbiased, hence slightly negative at times. **Kernels** (:data:`KERNELS`): 10 Laplace
``exp(-||x - y||_1 / h)`` on L1 distances and 10 Gaussian ``exp(-(||x - y||_2 / h)^2)`` on L2 distances
(no factor 2), the collection of MMDAgg (Schrab et al., 2023). **Bandwidths** (:func:`bandwidths`), per
layer and per distance, from the cross distances between the first 500 rows of ``X`` and of ``Y``:
``h_min`` is the smallest distance, or, if that is below 0.1, ``max(q, 0.1)`` with ``q`` the sorted
distances' entry at index ``floor(0.05 * count)``; then ``h_min / 2`` to ``2 max(d_max, 0.3)`` in 10
geometric steps. Which set is ``X`` matters only through the bandwidths: :func:`prepare` puts the target
first.

**Layers** (:func:`layers_of`): a layer is a module's weight *with its bias* (and a BatchNorm's gamma
with its beta), flattened together; buffers (running statistics) are left out. The paper says "layer-wise"
without saying where biases go; keeping a layer's parameters together is our reading. OptuNet has three
layers: ``conv1`` (32 parameters), ``conv2`` (250) and ``fc`` (100 + 10).

**Aggregates** (:func:`reduce`): per layer, the median (Table 1), mean or maximum over the 20 kernels;
then the mean over layers weighted by their parameter counts (Table 1 and App. B.4, whose columns are the
weighted means of the per-layer medians, means and maxima), or the plain mean or the maximum over layers.
The median of 20 values is the mean of the 10th and 11th (numpy's convention). The paper reports
``100 x`` these values (:data:`PERCENT`; :meth:`Result.summary` applies it).

**Symmetries** (:func:`remove_symmetries`): ``"raw"``; ``"ns"``, the paper's removal (unit-norm neurons,
then neurons sorted by their largest incoming weight, :func:`symlib.canonical.canonicalize`);
``"minmass"`` (min-mass scaling, then the same sort); ``"perm"`` and ``"scale"`` remove one kind only.

**Is a difference real?** (beyond the paper)

* :func:`mmd` with ``n_permutations``: a permutation test of "both sets come from one distribution".
  The checkpoints of the two sets are pooled and re-split at random; one permutation serves every kernel
  and every layer, so the per-layer statistic (median over kernels) and the aggregate (weighted mean of the
  medians) are tested with the same permutations. The p-value is ``(1 + #{T_b >= T}) / (1 + B)``. This
  is a simple, documented variant of MMDAgg's aggregated test (which calibrates a union of the 20
  single-kernel tests). The test statistic takes its bandwidths from the *pooled* distances (all pairs
  of checkpoints of both sets), which no re-split changes, so the test is exact by construction. The
  paper's cross-distance bandwidths depend on the split; held fixed across re-splits (as MMDAgg does),
  the test is only approximately valid (in our checks, 400 null repeats of 40 vs 10 and 100 vs 10
  samples, its type-I error at 0.1 was 0.09 and 0.12, as with pooled bandwidths). The cross rule also
  biases the single-kernel estimates of the smallest bandwidths upwards under the null (by about 0.3-0.5
  of their standard deviation with 10 to 40 samples: those bandwidths follow the smallest cross
  distances); the median over kernels was not visibly biased. ``rule="pooled"`` gives estimates that are
  exactly centred under the null (their mean over the re-splits of any fixed pool is 0).
* ``n_bootstrap``: percentile intervals for every reported number. Checkpoints are resampled with
  replacement within each set; in a resampled set, pairs of copies of one checkpoint are left out of the
  within-set sums (they would count ``k(x, x) = 1`` and bias every replicate upwards), so a replicate is
  ``a^T K_0 a / (m^2 - sum a^2) + ...`` with ``a`` the resampling counts and ``K_0`` the kernel matrix with
  a zero diagonal.
* :func:`difference`: the difference of two aggregate MMDs sharing a target (one-mode vs multi-mode, raw
  vs NS), with a paired bootstrap (the same resampled target checkpoints on both sides; the same method
  checkpoints too when both sides hold the same samples) and the p-value of the two-sided percentile
  test (the smallest ``1 - level`` at which the interval excludes 0).

**Computation.** Per layer, one L1 and one L2 distance matrix of the pooled checkpoints serves all 20
kernels, every permutation and every bootstrap replicate (a permutation or a resample is a weight vector,
and its statistic a quadratic form ``a^T K_0 a`` evaluated as one batched matrix product). Within a set,
each pair's distance is computed once (``torch.pdist``) and, for the estimate, exponentiated once. Work
stays on the device of the inputs, in float64 by default. :func:`table` shares the target's symmetry
removal and its within-target distances across methods.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from symlib import canonical
from symlib import progress as _progress
from symlib.spec import Params, Spec

N_BANDWIDTHS = 10
MAX_ROWS = 500
KERNELS = tuple(f"laplace-{i}" for i in range(N_BANDWIDTHS)) + tuple(
    f"gaussian-{i}" for i in range(N_BANDWIDTHS)
)
PERCENT = 100.0
SYMMETRIES = ("raw", "ns", "minmass", "perm", "scale")
KERNEL_REDUCE = ("median", "mean", "max")
LAYER_REDUCE = ("weighted", "mean", "max")
_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


# ----------------------------------------------------------------------------- inputs
def remove_symmetries(params: Params, spec: Spec | None, how: str = "ns", check: bool = True) -> Params:
    """The sample set ``params`` (stacked ``(S, ...)``) with the symmetries named by ``how`` removed.

    Args:
        params: stacked state dicts.
        spec: the architecture's symmetries (:func:`symlib.trace.spec_of`); unused for ``"raw"``.
        how: ``"raw"`` (nothing), ``"ns"`` (the paper's: unit L2-norm neurons, then sort by the maximum
            incoming weight), ``"minmass"`` (min-mass scaling, then the same sort), ``"perm"`` (sort
            only) or ``"scale"`` (unit-norm only).
        check: verify that every network computes the same function afterwards.
    """
    if how not in SYMMETRIES:
        raise ValueError(f"unknown symmetry removal {how!r}; choose one of {SYMMETRIES}")
    if how == "raw":
        return dict(params)
    if spec is None:
        raise ValueError(f"removing symmetries ({how!r}) needs the spec: pass spec=trace.spec_of(model, ...)")
    scaling = {"ns": "normalize", "minmass": "minmass", "perm": None}
    if how == "scale":
        return canonical.normalize(params, spec, check=check)
    return canonical.canonicalize(params, spec, key="max", scaling=scaling[how], check=check)


def layers_of(source: Spec | Mapping | Sequence[str], by: str = "module") -> dict[str, tuple[str, ...]]:
    """Layers as ``{layer: parameter names}``, in the order of ``source`` (buffers left out).

    Args:
        source: a :class:`~symlib.spec.Spec`, a state dict, or parameter names.
        by: ``"module"`` (a weight with its bias: ``"fc.weight"`` and ``"fc.bias"`` form layer ``"fc"``)
            or ``"tensor"`` (each parameter alone).
    """
    names = list(source.shapes) if isinstance(source, Spec) else list(source)
    if by not in ("module", "tensor"):
        raise ValueError(f"by must be 'module' or 'tensor', got {by!r}")
    out: dict[str, list[str]] = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        if leaf in _BUFFERS:
            continue
        out.setdefault(prefix if by == "module" and prefix else name, []).append(name)
    if not out:
        raise ValueError(f"no parameters to compare among {names[:5]}")
    return {k: tuple(v) for k, v in out.items()}


def _unwrap(samples) -> Params:
    """A stacked state dict from a dict or a :class:`symlib.posteriors.base.SampleSet`."""
    params = getattr(samples, "params", samples)
    if not isinstance(params, Mapping):
        raise TypeError(f"expected stacked weights {{name: (S, ...)}} or a SampleSet, got {type(samples)}")
    return dict(params)


def flatten(params: Params, layers: Mapping[str, Sequence[str]], dtype=torch.float64) -> list[torch.Tensor]:
    """One ``(S, d_layer)`` matrix per layer: its parameters flattened and concatenated, one row a sample."""
    out = []
    for layer, names in layers.items():
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"layer {layer!r} needs {missing}, absent from the sample set: same architecture?")
        s = params[names[0]].shape[0]
        out.append(torch.cat([params[n].reshape(s, -1).to(dtype) for n in names], dim=1))
    return out


@dataclasses.dataclass(frozen=True)
class Pair:
    """Two sample sets flattened per layer, ready to compare.

    Attributes:
        names: layer names; ``sizes``: their parameter counts.
        x: target layers, ``(m, d)`` each; ``y``: method layers, ``(n, d)`` each.
        symmetries: which symmetries were removed (:func:`remove_symmetries`).
        dxx: optional cached within-target distances per layer, ``(2, m(m-1)/2)`` (L1, L2; the upper
            triangle, :func:`_pdist`), shared by
            :func:`table` across methods.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    x: tuple[torch.Tensor, ...]
    y: tuple[torch.Tensor, ...]
    symmetries: str = "raw"
    dxx: tuple[torch.Tensor, ...] | None = None

    @property
    def m(self) -> int:
        return int(self.x[0].shape[0])

    @property
    def n(self) -> int:
        return int(self.y[0].shape[0])


def prepare(target, samples, spec: Spec | None = None, symmetries: str = "raw", layers=None,
            dtype=torch.float64, check: bool = True) -> Pair:
    """Remove symmetries from both sets and flatten them per layer (the target is ``X``).

    Args:
        target, samples: stacked state dicts ``(S, ...)`` or ``SampleSet`` s of one architecture.
        spec: the architecture's symmetries; needed unless ``symmetries="raw"``.
        symmetries: see :func:`remove_symmetries`.
        layers: ``{layer: names}`` (:func:`layers_of`); by default one layer per module of ``spec`` (or
            of ``target``'s keys).
        dtype: of the comparison (float64: the statistic is a difference of large sums).
    """
    target, samples = _unwrap(target), _unwrap(samples)
    layers = layers_of(spec if spec is not None else target) if layers is None else dict(layers)
    xs = flatten(remove_symmetries(target, spec, symmetries, check), layers, dtype)
    ys = flatten(remove_symmetries(samples, spec, symmetries, check), layers, dtype)
    for name, x, y in zip(layers, xs, ys, strict=True):
        if x.shape[1] != y.shape[1]:
            raise ValueError(f"layer {name!r} has {x.shape[1]} vs {y.shape[1]} parameters: "
                             "are both sets of one architecture?")
    if xs[0].shape[0] < 2 or ys[0].shape[0] < 2:
        raise ValueError(f"the unbiased MMD needs at least 2 samples per set, got {xs[0].shape[0]} and "
                         f"{ys[0].shape[0]}")
    return Pair(tuple(layers), tuple(int(x.shape[1]) for x in xs), tuple(xs), tuple(ys), symmetries)


# ------------------------------------------------------------------------- kernels
def _cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """L1 and L2 distances between the rows of ``a`` and ``b``: ``(2, len(a), len(b))``."""
    return torch.stack([torch.cdist(a, b, p=1.0),
                        torch.cdist(a, b, p=2.0, compute_mode="donot_use_mm_for_euclid_dist")])


def _pdist(a: torch.Tensor) -> torch.Tensor:
    """L1 and L2 distances between the distinct rows of ``a``, upper triangle row by row (the order of
    ``torch.triu_indices``): ``(2, m(m-1)/2)``. Computed directly, never through ``|a|^2 + |b|^2 - 2ab``,
    whose cancellation would blur small distances."""
    return torch.stack([torch.pdist(a, p=1.0), torch.pdist(a, p=2.0)])


def _square(d: torch.Tensor, m: int) -> torch.Tensor:
    """The full symmetric ``(2, m, m)`` matrices of condensed distances ``(2, m(m-1)/2)``."""
    full = d.new_zeros(2, m, m)
    iu = torch.triu_indices(m, m, 1, device=d.device)
    full[:, iu[0], iu[1]] = d
    return full + full.transpose(-1, -2)


def bandwidths(cross: torch.Tensor, n: int = N_BANDWIDTHS) -> torch.Tensor:
    """MMDAgg's bandwidth collection from the cross distances ``cross`` (any shape) of one metric: ``(n,)``.

    ``h_min = min(d)``, or ``max(sorted(d)[floor(0.05 * len(d))], 0.1)`` when ``min(d) < 0.1``; then ``n``
    geometric steps from ``h_min / 2`` to ``2 max(max(d), 0.3)``.
    """
    d = cross.reshape(-1)
    lo = d.min()
    if lo < 0.1:
        lo = torch.clamp(d.sort().values[int(math.floor(d.numel() * 0.05))], min=0.1)
    lo = lo / 2
    hi = 2 * torch.clamp(d.max(), min=0.3)
    steps = torch.arange(n, dtype=d.dtype, device=d.device) / (n - 1)
    return lo * (hi / lo) ** steps


RULES = ("cross", "pooled")


def _layer_bandwidths(dxx, dyy, dxy, rule: str = "cross") -> torch.Tensor:
    """The 20 bandwidths of one layer, Laplace (L1) then Gaussian (L2), from its distances (within-set
    condensed ``(2, .)``, cross ``(2, m, n)``).

    ``"cross"`` (the paper's, MMDAgg's): the cross distances of the first 500 rows of each set.
    ``"pooled"``: the distances between all pairs of distinct checkpoints of the pooled sample, a function
    of the pool that no re-split changes (the permutation test needs this).
    """
    if rule == "cross":
        d = dxy[:, :MAX_ROWS, :MAX_ROWS].reshape(2, -1)
    elif rule == "pooled":
        d = torch.cat([dxy.reshape(2, -1), dxx, dyy], -1)
    else:
        raise ValueError(f"unknown bandwidth rule {rule!r}; choose one of {RULES}")
    return torch.cat([bandwidths(d[0]), bandwidths(d[1])])


def _kernel(d: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The 20 kernels on distances ``d`` ``(2, ...)``: ``(20, ...)``."""
    shape = (-1,) + (1,) * (d.ndim - 1)
    out = torch.empty((2 * N_BANDWIDTHS, *d.shape[1:]), dtype=d.dtype, device=d.device)
    torch.mul(d[0], (-1 / h[:N_BANDWIDTHS]).reshape(shape), out=out[:N_BANDWIDTHS])
    torch.mul(d[1] * d[1], (-1 / h[N_BANDWIDTHS:] ** 2).reshape(shape), out=out[N_BANDWIDTHS:])
    return out.exp_()


def _kernel_sums(d: torch.Tensor, h: torch.Tensor, chunk: int = 1 << 18) -> torch.Tensor:
    """``sum_j k(d_j)`` for the 20 kernels over distances ``d`` ``(2, P)``: ``(20,)``, in slices of
    ``chunk`` distances (memory ``20 chunk`` floats)."""
    total = d.new_zeros(2 * N_BANDWIDTHS)
    for i in range(0, d.shape[-1], chunk):
        total += _kernel(d[:, i:i + chunk], h).sum(-1)
    return total


def _observed(dxx, dyy, dxy, h) -> torch.Tensor:
    """``MMD^2_u`` for the 20 kernels ``(20,)`` from condensed within-set distances (each pair once)."""
    m, n = dxy.shape[-2], dxy.shape[-1]
    sxx, syy = 2 * _kernel_sums(dxx, h), 2 * _kernel_sums(dyy, h)
    sxy = _kernel_sums(dxy.reshape(2, -1), h)
    return sxx / (m * (m - 1)) + syy / (n * (n - 1)) - 2 * sxy / (m * n)


def estimate(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor | None = None, rule: str = "cross"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``MMD^2_u`` of one layer for the 20 kernels, and their bandwidths: ``((20,), (20,))``.

    Args:
        x, y: ``(m, d)`` and ``(n, d)`` samples, one row each.
        h: bandwidths (10 Laplace then 10 Gaussian); by default MMDAgg's rule (:func:`bandwidths`) on the
            distances that ``rule`` names (``"cross"``, the paper's, or ``"pooled"``).
    """
    if x.shape[0] < 2 or y.shape[0] < 2:
        raise ValueError(f"the unbiased MMD needs at least 2 samples per set, got {x.shape[0]}, {y.shape[0]}")
    dxx, dyy, dxy = _pdist(x), _pdist(y), _cdist(x, y)
    h = _layer_bandwidths(dxx, dyy, dxy, rule) if h is None else torch.as_tensor(h, dtype=x.dtype,
                                                                                  device=x.device)
    return _observed(dxx, dyy, dxy, h), h


def _pooled_kernel(dxx, dyy, dxy, h) -> torch.Tensor:
    """The 20 kernel matrices of the pooled sample ``(20, m + n, m + n)``, zero on the diagonal."""
    m, n = dxy.shape[-2], dxy.shape[-1]
    top = torch.cat([_square(dxx, m), dxy], -1)
    d = torch.cat([top, torch.cat([dxy.transpose(-1, -2), _square(dyy, n)], -1)], -2)
    k = _kernel(d, h)
    k.diagonal(dim1=-2, dim2=-1).zero_()
    return k


def _permuted(k: torch.Tensor, m: int, order: torch.Tensor) -> torch.Tensor:
    """``MMD^2_u`` ``(20, B)`` after re-splitting the pool: ``order`` ``(B, N)`` are permutations of the
    pooled rows, the first ``m`` forming the new ``X`` and the rest the new ``Y``.

    With ``a`` the indicator of the new ``X``, ``r = K_0 1`` and ``T = 1^T K_0 1``: ``S_XX = a^T K_0 a``,
    ``S_XY = a^T r - S_XX`` and ``S_YY = T - 2 a^T r + S_XX``, one matrix product ``K_0 a`` for all kernels
    and permutations. (Gathering the small group's block instead, ``20 n^2`` values per permutation, was
    slower than this product on CPU for 1,000 vs 100 checkpoints.)
    """
    n = k.shape[-1] - m
    r = k.sum(-1)
    total = r.sum(-1, keepdim=True)
    a = torch.zeros(order.shape[0], k.shape[-1], dtype=k.dtype, device=k.device)
    a = a.scatter_(1, order[:, :m], 1.0).T.contiguous()
    sxx = ((k @ a) * a).sum(-2)
    ar = r @ a
    sxy, syy = ar - sxx, total - 2 * ar + sxx
    return sxx / (m * (m - 1)) + syy / (n * (n - 1)) - 2 * sxy / (m * n)


def _resampled(k: torch.Tensor, m: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``MMD^2_u`` ``(20, R)`` of resampled sets: ``a`` ``(m, R)`` and ``b`` ``(n, R)`` count the copies of
    each checkpoint; pairs of copies of one checkpoint are left out of the within-set sums."""
    n = k.shape[-1] - m
    sxx = ((k[:, :m, :m] @ a) * a).sum(-2)
    syy = ((k[:, m:, m:] @ b) * b).sum(-2)
    sxy = ((k[:, :m, m:] @ b) * a).sum(-2)
    nx = m * m - (a * a).sum(0)
    ny = n * n - (b * b).sum(0)
    return sxx / nx + syy / ny - 2 * sxy / (m * n)


def _counts(gen: torch.Generator, size: int, reps: int, dtype, device) -> torch.Tensor:
    """Bootstrap counts ``(size, reps)``: how often each of ``size`` items is drawn in ``size`` draws."""
    idx = torch.randint(0, size, (reps, size), generator=gen)
    c = torch.zeros(reps, size, dtype=dtype).scatter_add_(1, idx, torch.ones(reps, size, dtype=dtype))
    return c.T.contiguous().to(device)


def _chunks(total: int, size: int):
    return [(i, min(i + size, total)) for i in range(0, total, size)]


# --------------------------------------------------------------------- reductions
def _median(v: torch.Tensor, dim: int) -> torch.Tensor:
    """The median with numpy's convention (mean of the two middle values for an even count)."""
    s = v.sort(dim=dim).values
    c = s.shape[dim]
    return (s.select(dim, (c - 1) // 2) + s.select(dim, c // 2)) / 2


def reduce(values: torch.Tensor, sizes: Sequence[int], kernels: str = "median",
           layers: str | None = "weighted") -> torch.Tensor:
    """Reduce per-layer, per-kernel MMDs ``(L, 20, ...)`` over kernels, then over layers.

    Args:
        values: ``MMD^2_u`` per layer and kernel, optionally with trailing replicate axes.
        sizes: parameter count of each layer (the weights of ``"weighted"``).
        kernels: ``"median"`` (Table 1), ``"mean"`` or ``"max"`` over the 20 kernels.
        layers: ``"weighted"`` (mean weighted by parameter count, Table 1 and App. B.4), ``"mean"``,
            ``"max"``, or ``None`` to keep one value per layer.
    """
    if kernels not in KERNEL_REDUCE:
        raise ValueError(f"kernels must be one of {KERNEL_REDUCE}, got {kernels!r}")
    if layers is not None and layers not in LAYER_REDUCE:
        raise ValueError(f"layers must be one of {LAYER_REDUCE} or None, got {layers!r}")
    per_layer = {"median": lambda: _median(values, 1), "mean": lambda: values.mean(1),
                 "max": lambda: values.amax(1)}[kernels]()
    if layers is None:
        return per_layer
    if layers == "max":
        return per_layer.amax(0)
    if layers == "mean":
        return per_layer.mean(0)
    w = torch.as_tensor(sizes, dtype=per_layer.dtype, device=per_layer.device)
    w = (w / w.sum()).reshape((-1,) + (1,) * (per_layer.ndim - 1))
    return (w * per_layer).sum(0)


def _interval(reps: torch.Tensor, level: float) -> torch.Tensor:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=reps.dtype, device=reps.device)
    return torch.nanquantile(reps, q, dim=-1).movedim(0, -1)


def _p_value(observed: torch.Tensor, permuted: torch.Tensor) -> torch.Tensor:
    hits = (permuted >= observed[..., None]).sum(-1).to(observed.dtype)
    return (1 + hits) / (1 + permuted.shape[-1])


@dataclasses.dataclass(frozen=True)
class Result:
    """The MMD between two sample sets, per layer and kernel, with its test and bootstrap replicates.

    Attributes:
        names, sizes: layers and their parameter counts.
        values: ``MMD^2_u`` ``(L, 20)`` (kernels in the order of :data:`KERNELS`).
        bandwidths: ``(L, 20)``.
        m, n: sample sizes (target, method); ``symmetries``: the removal applied; ``rule``: the bandwidth
            rule of ``values`` and ``boot``.
        test_values: ``(L, 20)`` the statistic that the permutation test uses (bandwidths from the
            ``"pooled"`` rule, so that every re-split is scored by the same function), or ``None``.
        permuted: ``(L, 20, B)`` that statistic on re-split pools, or ``None``.
        boot: ``(L, 20, R)`` bootstrap replicates, or ``None``.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    values: torch.Tensor
    bandwidths: torch.Tensor
    m: int
    n: int
    symmetries: str = "raw"
    rule: str = "cross"
    test_values: torch.Tensor | None = None
    permuted: torch.Tensor | None = None
    boot: torch.Tensor | None = None

    def value(self, kernels: str = "median", layers: str | None = "weighted") -> torch.Tensor:
        """The aggregate (a 0-d tensor), or one value per layer for ``layers=None`` (see :func:`reduce`)."""
        return reduce(self.values, self.sizes, kernels, layers)

    def p_value(self, kernels: str = "median", layers: str | None = "weighted") -> torch.Tensor:
        """Permutation p-value of "same distribution" for the aggregate (or per layer)."""
        if self.permuted is None:
            raise ValueError("no permutation test was run: call mmd(..., n_permutations=1000)")
        observed = reduce(self.test_values, self.sizes, kernels, layers)
        return _p_value(observed, reduce(self.permuted, self.sizes, kernels, layers))

    def interval(self, kernels: str = "median", layers: str | None = "weighted",
                 level: float = 0.95) -> torch.Tensor:
        """Percentile bootstrap interval ``(..., 2)`` (low, high) of the aggregate (or per layer)."""
        if self.boot is None:
            raise ValueError("no bootstrap was run: call mmd(..., n_bootstrap=1000)")
        return _interval(reduce(self.boot, self.sizes, kernels, layers), level)

    def summary(self, scale: float = PERCENT, level: float = 0.95) -> dict[str, float]:
        """Table row: the weighted mean over layers of the median, mean and max over kernels, times
        ``scale`` (100 as in the paper), with ``_lo``/``_hi`` bounds and ``_p`` values when available."""
        out: dict[str, float] = {}
        for kern in KERNEL_REDUCE:
            out[kern] = scale * float(self.value(kern))
            if self.boot is not None:
                lo, hi = (scale * self.interval(kern, level=level)).tolist()
                out[f"{kern}_lo"], out[f"{kern}_hi"] = lo, hi
            if self.permuted is not None:
                out[f"{kern}_p"] = float(self.p_value(kern))
        return out


# --------------------------------------------------------------------------- main
def _distances(pair: Pair, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = pair.x[layer], pair.y[layer]
    dxx = pair.dxx[layer] if pair.dxx is not None else _pdist(x)
    return dxx, _pdist(y), _cdist(x, y)


def mmd(pair: Pair, n_permutations: int = 0, n_bootstrap: int = 0, seed: int = 0, rule: str = "cross",
        chunk: int = 256, progress: bool = False) -> Result:
    """``MMD^2_u`` per layer and kernel, with an optional permutation test and bootstrap replicates.

    Args:
        pair: from :func:`prepare`.
        n_permutations: re-splits of the pooled checkpoints (0: no test). One set of permutations
            serves every layer and kernel.
        n_bootstrap: resamples of each set for the confidence intervals (0: none).
        seed: of the permutations and resamples.
        rule: bandwidths of the reported values and the bootstrap, ``"cross"`` (the paper's) or
            ``"pooled"``. The permutation test always uses ``"pooled"`` bandwidths, which no re-split
            changes (the cross rule depends on the split).
        chunk: permutations / resamples per matrix product (memory: ``20 (m+n) chunk`` floats).
        progress: show a bar over the layers.

    Returns:
        A :class:`Result`; reduce it with ``value``, ``p_value``, ``interval`` or ``summary``.
    """
    m, n = pair.m, pair.n
    x0 = pair.x[0]
    dtype, device = x0.dtype, x0.device
    order = a = b = None
    if n_permutations:
        gen = torch.Generator().manual_seed(seed)
        order = torch.rand(n_permutations, m + n, generator=gen).argsort(-1).to(device)
    if n_bootstrap:
        gen = torch.Generator().manual_seed(seed + 7919)
        a = _counts(gen, m, n_bootstrap, dtype, device)
        b = _counts(gen, n, n_bootstrap, dtype, device)
    values, hs, tests, perms, boots = [], [], [], [], []
    with _progress.bar(len(pair.names), desc="mmd", enabled=progress) as bar:
        for layer in range(len(pair.names)):
            dxx, dyy, dxy = _distances(pair, layer)
            h = _layer_bandwidths(dxx, dyy, dxy, rule)
            hs.append(h)
            values.append(_observed(dxx, dyy, dxy, h))
            if a is not None:
                k = _pooled_kernel(dxx, dyy, dxy, h)
                boots.append(torch.cat([_resampled(k, m, a[:, i:j], b[:, i:j])
                                        for i, j in _chunks(n_bootstrap, chunk)], -1))
            if order is not None:
                if rule != "pooled":
                    h = _layer_bandwidths(dxx, dyy, dxy, "pooled")
                    k = _pooled_kernel(dxx, dyy, dxy, h)
                elif a is None:
                    k = _pooled_kernel(dxx, dyy, dxy, h)
                tests.append(values[-1] if rule == "pooled" else _observed(dxx, dyy, dxy, h))
                perms.append(torch.cat([_permuted(k, m, order[i:j])
                                        for i, j in _chunks(n_permutations, chunk)], -1))
            k = None
            bar.update()

    def stack(xs):
        return torch.stack(xs) if xs else None

    return Result(pair.names, pair.sizes, torch.stack(values), torch.stack(hs), m, n, pair.symmetries, rule,
                  stack(tests), stack(perms), stack(boots))


def table(target, methods: Mapping[str, object], spec: Spec | None = None,
          symmetries: Sequence[str] = ("raw", "ns"), layers=None, n_permutations: int = 0,
          n_bootstrap: int = 0, seed: int = 0, rule: str = "cross", dtype=torch.float64,
          check: bool = True, progress: bool = True) -> dict[tuple[str, str], Result]:
    """Every method against one target, for each symmetry removal: ``{(method, symmetries): Result}``.

    The target's symmetry removal and its within-target distances are computed once per removal and
    shared by all methods; each comparison then runs :func:`mmd` (same seed, so same permutations).
    """
    out = {}
    target = _unwrap(target)
    layers = layers_of(spec if spec is not None else target) if layers is None else dict(layers)
    with _progress.bar(len(methods) * len(symmetries), desc="mmd table", enabled=progress) as bar:
        for sym in symmetries:
            xs = flatten(remove_symmetries(target, spec, sym, check), layers, dtype)
            dxx = tuple(_pdist(x) for x in xs)
            for name, samples in methods.items():
                ys = flatten(remove_symmetries(_unwrap(samples), spec, sym, check), layers, dtype)
                pair = Pair(tuple(layers), tuple(int(x.shape[1]) for x in xs), tuple(xs), tuple(ys), sym, dxx)
                out[(name, sym)] = mmd(pair, n_permutations, n_bootstrap, seed, rule)
                bar.update()
    return out


@dataclasses.dataclass(frozen=True)
class Difference:
    """``MMD(first) - MMD(second)`` with its paired bootstrap.

    Attributes:
        value: the observed difference of aggregates; ``boot``: its replicates ``(R,)``.
        first, second: the two aggregates; ``level``: of ``interval``.
        interval: percentile interval (low, high); ``p_value``: two-sided bootstrap p-value of "no
            difference", ``min(1, 2 min(#{D* <= 0} + 1, #{D* >= 0} + 1) / (R + 1))``.
    """

    value: float
    first: float
    second: float
    interval: tuple[float, float]
    p_value: float
    boot: torch.Tensor
    level: float


def difference(first: Pair, second: Pair, n_bootstrap: int = 1000, seed: int = 0, kernels: str = "median",
               layers: str = "weighted", level: float = 0.95, share_target: bool = True,
               share_samples: bool = False, rule: str = "cross", chunk: int = 256) -> Difference:
    """Is ``MMD(first)`` different from ``MMD(second)``? The difference of their aggregates, bootstrapped.

    Both pairs usually share the target (one-mode vs multi-mode method; or one method on raw weights vs
    without symmetries). Resampling is paired: with ``share_target`` the same target checkpoints are drawn
    for both sides (they must have the same ``m``, in the same order); with ``share_samples`` (for one
    sample set seen two ways, e.g. raw vs NS) the same method checkpoints too.

    Returns:
        A :class:`Difference`; a difference is "larger than the noise" when its interval excludes 0.
    """
    if share_target and first.m != second.m:
        raise ValueError(f"share_target needs the same target on both sides, got {first.m} and {second.m} "
                         "checkpoints; pass share_target=False for independent targets")
    if share_samples and first.n != second.n:
        raise ValueError(f"share_samples needs the same samples on both sides, got {first.n} and {second.n}")
    gen = torch.Generator().manual_seed(seed)
    x0 = first.x[0]
    a1 = _counts(gen, first.m, n_bootstrap, x0.dtype, x0.device)
    a2 = a1 if share_target else _counts(gen, second.m, n_bootstrap, x0.dtype, x0.device)
    b1 = _counts(gen, first.n, n_bootstrap, x0.dtype, x0.device)
    b2 = b1 if share_samples else _counts(gen, second.n, n_bootstrap, x0.dtype, x0.device)
    agg = []
    for pair, a, b in ((first, a1, b1), (second, a2, b2)):
        obs, reps = [], []
        for layer in range(len(pair.names)):
            dxx, dyy, dxy = _distances(pair, layer)
            h = _layer_bandwidths(dxx, dyy, dxy, rule)
            obs.append(_observed(dxx, dyy, dxy, h))
            k = _pooled_kernel(dxx, dyy, dxy, h)
            reps.append(torch.cat([_resampled(k, pair.m, a[:, i:j], b[:, i:j])
                                   for i, j in _chunks(n_bootstrap, chunk)], -1))
            del k
        agg.append((reduce(torch.stack(obs), pair.sizes, kernels, layers),
                    reduce(torch.stack(reps), pair.sizes, kernels, layers)))
    d = agg[0][1] - agg[1][1]
    lo, hi = _interval(d, level).tolist()
    below = int((d <= 0).sum()) + 1
    above = int((d >= 0).sum()) + 1
    p = min(1.0, 2 * min(below, above) / (n_bootstrap + 1))
    return Difference(float(agg[0][0] - agg[1][0]), float(agg[0][0]), float(agg[1][0]), (lo, hi), p,
                      d, level)
