r"""Convergence diagnostics that understand weight-space symmetries (book: chapters "A gentle example" and
"Table 1"; beyond the paper and, as far as we know, beyond every MCMC library).

The posterior of a ReLU network is invariant under permutations of its hidden neurons (paper Prop. 1):
two chains that sample two permuted copies of one mode sample *the same distribution of functions*, yet
their raw weights never agree, so the usual :math:`\hat R` on raw weights calls them divergent. The same
draws are judged here on three scales (:data:`SCALES`), each with the rank-normalised split
:math:`\hat R` and the bulk and tail ESS of :mod:`symlib.stats.diagnostics` (ArviZ's definitions):

* ``"raw"``: every weight as sampled;
* ``"canonical"``: every weight of the canonical form (:func:`symlib.symmetry.canonical.canonicalize`:
  unit-norm neurons, sorted by their largest incoming weight), which maps all permuted and rescaled
  copies of a network to one point;
* ``"invariant"``: functionals the symmetries leave unchanged, given by the caller: the potential
  energy, the test log-likelihood, the predictive probabilities of a fixed set of test inputs
  (:func:`predictive_functionals`).

Besides the across-chain values, every quantity is judged *per chain* (each chain's split
:math:`\hat R` and bulk ESS on its own): a chain can be converged locally, in its own basin, while the
chains disagree because they sit in different basins. :meth:`Report.frame` gives one row per scale;
:meth:`Report.converged` applies thresholds (Vehtari et al. 2021 recommend :math:`\hat R < 1.01` and a
bulk and tail ESS above 400 for final results).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from symlib.params import Params
from symlib.stats import diagnostics as _diag
from symlib.symmetry import canonical as _canonical
from symlib.symmetry.spec import Spec

SCALES = ("raw", "canonical", "invariant")

__all__ = ["SCALES", "Report", "ScaleDiagnostics", "canonical_draws", "diagnose", "predictive_functionals"]


def canonical_draws(draws: Params, spec: Spec, **canon: Any) -> Params:
    """The canonical form of every draw of stacked draws ``{name: (C, S, ...)}`` (same shapes), by
    :func:`symlib.symmetry.canonical.canonicalize` (keyword arguments passed on; in float64)."""
    flat = {k: v.detach().to(torch.float64).flatten(0, 1) for k, v in draws.items()}
    c, s = next(iter(draws.values())).shape[:2]
    out = _canonical.canonicalize(flat, spec, **canon)
    return {k: v.reshape(c, s, *v.shape[1:]) for k, v in out.items()}


def _matrix(quantities: Mapping[str, Any]) -> tuple[np.ndarray, list[str]]:
    """``{name: (C, S, ...)}`` -> ``(C, S, P)`` and the ``P`` names (``name[i]`` for multi-valued ones)."""
    cols, names = [], []
    shape = None
    for name, v in quantities.items():
        a = v.detach().cpu().double().numpy() if isinstance(v, torch.Tensor) else np.asarray(v, np.float64)
        if a.ndim < 2:
            raise ValueError(f"{name!r} must be shaped (chains, draws, ...), got {a.shape}")
        if shape is not None and a.shape[:2] != shape:
            raise ValueError(f"{name!r} has {a.shape[:2]} chains x draws, the others {shape}")
        shape = a.shape[:2]
        a = a.reshape(*a.shape[:2], -1)
        cols.append(a)
        names += [name] if a.shape[2] == 1 else [f"{name}[{i}]" for i in range(a.shape[2])]
    if not cols:
        raise ValueError("no quantities to diagnose")
    return np.concatenate(cols, axis=2), names


@dataclasses.dataclass
class ScaleDiagnostics:
    """The diagnostics of one scale, per quantity.

    Attributes:
        scale: ``"raw"``, ``"canonical"`` or ``"invariant"``.
        names: the ``P`` quantities.
        rhat, ess_bulk, ess_tail: across all chains, ``(P,)``.
        rhat_per_chain, ess_bulk_per_chain: each chain alone (its split halves), ``(C, P)``.
    """

    scale: str
    names: list[str]
    rhat: np.ndarray
    ess_bulk: np.ndarray
    ess_tail: np.ndarray
    rhat_per_chain: np.ndarray
    ess_bulk_per_chain: np.ndarray

    def summary(self) -> dict[str, float]:
        """Worst and typical values: the quantities, max and median R-hat, min bulk and tail ESS, and the
        worst per-chain R-hat and bulk ESS over all chains and quantities."""
        return {
            "quantities": len(self.names),
            "rhat_max": float(self.rhat.max()),
            "rhat_median": float(np.median(self.rhat)),
            "ess_bulk_min": float(self.ess_bulk.min()),
            "ess_tail_min": float(self.ess_tail.min()),
            "rhat_per_chain_max": float(self.rhat_per_chain.max()),
            "ess_bulk_per_chain_min": float(self.ess_bulk_per_chain.min()),
        }

    def of(self, name: str) -> dict[str, Any]:
        """The values of one quantity (its per-chain values as lists)."""
        i = self.names.index(name)
        return {"rhat": float(self.rhat[i]), "ess_bulk": float(self.ess_bulk[i]),
                "ess_tail": float(self.ess_tail[i]), "rhat_per_chain": self.rhat_per_chain[:, i].tolist(),
                "ess_bulk_per_chain": self.ess_bulk_per_chain[:, i].tolist()}


def _scale(name: str, x: np.ndarray, names: list[str]) -> ScaleDiagnostics:
    c = x.shape[0]
    rhat = _diag.rhat(x)  # one chain: its two halves
    per_r = np.stack([_diag.rhat(x[i : i + 1]) for i in range(c)])
    per_e = np.stack([_diag.ess_bulk(x[i : i + 1]) for i in range(c)])
    return ScaleDiagnostics(name, names, rhat, _diag.ess_bulk(x), _diag.ess_tail(x), per_r, per_e)


@dataclasses.dataclass
class Report:
    """Diagnostics of one set of chains on each scale given (:data:`SCALES`)."""

    scales: dict[str, ScaleDiagnostics]
    n_chains: int
    n_draws: int

    def __getitem__(self, scale: str) -> ScaleDiagnostics:
        return self.scales[scale]

    def frame(self):
        """One row per scale (:meth:`ScaleDiagnostics.summary`), as a DataFrame whose columns keep their
        types (the number of quantities an integer, not ``9.0``)."""
        import pandas as pd

        return pd.DataFrame.from_dict({k: v.summary() for k, v in self.scales.items()}, orient="index")

    def converged(self, rhat: float = 1.01, ess: float = 400.0, scales=("canonical", "invariant"),
                  per_chain: bool = False) -> bool:
        """Whether every quantity of ``scales`` has :math:`\\hat R <` ``rhat`` and bulk and tail ESS
        ``>= ess`` across chains, or, with ``per_chain``, split :math:`\\hat R <` ``rhat`` and bulk ESS
        ``>= ess`` in every chain alone (a local criterion: each chain converged in its own basin)."""
        for s in scales:
            d = self.scales[s]
            if per_chain:
                ok = (d.rhat_per_chain < rhat).all() and (d.ess_bulk_per_chain >= ess).all()
            else:
                ok = (d.rhat < rhat).all() and (d.ess_bulk >= ess).all() and (d.ess_tail >= ess).all()
            if not ok:
                return False
        return True

    def to_json(self) -> dict[str, Any]:
        """JSON-able summaries per scale."""
        return {"n_chains": self.n_chains, "n_draws": self.n_draws,
                **{k: v.summary() for k, v in self.scales.items()}}


def diagnose(draws: Params | None = None, spec: Spec | None = None,
             functionals: Mapping[str, Any] | None = None, canonical: Params | None = None,
             **canon: Any) -> Report:
    """Diagnose chains on the raw, canonical and invariant scales.

    Args:
        draws: stacked draws ``{name: (C, S, ...)}`` (the ``raw`` scale), or ``None``.
        spec: the architecture's symmetries; with ``draws``, adds the ``canonical`` scale.
        functionals: ``{name: (C, S, ...)}`` values of symmetry-invariant functionals of every draw (the
            ``invariant`` scale), e.g. ``{"potential": U}`` and :func:`predictive_functionals`.
        canonical: the canonical draws if already computed (else from ``draws`` and ``spec``).
        **canon: options of :func:`symlib.symmetry.canonical.canonicalize`.

    Returns:
        A :class:`Report` with the scales that could be computed.
    """
    scales: dict[str, ScaleDiagnostics] = {}
    shape = None
    if draws is not None:
        x, names = _matrix(draws)
        shape = x.shape[:2]
        scales["raw"] = _scale("raw", x, names)
        if canonical is None and spec is not None:
            canonical = canonical_draws(draws, spec, **canon)
    if canonical is not None:
        x, names = _matrix(canonical)
        shape = x.shape[:2]
        scales["canonical"] = _scale("canonical", x, names)
    if functionals:
        x, names = _matrix(functionals)
        if shape is not None and x.shape[:2] != shape:
            raise ValueError(f"functionals have {x.shape[:2]} chains x draws, the draws {shape}")
        shape = x.shape[:2]
        scales["invariant"] = _scale("invariant", x, names)
    if not scales:
        raise ValueError("nothing to diagnose: pass draws (and a spec) and/or functionals")
    return Report(scales, int(shape[0]), int(shape[1]))


def predictive_functionals(probs: torch.Tensor | np.ndarray, y: torch.Tensor | np.ndarray,
                           n_inputs: int | None = None) -> dict[str, np.ndarray]:
    r"""Symmetry-invariant functionals of every draw from its predicted probabilities on test inputs.

    Args:
        probs: ``(C, S, N, K)`` class probabilities (or ``(C, S, N)``: the probability of class 1 of a
            binary classifier).
        y: ``(N,)`` test labels.
        n_inputs: how many of the test inputs (the first ones) get their own functional.

    Returns:
        ``{"test log-likelihood": (C, S)`` (the mean of :math:`\log p(y_n \mid x_n, \theta)` over the
        ``N`` inputs), ``"p(y|x)": (C, S, n_inputs)`` (the probability of the true class of the first
        ``n_inputs`` inputs)``}``.
    """
    p = torch.as_tensor(probs).detach().to("cpu", torch.float64)  # the diagnostics run on the host
    yy = torch.as_tensor(y).detach().cpu().long()
    if p.ndim == 3:
        p = torch.stack([1 - p, p], -1)
    if p.ndim != 4 or p.shape[2] != yy.shape[0]:
        raise ValueError(f"probs must be (chains, draws, N, classes) with N = len(y) = {yy.shape[0]}, "
                         f"got {tuple(p.shape)}")
    true = p.gather(3, yy.view(1, 1, -1, 1).expand(*p.shape[:3], 1))[..., 0]
    out = {"test log-likelihood": true.clamp_min(1e-300).log().mean(2).numpy()}
    k = true.shape[2] if n_inputs is None else min(int(n_inputs), true.shape[2])
    if k:
        out["p(y|x)"] = true[..., :k].numpy()
    return out
