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
then neurons sorted by their largest incoming weight, :func:`symlib.symmetry.canonical.canonicalize`);
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
  a zero diagonal. The bandwidths stay those of the observed sets.
* :func:`difference`: the difference of two aggregate MMDs sharing a target (one-mode vs multi-mode, raw
  vs NS), with a paired bootstrap (the same resampled target checkpoints on both sides; the same method
  checkpoints too when both sides hold the same samples) and the p-value of the two-sided percentile
  test (the smallest ``1 - level`` at which the interval excludes 0).

**Computation.** Per layer, one L1 and one L2 distance matrix of the pooled checkpoints serves all 20
kernels, every permutation and every bootstrap replicate (a permutation or a resample is a weight vector,
and its statistic a quadratic form ``a^T K_0 a`` evaluated as one batched matrix product). Within a set,
each pair's distance is computed once (``torch.pdist``) and, for the estimate, exponentiated once. Work
stays on the device of the inputs, in float64 by default. :func:`table` shares the target's symmetry
removal and its within-target distances across methods. Cost per comparison and layer: the estimate
exponentiates ``20 (m^2 + n^2) / 2 + 20 mn`` distances; tests add ``20 (m+n)^2`` exponentials and
``20 (m+n)^2`` multiply-adds per permutation or resample.

The package splits the concept into :mod:`~symlib.stats.mmd.inputs` (sets to per-layer matrices,
symmetries removed), :mod:`~symlib.stats.mmd.kernels` (distances, bandwidths, the estimator and the
quadratic forms of the tests) and :mod:`~symlib.stats.mmd.compare` (:func:`mmd`, :func:`two_sample`,
:func:`table`, :func:`difference`); the names below are re-exported here.

Usage (the chapter's calls)::

    res = mmd.table(target, {"laplace": laplace_set, "de": de_set}, spec, symmetries=("raw", "ns"),
                    n_permutations=500, n_bootstrap=500)
    res[("laplace", "ns")].summary()          # x100: median, median_lo, median_hi, median_p, mean, ...
    d = mmd.difference(mmd.prepare(target, one_mode, spec), mmd.prepare(target, multi_mode, spec))
    d.value, d.interval, d.p_value             # is one-mode farther from the target than multi-mode?
"""


from symlib.stats.mmd.compare import Difference, Result, difference, layered_table, mmd, table, two_sample
from symlib.stats.mmd.inputs import (
    SYMMETRIES,
    Layered,
    Pair,
    flatten,
    layered,
    layers_of,
    prepare,
    remove_symmetries,
)
from symlib.stats.mmd.kernels import (
    KERNEL_REDUCE,
    KERNELS,
    LAYER_REDUCE,
    PERCENT,
    RULES,
    bandwidths,
    estimate,
    reduce,
)

__all__ = [
    "Difference",
    "KERNELS",
    "KERNEL_REDUCE",
    "LAYER_REDUCE",
    "Layered",
    "PERCENT",
    "Pair",
    "RULES",
    "Result",
    "SYMMETRIES",
    "bandwidths",
    "difference",
    "estimate",
    "flatten",
    "layered",
    "layered_table",
    "layers_of",
    "mmd",
    "prepare",
    "reduce",
    "remove_symmetries",
    "table",
    "two_sample",
]
