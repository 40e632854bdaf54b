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
:func:`symlib.posteriors.seeds.base_seeds`, trained stacked for OptuNet), ``n_per_mode`` masks each.
"""

from __future__ import annotations

import dataclasses

import torch

from symlib.params import Params, unstack
from symlib.posteriors.base import Method, Request, SampleSet
from symlib.posteriors.modules import last_dropout
from symlib.posteriors.seeds import base_seeds, generator, stream_seeds
from symlib.posteriors.sgd import train_models

__all__ = ["DEFAULT_P", "METHOD", "fold", "sample"]

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


def _check(*, p: float | None = None) -> None:
    """The dropout rate, when given: in ``(0, 1)``."""
    if p is not None and (isinstance(p, bool) or not (isinstance(p, (int, float)) and 0.0 < p < 1.0)):
        raise ValueError(f"dropout probability p must be in (0, 1), got {p!r}")


def _draw(req: Request, *, p: float | None = None) -> SampleSet:
    """Train ``n_modes`` networks with last-layer dropout and fold ``n_per_mode`` masks into each.

    Network seeds are :func:`~symlib.posteriors.seeds.base_seeds`; the training masks and the folded masks
    come from :func:`~symlib.posteriors.seeds.stream_seeds`.

    Args:
        p: dropout probability (default 0.2 for OptuNet, 0.5 for ResNets, paper App. B.1).

    Returns:
        The folded samples (``method="dropout"``).

    Raises:
        ValueError: if the architecture has no dropout layer before its last layer, or ``p`` is not in
            ``(0, 1)``.
    """
    setup, n_modes, n_per_mode = req.setup, req.n_modes, req.n_per_mode
    with torch.device("meta"):
        last_dropout(setup.make_model())  # raises for a model without dropout
    p = DEFAULT_P.get(setup.arch) if p is None else p
    if p is None:
        raise ValueError(f"no default dropout rate for {setup.arch!r}; pass p")
    _check(p=p)
    seeds = base_seeds(n_modes, req.seed)
    train_seed, mask_seed = stream_seeds(2, req.seed, "dropout")
    trained = train_models(
        setup, seeds, dropout=p, progress=req.progress, desc=f"dropout p={p}", mask_seed=train_seed
    )
    gen = generator(mask_seed, "cpu")
    width = trained["fc.weight"].shape[-1]
    parts = []
    for i in range(n_modes):
        masks = (torch.rand(n_per_mode, width, generator=gen) >= p).to(setup.device)
        parts.append(fold(unstack(trained, i), masks, p))
    params = {k: torch.cat([q[k] for q in parts]) for k in parts[0]}
    return SampleSet(
        params=params,
        method="dropout",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper={"p": p, "where": "before the last layer", "recipe": dataclasses.asdict(setup.recipe)},
        base_seeds=seeds,
    )


METHOD = Method("dropout", _draw, base="forbidden", check=_check)
sample = METHOD.sampler()
