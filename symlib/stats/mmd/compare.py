r"""Comparing two sample sets: the MMD with its permutation test and bootstrap intervals, tables of many
sets against one target, and paired differences (book: chapter "Table 1"; paper §4, App. B.4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from symlib import progress as _progress
from symlib import scales as _scales
from symlib.stats.mmd.inputs import (
    Layered,
    Pair,
    check_set,
    flatten,
    layers_of,
    prepare,
    remove_symmetries,
    unwrap,
)
from symlib.stats.mmd.kernels import (
    KERNEL_REDUCE,
    PERCENT,
    cdist,
    chunks,
    counts,
    interval,
    layer_bandwidths,
    observed,
    observed_pooled,
    p_value,
    pdist,
    permuted,
    pooled_kernel,
    reduce,
    resampled,
)
from symlib.symmetry.spec import Spec

__all__ = ["Difference", "Result", "difference", "layered_table", "mmd", "table", "two_sample"]


@dataclasses.dataclass(frozen=True)
class Result:
    """The MMD between two sample sets, per layer and kernel, with its test and bootstrap replicates.

    Attributes:
        names, sizes: layers and their parameter counts.
        values: ``MMD^2_u`` ``(L, 20)`` (kernels in the order of :data:`~symlib.stats.mmd.kernels.KERNELS`).
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
        return p_value(observed, reduce(self.permuted, self.sizes, kernels, layers))

    def interval(self, kernels: str = "median", layers: str | None = "weighted",
                 level: float = 0.95) -> torch.Tensor:
        """Percentile bootstrap interval ``(..., 2)`` (low, high) of the aggregate (or per layer)."""
        if self.boot is None:
            raise ValueError("no bootstrap was run: call mmd(..., n_bootstrap=1000)")
        return interval(reduce(self.boot, self.sizes, kernels, layers), level)

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
def _counts(n_permutations: int, n_bootstrap: int, chunk: int = 1) -> None:
    """Refuse negative or non-integer numbers of permutations and resamples (0: none)."""
    for name, value, least, what in (("n_permutations", n_permutations, 0, "0: no test; e.g. 1000"),
                                     ("n_bootstrap", n_bootstrap, 0, "0: no intervals; e.g. 1000"),
                                     ("chunk", chunk, 1, "e.g. 256")):
        try:
            _scales.check_int(name, value, least)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e} ({what})") from None


