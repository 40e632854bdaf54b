r"""Converged Bayesian posteriors of small networks, the gold standard of the gentle example (book: chapter "A
gentle example"; beyond the paper).

The paper calls 10,000 independently trained perceptrons a sample of the posterior. Here the posterior
itself is sampled where the network is small enough to do it properly: replica-exchange HMC
(:func:`symlib.posteriors.hmc.tempering.run_tempered`) on

.. math:: p(\theta \mid D) \propto \exp(-L(\theta)) \, \mathcal N(\theta; 0, \sigma_p^2 I),

temperature 1, the full training set, and a Gaussian prior of standard deviation :math:`\sigma_p` on
every weight and bias (:class:`Problem`):

* ``"perceptron"``: the gentle example's 2-2-1 ReLU perceptron (9 parameters) on its 400 points,
  Bernoulli likelihood (the binary cross-entropy on the logit, summed), :math:`\sigma_p = 1`;
* ``"mlp"``: the 10-16-16-1 ReLU MLP of chapter "The posterior's marginals" (465 parameters) on the 442
  standardised diabetes patients, Gaussian likelihood with the noise standard deviation fixed to the
  residual standard deviation of the least-squares linear fit (:func:`noise_sd`), :math:`\sigma_p = 1`.

:func:`posterior` runs the sampler with the settings of a scale (:data:`SETTINGS`) and caches the draws
in the zoo cache (``<cache>/reference/<name>-<hash>``, the hash of the problem, the settings and the
data), so the book pays for them once. :func:`outputs` evaluates stacked draws on inputs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Any

import numpy as np
import torch

from symlib import scales as _scales
from symlib import store
from symlib.params import Params, flatten, unflatten
from symlib.posteriors.hmc import potentials as _pot
from symlib.posteriors.hmc import tempering as _temp

__all__ = ["PROBLEMS", "SETTINGS", "Problem", "Reference", "Settings", "describe", "flat_draws",
           "local_chains", "noise_sd", "outputs", "posterior"]


@dataclasses.dataclass(frozen=True)
class Problem:
    """A Bayesian small-MLP problem: architecture, likelihood and Gaussian prior, at temperature 1."""

    name: str
    widths: tuple[int, ...]
    likelihood: str  # "bernoulli" or "gaussian"
    prior_sd: float = 1.0
    noise_sd: float | None = None  # gaussian only; None: noise_sd(x, y)


PROBLEMS = {
    "perceptron": Problem("perceptron", (2, 2, 1), "bernoulli"),
    "mlp": Problem("mlp", (10, 16, 16, 1), "gaussian"),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Replica-exchange settings: ``n_chains`` independent ladders of ``n_temperatures`` replicas from
    :math:`\\beta = 1` down to ``beta_min`` (geometric), ``n_warmup`` adaptation rounds, ``n_samples``
    kept rounds per chain (every ``thin``-th), ``n_leapfrog`` steps per trajectory."""

    n_chains: int
    n_temperatures: int
    beta_min: float
    n_warmup: int
    n_samples: int
    n_leapfrog: int
    thin: int = 1
    seed: int = 0


# The perceptron: 4 chains x 1,000 draws after 200 warm-up rounds, 8 temperatures down to 1 / 100 (where the
# replica nearly samples the prior). Measured on 2 loaded cores: swap acceptance 0.49-0.65 between all
# neighbours, 54-71 round trips per chain, R-hat < 1.005 and bulk ESS > 2,000 on canonical weights and
# invariant functionals, about 17 CPU-seconds. The MLP: a run of the same kind sized to about a minute; a
# 25-minute trial (12 temperatures down to 1e-3, 500 draws, 16 leapfrog steps) did not converge either
# (R-hat 1.8 on canonical weights, swap acceptance 0.02 between the two coldest replicas, no round trip).
SETTINGS = {
    "perceptron": {
        "tiny": Settings(4, 4, 0.05, 30, 100, 8),
        "cpu": Settings(4, 8, 0.01, 200, 1000, 10),
        "paper": Settings(8, 8, 0.01, 500, 4000, 10),
    },
    "mlp": {
        "tiny": Settings(4, 4, 0.05, 20, 40, 8),
        "cpu": Settings(4, 8, 0.01, 100, 200, 10),
        "paper": Settings(8, 16, 0.001, 1000, 4000, 16),
    },
}


def noise_sd(x: torch.Tensor, y: torch.Tensor) -> float:
    """The residual standard deviation of the least-squares linear fit (with intercept) of ``y`` on ``x``,
    ddof = number of coefficients."""
    xs, ys = x.detach().double().cpu().numpy(), y.detach().double().cpu().numpy()
    a = np.hstack([xs, np.ones((xs.shape[0], 1))])
    coef, *_ = np.linalg.lstsq(a, ys, rcond=None)
    r = ys - a @ coef
    return float(np.sqrt((r @ r) / (len(r) - a.shape[1])))


