r"""The pieces of a local HMC reference: polished starting points, a curvature metric per chain, and the
chains judged on three scales (book: chapter "Table 1").

* :func:`polish`: SGD on :math:`U / N` without augmentation, in blocks of ``block`` epochs, until the
  full-batch potential of every chain stops falling (by less than ``tol`` per block) or ``max_epochs``;
  the trace of :math:`U / N` after every block is returned;
* :func:`ggn_metric`: per chain, the dense mass matrix :math:`M = G + c I` from the GGN :math:`G` of the
  likelihood at the chain's start (:func:`symlib.posteriors.laplace.curvature.full_curvature`) and a
  damping :math:`c`;
* :func:`probes` and :func:`judge`: the invariant functionals of every draw (the potential, the test
  log-likelihood, the predictive probabilities of fixed test inputs) and the diagnostics on raw weights,
  canonical forms and those functionals (:func:`symlib.stats.convergence.diagnose`), across chains and
  per chain.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from symlib import progress as _progress
from symlib import training as _train
from symlib.params import Params, unflatten
from symlib.posteriors.base import Setup
from symlib.posteriors.hmc.metric import Dense, from_curvature
from symlib.posteriors.hmc.potentials import Potential

__all__ = ["ggn", "ggn_metric", "judge", "polish", "probes"]

PER_CHAIN_RHAT = 1.05
PER_CHAIN_ESS = 50.0


def polish(setup: Setup, start: Params, seeds: list[int], potential: Potential, max_epochs: int,
           block: int = 10, tol: float = 0.005, progress: bool = False) -> tuple[Params, dict[str, Any]]:
    r"""SGD on :math:`U / N = \bar L + \tfrac{wd}{2}|\theta|^2` without augmentation (the recipe's final
    learning rate and momentum), ``block`` epochs at a time, until :math:`U / N` of every chain falls by
    less than ``tol`` over a block, or ``max_epochs``. OptuNet only (others are returned as given).
    Returns the polished weights and ``{"epochs", "trace" (U / N per chain after each block),
    "seconds"}``."""
    t0 = time.perf_counter()
    n = setup.n_train
    names = list(start)
    flat = torch.cat([start[k].flatten(1) for k in names], 1)
    trace = [(potential(flat)[0] / n).tolist()]
    if setup.arch != "optunet" or max_epochs == 0:
        return start, {"epochs": 0, "trace": trace, "seconds": 0.0}
    rec = dataclasses.replace(setup.recipe, epochs=block, lr=setup.recipe.lr_at(setup.recipe.epochs - 1),
                              milestones=(), schedule="step", crop_padding=0, flip=False)
    epochs = 0
    bar = _progress.bar(max_epochs, "hmc: polish", enabled=progress)
    while epochs < max_epochs:
        start = _train.train_stacked(start, [s + 7919 + epochs for s in seeds], setup.x, setup.y, rec,
                                     setup.fill, setup.arch)
        epochs += block
        bar.update(block)
        flat = torch.cat([start[k].flatten(1) for k in names], 1)
        trace.append((potential(flat)[0] / n).tolist())
        if max(a - b for a, b in zip(trace[-2], trace[-1], strict=True)) < tol:
            break
    bar.close()
    return start, {"epochs": epochs, "trace": trace, "seconds": round(time.perf_counter() - t0, 2)}


def ggn(setup: Setup, start: Params, images: int = 0) -> tuple[torch.Tensor, int]:
    """The GGN ``(C, D, D)`` (float64) of the summed cross-entropy of every chain at ``start``, on the first
    ``images`` training images (0: all), scaled to all ``N``; and the images used."""
    from symlib.posteriors.laplace import curvature

    m = setup.n_train if images <= 0 else min(images, setup.n_train)
    base = {k: v.to(torch.float64) for k, v in start.items()}
    g, _ = curvature.full_curvature(setup.make_model, base, setup.x[:m], setup.y[:m], arch=setup.arch)
    return g * (setup.n_train / m), m


def ggn_metric(setup: Setup, start: Params, damping: float, images: int = 0) -> tuple[Dense, float]:
    r"""The dense metric :math:`M = G + c I` of every chain, :math:`G` the GGN of the summed cross-entropy
    at ``start`` on the first ``images`` training images (0: all), scaled to all ``N`` (:func:`ggn`).
    Returns the metric and the seconds it took."""
    t0 = time.perf_counter()
    g, m = ggn(setup, start, images)
    met = from_curvature(g, damping, {"metric_images": m, "damping": damping})
    return met, time.perf_counter() - t0


def probes(setup: Setup, n_test: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """The inputs of the invariant functionals: the first ``n_test`` test images of the setup's zoo preset,
    or, for a setup that is not a preset, its first training images. Returns ``(x, y, which)``."""
    from symlib import zoo

    if setup.name in zoo.PRESETS:
        d = zoo.load_data(zoo.preset(setup.name, setup.scale), setup.device)
        if d.x_test is not None and len(d.x_test):
            return d.x_test[:n_test], d.y_test[:n_test], "test"
    return setup.x[:n_test], setup.y[:n_test], "train"


def judge(setup: Setup, draws: torch.Tensor, potential: torch.Tensor, shapes: dict[str, tuple[int, ...]],
          n_test: int, n_probe: int) -> dict[str, Any]:
    """Diagnostics of HMC draws ``(C, S, D)`` on the raw, canonical and invariant scales (JSON-able),
    the per-chain verdict (split R-hat < 1.05 and bulk ESS >= 50 on every invariant functional) and the
    chains' levels (training NLL per example, test log-likelihood and accuracy)."""
    from symlib.stats import convergence, predict
    from symlib.symmetry import trace

    c, s, _ = draws.shape
    params = unflatten(draws.reshape(c * s, -1), shapes)
    stacked = {k: v.reshape(c, s, *v.shape[1:]) for k, v in params.items()}
    x, y, which = probes(setup, n_test)
    arch = "optunet" if setup.arch == "optunet" else setup.make_model
    p = predict.probs(params, x, arch=arch, progress=False).reshape(c, s, x.shape[0], -1)
    funcs = {"potential": potential, **convergence.predictive_functionals(p, y, n_inputs=n_probe)}
    spec = trace.spec_of(setup.make_model().to(torch.float64), tuple(setup.x.shape[1:]))
    rep = convergence.diagnose({k: v.to(torch.float64) for k, v in stacked.items()}, spec, funcs)
    inv = rep["invariant"]
    per_r, per_e = inv.rhat_per_chain.max(1), inv.ess_bulk_per_chain.min(1)
    acc = (p.argmax(-1) == y.to(p.device)).double().mean(-1)  # (C, S)
    lam = setup.prior_precision
    nll = (potential.double() - 0.5 * lam * (draws.double() ** 2).sum(-1)) / setup.n_train
    return {
        "scales": rep.to_json(),
        "probes": which,
        "potential": inv.of("potential"),
        "test_loglik": inv.of("test log-likelihood"),
        "rhat_invariant_per_chain": per_r.tolist(),
        "ess_bulk_invariant_per_chain": per_e.tolist(),
        "chain_converged": [bool(a < PER_CHAIN_RHAT and b >= PER_CHAIN_ESS) for a, b in zip(per_r, per_e,
                                                                                          strict=True)],
        "train_nll_per_chain": nll.mean(1).tolist(),
        "test_loglik_per_chain": np.asarray(funcs["test log-likelihood"]).mean(1).tolist(),
        "test_acc_per_chain": acc.mean(1).tolist(),
        "potential_trace": (potential.double() / setup.n_train).tolist(),
    }