def _distances(pair: Pair, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = pair.x[layer], pair.y[layer]
    dxx = pair.dxx[layer] if pair.dxx is not None else pdist(x)
    return dxx, pdist(y), cdist(x, y)


def mmd(pair: Pair, n_permutations: int = 0, n_bootstrap: int = 0, seed: int = 0, rule: str = "cross",
        chunk: int = 256, progress: bool = False) -> Result:
    """``MMD^2_u`` per layer and kernel, with an optional permutation test and bootstrap replicates.

    Args:
        pair: from :func:`~symlib.stats.mmd.inputs.prepare`.
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
    _counts(n_permutations, n_bootstrap, chunk)
    m, n = pair.m, pair.n
    x0 = pair.x[0]
    dtype, device = x0.dtype, x0.device
    order = a = b = None
    if n_permutations:
        gen = torch.Generator().manual_seed(seed)
        order = torch.rand(n_permutations, m + n, generator=gen).argsort(-1).to(device)
    if n_bootstrap:
        gen = torch.Generator().manual_seed(seed + 7919)
        a = counts(gen, m, n_bootstrap, dtype, device)
        b = counts(gen, n, n_bootstrap, dtype, device)
    values, hs, tests, perms, boots = [], [], [], [], []
    buf = None  # one (20, m + n, m + n) buffer for every kernel matrix of this comparison
    with _progress.bar(len(pair.names), desc="mmd", enabled=progress) as bar:
        for layer in range(len(pair.names)):
            dxx, dyy, dxy = _distances(pair, layer)
            h = layer_bandwidths(dxx, dyy, dxy, rule)
            hs.append(h)
            # The pooled kernel matrices, when a test needs them, also give the observed value (their block
            # sums); without a test, the kernels' sums over the distances do, without the matrices.
            k = None
            if a is not None or (order is not None and rule == "pooled"):
                k = buf = pooled_kernel(dxx, dyy, dxy, h, buf)
            values.append(observed(dxx, dyy, dxy, h) if k is None else observed_pooled(k, m))
            if a is not None:
                boots.append(torch.cat([resampled(k, m, a[:, i:j], b[:, i:j])
                                        for i, j in chunks(n_bootstrap, chunk)], -1))
            if order is not None:
                if rule != "pooled":
                    k = buf = pooled_kernel(dxx, dyy, dxy, layer_bandwidths(dxx, dyy, dxy, "pooled"), buf)
                    tests.append(observed_pooled(k, m))
                else:
                    tests.append(values[-1])
                perms.append(torch.cat([permuted(k, m, order[i:j])
                                        for i, j in chunks(n_permutations, chunk)], -1))
            bar.update()

    def stack(xs):
        return torch.stack(xs) if xs else None

    return Result(pair.names, pair.sizes, torch.stack(values), torch.stack(hs), m, n, pair.symmetries, rule,
                  stack(tests), stack(perms), stack(boots))


def two_sample(
    target,
    samples,
    *,
    spec: Spec | None = None,
    symmetries: str = "raw",
    layers=None,
    n_permutations: int = 0,
    n_bootstrap: int = 0,
    seed: int = 0,
    rule: str = "cross",
    dtype=torch.float64,
    check: bool = True,
) -> Result:
    r"""The paper's MMD between two sets of weights, in one call (``symlib.mmd``):
    :func:`~symlib.stats.mmd.inputs.prepare` then :func:`mmd`.

    Args:
        target, samples: stacked state dicts ``{name: (S, ...)}`` (or ``SampleSet`` s) of one architecture;
            ``target`` is ``X`` (its distances set the bandwidths).
        spec: the architecture's symmetries (:func:`symlib.spec_of`); needed unless ``symmetries="raw"``.
        symmetries: ``"raw"``, ``"ns"`` (the paper's removal), ``"minmass"``, ``"perm"`` or ``"scale"``
            (:func:`remove_symmetries`).
        layers: ``{layer: parameter names}`` (default: one layer per module, :func:`layers_of`).
        n_permutations: re-splits for the permutation test of "same distribution" (0: no test).
        n_bootstrap: resamples for the percentile intervals (0: none).
        seed: of the permutations and resamples.
        rule: bandwidth rule of the reported values, ``"cross"`` (the paper's) or ``"pooled"``.
        dtype: of the comparison; check: verify that removing symmetries keeps every network's function.

    Returns:
        A :class:`Result`: ``res.value()`` the aggregate :math:`\widehat{\mathrm{MMD}}{}^2_u` (weighted
        mean over layers of the median over the 20 kernels), ``res.p_value()``, ``res.interval()``,
        ``res.summary()`` (the paper's ``100 x`` values).
    """
    pair = prepare(target, samples, spec, symmetries, layers, dtype, check)
    return mmd(pair, n_permutations, n_bootstrap, seed, rule)


def table(target, methods: Mapping[str, object], spec: Spec | None = None,
          symmetries: Sequence[str] = ("raw", "ns"), layers=None, n_permutations: int = 0,
          n_bootstrap: int = 0, seed: int = 0, rule: str = "cross", dtype=torch.float64,
          check: bool = True, progress: bool = True) -> dict[tuple[str, str], Result]:
    """Every method against one target, for each symmetry removal: ``{(method, symmetries): Result}``.

    The target's symmetry removal and its within-target distances are computed once per removal and
    shared by all methods; each comparison then runs :func:`mmd` (same seed, so same permutations).
    """
    out = {}
    target = unwrap(target)
    layers = layers_of(spec if spec is not None else target) if layers is None else dict(layers)
    _counts(n_permutations, n_bootstrap)
    if not methods:
        raise ValueError("table needs at least one method to compare with the target: pass {name: set}")
    # Every set is checked before any work (prepare's checks: at least 2 samples, finite weights).
    check_set(target, layers, "the target set")
    for name, samples in methods.items():
        check_set(unwrap(samples), layers, f"method {name!r}")
    with _progress.bar(len(methods) * len(symmetries), desc="mmd table", enabled=progress) as bar:
        for sym in symmetries:
            xs = flatten(remove_symmetries(target, spec, sym, check), layers, dtype)
            dxx = tuple(pdist(x) for x in xs)
            for name, samples in methods.items():
                ys = flatten(remove_symmetries(unwrap(samples), spec, sym, check), layers, dtype)
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
    try:
        _scales.check_int("n_bootstrap", n_bootstrap, 1)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{e}: difference judges the difference by its bootstrap; pass e.g. "
                      "n_bootstrap=1000") from None
    if share_target and first.m != second.m:
        raise ValueError(f"share_target needs the same target on both sides, got {first.m} and {second.m} "
                         "checkpoints; pass share_target=False for independent targets")
    if share_samples and first.n != second.n:
        raise ValueError(f"share_samples needs the same samples on both sides, got {first.n} and {second.n}")
    gen = torch.Generator().manual_seed(seed)
    x0 = first.x[0]
    a1 = counts(gen, first.m, n_bootstrap, x0.dtype, x0.device)
    a2 = a1 if share_target else counts(gen, second.m, n_bootstrap, x0.dtype, x0.device)
    b1 = counts(gen, first.n, n_bootstrap, x0.dtype, x0.device)
    b2 = b1 if share_samples else counts(gen, second.n, n_bootstrap, x0.dtype, x0.device)
    agg = []
    buf = None  # the kernel matrices' buffer, reused while the sizes agree
    for pair, a, b in ((first, a1, b1), (second, a2, b2)):
        obs, reps = [], []
        for layer in range(len(pair.names)):
            dxx, dyy, dxy = _distances(pair, layer)
            h = layer_bandwidths(dxx, dyy, dxy, rule)
            k = buf = pooled_kernel(dxx, dyy, dxy, h, buf)
            obs.append(observed_pooled(k, pair.m))
            reps.append(torch.cat([resampled(k, pair.m, a[:, i:j], b[:, i:j])
                                   for i, j in chunks(n_bootstrap, chunk)], -1))
        agg.append((reduce(torch.stack(obs), pair.sizes, kernels, layers),
                    reduce(torch.stack(reps), pair.sizes, kernels, layers)))
    d = agg[0][1] - agg[1][1]
    lo, hi = interval(d, level).tolist()
    below = int((d <= 0).sum()) + 1
    above = int((d >= 0).sum()) + 1
    p = min(1.0, 2 * min(below, above) / (n_bootstrap + 1))
    return Difference(float(agg[0][0] - agg[1][0]), float(agg[0][0]), float(agg[1][0]), (lo, hi), p,
                      d, level)


def layered_table(lay: Layered, reference: str, names: Sequence[str],
                  symmetries: Sequence[str] = ("raw", "ns"), n_permutations: int = 0, n_bootstrap: int = 0,
                  seed: int = 0, progress: bool = False) -> dict[tuple[str, str], Result]:
    """:func:`mmd` of every set of ``names`` against ``reference`` in a :class:`Layered`:
    ``{(name, symmetries): Result}``, as :func:`table` returns (same seed, so the same permutations and
    resamples)."""
    out = {}
    with _progress.bar(len(names) * len(symmetries), desc="mmd", enabled=progress) as bar:
        for sym in symmetries:
            for name in names:
                out[(name, sym)] = mmd(lay.pair(reference, name, sym), n_permutations, n_bootstrap, seed)
                bar.update()
    return out


