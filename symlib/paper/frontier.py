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
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symlib import store
from symlib.paper import pca_digits as _pd
from symlib.params import unflatten
from symlib.posteriors.hmc.ladder import Ladder

__all__ = ["ABLATION", "ABLATIONS", "ABLATION_HIDDEN", "RESULTS", "SETTINGS", "SIZES", "Run", "Settings",
           "ablation", "functionals", "judge", "machine", "main", "results", "run", "spec", "summary",
           "sweep"]

SIZES: tuple[tuple[int, ...], ...] = ((2,), (4,), (8,), (16,), (32,), (2, 2), (4, 4), (8, 8), (16, 16))
"""The hidden layouts of the frontier: one and two hidden layers of growing width."""

RESULTS = Path(__file__).parent / "results" / "frontier.json"
"""The committed frontier (machine, date and command recorded inside)."""

ABLATION = Path(__file__).parent / "results" / "ablation.json"
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


@dataclasses.dataclass(frozen=True)
class Settings:
    """Sampler settings of a frontier run (every one of them a parameter of the chapter).

    Attributes:
        n_chains: independent ladders.
        n_leapfrog: leapfrog steps per trajectory.
        warmup: rounds of the adaptation phases; the schedule is re-tuned after each phase but the last
            (:meth:`~symlib.posteriors.hmc.ladder.Ladder.retune`).
        levels: levels of the initial schedule (geometric from 1 to ``1e-3``, then the prior).
        mass: ``"diag"`` or ``"dense"`` covariance of each level's states as inverse mass matrix.
        per_chain: one mass matrix per chain and level (else pooled over the chains).
        orbit_moves: exact Gibbs moves along the scaling orbits before every trajectory
            (:class:`symlib.posteriors.hmc.orbits.ScalingMoves`).
        shift_moves: exact Gibbs moves along the softmax shift before every trajectory
            (:class:`symlib.posteriors.hmc.orbits.SoftmaxShift`), the mass matrices estimated without it.
        target_accept: the step sizes' target acceptance; jitter: their jitter when sampling.
        segment: sampling rounds between two checks; thin: rounds per kept draw.
        budget: CPU seconds of sampling (warm-up included) after which a run that has not converged stops.
        rounds: a fixed number of sampling rounds instead (a reference of known length; ``None``: until
            convergence or the budget).
        n_probe: test digits whose predictive probability is an invariant functional.
        seed: of the initial states and of every random draw.
    """

    n_chains: int = 4
    n_leapfrog: int = 20
    warmup: tuple[int, ...] = (50, 100, 200, 300)
    levels: int = 10
    mass: str = "diag"
    per_chain: bool = True
    orbit_moves: bool = True
    shift_moves: bool = True
    target_accept: float = 0.75
    jitter: float = 0.1
    segment: int = 250
    thin: int = 1
    budget: float = 1200.0
    rounds: int | None = None
    n_probe: int = 20
    seed: int = 0


SETTINGS = Settings()
"""The chapter's sampler settings (see the measurements in the chapter)."""


