r"""The convergence frontier: how large an MLP's posterior can be certified on two CPU cores (book: chapter
"Against the true posterior"; beyond the paper).

For each hidden layout of :data:`SIZES`, :func:`run` samples the posterior of the problem of
:mod:`symlib.paper.pca_digits` with non-reversible parallel tempering down to the prior
(:class:`symlib.posteriors.hmc.ladder.Ladder`) and judges the chains every ``segment`` rounds with the
symmetry-aware diagnostics of :mod:`symlib.stats.convergence` on raw weights, canonical forms and
invariant functionals (the potential, the test log-likelihood, the predictive probability of the true
class of ``n_probe`` test digits). A size *converges* at the first check where, on the canonical and the
invariant scales, every quantity has :math:`\hat R < 1.01` and bulk and tail ESS of at least 400
(:meth:`symlib.stats.convergence.Report.converged`); the time it took is the sampler's CPU time (warm-up
included, the diagnostics' own time excluded) and its wall time. A size that does not converge within
``budget`` CPU seconds reports the diagnostics it reached.

Every run is resumable and written atomically: ``<folder>/state-p<phase>-s<segments>.safetensors`` (the
ladder after the last finished phase or segment, :meth:`~symlib.posteriors.hmc.ladder.Ladder.state_dict`),
``segment-<i>.safetensors`` (the kept draws of the posterior's level, their canonical forms and their
invariant functionals) and ``manifest.json`` (settings, progress, every check). A killed run restarts
from its last file with exactly the rounds it would have run. :func:`sweep` runs every size and writes the
summary :func:`results` reads; ``python -m symlib.paper.frontier`` is its command line.

:mod:`~symlib.paper.frontier.judging` holds a run's settings, its diagnostics and the certification rule,
:mod:`~symlib.paper.frontier.runs` one resumable run; this module the sweep, its summaries and the command
line.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from symlib import store
from symlib.paper import pca_digits as _pd
from symlib.paper.frontier.judging import (
    ESS,
    RHAT,
    SETTINGS,
    Settings,
    canonical_forms,
    certify,
    functionals,
    halves,
    judge,
    name,
    spec,
)
from symlib.paper.frontier.runs import Run, run

__all__ = ["ABLATION", "ABLATIONS", "ABLATION_HIDDEN", "EARLIER_RULE", "ESS", "REPLICATES", "RESULTS", "RHAT",
           "RULE_FIELDS", "SETTINGS", "SIZES", "Run", "Settings", "ablation", "canonical_forms", "certify",
           "frame", "functionals", "halves", "judge", "machine", "main", "name", "replicates", "results",
           "rule", "run", "sampler_settings", "spec", "summary", "sweep"]

SIZES: tuple[tuple[int, ...], ...] = ((2,), (4,), (8,), (16,), (32,), (2, 2), (4, 4), (8, 8), (16, 16))
"""The hidden layouts of the frontier: one and two hidden layers of growing width."""

RESULTS = Path(__file__).parents[1] / "results" / "frontier.json"
"""The committed frontier (machine, date and command recorded inside)."""

REPLICATES = tuple(Path(__file__).parents[1] / "results" / f"frontier-seed{k}.json" for k in (1, 2))
"""The committed reruns of the smallest layouts from other seeds (``python -m symlib.paper.frontier --sizes
2,4 --set seed=K --out ...``): the frontier's runs replicated where the budget allowed."""

ABLATION = Path(__file__).parents[1] / "results" / "ablation.json"
"""The committed ablation of the sampler's settings on :data:`ABLATION_HIDDEN` (:func:`ablation`)."""

ABLATION_HIDDEN: tuple[int, ...] = (2,)
"""The layout the ablation runs on: the smallest of the frontier."""

ABLATIONS: dict[str, dict[str, Any]] = {
    "the chapter's settings": {},
    "no softmax-shift moves": {"shift_moves": False},
    "no orbit moves": {"orbit_moves": False},
    "dense mass matrices": {"mass": "dense"},
    "mass pooled over the chains": {"per_chain": False},
    "10 leapfrog steps": {"n_leapfrog": 10},
}
"""Each variant of the ablation: the settings it changes from :data:`SETTINGS`."""


RULE_FIELDS = ("confirm", "halves", "max_divergent")
"""The fields of :class:`Settings` that make the certification rule (:func:`certify`), not the sampler."""

EARLIER_RULE: dict[str, Any] = {"confirm": 1, "halves": False, "max_divergent": None}
"""The rule of results written before the rule had fields of its own: the first check at which the
criterion held, no halves, no limit on divergences."""


