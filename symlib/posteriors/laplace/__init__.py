r"""The Laplace approximation as a posterior sample set (book: chapter "Table 1"; paper §4, App. B).

Around a trained network :math:`\theta^*` (a *mode*), the Laplace approximation is the Gaussian
:math:`\mathcal N(\theta^*, P^{-1})` whose precision is the curvature of the negative log posterior,

.. math:: P = \sum_{n=1}^N J_n^\top \Lambda_n J_n + \lambda I, \qquad
          \Lambda_n = \mathrm{diag}(p_n) - p_n p_n^\top,

with :math:`J_n = \partial \ell(x_n; \theta) / \partial \theta` the Jacobian of the logits and
:math:`p_n = \mathrm{softmax}(\ell_n)`: the generalised Gauss-Newton matrix (GGN) of the cross-entropy,
which for a softmax likelihood is also its Fisher. As in laplace-torch (Daxberger et al. 2021), whose
log posterior is :math:`\sum_n \log p(y_n \mid x_n, \theta) + \log p(\theta)`, the curvature is *summed*
over the training set, not averaged, and the prior is :math:`\mathcal N(0, \lambda^{-1} I)`.

Two structures, as in the paper (App. B.2-B.3; NOTES "Methods of Table 1"):

* ``structure="full"`` (OptuNet): the dense :math:`392 \times 392` GGN over all parameters, what
  laplace-torch's ``Laplace(model, "classification", subset_of_weights="all",
  hessian_structure="full")`` computes (its backends return the GGN for that call: the paper's "full
  Hessian" is most likely this full GGN, our default). ``hessian="full"`` gives the exact Hessian of the
  summed cross-entropy instead (:func:`full_curvature`); it is indefinite away from an exact minimum, so
  it can fail where the GGN cannot. For OptuNet both are assembled from per-example feature Jacobians
  (and, for the Hessian, the features' only non-vanishing second derivatives) written by hand
  (:mod:`symlib.posteriors.laplace.optunet`, exact, float64, batched over the modes): seconds for 10
  modes on 4,000 digits. Other small networks use ``torch.func`` (``vmap`` of ``jacrev``, or ``hessian``).
* ``structure="kron"`` (ResNet-18): last-layer KFAC (Ritter et al. 2018), laplace-torch's
  ``subset_of_weights="last_layer", hessian_structure="kron"``: the network in eval mode is a fixed
  feature map :math:`a_n`, and the last layer's GGN is approximated by Kronecker factors
  :math:`G \otimes A` with :math:`G = \sum_n \Lambda_n` and :math:`A = \tfrac1N \sum_n a_n a_n^\top`
  (weights flattened row-major, :math:`W_{oi} \mapsto o \cdot d_{in} + i`). laplace-torch (curvlinops
  backend, ``separate_weight_and_bias=True``) gives the bias its own block :math:`G` (``bias="separate"``,
  our default); ``bias="augmented"`` uses one factor :math:`G \otimes \bar A` on :math:`[W \mid b]`
  with :math:`\bar a_n = (a_n, 1)`. The prior is added *exactly* to the eigenvalues of the Kronecker
  product, as laplace-torch's ``KronDecomposed`` does: :math:`P = (Q_G \otimes Q_A)\,
  (\mathrm{diag}(g \otimes a) + \lambda)\,(Q_G \otimes Q_A)^\top`. Samples perturb only the last layer;
  the rest of the state dict (BatchNorm buffers included) is the base model's.

**Prior precision.** Default (``prior_precision=None``): :math:`\lambda = N \cdot wd` from the recipe's
weight decay (:attr:`~symlib.posteriors.base.Setup.prior_precision`), the prior SGD with weight decay
finds the mode of. (laplace-torch's own default is :math:`\lambda = 1`.) ``tune="marglik"`` instead
maximises the Laplace evidence over a scalar :math:`\lambda` per mode (:func:`tune_prior_precision`).

The GGN is singular: the network's function does not change along its symmetries' orbits (OptuNet's
positive rescalings across ReLU / max-pool, the softmax's shift of all logits), so those directions have
zero curvature and posterior variance :math:`1 / \lambda`, the prior's: the prior alone sets how far
the samples spread along the symmetries.

**Samples.** :math:`\theta = \theta^* + L^{-\top} z` with :math:`P = L L^\top` (Cholesky) and
:math:`z \sim \mathcal N(0, I)`, so :math:`\mathrm{Cov}\,\theta = P^{-1}`; KFAC samples in the
eigenbasis, :math:`P^{-1/2} z`. Every sample is a full state dict.
"""


from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from symlib import scales as _scales
from symlib.posteriors.base import Method, Request, SampleSet
from symlib.posteriors.laplace import curvature, evidence, kfac, optunet
from symlib.posteriors.laplace.curvature import HESSIANS, full_curvature
from symlib.posteriors.laplace.evidence import (
    check_prior_precision,
    log_marginal_likelihood,
    tune_prior_precision,
)
from symlib.posteriors.laplace.kfac import BIAS, KronFactors, KronPosterior, kron_factors, last_layer_name

STRUCTURES = ("full", "kron")
DEFAULT_STRUCTURE = {"optunet": "full", "mlp": "full", "resnet18": "kron", "resnet20": "kron"}
_LAPLACE_TORCH = {"full": ("all", "full"), "kron": ("last_layer", "kron")}

__all__ = [
    "BIAS",
    "DEFAULT_STRUCTURE",
    "HESSIANS",
    "METHOD",
    "STRUCTURES",
    "KronFactors",
    "KronPosterior",
    "check_prior_precision",
    "curvature",
    "evidence",
    "full_curvature",
    "kfac",
    "kron_factors",
    "last_layer_name",
    "log_marginal_likelihood",
    "optunet",
    "sample",
    "tune_prior_precision",
]