def _key(hidden, settings: Settings, problem: _pd.Problem) -> str:
    text = json.dumps({"hidden": list(hidden), "settings": dataclasses.asdict(settings),
                       "problem": dataclasses.asdict(problem), "data": _pd.load(problem).fingerprint,
                       "format": 1}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def spec(hidden: Sequence[int], problem: _pd.Problem = _pd.PROBLEM):
    """The symmetry spec of the MLP with hidden layers ``hidden`` (:func:`symlib.symmetry.trace.spec_of`,
    float64)."""
    from symlib import models
    from symlib.symmetry import trace

    w = _pd.widths(hidden, problem)
    return trace.spec_of(models.MLPClassifier(w).double(), (w[0],))


def functionals(draws: torch.Tensor, hidden, problem: _pd.Problem = _pd.PROBLEM,
                n_probe: int = 20) -> dict[str, torch.Tensor]:
    """The invariant functionals of draws ``(C, S, D)`` but the potential: ``"test log-likelihood"`` ``(C,
    S)`` and ``"p(y|x)"`` ``(C, S, n_probe)`` (:func:`symlib.stats.convergence.predictive_functionals`)."""
    from symlib.stats import convergence
    from symlib.training import mlp as _mlp

    d = _pd.load(problem)
    c, s, _ = draws.shape
    shapes = _mlp.shapes(_pd.widths(hidden, problem))
    out: dict[str, list] = {}
    for lo in range(0, s, 200):
        part = draws[:, lo : lo + 200]
        logits = _mlp.mlp_forward(unflatten(part.reshape(-1, part.shape[-1]), shapes), d.x_test)
        p = torch.softmax(logits, -1).reshape(c, part.shape[1], *logits.shape[1:])
        for k, v in convergence.predictive_functionals(p, d.y_test, n_probe).items():
            out.setdefault(k, []).append(torch.as_tensor(v))
    return {k: torch.cat(v, 1) for k, v in out.items()}


def judge(draws: torch.Tensor, canonical: torch.Tensor, invariant: dict[str, torch.Tensor], hidden,
          problem: _pd.Problem = _pd.PROBLEM):
    """The diagnostics of draws ``(C, S, D)`` on the three scales
    (:func:`symlib.stats.convergence.diagnose`): raw, canonical (``canonical (C, S, D)``, flat in the same
    order) and ``invariant`` (``{name: (C, S, ...)}``, the potential included)."""
    from symlib.stats import convergence
    from symlib.training import mlp as _mlp

    shapes = _mlp.shapes(_pd.widths(hidden, problem))
    c, s, _ = draws.shape

    def unflat(t):
        return {k: v.reshape(c, s, *v.shape[1:]) for k, v in unflatten(t.reshape(c * s, -1), shapes).items()}

    return convergence.diagnose(unflat(draws), None, invariant, canonical=unflat(canonical))


def _canonical(draws: torch.Tensor, hidden, problem: _pd.Problem) -> torch.Tensor:
    from symlib.params import flatten
    from symlib.symmetry import canonical
    from symlib.training import mlp as _mlp

    shapes = _mlp.shapes(_pd.widths(hidden, problem))
    c, s, d = draws.shape
    out = canonical.canonicalize(unflatten(draws.reshape(c * s, d), shapes), spec(hidden, problem))
    return flatten(out, list(shapes)).reshape(c, s, d)


class Run:
    """One size's resumable run in ``folder`` (see the module docstring); :meth:`advance` does the work.

    Args:
        hidden: the hidden layout, e.g. ``(8,)`` or ``(4, 4)``.
        settings: the sampler settings.
        folder: where the run lives (created; a folder of another run is refused).
        problem: the data and prior.
    """

    def __init__(self, hidden: Sequence[int], settings: Settings = SETTINGS,
                 folder: str | os.PathLike | None = None, problem: _pd.Problem = _pd.PROBLEM):
        from symlib.posteriors.hmc.ladder import MASSES

        self.hidden, self.settings, self.problem = tuple(int(h) for h in hidden), settings, problem
        if settings.mass not in MASSES:
            raise ValueError(f"mass must be one of {MASSES}, got {settings.mass!r}")
        self.key = _key(self.hidden, settings, problem)
        self.folder = Path(folder) if folder is not None else None
        self.lik, self.shapes = _pd.likelihood(self.hidden, problem)
        from symlib.posteriors.hmc import orbits

        lam = 1.0 / problem.prior_sd**2
        steps = []
        if settings.orbit_moves:
            steps.append(orbits.ScalingMoves(spec(self.hidden, problem), self.shapes, lam))
        self.shift = orbits.SoftmaxShift(self.shapes, lam) if settings.shift_moves else None
        if self.shift is not None:
            steps.append(self.shift)
        self.moves = _compose(steps)
        self.segments: list[dict[str, torch.Tensor]] = []
        self.manifest = self._fresh_manifest()
        self.ladder: Ladder | None = None
        if self.folder is not None and (self.folder / store.MANIFEST).exists():
            self._load()

    # ------------------------------------------------------------------ files
    def _fresh_manifest(self) -> dict[str, Any]:
        return {"kind": "frontier-run", "key": self.key, "hidden": list(self.hidden),
                "n_params": _pd.n_params(self.hidden, self.problem),
                "settings": dataclasses.asdict(self.settings), "problem": dataclasses.asdict(self.problem),
                "phase": 0, "segments": 0, "cpu_s": 0.0, "wall_s": 0.0, "diagnostics_s": 0.0,
                "checks": [], "converged_at": None, "done": False, "warmup": []}

    def _load(self) -> None:
        man = json.loads((self.folder / store.MANIFEST).read_text())
        if man.get("key") != self.key:
            raise store.StoreError(
                f"{self.folder} holds another frontier run (key {man.get('key')}, this one {self.key}); use "
                "another folder"
            )
        self.manifest = man
        from safetensors.torch import load_file

        state = self.folder / self._state_name()
        if state.exists():
            self.ladder = Ladder.from_state(load_file(str(state)), self.lik, 1.0 / self.problem.prior_sd**2,
                                            **self._ladder_args())
        self.segments = [load_file(str(self.folder / f"segment-{i:04d}.safetensors"))
                         for i in range(man["segments"])]

    def _save(self, segment: dict[str, torch.Tensor] | None = None) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        meta = {"format": "symlib-frontier/1", "key": self.key}
        if segment is not None:
            name = f"segment-{len(self.segments) - 1:04d}.safetensors"
            store.atomic_save(segment, self.folder / name, meta)
        name = self._state_name()
        store.atomic_save(self.ladder.state_dict(), self.folder / name, meta)
        store.write_manifest(self.folder, {**self.manifest, **store.provenance()})  # the commit point
        for old in self.folder.glob("state-*.safetensors"):
            if old.name != name:
                old.unlink(missing_ok=True)

    def _state_name(self) -> str:
        """The ladder's file after the manifest's phase and segment (a run killed between two writes
        resumes from the state its manifest names)."""
        return f"state-p{self.manifest['phase']}-s{self.manifest['segments']}.safetensors"

    def _ladder_args(self) -> dict[str, Any]:
        s = self.settings
        return {"target_accept": s.target_accept, "jitter": s.jitter, "n_leapfrog": s.n_leapfrog,
                "moves": self.moves, "mass": s.mass, "per_chain": s.per_chain,
                "exact": self.shift.basis if self.shift is not None else None}

    # ------------------------------------------------------------------ work
    def _timed(self, fn):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        self.manifest["cpu_s"] += time.process_time() - c0
        self.manifest["wall_s"] += time.perf_counter() - w0
        return out

    def _start(self) -> None:
        s = self.settings
        gen = torch.Generator().manual_seed(s.seed)
        d = _pd.n_params(self.hidden, self.problem)
        theta0 = self.problem.prior_sd * torch.randn(s.n_chains, d, generator=gen, dtype=torch.float64)
        betas = torch.cat([torch.logspace(0, -3, s.levels - 1, dtype=torch.float64),
                           torch.zeros(1, dtype=torch.float64)])
        self.ladder = self._timed(lambda: Ladder(self.lik, 1.0 / self.problem.prior_sd**2, theta0, betas,
                                                 seed=s.seed + 1, **self._ladder_args()))

    def _stop(self) -> bool:
        m, s = self.manifest, self.settings
        if s.rounds is not None:
            return m["segments"] * s.segment >= s.rounds
        return m["converged_at"] is not None or m["cpu_s"] >= s.budget

    def advance(self, progress: bool = False, max_segments: int | None = None) -> dict[str, Any]:
        """Run (or resume) until the size converges, the budget is spent or, with ``settings.rounds``, the
        fixed length is reached; every phase and segment is saved before the next. ``max_segments``
        returns earlier, after that many new segments (the run stays resumable). Returns the manifest."""
        s = self.settings
        if self.manifest["done"]:
            return self.manifest
        if self.ladder is None:
            self._start()
            self._save()
        while self.manifest["phase"] < len(s.warmup):
            i = self.manifest["phase"]
            stats = self._timed(lambda i=i: self.ladder.adapt(s.warmup[i]))
            if i < len(s.warmup) - 1:
                self._timed(self.ladder.retune)
            self.manifest["warmup"].append({**stats, "cpu_s": round(self.manifest["cpu_s"], 2)})
            self.manifest["phase"] = i + 1
            self._save()
            _say(progress, f"{self.hidden}: warm-up phase {i + 1}/{len(s.warmup)}, {self.ladder.n_levels} "
                           f"levels, barrier {stats['barrier']}, {self.manifest['cpu_s']:.0f} CPU s")
        new = 0
        while not self._stop():
            if max_segments is not None and new >= max_segments:
                return self.manifest
            new += 1
            seg = self._timed(lambda: self.ladder.sample(s.segment * s.thin, s.thin))
            t0 = time.perf_counter()
            record = {"draws": seg.draws, "potential": seg.potential, "nll": seg.nll,
                      "canonical": _canonical(seg.draws, self.hidden, self.problem),
                      **{f"f:{k}": v for k, v in functionals(seg.draws, self.hidden, self.problem,
                                                              s.n_probe).items()}}
            self.segments.append(record)
            self.manifest["segments"] = len(self.segments)
            check = self.check()
            self.manifest["diagnostics_s"] += time.perf_counter() - t0
            self.manifest["checks"].append(check)
            if check["converged"] and self.manifest["converged_at"] is None:
                self.manifest["converged_at"] = {k: check[k] for k in ("cpu_s", "wall_s", "rounds", "draws")}
            self._save(record)
            _say(progress, f"{self.hidden}: {check['draws']} draws/chain, {check['cpu_s']:.0f} CPU s, R-hat "
                           f"{check['canonical']['rhat_max']:.3f}/{check['invariant']['rhat_max']:.3f}, "
                           f"ESS {check['canonical']['ess_min']:.0f}/{check['invariant']['ess_min']:.0f}")
        self.manifest["done"] = True
        self._save()
        return self.manifest

    def report(self):
        """The :class:`symlib.stats.convergence.Report` of every kept draw so far."""
        if not self.segments:
            raise ValueError("no draws yet: advance the run first")
        cat = {k: torch.cat([seg[k] for seg in self.segments], 1) for k in self.segments[0]}
        inv = {"potential": cat["potential"], **{k[2:]: v for k, v in cat.items() if k.startswith("f:")}}
        return judge(cat["draws"], cat["canonical"], inv, self.hidden, self.problem)

    def check(self) -> dict[str, Any]:
        """One check of the criterion on every kept draw so far, with the sampler's state."""
        rep = self.report()
        rounds = self.manifest["segments"] * self.settings.segment * self.settings.thin
        out: dict[str, Any] = {"rounds": rounds,
                               "draws": rep.n_draws, "cpu_s": round(self.manifest["cpu_s"], 2),
                               "wall_s": round(self.manifest["wall_s"], 2),
                               "converged": rep.converged(rhat=1.01, ess=400.0)}
        for sc in ("raw", "canonical", "invariant"):
            d = rep[sc]
            out[sc] = {"rhat_max": float(d.rhat.max()), "ess_bulk_min": float(d.ess_bulk.min()),
                       "ess_tail_min": float(d.ess_tail.min()),
                       "ess_min": float(min(d.ess_bulk.min(), d.ess_tail.min()))}
        st = self.ladder.stats()
        out["sampler"] = {"levels": len(st["betas"]), "swap_accept_min": min(st["swap_accept"]),
                          "round_trips": st["round_trips"], "accept_cold": st["accept"][0],
                          "step_cold": st["step_size"][0], "divergences": st["divergences"],
                          "n_grad": st["n_grad"]}
        return out

    def draws(self) -> dict[str, torch.Tensor]:
        """Every kept draw so far: ``{"draws": (C, S, D), "potential": (C, S), "nll": (C, S)}``."""
        return {k: torch.cat([seg[k] for seg in self.segments], 1) for k in ("draws", "potential", "nll")}


def _compose(steps):
    """One move made of ``steps`` in turn (``None`` without any)."""
    if not steps:
        return None

    def moves(theta: torch.Tensor, gen: torch.Generator):
        acc = torch.ones(theta.shape[0], dtype=torch.float64)
        for step in steps:
            theta, a = step(theta, gen)
            acc = acc * a
        return theta, acc

    return moves


def _say(enabled: bool, text: str) -> None:
    if enabled:
        print(text, file=sys.stderr, flush=True)


def run(hidden: Sequence[int], settings: Settings = SETTINGS, folder: str | os.PathLike | None = None,
        problem: _pd.Problem = _pd.PROBLEM, progress: bool = False) -> Run:
    """:class:`Run` of ``hidden`` advanced to its end (resumed from ``folder`` when it holds it)."""
    r = Run(hidden, settings, folder, problem)
    r.advance(progress)
    return r


def machine() -> dict[str, Any]:
    """Where a measurement ran: CPU model, logical CPUs, torch's intra-op threads, load average, Python
    and torch versions, date (UTC)."""
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


def sweep(sizes: Sequence[Sequence[int]] = SIZES, settings: Settings = SETTINGS,
          root: str | os.PathLike = "build/frontier", out: str | os.PathLike | None = None,
          problem: _pd.Problem = _pd.PROBLEM, progress: bool = True) -> dict[str, Any]:
    """Every size's :func:`run` under ``root/<layout>-<key>`` (resuming), then the summary written to
    ``out`` (atomic JSON; default: none) and returned: the settings, the problem, the machine and one row
    per size (:func:`summary`)."""
    rows = []
    for hidden in sizes:
        r = Run(hidden, settings, None, problem)
        folder = Path(root) / ("x".join(str(h) for h in r.hidden) + f"-{r.key}")
        r = run(hidden, settings, folder, problem, progress)
        rows.append(summary(r))
        if out is not None:
            _write(out, rows, settings, problem)
    return _document(rows, settings, problem)


def _document(rows, settings: Settings, problem: _pd.Problem) -> dict[str, Any]:
    return {"format": "symlib-frontier/1", "settings": dataclasses.asdict(settings),
            "problem": dataclasses.asdict(problem), "machine": machine(), **store.provenance(),
            "command": "python -m symlib.paper.frontier " + " ".join(sys.argv[1:]), "sizes": rows}


def _write(out, rows, settings, problem) -> None:
    doc = _document(rows, settings, problem)
    store.atomic_write_bytes(out, (json.dumps(store.jsonable(doc), indent=1) + "\n").encode())


def ablation(variants: dict[str, dict[str, Any]] = ABLATIONS, hidden: Sequence[int] = ABLATION_HIDDEN,
             settings: Settings = SETTINGS, root: str | os.PathLike = "build/frontier",
             out: str | os.PathLike | None = None, problem: _pd.Problem = _pd.PROBLEM,
             progress: bool = True) -> dict[str, Any]:
    """Every variant of the sampler's settings (``{name: changed fields}``) run on ``hidden`` like a size
    of the frontier (same root: the unchanged settings reuse the frontier's run), then the summary written
    to ``out`` (atomic JSON) and returned: ``{"variants": {name: {"changes", "row"}}}`` with the machine."""
    rows = {}
    for name, changes in variants.items():
        s = dataclasses.replace(settings, **changes)
        r = Run(hidden, s, None, problem)
        folder = Path(root) / ("x".join(str(h) for h in r.hidden) + f"-{r.key}")
        rows[name] = {"changes": dict(changes), "row": summary(run(hidden, s, folder, problem, progress))}
        if out is not None:
            doc = {**_document([], settings, problem), "hidden": list(hidden), "variants": rows}
            store.atomic_write_bytes(out, (json.dumps(store.jsonable(doc), indent=1) + "\n").encode())
    return {**_document([], settings, problem), "hidden": list(hidden), "variants": rows}


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
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="another value of a sampler setting (e.g. mass=dense, shift_moves=false); repeatable")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
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


if __name__ == "__main__":
    sys.exit(main())
