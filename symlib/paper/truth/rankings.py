r"""Do two yardsticks rank Table 1's rows alike? Kendall's :math:`\tau` between the rows' distances to the
DE target and to the true posterior: on the point values with the MMDs' bootstrap (:func:`ranking_agreement`),
and over every combination of replicated methods and references (:func:`replicated_agreement`, from the
distances of :func:`layered_sets` and :func:`replicated_distances`), with tables keyed by comparison
(:data:`SYMMETRIES`, :func:`labelled`), never by position."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["SYMMETRIES", "agreement_frame", "distances", "kendall", "labelled", "layered_sets",
           "ranking_agreement", "replicated_agreement", "replicated_distances", "replicated_tau", "spread"]


def kendall(x: Sequence[float], y: Sequence[float]) -> float:
    r"""Kendall's :math:`\tau_b` between two score vectors (ties counted as scipy does); NaN with fewer than
    two finite pairs."""
    from scipy import stats

    a, b = np.asarray(x, np.float64), np.asarray(y, np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 2:
        return float("nan")
    return float(stats.kendalltau(a[ok], b[ok]).statistic)


def ranking_agreement(to_target: Mapping[tuple[str, str], Any], to_truth: Mapping[tuple[str, str], Any],
                      names: Sequence[str], kernels: str = "median",
                      level: float = 0.95) -> dict[str, dict[str, float]]:
    r"""Kendall's :math:`\tau` between the rows' distances to the DE target and to the true posterior.

    Args:
        to_target, to_truth: :func:`symlib.stats.mmd.layered_table` results ``{(name, symmetries):
            Result}`` against each reference, with bootstrap replicates.
        names: the rows ranked (their names in both results).
        kernels: the kernel reduction (``"median"``, Table 1's).
        level: of the percentile interval.

    Returns:
        ``{symmetries: {"tau", "low", "high", "p", "n", "replicates"}}``, keyed (label the rows by key with
        :func:`labelled`, never by position): :math:`\tau` of the point estimates,
        the percentile interval of :math:`\tau` over the bootstrap replicates (replicate ``b`` of every
        comparison resamples the same target checkpoints), scipy's two-sided p-value of "no association"
        and the number of rows.
    """
    from scipy import stats

    from symlib.stats.mmd.kernels import reduce

    out = {}
    both = {sym for (_, sym) in to_target} & {sym for (_, sym) in to_truth}
    syms = [k for k in SYMMETRIES if k in both] + sorted(both - set(SYMMETRIES))
    for sym in syms:
        a = np.array([float(to_target[(n, sym)].value(kernels)) for n in names])
        b = np.array([float(to_truth[(n, sym)].value(kernels)) for n in names])
        res = stats.kendalltau(a, b)
        reps_a = [to_target[(n, sym)].boot for n in names]
        reps_b = [to_truth[(n, sym)].boot for n in names]
        taus = []
        if all(r is not None for r in reps_a + reps_b):
            ra = torch.stack([reduce(r, to_target[(n, sym)].sizes, kernels) for r, n in zip(reps_a, names,
                                                                                           strict=True)])
            rb = torch.stack([reduce(r, to_truth[(n, sym)].sizes, kernels) for r, n in zip(reps_b, names,
                                                                                          strict=True)])
            for j in range(min(ra.shape[1], rb.shape[1])):
                taus.append(kendall(ra[:, j].cpu().numpy(), rb[:, j].cpu().numpy()))
        taus = np.asarray(taus)
        lo, hi = (np.nanquantile(taus, [(1 - level) / 2, (1 + level) / 2]) if taus.size else (np.nan, np.nan))
        out[sym] = {"tau": float(res.statistic), "low": float(lo), "high": float(hi), "p": float(res.pvalue),
                    "n": len(names), "replicates": int(taus.size)}
    return out


SYMMETRIES = {"raw": "raw weights (MMD)", "ns": "symmetries removed (NS)"}
"""The label of each comparison's key (:func:`ranking_agreement`, :func:`replicated_agreement`): tables
built from their results keep the keys and take these labels by key, never by position."""


def labelled(result: Mapping[str, Mapping[str, float]]):
    """A result keyed by symmetries (``{"raw": {...}, "ns": {...}}``) as a table whose rows carry the
    :data:`SYMMETRIES` label of their own key."""
    import pandas as pd

    unknown = set(result) - set(SYMMETRIES)
    if unknown:
        raise KeyError(f"no label for {sorted(unknown)}: expected keys among {sorted(SYMMETRIES)}")
    frame = pd.DataFrame.from_dict({SYMMETRIES[k]: dict(v) for k, v in result.items()}, orient="index")
    frame.index.name = "comparison"
    return frame


def _signs(values: np.ndarray) -> np.ndarray:
    """``sign(v[i, a] - v[j, b])`` for every pair of rows ``i < j``: ``(P, R, R)`` from ``(n, R)``."""
    n = values.shape[0]
    i, j = np.triu_indices(n, 1)
    return np.sign(values[i][:, :, None] - values[j][:, None, :])


def replicated_tau(to_target: np.ndarray, to_truth: np.ndarray) -> np.ndarray:
    r"""Kendall's :math:`\tau_b` for every combination of replicates and references.

    Args:
        to_target: ``(n, R)``, row ``i``'s replicate ``r`` distance to the DE target (or any score; ties,
            e.g. of an indicator, are counted as :math:`\tau_b` does).
        to_truth: ``(n, R, K)``, the same replicate's distance to reference ``k``.

    Returns:
        ``(R,) * n + (K,)``: :math:`\tau_b` between the two orders when row ``i`` is represented by
        replicate ``r_i`` (the same replicate in both orders) and the truth by reference ``k``.
    """
    a = np.asarray(to_target, np.float64)
    b = np.asarray(to_truth, np.float64)
    n, r = a.shape
    if b.shape[:2] != (n, r) or b.ndim != 3:
        raise ValueError(f"to_truth must be (rows, replicates, references) = ({n}, {r}, K), got {b.shape}")
    k = b.shape[2]
    if n > 14 or r**n * k > 5_000_000:
        raise ValueError(f"{r}^{n} x {k} combinations are too many to enumerate; rank fewer rows or "
                         "replicates")
    sa = _signs(a)  # (P, R, R)
    sb = np.stack([_signs(b[:, :, q]) for q in range(k)], -1)  # (P, R, R, K)
    shape = (r,) * n + (k,)
    num = np.zeros(shape)
    ta = np.zeros(shape)
    tb = np.zeros(shape)
    for p, (i, j) in enumerate(zip(*np.triu_indices(n, 1), strict=True)):
        view = [1] * (n + 1)
        view[i], view[j], view[n] = r, r, k
        num += (sa[p][:, :, None] * sb[p]).reshape(view)
        ta += (sa[p][:, :, None] == 0).astype(np.float64).repeat(k, 2).reshape(view)
        tb += (sb[p] == 0).astype(np.float64).reshape(view)
    pairs = n * (n - 1) / 2
    with np.errstate(invalid="ignore", divide="ignore"):
        return num / np.sqrt((pairs - ta) * (pairs - tb))


def replicated_agreement(to_target: Mapping[str, Mapping[tuple, float]],
                         to_truth: Mapping[str, Mapping[tuple, float]], groups: Mapping[str, Sequence[str]],
                         level: float = 0.95) -> dict[tuple[str, str], dict[str, float]]:
    r"""Kendall's :math:`\tau` between the rows' distances to the DE target and to the true posterior, over
    replicated methods and several references.

    Args:
        to_target: ``{symmetries: {(row, replicate): distance}}``.
        to_truth: ``{symmetries: {(row, replicate, reference): distance}}``, every row with the same
            replicates and references.
        groups: ``{group: rows}``, e.g. every row, without the deep ensemble, the one-mode rows.
        level: of the percentile interval over the combinations.

    Returns:
        ``{(group, symmetries): {"tau", "mean", "low", "high", "min", "max", "n", "combinations"}}``:
        ``tau`` at the first replicate and reference (the tables' point), then the mean, the percentile
        interval and the range over every combination (each row represented by any one of its replicates,
        the truth by any one reference: :func:`replicated_tau`).
    """
    out = {}
    for sym in to_target:
        reps = sorted({r for (_, r) in to_target[sym]})
        refs = sorted({q for (_, _, q) in to_truth[sym]})
        for group, rows in groups.items():
            missing = [(n, r) for n in rows for r in reps if (n, r) not in to_target[sym]] + [
                (n, r, q) for n in rows for r in reps for q in refs if (n, r, q) not in to_truth[sym]]
            if missing:
                raise KeyError(f"{sym}: no distance for {missing[:3]} (group {group!r})")
            a = np.array([[to_target[sym][(n, r)] for r in reps] for n in rows])
            b = np.array([[[to_truth[sym][(n, r, q)] for q in refs] for r in reps] for n in rows])
            taus = replicated_tau(a, b).ravel()
            lo, hi = np.nanquantile(taus, [(1 - level) / 2, (1 + level) / 2])
            out[(group, sym)] = {"tau": float(replicated_tau(a[:, :1], b[:, :1, :1]).ravel()[0]),
                                 "mean": float(np.nanmean(taus)), "low": float(lo), "high": float(hi),
                                 "min": float(np.nanmin(taus)), "max": float(np.nanmax(taus)),
                                 "n": len(rows), "combinations": int(taus.size)}
    return out


def distances(lay, rows: Mapping[Any, str], reference: str, symmetries: Sequence[str] = ("raw", "ns"),
              kernels: str = "median", known: Mapping[tuple[str, str], Any] | None = None
              ) -> dict[str, dict[Any, float]]:
    """:math:`100 \\times` the MMD (the point value, as the tables print it) of every set of ``rows``
    (``{key: name in lay}``) against the set ``reference`` of a :func:`symlib.stats.mmd.layered`:
    ``{symmetries: {key: distance}}``. ``known``: results already measured against ``reference``
    (:func:`symlib.stats.mmd.layered_table`, ``{(name, symmetries): Result}``), read instead of measured
    again."""
    from symlib.stats import mmd as _mmd

    known = known or {}

    def one(name: str, sym: str) -> float:
        res = known.get((name, sym)) or _mmd.mmd(lay.pair(reference, name, sym))
        return 100 * float(res.value(kernels))

    return {sym: {key: one(name, sym) for key, name in rows.items()} for sym in symmetries}


def layered_sets(target, references: Mapping[int, Any], by_rep: Mapping[int, Mapping[tuple, Any]], seed: int,
                 spec, symmetries: Sequence[str] = ("raw", "ns")):
    """Every set of the replicated comparison, symmetries removed once (:func:`symlib.stats.mmd.layered`).

    Args:
        target: the DE target. references: ``{seed: networks}``, the first is ``"HMC"``, the others
            ``"HMC <seed>"``. by_rep: ``{run seed: {(method, modes): set}}``
            (:func:`symlib.paper.truth.produce`).
        seed: the first replicate's run seed (its rows are named ``"<method> (<modes>)"``, the others'
            ``"<method> (<modes>) #<run seed>"``). spec: the MLP's symmetries.

    Returns:
        ``(layered, labels, reference_names)``: ``labels`` maps each row name to its ``(method, modes)``
        key, ``reference_names`` each reference seed to its name in ``layered``.
    """
    from symlib.stats import mmd as _mmd

    labels = {f"{a} ({b})": (a, b) for (a, b) in by_rep[seed]}
    ref_names = {k: "HMC" if i == 0 else f"HMC {k}" for i, k in enumerate(references)}
    sets = {"target": target, **{ref_names[k]: v for k, v in references.items()},
            **{n: by_rep[seed][lab] for n, lab in labels.items()},
            **{f"{n} #{r}": by_rep[r][lab] for n, lab in labels.items() for r in by_rep if r != seed}}
    return _mmd.layered(sets, spec, symmetries), labels, ref_names


def replicated_distances(lay, labels: Mapping[str, tuple], reference_names: Mapping[int, str],
                         reps: Sequence[int], seed: int, known: Mapping[str, Mapping] | None = None):
    """The distances of every replicate of every row (:func:`layered_sets`) to the DE target and to every
    reference (:func:`distances`; ``known``: ``{reference name: layered_table results}`` already measured).

    Returns:
        ``(to_target, to_truth)``: ``{symmetries: {(row, run seed): distance}}`` and ``{symmetries: {(row,
        run seed, reference seed): distance}}``, as :func:`replicated_agreement` takes them.
    """
    known = known or {}
    rows = {(n, r): (n if r == seed else f"{n} #{r}") for n in labels for r in reps}
    to_target = distances(lay, rows, "target", known=known.get("target"))
    to_truth: dict[str, dict] = {sym: {} for sym in to_target}
    for k, name in reference_names.items():
        for sym, d in distances(lay, rows, name, known=known.get(name)).items():
            to_truth[sym].update({(n, r, k): v for (n, r), v in d.items()})
    return to_target, to_truth


def agreement_frame(to_target, to_truth, labels: Mapping[str, tuple]):
    """:func:`replicated_agreement` over all rows, without the deep ensemble, within the one-mode and within
    the multi-mode rows, and what the one-mode/multi-mode label alone reaches over all rows, as a table
    indexed by ``(rows, comparison)`` (the :data:`SYMMETRIES` label of each key)."""
    import pandas as pd

    names = list(labels)
    one = {n: labels[n][1] == "one-mode" for n in names}
    groups = {"all rows": names,
              "without the deep ensemble": [n for n in names if labels[n] != ("DE", "multi-mode")],
              "one-mode rows": [n for n in names if one[n]],
              "multi-mode rows": [n for n in names if labels[n][1] == "multi-mode" and labels[n][0] != "DE"]}
    out = replicated_agreement(to_target, to_truth, groups)
    reps = sorted({r for (_, r) in next(iter(to_target.values()))})
    split = {sym: {(n, r): float(one[n]) for n in names for r in reps} for sym in to_target}
    out.update({("the mode split alone", sym): v for (_, sym), v in
                replicated_agreement(split, to_truth, {"all rows": names}).items()})
    frame = pd.DataFrame.from_dict({(g, SYMMETRIES[sym]): v for (g, sym), v in out.items()}, orient="index")
    frame.index = pd.MultiIndex.from_tuples(frame.index, names=["rows", "comparison"])
    return frame


def spread(to_target: Mapping[str, Mapping[tuple, float]], to_truth: Mapping[str, Mapping[tuple, float]],
           names: Sequence[str]):
    """Per row and comparison, the replicates' distances to the DE target and to the true posterior (every
    reference): mean, least and largest (:math:`100 \\times` the MMD), keyed by row name and by the
    :data:`SYMMETRIES` label of each comparison."""
    import pandas as pd

    cols = {}
    for sym, label in SYMMETRIES.items():
        if sym not in to_target:
            continue
        for who, src in (("target", to_target[sym]), ("HMC", to_truth[sym])):
            vals = {n: [v for key, v in src.items() if key[0] == n] for n in names}
            cols[(label, f"to {who}", "mean")] = {n: float(np.mean(v)) for n, v in vals.items()}
            cols[(label, f"to {who}", "least")] = {n: float(np.min(v)) for n, v in vals.items()}
            cols[(label, f"to {who}", "largest")] = {n: float(np.max(v)) for n, v in vals.items()}
    frame = pd.DataFrame(cols)
    frame.columns.names = ["comparison", "distance", "over replicates"]
    # sorted on the first two levels, so that selecting a (comparison, distance) block is a plain lookup
    frame = frame.sort_index(axis=1, level=[0, 1], sort_remaining=False)
    return frame.loc[list(names)]

