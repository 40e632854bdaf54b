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
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from symlib import scales as _scales

COLUMNS = ("MMD", "NS", "Acc", "ECE", "Brier", "AUPR", "FPR95", "IDMI", "OODMI")
METRIC_COLUMNS = COLUMNS[2:]
# Which direction is better for each uncertainty column (+1: higher is better).
BETTER = {"Acc": 1, "ECE": -1, "Brier": -1, "AUPR": 1, "FPR95": -1, "IDMI": -1, "OODMI": 1}
# symlib method -> the paper's name in Table 1.
NAMES = {"dropout": "Dropout", "vi": "BNN", "sghmc": "SGHMC", "swag": "SWAG", "laplace": "Laplace",
         "ensemble": "DE", "hmc": "HMC"}
APPROXIMATIONS = ("dropout", "vi", "sghmc", "swag", "laplace")

# The paper's Table 1, MNIST-OptuNet (Laurent et al. 2024, §4; NOTES.md "Table 1"), in percent.
PAPER: dict[tuple[str, str], tuple[float, ...]] = {
    ("Dropout", "one-mode"): (15.0, 14.3, 83.3, 33.4, 26.1, 96.4, 98.6, 26.1, 22.2),
    ("BNN", "one-mode"): (18.8, 17.1, 78.1, 7.4, 30.9, 67.9, 93.7, 0.1, 0.1),
    ("SGHMC", "one-mode"): (16.7, 17.7, 95.1, 7.6, 2.8, 73.7, 98.4, 4.3, 14.5),
    ("SWAG", "one-mode"): (16.0, 14.6, 88.3, 17.7, 4.9, 73.4, 68.6, 4.0, 8.7),
    ("Laplace", "one-mode"): (10.6, 9.5, 87.9, 18.1, 4.8, 48.2, 74.6, 6.2, 5.9),
    ("Dropout", "multi-mode"): (2.1, 2.1, 92.1, 29.2, 36.8, 97.2, 78.2, 36.6, 52.5),
    ("BNN", "multi-mode"): (2.8, 2.5, 86.5, 17.5, 24.4, 96.9, 27.2, 21.1, 52.3),
    ("SWAG", "multi-mode"): (1.8, 1.3, 95.0, 13.1, 17.5, 88.7, 24.6, 27.6, 62.2),
    ("Laplace", "multi-mode"): (1.8, 0.8, 94.8, 12.8, 15.8, 95.4, 32.1, 21.1, 52.2),
    ("DE", "multi-mode"): (0.0, 0.0, 95.3, 10.7, 13.5, 95.7, 12.8, 19.3, 62.6),
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of Table 1: a method and its sizes.

    Attributes:
        method: a name of :data:`symlib.posteriors.METHODS`.
        modes: ``"one-mode"``, ``"multi-mode"`` or ``"reference"`` (HMC).
        n_modes, n_per_mode: sizes (``n_modes * n_per_mode`` samples, mode-major).
        hyper: the method's hyper-parameters beyond its defaults.
    """

    method: str
    modes: str
    n_modes: int
    n_per_mode: int
    hyper: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> tuple[str, str]:
        return (NAMES.get(self.method, self.method), self.modes)

    @property
    def n_samples(self) -> int:
        return self.n_modes * self.n_per_mode

    @property
    def key(self) -> str:
        """Directory name of the set: ``swag-10x10``, with a short hash of the hyper-parameters when the row
        sets any (``sghmc-1x100-3f2a9c01``), so that a set produced with other settings is never in the
        way (:func:`symlib.posteriors.sampling.run` refuses to overwrite another set)."""
        name = f"{self.method}-{self.n_modes}x{self.n_per_mode}"
        if not self.hyper:
            return name
        import hashlib
        import json

        text = json.dumps(dict(self.hyper), sort_keys=True, default=str)
        return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def sizes(scale: str) -> dict[str, tuple[int, int]]:
    """``{"one-mode": (1, S), "multi-mode": (M, K), "de": (S, 1), "hmc": (chains, draws)}`` of a scale.

    ``cpu`` and ``paper`` use the paper's sizes (1 x 100, 10 x 10, 100 ensemble members); HMC stores 10
    states of each of its 10 chains (started from the 10 multi-mode base models), every ``keep_every``-th of
    the states its diagnostics use (its preset, :mod:`symlib.posteriors.hmc`). ``tiny`` shrinks everything
    to seconds.
    """
    return _scales.pick(
        scale,
        tiny={"one-mode": (1, 6), "multi-mode": (2, 3), "de": (6, 1), "hmc": (2, 3)},
        cpu={"one-mode": (1, 100), "multi-mode": (10, 10), "de": (100, 1), "hmc": (10, 10)},
        paper={"one-mode": (1, 100), "multi-mode": (10, 10), "de": (100, 1), "hmc": (10, 10)},
    )


def plan(scale: str, methods: Sequence[str] = APPROXIMATIONS, hmc: bool = True,
         hyper: Mapping[str, Mapping[str, Any]] | None = None) -> list[Entry]:
    """The rows of Table 1 at ``scale``: each of ``methods`` one-mode then multi-mode, DE, then HMC.

    Args:
        scale: ``tiny``, ``cpu`` or ``paper`` (see :func:`sizes`).
        methods: the approximations (default: dropout, VI, SGHMC, SWAG, Laplace).
        hmc: add the HMC reference row.
        hyper: per-method hyper-parameters passed to their ``sample`` (e.g. ``{"vi": {"epochs": 5}}``).
    """
    from symlib.posteriors import METHODS

    s = sizes(scale)
    hyper = {**sampler_defaults(scale), **dict(hyper or {})}
    unknown = [m for m in (*methods, *hyper) if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown posterior method(s) {unknown}; choose among {list(METHODS)}")
    rows = []
    for modes in ("one-mode", "multi-mode"):
        for m in methods:
            rows.append(Entry(m, modes, *s[modes], dict(hyper.get(m, {}))))
    rows.append(Entry("ensemble", "multi-mode", *s["de"], dict(hyper.get("ensemble", {}))))
    if hmc:
        rows.append(Entry("hmc", "reference", *s["hmc"], dict(hyper.get("hmc", {}))))
    return rows


def sampler_defaults(scale: str) -> dict[str, dict[str, Any]]:
    """The samplers' settings, written out in the rows' hyper-parameters so that they are part of every
    cached set's identity (a changed default recomputes the set instead of loading a stale one): SGHMC's
    ``"corrected"`` setting (:data:`symlib.posteriors.sghmc.SETTINGS`) and HMC's preset of ``scale``."""
    from symlib.posteriors import hmc, sghmc

    return {"sghmc": {"setting": "corrected", **sghmc.SETTINGS["corrected"]},
            "hmc": dataclasses.asdict(hmc.preset(scale))}


def sets_dir(setup, seed: int = 0, root: str | os.PathLike | None = None) -> Path:
    """Where :func:`produce` keeps the sample sets of a problem:
    ``<root>/<preset>-<scale>-<problem hash>-seed<seed>``, ``root`` defaulting to ``posteriors/`` inside the
    zoo cache (``$SYMLIB_CACHE``). The hash (of the recipe, data and prior the manifests record) keeps the
    sets of a changed preset apart from stale ones."""
    import hashlib
    import json

    from symlib import zoo
    from symlib.posteriors import io

    base = Path(root) if root is not None else zoo.cache_dir() / "posteriors"
    record = json.dumps(io.setup_record(setup), sort_keys=True).encode()
    digest = hashlib.sha256(record).hexdigest()[:10]
    return base / f"{setup.name or setup.arch}-{setup.scale}-{digest}-seed{seed}"


def produce(setup, entries: Sequence[Entry], seed: int = 0, root: str | os.PathLike | None = None,
            cache_dir: str | os.PathLike | None = None, progress: bool = True,
            timings: dict | None = None) -> dict[tuple[str, str], Any]:
    """Every row's :class:`~symlib.posteriors.base.SampleSet`, produced (or loaded) through
    :func:`symlib.posteriors.sampling.run` into :func:`sets_dir`.

    Args:
        setup: the training problem (:func:`symlib.posteriors.sampling.setup_for`).
        entries: rows from :func:`plan`.
        seed: the run seed (base models and streams, see :mod:`symlib.posteriors.sampling`).
        root: parent folder of the sets (default ``<zoo cache>/posteriors``).
        cache_dir: the zoo cache of the base models (default ``$SYMLIB_CACHE``).
        progress: progress bars.
        timings: if given, filled with the seconds each row took (loading a cached set is fast).

    Returns:
        ``{entry.label: SampleSet}`` in the order of ``entries``.
    """
    import time

    from symlib.posteriors import sampling

    out_root = sets_dir(setup, seed, root)
    out = {}
    for e in entries:
        if e.label in out:
            raise ValueError(f"two rows share the label {e.label}")
        t0 = time.perf_counter()
        chunk = e.n_samples if e.n_per_mode == 1 else None
        out[e.label] = sampling.run(e.method, setup, e.n_modes, e.n_per_mode, seed, out_root / e.key,
                                    progress=progress, cache_dir=cache_dir, chunk=chunk, **dict(e.hyper))
        if timings is not None:
            timings[e.label] = time.perf_counter() - t0
    return out


def spec_for(cfg, device: str | torch.device = "cpu"):
    """The symmetry spec of a zoo preset's architecture (:func:`symlib.symmetry.trace.spec_of`), traced in
    float64."""
    from symlib.symmetry import trace

    model = cfg.make_model().to(device, torch.float64)
    return trace.spec_of(model, (cfg.channels, cfg.image_size, cfg.image_size))


def ood_inputs(cfg, n: int | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
    """The OOD test inputs of a zoo preset (FashionMNIST for MNIST, SVHN for CIFAR-100; normalised like the
    in-distribution set), the first ``n``. Synthetic presets (tiny ResNets) get Gaussian noise images."""
    if cfg.source == "synthetic":
        gen = torch.Generator().manual_seed(12345)
        m = n or cfg.n_test or 128
        return torch.randn(m, cfg.channels, cfg.image_size, cfg.image_size, generator=gen).to(device)
    from symlib import data

    x = data.load_ood(cfg.dataset, "test", source=cfg.source).x
    return x[:n].to(device) if n is not None else x.to(device)


def probabilities(params, x: torch.Tensor, arch="optunet", device=None, progress: bool = False):
    """``(S, N, C)`` softmax outputs of a sample set (a ``SampleSet`` or stacked state dict)."""
    from symlib.stats import predict

    params = getattr(params, "params", params)
    return predict.probs(dict(params), x, arch=arch, device=device, progress=progress)


def metric_frame(sets: Mapping[tuple[str, str], Any], x: torch.Tensor, y: torch.Tensor, x_ood: torch.Tensor,
                 arch="optunet", device=None, progress: bool = False):
    """Table 1's uncertainty columns of every set, in percent (:func:`symlib.stats.metrics.evaluate`).

    Args:
        sets: ``{label: SampleSet or stacked state dict}``.
        x, y: the in-distribution test set; ``x_ood``: the OOD inputs.
        arch: ``"optunet"`` or a module factory (:func:`symlib.stats.predict.probs`).

    Returns:
        A DataFrame indexed by ``(method, modes)`` with columns :data:`METRIC_COLUMNS` and ``NLL``.
    """
    import pandas as pd

    from symlib.stats import metrics

    rows = {}
    for label, s in sets.items():
        p_id = probabilities(s, x, arch, device, progress)
        p_ood = probabilities(s, x_ood, arch, device, progress)
        rows[label] = metrics.evaluate(p_id, y, p_ood)
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.index = pd.MultiIndex.from_tuples(list(rows), names=["method", "modes"])
    return frame[[*METRIC_COLUMNS, "NLL"]]


SYMMETRY_COLUMNS = {"raw": "MMD", "ns": "NS", "minmass": "MinMass", "perm": "Perm", "scale": "Scale"}


def mmd_frame(results: Mapping[tuple[str, str], Any], labels: Mapping[str, tuple[str, str]] | None = None,
              kernels: str = "median", level: float = 0.95):
    """The MMD columns from :func:`symlib.stats.mmd.table` results: per row and symmetry removal,
    ``100 x`` the aggregate (kernel reduction ``kernels``, layers weighted by parameter count), with
    ``_lo``/``_hi`` (bootstrap interval) and ``_p`` (permutation p-value of "same distribution") when
    computed.

    Args:
        results: ``{(name, symmetries): Result}``.
        labels: maps the names of ``results`` to row labels ``(method, modes)`` (default: the names).
        kernels: ``"median"`` (Table 1), ``"mean"`` or ``"max"``.
    """
    import pandas as pd

    rows: dict[Any, dict[str, float]] = {}
    for (name, sym), res in results.items():
        col = SYMMETRY_COLUMNS.get(sym, sym)
        summ = res.summary(level=level)
        row = rows.setdefault(labels[name] if labels else name, {})
        row[col] = summ[kernels]
        for suffix in ("lo", "hi", "p"):
            if f"{kernels}_{suffix}" in summ:
                row[f"{col}_{suffix}"] = summ[f"{kernels}_{suffix}"]
    frame = pd.DataFrame.from_dict(rows, orient="index")
    if labels or all(isinstance(k, tuple) for k in rows):
        frame.index = pd.MultiIndex.from_tuples(list(rows), names=["method", "modes"])
    return frame


def variant_frame(results: Mapping[tuple[str, str], Any],
                  labels: Mapping[str, tuple[str, str]] | None = None):
    """App. B.4's variants: per row, ``100 x`` the weighted mean over layers of the median, mean and max
    over the 20 kernels, on raw weights and without symmetries (columns ``MMD median``, ``NS max``, ...)."""
    import pandas as pd

    rows: dict[Any, dict[str, float]] = {}
    for (name, sym), res in results.items():
        col = SYMMETRY_COLUMNS.get(sym, sym)
        summ = res.summary()
        row = rows.setdefault(labels[name] if labels else name, {})
        for kern in ("median", "mean", "max"):
            row[f"{col} {kern}"] = summ[kern]
    frame = pd.DataFrame.from_dict(rows, orient="index")
    if labels or all(isinstance(k, tuple) for k in rows):
        frame.index = pd.MultiIndex.from_tuples(list(rows), names=["method", "modes"])
    return frame


def paper_frame():
    """The paper's MNIST-OptuNet rows (:data:`PAPER`) as a DataFrame indexed by ``(method, modes)``."""
    import pandas as pd

    frame = pd.DataFrame.from_dict(PAPER, orient="index", columns=list(COLUMNS))
    frame.index = pd.MultiIndex.from_tuples(list(PAPER), names=["method", "modes"])
    return frame


def side_by_side(ours, paper=None, columns: Sequence[str] = COLUMNS):
    """Our values and the paper's in alternating columns (``(column, "ours")``, ``(column, "paper")``),
    on our rows (the paper's value is NaN where it has none)."""
    import pandas as pd

    paper = paper_frame() if paper is None else paper
    cols = {}
    for c in columns:
        cols[(c, "ours")] = ours[c]
        cols[(c, "paper")] = paper[c].reindex(ours.index) if c in paper else np.nan
    return pd.DataFrame(cols, index=ours.index)


def with_interval(frame, column: str, digits: int = 1) -> list[str]:
    """``"value [lo, hi]"`` strings of ``column`` and its ``_lo``/``_hi`` bounds, for display."""
    out = []
    for v, lo, hi in zip(frame[column], frame[f"{column}_lo"], frame[f"{column}_hi"], strict=True):
        out.append(f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]")
    return out


def rank_correlation(frame, x: str = "MMD", columns: Sequence[str] = METRIC_COLUMNS,
                     oriented: bool = True):
    """Spearman's rank correlation between column ``x`` and each of ``columns`` across the rows of
    ``frame``, with its two-sided p-value (scipy; few rows make it a coarse test).

    With ``oriented``, each metric is signed so that higher is better (:data:`BETTER`): a *negative*
    correlation then means "closer to the target (lower MMD), better on this metric".

    Returns:
        A DataFrame indexed by metric with columns ``rho``, ``p`` and ``n`` (rows used, NaNs dropped).
    """
    import pandas as pd
    from scipy import stats

    rows = {}
    for c in columns:
        sub = frame[[x, c]].dropna()
        v = sub[c] * (BETTER.get(c, 1) if oriented else 1)
        if len(sub) < 3:
            rows[c] = {"rho": math.nan, "p": math.nan, "n": len(sub)}
            continue
        r = stats.spearmanr(sub[x], v)
        rows[c] = {"rho": float(r.statistic), "p": float(r.pvalue), "n": len(sub)}
    return pd.DataFrame.from_dict(rows, orient="index")


def hmc_diagnostics(sample_set) -> dict[str, float]:
    """The headline diagnostics of an HMC set (:mod:`symlib.posteriors.hmc`): acceptance, divergences,
    R-hat and bulk ESS of the potential and of the weights, step size, gradient evaluations, seconds.

    Every numeric entry of ``sample_set.diagnostics`` is flattened (lists: their mean, min and max;
    ``None``, a diagnostic that could not be computed, becomes NaN), so the chapter can show
    whatever the sampler recorded.
    """
    d = dict(sample_set.diagnostics)
    out: dict[str, float] = {}

    def put(name, v):
        if v is None:  # not computable (e.g. R-hat with fewer than 4 draws per chain)
            out[name] = math.nan
        elif isinstance(v, bool):
            out[name] = float(v)
        elif isinstance(v, (int, float)):
            out[name] = float(v)
        elif isinstance(v, Mapping):
            for k, w in v.items():
                put(f"{name}.{k}", w)
        elif isinstance(v, (list, tuple)) and v and all(isinstance(w, (int, float)) for w in v):
            out[f"{name} (mean)"] = float(np.mean(v))
            out[f"{name} (min)"] = float(np.min(v))
            out[f"{name} (max)"] = float(np.max(v))

    for k, v in d.items():
        put(k, v)
    return out


# ----------------------------------------------------------------------------- reading the tables
MISSING = "\u2013"  # an en dash: a value the paper does not report
NON_BREAKING_HYPHEN = "\u2011"  # "multi-mode" stays on one line
# The side-by-side table in column groups narrow enough for the book's text width.
PAPER_GROUPS = (("MMD", "NS", "Acc", "ECE"), ("Brier", "AUPR", "FPR95", "IDMI", "OODMI"))


def p_floor(n_resamples: int, two_sided: bool = False) -> float:
    r"""The smallest p-value a resampling test can return: ``1 / (B + 1)`` for the permutation test of
    :func:`symlib.stats.mmd.mmd` (``(1 + #{T_b >= T}) / (1 + B)``), ``2 / (R + 1)`` for the two-sided
    bootstrap p-value of :func:`symlib.stats.mmd.difference`."""
    n = _scales.check_int("n_resamples", n_resamples, 1)
    return (2.0 if two_sided else 1.0) / (n + 1)


def _ceil_one_digit(x: float) -> float:
    """``x > 0`` rounded up to one significant digit (0.0099 -> 0.01, 0.004975 -> 0.005)."""
    unit = 10.0 ** math.floor(math.log10(x))
    return math.ceil(round(x / unit, 9)) * unit


def format_p(p: float, floor: float | None = None, digits: int = 2) -> str:
    """A p-value for a table: ``"≤ 0.01"`` at the test's floor (it means "at most ``floor``", the
    resolution of ``B`` resamples, not "0.01"), ``"–"`` when missing, else ``digits`` decimals.

    Args:
        p: the p-value.
        floor: the test's smallest possible value (:func:`p_floor`), or ``None`` (no floor marked).
        digits: decimals of the other values.
    """
    if p is None or p != p:
        return MISSING
    if floor is not None and p <= floor * (1 + 1e-9):
        return f"\u2264 {_ceil_one_digit(floor):g}"
    return f"{p:.{digits}f}"


def paper_tables(ours, paper=None, groups: Sequence[Sequence[str]] = PAPER_GROUPS) -> list:
    """:func:`side_by_side` split into column groups (:data:`PAPER_GROUPS`: distances, accuracy and
    calibration; then OOD detection and mutual information), each narrow enough for the text width."""
    paper = paper_frame() if paper is None else paper
    return [side_by_side(ours, paper, [c for c in g if c in ours]) for g in groups]


def display(frame, digits: int = 1, p_columns: Sequence = (), floor: float | None = None,
            missing: str = MISSING, uuid: str | None = None):
    """A DataFrame styled to read like a paper's table (a pandas ``Styler``; the frame is not changed).

    Numbers get ``digits`` decimals, missing values print as ``missing`` ("–", not NaN), the columns
    named in ``p_columns`` are p-values (:func:`format_p`, ``"≤ 0.01"`` at ``floor``), strings pass
    through. Hyphens in the row labels become non-breaking ("multi-mode" never wraps), no cell wraps, and
    a table wider than the page scrolls horizontally instead of being cut off.

    Args:
        frame: the table (any index; MultiIndex columns allowed).
        digits: decimals of the numeric cells.
        p_columns: column keys holding p-values.
        floor: the p-values' floor (:func:`p_floor`).
        missing: what a missing value prints as.
        uuid: a fixed id for the HTML (stable outputs across runs).

    Returns:
        ``frame.style`` with the formats and the table styles set.
    """
    def cell(v):
        if isinstance(v, str):
            return v
        if v is None or (isinstance(v, float | np.floating) and np.isnan(v)):
            return missing
        if isinstance(v, int | np.integer) and not isinstance(v, bool):
            return str(v)
        return f"{float(v):.{digits}f}"

    def label(v):
        return str(v).replace("-", NON_BREAKING_HYPHEN)

    styler = frame.style
    if uuid is not None:
        styler = styler.set_uuid(uuid)
    p_columns = [c for c in p_columns if c in frame.columns]
    others = [c for c in frame.columns if c not in p_columns]
    if others:
        styler = styler.format(cell, subset=others)
    if p_columns:
        styler = styler.format(lambda v: format_p(v, floor) if not isinstance(v, str) else v,
                               subset=p_columns)
    styler = styler.format_index(label, axis=0)
    return styler.set_table_styles([
        {"selector": "", "props": "display: block; overflow-x: auto; max-width: 100%;"},
        {"selector": "th, td", "props": "white-space: nowrap;"},
    ])


def subsample_tests(pair, sizes: Sequence[int], repeats: int = 10, n_permutations: int = 200,
                    seed: int = 0):
    """The MMD and its permutation p-value on random subsets of a pair of sample sets, ``n`` checkpoints
    from each side, for every ``n`` of ``sizes``: how the evidence grows with the number of samples.

    Args:
        pair: two sets with their symmetries already removed (:meth:`symlib.stats.mmd.Layered.pair` or
            :func:`symlib.stats.mmd.prepare`).
        sizes: subset sizes ``n`` (at least 2, at most the smaller set).
        repeats: subsets drawn per size (without replacement within a subset).
        n_permutations: of each test (its floor is ``1 / (n_permutations + 1)``).
        seed: of the subsets and the permutations.

    Returns:
        A DataFrame with one row per subset: ``n``, ``repeat``, ``MMD`` (``100 x`` the aggregate) and ``p``.
    """
    import pandas as pd

    from symlib.stats import mmd as _mmd

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in sizes:
        n = _scales.check_int("size", n, 2)
        if n > min(pair.m, pair.n):
            raise ValueError(f"subset size {n} exceeds the smaller set ({min(pair.m, pair.n)} samples)")
        for r in range(repeats):
            i = torch.randperm(pair.m, generator=gen)[:n]
            j = torch.randperm(pair.n, generator=gen)[:n]
            sub = dataclasses.replace(pair, x=tuple(x[i] for x in pair.x), y=tuple(y[j] for y in pair.y),
                                      dxx=None)
            res = _mmd.mmd(sub, n_permutations=n_permutations, seed=seed + r)
            rows.append({"n": n, "repeat": r, "MMD": _mmd.PERCENT * float(res.value()),
                         "p": float(res.p_value())})
    return pd.DataFrame(rows)