def rule(settings: dict[str, Any]) -> dict[str, Any]:
    """The certification rule a committed result's ``settings`` were judged by (:data:`EARLIER_RULE` for
    fields it does not record)."""
    return {k: settings.get(k, v) for k, v in EARLIER_RULE.items()}


def sampler_settings(settings: Settings | dict[str, Any]) -> dict[str, Any]:
    """The sampler's part of ``settings`` (without :data:`RULE_FIELDS`), JSON-like (tuples as lists):
    what a committed result and a run must share to be the same sampler."""
    d = dataclasses.asdict(settings) if isinstance(settings, Settings) else dict(settings)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items() if k not in RULE_FIELDS}


def machine() -> dict[str, Any]:
    """Where a measurement ran: CPU model, logical CPUs, the process's torch intra-op threads (the sampler
    itself runs on one, :meth:`Run.advance`), load average, Python and torch versions, date (UTC)."""
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": model, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": load, "python": platform.python_version(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def summary(r: Run) -> dict[str, Any]:
    """One size's row of the frontier: layout, parameters, whether and when it converged, the last check."""
    m = r.manifest
    last = m["checks"][-1] if m["checks"] else None
    return {"hidden": list(r.hidden), "n_params": m["n_params"], "converged": m["converged_at"] is not None,
            "converged_at": m["converged_at"], "cpu_s": round(m["cpu_s"], 2), "wall_s": round(m["wall_s"], 2),
            "diagnostics_s": round(m["diagnostics_s"], 2), "last": last,
            "warmup": m["warmup"][-1] if m["warmup"] else None, "checks": m["checks"]}


def frame(rows: Sequence[dict[str, Any]], labels: Sequence[str] | None = None):
    """The rows of :func:`summary` (a sweep's, or an ablation's ``row`` entries) as a table, one line per
    run: whether and when it converged (CPU and wall seconds, draws per chain), what it spent, and the
    diagnostics and sampler state at its last check.

    Args:
        rows: :func:`summary` dictionaries.
        labels: the lines' names (an ablation's variants, index ``"variant"``); by default the hidden
            layouts (``"4-4"``, index ``"hidden"``).

    Returns:
        A :class:`pandas.DataFrame`; a run that did not converge has NaN in the columns "... to converge".
    """
    import pandas as pd

    def line(r: dict[str, Any]) -> dict[str, Any]:
        last, at = r["last"], r["converged_at"]
        return {"parameters": r["n_params"], "levels": last["sampler"]["levels"],
                "barrier": r["warmup"]["barrier"], "converged": "yes" if r["converged"] else "no",
                "CPU s to converge": at["cpu_s"] if at else np.nan,
                "wall s to converge": at["wall_s"] if at else np.nan, "CPU s spent": r["cpu_s"],
                "draws per chain": (at or last)["draws"],
                "step size at beta = 1": last["sampler"]["step_cold"],
                "worst R-hat (canonical)": last["canonical"]["rhat_max"],
                "worst R-hat (invariant)": last["invariant"]["rhat_max"],
                "least ESS (canonical)": last["canonical"]["ess_min"],
                "least ESS (invariant)": last["invariant"]["ess_min"],
                "round trips (least chain)": min(last["sampler"]["round_trips"]),
                "divergent trajectories": last["sampler"]["divergences"]}

    if labels is not None and len(labels) != len(rows):
        raise ValueError(f"{len(labels)} labels for {len(rows)} rows")
    index = pd.Index(list(labels) if labels is not None else ["-".join(map(str, r["hidden"])) for r in rows],
                     name="variant" if labels is not None else "hidden")
    return pd.DataFrame([line(r) for r in rows], index=index)


def replicates(docs: Sequence[dict[str, Any]]):
    """One line per layout and seed of several sweeps (the committed frontier and :data:`REPLICATES`): the
    layouts that more than one sweep ran, with whether and when each run was certified.

    Returns:
        A :class:`pandas.DataFrame` indexed by ``("hidden", "seed")``; NaN where a run was not certified.
    """
    import pandas as pd

    runs: dict[tuple[str, int], dict[str, Any]] = {}
    for doc in docs:
        seed = int(doc["settings"]["seed"])
        for r in doc["sizes"]:
            at = r["converged_at"]
            runs[("-".join(map(str, r["hidden"])), seed)] = {
                "parameters": r["n_params"], "certified": "yes" if r["converged"] else "no",
                "CPU s to certify": at["cpu_s"] if at else np.nan,
                "draws per chain": (at or r["last"])["draws"],
                "divergent trajectories": r["last"]["sampler"]["divergences"]}
    shared = {h for h, _ in runs if sum(1 for k in runs if k[0] == h) > 1}
    keys = sorted((k for k in runs if k[0] in shared), key=lambda k: (runs[k]["parameters"], k[1]))
    index = pd.MultiIndex.from_tuples(keys, names=["hidden", "seed"])
    return pd.DataFrame([runs[k] for k in keys], index=index)


def sweep(sizes: Sequence[Sequence[int]] = SIZES, settings: Settings = SETTINGS,
          root: str | os.PathLike = "build/frontier", out: str | os.PathLike | None = None,
          problem: _pd.Problem = _pd.PROBLEM, progress: bool = True) -> dict[str, Any]:
    """Every size's :func:`run` under ``root/<layout>-<key>`` (resuming), then the summary written to
    ``out`` (atomic JSON; default: none) and returned: the settings, the problem, the machine and one row
    per size (:func:`summary`)."""
    rows = []
    for hidden in sizes:
        r = run(hidden, settings, Path(root) / name(hidden, settings, problem), problem, progress)
        rows.append(summary(r))
        if out is not None:
            _write(out, _document(rows, settings, problem))
    return _document(rows, settings, problem)


def _document(rows, settings: Settings, problem: _pd.Problem) -> dict[str, Any]:
    return {"format": "symlib-frontier/1", "settings": dataclasses.asdict(settings),
            "problem": dataclasses.asdict(problem), "machine": machine(), **store.provenance(),
            "command": "python -m symlib.paper.frontier " + " ".join(sys.argv[1:]), "sizes": rows}


def _write(out, doc: dict[str, Any]) -> None:
    store.atomic_write_bytes(out, (json.dumps(store.jsonable(doc), indent=1) + "\n").encode())


def ablation(variants: dict[str, dict[str, Any]] = ABLATIONS, hidden: Sequence[int] = ABLATION_HIDDEN,
             settings: Settings = SETTINGS, root: str | os.PathLike = "build/frontier",
             out: str | os.PathLike | None = None, problem: _pd.Problem = _pd.PROBLEM,
             progress: bool = True) -> dict[str, Any]:
    """Every variant of the sampler's settings (``{name: changed fields}``) run on ``hidden`` like a size
    of the frontier (same root: the unchanged settings reuse the frontier's run), then the summary written
    to ``out`` (atomic JSON) and returned: ``{"variants": {name: {"changes", "row"}}}`` with the machine."""
    rows = {}

    def document() -> dict[str, Any]:
        return {**_document([], settings, problem), "hidden": list(hidden), "variants": rows}

    for variant, changes in variants.items():
        s = dataclasses.replace(settings, **changes)
        r = run(hidden, s, Path(root) / name(hidden, s, problem), problem, progress)
        rows[variant] = {"changes": dict(changes), "row": summary(r)}
        if out is not None:
            _write(out, document())
    return document()


def results(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The frontier written by :func:`sweep` (default: the committed :data:`RESULTS`)."""
    return json.loads(Path(path or RESULTS).read_text())


def _overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """``["mass=dense", "warmup=50,100"]`` as :class:`Settings` fields of the right types."""
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--set takes NAME=VALUE with NAME one of {sorted(fields)}, got {pair!r}")
        default = getattr(SETTINGS, name)
        if isinstance(default, bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--set {name} takes true or false, got {value!r}")
            out[name] = value.lower() == "true"
        elif isinstance(default, tuple):
            out[name] = tuple(int(v) for v in value.split(","))
        elif name == "rounds":
            out[name] = None if value.lower() == "none" else int(value)
        else:
            out[name] = type(default)(value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m symlib.paper.frontier``: :func:`sweep` from the command line; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m symlib.paper.frontier", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join("x".join(map(str, h)) for h in SIZES),
                   help="hidden layouts, comma-separated, layers joined by x (e.g. 8,4x4)")
    p.add_argument("--budget", type=float, default=SETTINGS.budget, help="CPU seconds per size")
    p.add_argument("--root", default="build/frontier", help="where the runs live (resumable)")
    p.add_argument("--out", default=None, help="the summary JSON (default: the committed results)")
    p.add_argument("--ablation", action="store_true",
                   help="the ablation of the sampler's settings on the smallest layout instead of the sweep")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="another value of a sampler setting (e.g. mass=dense, shift_moves=false); repeatable")
    args = p.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",") if s]
    try:
        settings = dataclasses.replace(SETTINGS, budget=args.budget, **_overrides(args.set))
    except (ValueError, TypeError) as e:
        print(f"symlib.paper.frontier: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.ablation:
            ablation(ABLATIONS, ABLATION_HIDDEN, settings, args.root, args.out or ABLATION)
        else:
            sweep(sizes, settings, args.root, args.out or RESULTS)
    except (store.StoreError, ValueError, FloatingPointError) as e:
        print(f"symlib.paper.frontier: error: {e}", file=sys.stderr)
        return 2
    return 0
