r"""Assembling Table 1: every posterior approximation against the target posterior (book: chapter
"Table 1: how good are posterior approximations?"; paper §4, App. B).

The chapter's pipeline, in four calls:

1. :func:`plan` lists the rows of the table for a scale: each method of :mod:`symlib.posteriors`
   one-mode (``1 x S``) and multi-mode (``M x K``, the paper's ``10 x 10``), the deep ensemble (DE,
   ``S`` independently trained checkpoints disjoint from the target) and the HMC reference.
2. :func:`produce` makes every row's sample set through :func:`symlib.posteriors.sampling.run` into the
   cache (``<zoo cache>/posteriors/...``): a rerun loads finished sets, an interrupted run resumes.
3. :func:`metric_frame` computes the uncertainty columns (Acc, ECE, Brier, AUPR, FPR95, IDMI, OODMI, in
   percent, :func:`symlib.stats.metrics.evaluate`) of every set from its predicted probabilities
   (:func:`symlib.stats.predict.probs`); :func:`mmd_frame` turns :func:`symlib.stats.mmd.table` results
   into the MMD and NS columns (``100 x`` the weighted mean over layers of the median over the 20
   kernels) with bootstrap intervals and permutation p-values, and :func:`variant_frame` into App.
   B.4's median / mean / max variants.
4. :func:`paper_frame` holds the paper's MNIST-OptuNet values (:data:`PAPER`) for the side-by-side
   comparison and :func:`rank_correlation` relates the MMD to the uncertainty metrics across rows.

Rows are labelled by ``(method, modes)`` with the paper's names: ``("Laplace", "one-mode")``,
``("SWAG", "multi-mode")``, ``("DE", "multi-mode")``, ``("HMC", "reference")``.

At the ``cpu`` scale the HMC reference is sampled once and committed with its base models
(:mod:`symlib.paper.table1.committed`: :func:`commit`, ``python -m symlib.paper.table1``); ``make zoo``
installs it into the cache (:func:`install`) instead of sampling it again.

Layout: :mod:`symlib.paper.table1.rows` (the rows and their sets), :mod:`symlib.paper.table1.frames` (the
columns, computed), :mod:`symlib.paper.table1.display` (the tables as the chapter shows them),
:mod:`symlib.paper.table1.committed` (the committed reference). Every name
is re-exported here, so the chapter reads ``table1.plan(...)``, ``table1.display(...)``.
"""

from symlib.paper.table1.committed import COMMITTED, commit, install
from symlib.paper.table1.display import (
    MISSING,
    NON_BREAKING_HYPHEN,
    PAPER_GROUPS,
    display,
    format_p,
    p_floor,
    paper_tables,
    with_interval,
)
from symlib.paper.table1.frames import (
    SYMMETRY_COLUMNS,
    hmc_diagnostics,
    metric_frame,
    mmd_frame,
    ood_inputs,
    paper_frame,
    probabilities,
    rank_correlation,
    side_by_side,
    spec_for,
    subsample_tests,
    variant_frame,
)
from symlib.paper.table1.rows import (
    APPROXIMATIONS,
    BETTER,
    COLUMNS,
    METRIC_COLUMNS,
    NAMES,
    PAPER,
    Entry,
    plan,
    produce,
    sampler_defaults,
    sets_dir,
    sizes,
)

__all__ = [
    "APPROXIMATIONS", "BETTER", "COLUMNS", "METRIC_COLUMNS", "NAMES", "PAPER", "Entry", "plan", "produce",
    "sampler_defaults", "sets_dir", "sizes", "SYMMETRY_COLUMNS", "hmc_diagnostics", "metric_frame",
    "mmd_frame", "ood_inputs", "paper_frame", "probabilities", "rank_correlation", "side_by_side",
    "spec_for", "subsample_tests", "variant_frame", "MISSING", "NON_BREAKING_HYPHEN", "PAPER_GROUPS",
    "display", "format_p", "p_floor", "paper_tables", "with_interval", "COMMITTED", "commit", "install",
]
