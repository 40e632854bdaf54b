r"""The rows of Table 1 and their sample sets (book: chapter "Table 1"; paper §4, App. B): which methods at
which sizes (:func:`plan`, :func:`sizes`), where their sets live (:func:`sets_dir`) and how they are made or
loaded (:func:`produce`); the paper's reported values (:data:`PAPER`) and the table's column names.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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
    to seconds, HMC to 4 draws per chain: the fewest its per-chain diagnostics (split R-hat) are computed
    from, which the chapter reads.
    """
    return _scales.pick(
        scale,
        tiny={"one-mode": (1, 6), "multi-mode": (2, 3), "de": (6, 1), "hmc": (2, 4)},
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