@dataclasses.dataclass
class Reference:
    """Draws of a converged (or attempted) posterior.

    Attributes:
        draws: ``{name: (C, S, ...)}`` float64, keys of :class:`symlib.models.MLP`.
        potential, nll: ``(C, S)``: :math:`U` and :math:`L` of every draw.
        sampler: the replica-exchange diagnostics (swap rates, round trips, acceptance, gradients, seconds).
        problem, settings: what was sampled and how (JSON).
        cached: whether the draws were loaded from the cache.
    """

    draws: Params
    potential: torch.Tensor
    nll: torch.Tensor
    sampler: dict[str, Any]
    problem: dict[str, Any]
    settings: dict[str, Any]
    cached: bool = False

    @property
    def n_chains(self) -> int:
        return int(self.potential.shape[0])

    def flat(self) -> Params:
        """The draws of all chains as one stack ``{name: (C S, ...)}``, chain-major."""
        return {k: v.flatten(0, 1) for k, v in self.draws.items()}


def outputs(params: Params, x: torch.Tensor) -> torch.Tensor:
    """The output (logit or regression mean) of stacked MLPs ``{name: (M, ...)}`` on inputs ``x (N, d)``:
    ``(M, N)``, float64."""
    n_layers = len(params) // 2
    h = x.to(torch.float64).expand(next(iter(params.values())).shape[0], *x.shape)
    for i in range(n_layers):
        w, b = params[f"{2 * i}.weight"].double(), params[f"{2 * i}.bias"].double()
        h = torch.baddbmm(b.unsqueeze(1), h, w.transpose(1, 2))
        if i < n_layers - 1:
            h = torch.relu(h)
    return h[..., 0]


