r"""The MMD's kernels, bandwidths and estimator, and the quadratic forms of its tests (book: chapter
"Table 1"; paper App. B.4).

Per layer, one L1 and one L2 distance matrix of the pooled checkpoints serves all 20 kernels
(:data:`KERNELS`), every permutation and every bootstrap replicate: a permutation or a resample is a
weight vector, and its statistic a quadratic form evaluated as one batched matrix product
(:func:`permuted`, :func:`resampled`). See :mod:`symlib.stats.mmd` for the definitions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "KERNELS",
    "KERNEL_REDUCE",
    "LAYER_REDUCE",
    "MAX_ROWS",
    "N_BANDWIDTHS",
    "PERCENT",
    "RULES",
    "bandwidths",
    "cdist",
    "estimate",
    "pdist",
    "permuted",
    "reduce",
    "resampled",
]

N_BANDWIDTHS = 10


MAX_ROWS = 500


KERNELS = tuple(f"laplace-{i}" for i in range(N_BANDWIDTHS)) + tuple(
    f"gaussian-{i}" for i in range(N_BANDWIDTHS)
)


PERCENT = 100.0


KERNEL_REDUCE = ("median", "mean", "max")


LAYER_REDUCE = ("weighted", "mean", "max")


# ------------------------------------------------------------------------- kernels
def cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """L1 and L2 distances between the rows of ``a`` and ``b``: ``(2, len(a), len(b))``."""
    return torch.stack([torch.cdist(a, b, p=1.0),
                        torch.cdist(a, b, p=2.0, compute_mode="donot_use_mm_for_euclid_dist")])


def pdist(a: torch.Tensor) -> torch.Tensor:
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
        # the (floor(0.05 len) + 1)-th smallest distance: a selection, not a sort
        lo = torch.clamp(d.kthvalue(int(math.floor(d.numel() * 0.05)) + 1).values, min=0.1)
    lo = lo / 2
    hi = 2 * torch.clamp(d.max(), min=0.3)
    steps = torch.arange(n, dtype=d.dtype, device=d.device) / (n - 1)
    return lo * (hi / lo) ** steps


RULES = ("cross", "pooled")


def layer_bandwidths(dxx, dyy, dxy, rule: str = "cross") -> torch.Tensor:
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


def _kernel(d: torch.Tensor, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The 20 kernels on distances ``d`` ``(2, ...)``: ``(20, ...)``, written into ``out`` if given (a
    buffer of that shape, dtype and device, reused: a fresh large one costs its pages' first touch)."""
    shape = (-1,) + (1,) * (d.ndim - 1)
    size = (2 * N_BANDWIDTHS, *d.shape[1:])
    if out is None or tuple(out.shape) != size or out.dtype != d.dtype or out.device != d.device:
        out = torch.empty(size, dtype=d.dtype, device=d.device)
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


def observed(dxx, dyy, dxy, h) -> torch.Tensor:
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
    dxx, dyy, dxy = pdist(x), pdist(y), cdist(x, y)
    h = layer_bandwidths(dxx, dyy, dxy, rule) if h is None else torch.as_tensor(h, dtype=x.dtype,
                                                                                  device=x.device)
    return observed(dxx, dyy, dxy, h), h


def observed_pooled(k: torch.Tensor, m: int) -> torch.Tensor:
    """``MMD^2_u`` ``(20,)`` from the pooled kernel matrices ``k`` (:func:`pooled_kernel`, zero diagonal),
    the first ``m`` rows being ``X``: the same value as :func:`observed`, from the block sums of a matrix
    the tests build anyway instead of the kernels computed a second time."""
    n = k.shape[-1] - m
    sxx, syy = k[:, :m, :m].sum((-2, -1)), k[:, m:, m:].sum((-2, -1))
    sxy = k[:, :m, m:].sum((-2, -1))
    return sxx / (m * (m - 1)) + syy / (n * (n - 1)) - 2 * sxy / (m * n)


def pooled_kernel(dxx, dyy, dxy, h, out: torch.Tensor | None = None) -> torch.Tensor:
    """The 20 kernel matrices of the pooled sample ``(20, m + n, m + n)``, zero on the diagonal (written
    into ``out``, a previous result of the same shape, if given)."""
    m, n = dxy.shape[-2], dxy.shape[-1]
    top = torch.cat([_square(dxx, m), dxy], -1)
    d = torch.cat([top, torch.cat([dxy.transpose(-1, -2), _square(dyy, n)], -1)], -2)
    k = _kernel(d, h, out)
    k.diagonal(dim1=-2, dim2=-1).zero_()
    return k


def permuted(k: torch.Tensor, m: int, order: torch.Tensor) -> torch.Tensor:
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


def resampled(k: torch.Tensor, m: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``MMD^2_u`` ``(20, R)`` of resampled sets: ``a`` ``(m, R)`` and ``b`` ``(n, R)`` count the copies of
    each checkpoint; pairs of copies of one checkpoint are left out of the within-set sums."""
    n = k.shape[-1] - m
    sxx = ((k[:, :m, :m] @ a) * a).sum(-2)
    syy = ((k[:, m:, m:] @ b) * b).sum(-2)
    sxy = ((k[:, :m, m:] @ b) * a).sum(-2)
    nx = m * m - (a * a).sum(0)
    ny = n * n - (b * b).sum(0)
    return sxx / nx + syy / ny - 2 * sxy / (m * n)


def counts(gen: torch.Generator, size: int, reps: int, dtype, device) -> torch.Tensor:
    """Bootstrap counts ``(size, reps)``: how often each of ``size`` items is drawn in ``size`` draws."""
    idx = torch.randint(0, size, (reps, size), generator=gen)
    c = torch.zeros(reps, size, dtype=dtype).scatter_add_(1, idx, torch.ones(reps, size, dtype=dtype))
    return c.T.contiguous().to(device)


def chunks(total: int, size: int):
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


def interval(reps: torch.Tensor, level: float) -> torch.Tensor:
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=reps.dtype, device=reps.device)
    return torch.nanquantile(reps, q, dim=-1).movedim(0, -1)


def p_value(observed: torch.Tensor, permuted: torch.Tensor) -> torch.Tensor:
    hits = (permuted >= observed[..., None]).sum(-1).to(observed.dtype)
    return (1 + hits) / (1 + permuted.shape[-1])