def _seed_of(seed: int) -> int:
    _scales.check_int("seed", seed, 0)
    return int(
        np.random.SeedSequence([int(seed), zlib.crc32(b"laplace")]).generate_state(1, np.uint64)[0] >> 1
    )


def _check(*, structure: str | None = None, hessian: str = "ggn", prior_precision: float | None = None,
           tune: str | None = None, bias: str = "separate", **_: object) -> None:
    """The values of the Laplace hyper-parameters that do not depend on the setup."""
    if structure is not None and structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    if hessian not in HESSIANS:
        raise ValueError(f"hessian must be one of {HESSIANS}, got {hessian!r}")
    if hessian == "full" and structure not in (None, "full"):
        raise ValueError("hessian='full' (exact Hessian) needs structure='full'; last-layer KFAC is a GGN")
    if bias not in BIAS:
        raise ValueError(f"bias must be one of {BIAS}, got {bias!r}")
    if tune not in (None, "marglik"):
        raise ValueError(f"tune must be None or 'marglik', got {tune!r}")
    if prior_precision is not None:
        check_prior_precision(prior_precision)


def _draw(
    req: Request,
    *,
    structure: str | None = None,
    hessian: str = "ggn",
    prior_precision: float | None = None,
    tune: str | None = None,
    marglik_range: tuple[float, float] = (1e-6, 1e8),
    bias: str = "separate",
    last_layer: str | None = None,
    chunk_size: int | None = None,
    base_seeds: Sequence[int] | None = None,
) -> SampleSet:
    r"""Laplace approximations around ``n_modes`` trained base models, ``n_per_mode`` samples each.

    The setup's data is the data of the curvature; the seed seeds the Gaussian draws.

    Args:
        structure: ``"full"`` (all weights, dense; default for OptuNet and MLPs) or ``"kron"`` (last-layer
            KFAC; default for the ResNets).
        hessian: ``"ggn"`` (default, laplace-torch's) or ``"full"`` (exact Hessian; ``structure="full"``).
        prior_precision: :math:`\lambda`; default ``setup.prior_precision`` (:math:`N \cdot wd`).
        tune: ``None`` (default: keep :math:`\lambda`) or ``"marglik"`` (maximise the Laplace evidence
            over a scalar :math:`\lambda`, per mode, within ``marglik_range``).
        marglik_range: the search range of ``tune="marglik"``.
        bias: KFAC's bias: ``"separate"`` (laplace-torch) or ``"augmented"``.
        last_layer: name of the last ``nn.Linear`` (default: found).
        chunk_size: images per chunk of the curvature pass.
        base_seeds: the base models' seeds, recorded in the manifest.

    Returns:
        ``SampleSet(method="laplace")``; ``diagnostics`` holds per mode the prior precision used, the log
        marginal likelihood, the mean training loss, the smallest curvature eigenvalue and the mean
        marginal posterior standard deviation.

    Raises:
        ValueError: no or wrong base models, a non-positive prior precision, bad options.
        FloatingPointError: a non-finite curvature.
        torch.linalg.LinAlgError: a posterior precision that is not positive definite (``hessian="full"``
            at SGD-trained OptuNets: the exact Hessian has eigenvalues near -2e3 there).
    """
    setup, n_modes, n_per_mode, base = req.setup, req.n_modes, req.n_per_mode, req.base
    structure = DEFAULT_STRUCTURE.get(setup.arch, "kron") if structure is None else structure
    _check(structure=structure, hessian=hessian, bias=bias, tune=tune)
    if hessian == "full" and structure != "full":
        raise ValueError("hessian='full' (exact Hessian) needs structure='full'; last-layer KFAC is a GGN")
    if prior_precision is None and tune is None:
        lam0, source = check_prior_precision(setup.prior_precision), "weight_decay"
    elif prior_precision is not None:
        lam0, source = check_prior_precision(prior_precision), "given"
    else:
        lam0, source = None, "marglik"
    if tune == "marglik":
        source = "marglik"

    def lam_of(eigs: torch.Tensor, sq: float) -> float:
        return tune_prior_precision(eigs, sq, marglik_range) if tune else lam0

    gen = torch.Generator().manual_seed(_seed_of(req.seed))
    out = {k: v.repeat_interleave(n_per_mode, 0).clone() for k, v in base.items()}
    fits = evidence.Fits()
    if structure == "full":
        curvature.sample_full(setup, base, n_per_mode, gen, out, fits, hessian=hessian, lam_of=lam_of,
                              chunk_size=chunk_size, progress=req.progress)
    else:
        model_name = kfac.sample_kron(setup, base, n_per_mode, gen, out, fits, lam_of=lam_of,
                                      last_layer=last_layer, bias=bias, chunk_size=chunk_size,
                                      progress=req.progress)
    subset, hstruct = _LAPLACE_TORCH[structure]
    hyper: dict[str, Any] = {
        "structure": structure,
        "subset_of_weights": subset,
        "hessian_structure": hstruct,
        "hessian": hessian,
        "prior_precision": lam0,
        "prior_source": source,
        "tune": tune,
        "marglik_range": list(marglik_range) if tune else None,
        "n_train": setup.n_train,
        "likelihood": "classification (softmax cross-entropy), curvature summed over the training set",
    }
    if structure == "kron":
        hyper.update(bias=bias, last_layer=model_name)
    return SampleSet(
        params=out,
        method="laplace",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper=hyper,
        base_seeds=[int(s) for s in base_seeds] if base_seeds is not None else [],
        diagnostics=dataclasses.asdict(fits),
    )


METHOD = Method("laplace", _draw, base="required", check=_check)
sample = METHOD.sampler()