def _key(problem: Problem, settings: Settings, x: torch.Tensor, y: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"problem": dataclasses.asdict(problem), "settings": dataclasses.asdict(settings),
                         "format": 1}, sort_keys=True).encode())
    for t in (x, y):
        h.update(t.detach().cpu().double().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def posterior(
    x: torch.Tensor,
    y: torch.Tensor,
    problem: str | Problem = "perceptron",
    scale: str = "cpu",
    settings: Settings | None = None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = False,
) -> Reference:
    """Sample (or load) the posterior of a small MLP by replica-exchange HMC.

    Args:
        x, y: the training data (labels in {0, 1} for ``"bernoulli"``).
        problem: a name of :data:`PROBLEMS` or a :class:`Problem`.
        scale: picks :data:`SETTINGS` (``tiny``, ``cpu``, ``paper``) unless ``settings`` is given.
        cache_dir: the zoo cache (default ``$SYMLIB_CACHE``); the draws live under ``reference/``.
        progress: progress bar.
    """
    from symlib import zoo

    prob = PROBLEMS[problem] if isinstance(problem, str) else problem
    if prob.likelihood == "gaussian" and prob.noise_sd is None:
        prob = dataclasses.replace(prob, noise_sd=noise_sd(x, y))
    if settings is None:
        settings = _scales.pick(scale, **SETTINGS[prob.name])
    x, y = x.to(torch.float64), y.to(torch.float64)
    folder = zoo.cache_dir(cache_dir) / "reference" / f"{prob.name}-{_key(prob, settings, x, y)}"
    shapes = _pot.mlp_shapes(prob.widths)
    file = folder / "draws.safetensors"
    if (folder / store.MANIFEST).exists() and file.exists():
        man = json.loads((folder / store.MANIFEST).read_text())
        from safetensors.torch import load_file

        t = load_file(str(file))
        c, s = t["potential"].shape
        flat = unflatten(t["draws"].flatten(0, 1), shapes)
        draws = {k: v.reshape(c, s, *v.shape[1:]) for k, v in flat.items()}
        return Reference(draws, t["potential"], t["nll"], man["sampler"], man["problem"], man["settings"],
                         cached=True)
    lik, _ = _pot.mlp_likelihood(prob.widths, x, y, prob.likelihood, prob.noise_sd or 1.0)
    gen = torch.Generator().manual_seed(settings.seed)
    d = sum(int(np.prod(s)) for s in shapes.values())
    # every replica starts from its own draw of the prior
    theta0 = prob.prior_sd * torch.randn(settings.n_temperatures, settings.n_chains, d, generator=gen,
                                         dtype=torch.float64)
    t0 = time.perf_counter()
    res = _temp.run_tempered(
        lik, 1.0 / prob.prior_sd**2, theta0,
        _temp.geometric_ladder(settings.n_temperatures, settings.beta_min),
        settings.n_warmup, settings.n_samples, settings.n_leapfrog, settings.thin,
        seed=settings.seed + 1, progress=progress,
    )
    sampler = {**res.diagnostics(), "seconds": round(time.perf_counter() - t0, 2)}
    c, s = res.potential.shape
    draws = {k: v.reshape(c, s, *v.shape[1:]) for k, v in unflatten(res.draws.flatten(0, 1), shapes).items()}
    folder.mkdir(parents=True, exist_ok=True)
    store.atomic_save({"draws": res.draws, "potential": res.potential, "nll": res.nll}, file,
                      {"format": "symlib-reference/1"})
    store.write_manifest(folder, {"kind": "reference", "problem": dataclasses.asdict(prob),
                                  "settings": dataclasses.asdict(settings), "sampler": sampler})
    return Reference(draws, res.potential, res.nll, sampler, dataclasses.asdict(prob),
                     dataclasses.asdict(settings))


def local_chains(x: torch.Tensor, y: torch.Tensor, start: Params, problem: str | Problem = "perceptron",
                 n_warmup: int = 200, n_samples: int = 1000, n_leapfrog: int = 10,
                 seed: int = 0) -> Reference:
    """Plain HMC at temperature 1 (no tempering) from given starting networks ``start {name: (C, ...)}``:
    each chain explores the mode it starts in (for the symmetry-aware diagnostics' demonstration)."""
    from symlib.posteriors.hmc import sampler as _sampler

    prob = PROBLEMS[problem] if isinstance(problem, str) else problem
    if prob.likelihood == "gaussian" and prob.noise_sd is None:
        prob = dataclasses.replace(prob, noise_sd=noise_sd(x, y))
    lik, shapes = _pot.mlp_likelihood(prob.widths, x.double(), y.double(), prob.likelihood,
                                      prob.noise_sd or 1.0)
    lam = 1.0 / prob.prior_sd**2
    theta0 = flatten({k: start[k].double() for k in shapes})
    res = _sampler.run_chains(_pot.with_prior(lik, lam), theta0, n_warmup, n_samples, n_leapfrog, seed=seed,
                              progress=False)
    c, s = res.potential.shape
    draws = {k: v.reshape(c, s, *v.shape[1:]) for k, v in unflatten(res.draws.flatten(0, 1), shapes).items()}
    nll = res.potential - 0.5 * lam * (res.draws**2).sum(-1)
    sampler = {k: v for k, v in res.diagnostics().items() if k in (
        "accept_prob", "divergences", "step_size", "n_leapfrog", "n_grad", "seconds")}
    return Reference(draws, res.potential, nll, sampler, dataclasses.asdict(prob),
                     {"n_chains": c, "n_warmup": n_warmup, "n_samples": n_samples, "n_leapfrog": n_leapfrog,
                      "seed": seed, "tempering": False})


def describe(params: Params, x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor,
             y_test: torch.Tensor) -> dict[str, float]:
    """What a set of binary-classifier MLPs ``{name: (M, ...)}`` looks like as functions and as weights: mean
    training and test cross-entropy of single networks, test cross-entropy and accuracy of their averaged
    prediction, mean confidence on the test points, the share with a hidden neuron dead on every training
    point, and the median squared weight norm."""
    f_tr, f_te = outputs(params, x), outputs(params, x_test)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    y_tr, y_te = y.double().expand_as(f_tr), y_test.double().expand_as(f_te)
    p = torch.sigmoid(f_te).mean(0)
    w, b = params["0.weight"].double(), params["0.bias"].double()
    pre = torch.baddbmm(b.unsqueeze(1), x.double().expand(w.shape[0], *x.shape), w.transpose(1, 2))
    dead = (pre <= 0).all(1).any(1)
    norm = sum((v.double() ** 2).flatten(1).sum(1) for v in params.values())
    return {
        "train NLL (one network)": float(bce(f_tr, y_tr, reduction="none").mean()),
        "test NLL (one network)": float(bce(f_te, y_te, reduction="none").mean()),
        "test NLL (averaged prediction)": float(torch.nn.functional.binary_cross_entropy(p, y_test.double())),
        "test accuracy (averaged prediction)": float(((p > 0.5).double() == y_test.double()).double().mean()),
        "mean confidence max(p, 1 - p)": float(torch.maximum(p, 1 - p).mean()),
        "share with a dead hidden neuron": float(dead.double().mean()),
        "median squared weight norm": float(norm.median()),
    }


def flat_draws(ref: Reference) -> torch.Tensor:
    """``(C, S, D)`` flat draws of a :class:`Reference`."""
    c, s = ref.potential.shape
    return flatten(ref.flat()).reshape(c, s, -1)
