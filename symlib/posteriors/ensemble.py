r"""Deep ensembles (Lakshminarayanan et al. 2017; book: chapter "Table 1", paper §4, App. B).

The posterior is approximated by independently trained checkpoints:
:math:`\theta_s \sim` SGD from the initialisation and data order of seed :math:`s`. The paper's DE row uses
100 checkpoints other than the 1,000 of the target, so its MMD to the target is zero up to noise.

Every member is its own mode: ``n_modes x n_per_mode`` members are trained (all stacked for OptuNet) with
the seeds :func:`symlib.posteriors.sampling.base_seeds` (``1e9 + 1e5 * seed + i``, disjoint from the zoo's
``0 .. N - 1``); ``n_modes`` only labels them, so ``(1, 100)`` and ``(10, 10)`` hold the same 100 networks.
The first ``n_modes`` members are the base models that SWAG, Laplace and SGHMC start from.
"""

from __future__ import annotations

import dataclasses

from symlib.posteriors import sampling
from symlib.posteriors.base import Params, SampleSet, Setup


def sample(
    setup: Setup,
    n_modes: int,
    n_per_mode: int,
    seed: int = 0,
    *,
    base: Params | None = None,
    progress: bool = True,
) -> SampleSet:
    """Train ``n_modes * n_per_mode`` independent networks with the setup's recipe.

    Args:
        setup: the training problem.
        n_modes, n_per_mode: sizes; every sample is an independently trained network.
        seed: run seed (member ``i`` has seed ``base_seeds(n, seed)[i]``).
        base: must be ``None`` (an ensemble trains its own members).
        progress: progress bar.

    Returns:
        The members as a :class:`SampleSet` (``method="ensemble"``).
    """
    sampling.check_sizes(n_modes, n_per_mode)
    sampling.forbid_base(base, "a deep ensemble")
    seeds = sampling.base_seeds(n_modes * n_per_mode, seed)
    params = sampling.train_models(setup, seeds, progress=progress, desc="deep ensemble")
    return SampleSet(
        params=params,
        method="ensemble",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper={"recipe": dataclasses.asdict(setup.recipe), "member_seeds": seeds},
        base_seeds=seeds[:n_modes],
    )
