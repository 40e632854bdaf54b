r"""Deep ensembles (Lakshminarayanan et al. 2017; book: chapter "Table 1", paper §4, App. B).

The posterior is approximated by independently trained checkpoints:
:math:`\theta_s \sim` SGD from the initialisation and data order of seed :math:`s`. The paper's DE row uses
100 checkpoints other than the 1,000 of the target, so its MMD to the target is zero up to noise.

Every member is its own mode: ``n_modes x n_per_mode`` members are trained (all stacked for OptuNet) with
the seeds :func:`symlib.posteriors.seeds.base_seeds` (``1e9 + 1e5 * seed + i``, disjoint from the zoo's
``0 .. N - 1``); ``n_modes`` only labels them, so ``(1, 100)`` and ``(10, 10)`` hold the same 100 networks.
The first ``n_modes`` members are the base models that SWAG, Laplace and SGHMC start from.
"""

from __future__ import annotations

import dataclasses

from symlib.posteriors.base import Method, Request, SampleSet
from symlib.posteriors.seeds import base_seeds
from symlib.posteriors.sgd import train_models

__all__ = ["METHOD", "sample"]


def _draw(req: Request) -> SampleSet:
    """Train ``n_modes * n_per_mode`` independent networks with the setup's recipe (member ``i`` has seed
    ``base_seeds(n, seed)[i]``); ``n_modes`` only labels them.

    Returns:
        The members as a :class:`~symlib.posteriors.base.SampleSet` (``method="ensemble"``).
    """
    seeds = base_seeds(req.n_modes * req.n_per_mode, req.seed)
    params = train_models(req.setup, seeds, progress=req.progress, desc="deep ensemble")
    return SampleSet(
        params=params,
        method="ensemble",
        n_modes=req.n_modes,
        n_per_mode=req.n_per_mode,
        hyper={"recipe": dataclasses.asdict(req.setup.recipe), "member_seeds": seeds},
        base_seeds=seeds[: req.n_modes],
    )


METHOD = Method("ensemble", _draw, base="forbidden")
sample = METHOD.sampler()
