r"""The two MCMC rows of Table 1 read off their sample sets: SGHMC's temperature and the HMC reference's
convergence and cost (book: chapter "Table 1"; beyond the paper).

* :func:`sghmc_temperatures`: per SGHMC row, its setting and the effective and kinetic temperatures its
  chains recorded (:mod:`symlib.posteriors.temperature`);
* :func:`setting_temperatures`: the effective temperature of SGHMC's named settings
  (:data:`symlib.posteriors.sghmc.SETTINGS`) at given weights, with and without the random crops;
* :func:`hmc_scales`, :func:`hmc_chains` and :func:`hmc_cost`: the HMC reference's diagnostics on raw
  weights, canonical forms and invariant functionals, its chains one by one, and what it cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["hmc_chains", "hmc_cost", "hmc_scales", "setting_temperatures", "sghmc_temperatures"]


def sghmc_temperatures(sets: Mapping[tuple[str, str], Any]):
    """One row per SGHMC set of ``sets`` (``{label: SampleSet}``): setting, friction, correction, the
    effective temperature (``T_eff``: mean over chains of each chain's mean over its kept samples;
    ``T_eff chain min/max``: the coolest and hottest chain; ``T_eff min/max``: the extremes of single kept
    samples, each an estimate from a few minibatches, so they scatter around their chain's value), the
    kinetic temperature ``T_kin`` of the velocities and ``T_kin / T_eff``, which the discretisation
    raises to about ``2 / (2 - alpha)`` (the stationary velocity variance of
    ``v <- (1 - alpha) v + N(0, 2 alpha eta T)`` is ``2 eta T / (2 - alpha)``)."""
    import pandas as pd

    rows = {}
    for label, s in sets.items():
        if getattr(s, "method", None) != "sghmc":
            continue
        d, h = s.diagnostics, s.hyper
        te = d.get("effective_temperature") or [np.nan]
        t_kin = float(np.mean(d.get("kinetic_temperature") or [np.nan]))
        rows[label] = {
            "setting": h.get("setting", "paper"),
            "alpha": h.get("alpha"),
            "correction": bool(h.get("correction", False)),
            "T_eff": float(np.mean(te)),
            "T_eff chain min": float(np.min(te)),
            "T_eff chain max": float(np.max(te)),
            "T_eff min": float(np.min(d.get("effective_temperature_min") or te)),
            "T_eff max": float(np.max(d.get("effective_temperature_max") or te)),
            "T_kin": t_kin,
            "T_kin / T_eff": t_kin / float(np.mean(te)),
        }
    frame = pd.DataFrame.from_dict(rows, orient="index")
    if rows:
        frame.index = pd.MultiIndex.from_tuples(list(rows), names=["method", "modes"])
    return frame


def setting_temperatures(setup, theta, settings: Sequence[str] = ("corrected", "paper"), n_batches: int = 32,
                         seed: int = 0):
    """The effective temperature of SGHMC's named settings at stacked weights ``theta`` (e.g. the base
    models the chains start from), with and without the recipe's random crops: one row per setting, the
    smallest and largest value over the models. The correction's estimate comes from ``n_batches // 2``
    other batches, as in a run."""
    import pandas as pd

    from symlib.posteriors import sghmc
    from symlib.posteriors import temperature as tt

    m = next(iter(theta.values())).shape[0]
    seeds = [10_007 * (seed + 1) * (i + 1) for i in range(m)]
    noise = {aug: tt.gradient_noise(setup, theta, seeds, n_batches, augment=aug) for aug in (True, False)}
    estimate = tt.gradient_noise(setup, theta, [s + 1 for s in seeds], max(2, n_batches // 2), augment=True)
    eta = setup.recipe.lr_at(setup.recipe.epochs - 1) / setup.n_train
    rows = {}
    for name in settings:
        st = sghmc.SETTINGS[name]
        nv = estimate if st["correction"] else None
        row = {"alpha": st["alpha"], "correction": st["correction"]}
        for aug, col in ((True, "with crops"), (False, "without crops")):
            t = tt.effective_temperature(noise[aug], eta, st["alpha"], 1.0, nv)
            row[f"T_eff {col} (min)"], row[f"T_eff {col} (max)"] = float(t.min()), float(t.max())
        rows[name] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def hmc_scales(sample_set):
    """The HMC set's diagnostics on the three scales (raw, canonical, invariant): one row each."""
    import pandas as pd

    sc = dict(sample_set.diagnostics.get("scales", {}))
    rows = {k: v for k, v in sc.items() if isinstance(v, Mapping)}
    return pd.DataFrame.from_dict(rows, orient="index")


def hmc_chains(sample_set):
    """The HMC reference chain by chain: where it sits (training NLL per example, test log-likelihood and
    accuracy), whether it converged locally (split R-hat and bulk ESS on the invariant functionals), and
    how it moved (acceptance, step size, trajectory length, divergences)."""
    import pandas as pd

    d = sample_set.diagnostics
    cols = {
        "train NLL": "train_nll_per_chain",
        "test log-lik": "test_loglik_per_chain",
        "test acc": "test_acc_per_chain",
        "R-hat (invariant, max)": "rhat_invariant_per_chain",
        "bulk ESS (invariant, min)": "ess_bulk_invariant_per_chain",
        "converged locally": "chain_converged",
        "acceptance": "accept_prob",
        "step size": "step_size",
        "trajectory length": "trajectory_length",
        "divergences": "divergences",
    }
    frame = pd.DataFrame({name: d[key] for name, key in cols.items() if key in d})
    frame.index.name = "chain"
    return frame


def hmc_cost(sample_set) -> dict[str, float]:
    """What the HMC reference cost: polish epochs (one epoch costs about one full-batch gradient) and
    seconds, the metric's seconds, the sampler's full-batch gradients (each for all chains at once) and
    seconds, the diagnostics' seconds, and the total."""
    d = sample_set.diagnostics
    pol = d.get("polish", {})
    out = {
        "polish epochs": float(pol.get("epochs", 0)),
        "polish s": float(pol.get("seconds", 0.0)),
        "metric s": float(d.get("seconds_metric", 0.0)),
        "sampler gradients": float(d.get("n_grad", 0)),
        "sampler s": float(d.get("seconds", 0.0)),
        "diagnostics s": float(d.get("seconds_diagnostics", 0.0)),
    }
    out["total s"] = out["polish s"] + out["metric s"] + out["sampler s"] + out["diagnostics s"]
    return out
