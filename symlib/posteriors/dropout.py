r"""Monte-Carlo dropout (Gal & Ghahramani 2016; book: chapter "Table 1", paper App. B.1-B.2).

Networks are trained with dropout before their last layer (OptuNet: p = 0.2 on the 10 pooled features;
ResNet-18: p = 0.5 on the pooled features, "last-layer dropout"), and dropout stays on at test time. A
posterior sample is one dropout mask :math:`m \in \{0, 1\}^{d}` (:math:`m_j \sim \mathrm{Bernoulli}(1 - p)`)
folded into the weights: with features :math:`h`, the masked network computes

.. math:: W \Big(h \odot \frac{m}{1 - p}\Big) + b = \Big(W \operatorname{diag}\frac{m}{1 - p}\Big) h + b,

so the sample is the trained network with last-layer weight :math:`W' = W \operatorname{diag}(m / (1 - p))`
and every other tensor unchanged: a full weight set, evaluated with dropout off, that gives exactly the
masked network's outputs (:func:`fold`).

One-mode: one network, ``n_per_mode`` masks; multi-mode: ``n_modes`` networks (seeds
:func:`symlib.posteriors.sampling.base_seeds`, trained stacked for OptuNet), ``n_per_mode`` masks each.
"""

from __future__ import annotations

import dataclasses

import torch

from symlib.posteriors import sampling
from symlib.posteriors.base import Params, SampleSet, Setup

DEFAULT_P = {"optunet": 0.2, "resnet18": 0.5, "resnet20": 0.5}


def fold(params: Params, masks: torch.Tensor, p: float) -> Params:
    r"""Fold dropout masks into the last layer: :math:`W'_s = W \operatorname{diag}(m_s / (1 - p))`.

    Args:
        params: one model's state dict (``fc.weight`` is ``(classes, d)``).
        masks: ``(S, d)`` keep-indicators (0 or 1).
        p: the dropout probability.

    Returns:
        ``S`` stacked state dicts ``{name: (S, ...)}``.
    """
    if "fc.weight" not in params:
        raise ValueError(f"no last layer 'fc.weight' to fold dropout masks into; tensors {sorted(params)}")
    n = masks.shape[0]
    out = {k: v.unsqueeze(0).expand(n, *v.shape).clone() for k, v in params.items()}
    w = params["fc.weight"]
    out["fc.weight"] = w.unsqueeze(0) * (masks.to(w.dtype) / (1.0 - p)).unsqueeze(1)
    return out


def sample(
    setup: Setup,
    n_modes: int,
    n_per_mode: int,
    seed: int = 0,
    *,
    base: Params | None = None,
    progress: bool = True,
    p: float | None = None,
) -> SampleSet:
    """Train ``n_modes`` networks with last-layer dropout and fold ``n_per_mode`` masks into each.

    Args:
        setup: the training problem (its recipe trains the dropout networks).
        n_modes, n_per_mode: sizes.
        seed: run seed (network seeds :func:`~symlib.posteriors.sampling.base_seeds`; masks
            from :func:`~symlib.posteriors.sampling.stream_seeds`).
        base: must be ``None`` (base models trained without dropout are not MC-dropout models).
        progress: progress bar.
        p: dropout probability (default 0.2 for OptuNet, 0.5 for ResNets, paper App. B.1).

    Returns:
        The folded samples (``method="dropout"``).

    Raises:
        ValueError: if the architecture has no dropout layer before its last layer, or ``p`` is not in
            ``(0, 1)``.
    """
    sampling.check_sizes(n_modes, n_per_mode)
    sampling.forbid_base(base, "MC dropout")
    with torch.device("meta"):
        sampling.last_dropout(setup.make_model())  # raises for a model without dropout
    p = DEFAULT_P.get(setup.arch) if p is None else p
    if p is None:
        raise ValueError(f"no default dropout rate for {setup.arch!r}; pass p")
    if isinstance(p, bool) or not (isinstance(p, (int, float)) and 0.0 < p < 1.0):
        raise ValueError(f"dropout probability p must be in (0, 1), got {p!r}")
    seeds = sampling.base_seeds(n_modes, seed)
    train_seed, mask_seed = sampling.stream_seeds(2, seed, "dropout")
    trained = sampling.train_models(
        setup, seeds, dropout=p, progress=progress, desc=f"dropout p={p}", mask_seed=train_seed
    )
    gen = sampling.generator(mask_seed, "cpu")
    width = trained["fc.weight"].shape[-1]
    parts = []
    for i in range(n_modes):
        masks = (torch.rand(n_per_mode, width, generator=gen) >= p).to(setup.device)
        parts.append(fold(sampling.unstack(trained, i), masks, p))
    params = {k: torch.cat([q[k] for q in parts]) for k in parts[0]}
    return SampleSet(
        params=params,
        method="dropout",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper={"p": p, "where": "before the last layer", "recipe": dataclasses.asdict(setup.recipe)},
        base_seeds=seeds,
    )
