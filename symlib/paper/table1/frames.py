r"""The columns of Table 1, computed (book: chapter "Table 1"; paper §4, App. B.4): the uncertainty metrics of
every sample set (:func:`metric_frame`), the MMD columns with intervals and p-values (:func:`mmd_frame`,
:func:`variant_frame`), the paper's values beside ours (:func:`paper_frame`, :func:`side_by_side`), how
the MMD ranks the rows against the metrics (:func:`rank_correlation`), the HMC reference's diagnostics
(:func:`hmc_diagnostics`) and how the evidence grows with the number of samples (:func:`subsample_tests`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from symlib import scales as _scales
from symlib.paper.table1.rows import BETTER, COLUMNS, METRIC_COLUMNS, PAPER


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
        A DataFrame indexed by ``(method, modes)`` with columns
        :data:`~symlib.paper.table1.rows.METRIC_COLUMNS` and ``NLL``.
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
    """The paper's MNIST-OptuNet rows (:data:`~symlib.paper.table1.rows.PAPER`) as a DataFrame indexed by
    ``(method, modes)``."""
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


def rank_correlation(frame, x: str = "MMD", columns: Sequence[str] = METRIC_COLUMNS,
                     oriented: bool = True):
    """Spearman's rank correlation between column ``x`` and each of ``columns`` across the rows of
    ``frame``, with its two-sided p-value (scipy; few rows make it a coarse test).

    With ``oriented``, each metric is signed so that higher is better
    (:data:`~symlib.paper.table1.rows.BETTER`): a *negative* correlation then means "closer to the target
    (lower MMD), better on this metric".

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
