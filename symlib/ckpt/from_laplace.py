r"""Weight samples of a fitted ``laplace-torch`` approximation as a stacked set (book: "symlib on your own
network").

``laplace-torch`` (Daxberger et al., 2021) fits a Gaussian :math:`\mathcal{N}(\theta_{\mathrm{MAP}},
P^{-1})` around a trained network and draws flat weight vectors from it with ``la.sample(n)``: over every
parameter that requires a gradient (``subset_of_weights="all"``, and ``"subnetwork"``, whose other
entries stay at the MAP), or over the last layer's parameters (``"last_layer"``). :func:`samples` maps
each vector back to the network's ``state_dict`` names, keeping the MAP for everything not sampled (the
other layers of a last-layer Laplace, BatchNorm statistics, frozen parameters), so the result is a stack
of whole networks that :func:`symlib.mmd` compares with a deep ensemble, symmetries removed::

    la = laplace.Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    la.fit(train_loader)
    theta = symlib.ckpt.from_laplace.samples(la, 100)

A function-space approximation (``hessian_structure="gp"``) has no weight posterior: it is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from symlib.ckpt.errors import CheckpointError
from symlib.params import Params

__all__ = ["network", "samples"]


def network(la: Any) -> torch.nn.Module:
    """The network a Laplace approximation was fitted around (for the spec: :func:`symlib.spec_of`)."""
    model = la.model
    inner = getattr(model, "model", None)  # a last-layer Laplace wraps it in laplace's FeatureExtractor
    wrapped = type(model).__name__ == "FeatureExtractor" and isinstance(inner, torch.nn.Module)
    return inner if wrapped else model


def _sampled(la: Any) -> list[tuple[str, torch.Tensor]]:
    """``(state_dict name, parameter)`` of the entries of ``la.sample``'s vectors, in their order."""
    from laplace.lllaplace import LLLaplace

    if isinstance(la, LLLaplace):
        name = getattr(la.model, "_last_layer_name", None)
        if name is None or la.model.last_layer is None:
            raise CheckpointError("this last-layer Laplace approximation is not fitted yet (its last layer "
                                  "is unknown): call la.fit(train_loader) first")
        return [(f"{name}.{n}", p) for n, p in la.model.last_layer.named_parameters()]
    ids = {id(p) for p in la.params}
    return [(n, p) for n, p in la.model.named_parameters() if id(p) in ids]


def samples(la: Any, n_samples: int, generator: torch.Generator | None = None) -> Params:
    """``n_samples`` draws of a fitted Laplace approximation as whole networks ``{name: (n, ...)}``
    (module docstring).

    Args:
        la: a fitted ``laplace.BaseLaplace`` (``Laplace(...)`` then ``la.fit(...)``).
        n_samples: how many draws.
        generator: for ``la.sample`` (reproducible draws).

    Raises:
        CheckpointError: a function-space approximation, or one that is not fitted.
    """
    from laplace.baselaplace import BaseFunctionalLaplace

    if isinstance(la, BaseFunctionalLaplace):
        raise CheckpointError(f"{type(la).__name__} is a function-space approximation: it has no weight "
                              f"posterior to sample; use a weight-space one (hessian_structure diag, kron, "
                              f"full or lowrank)")
    entries = _sampled(la)
    try:
        draws = la.sample(n_samples, generator=generator).detach()
    except (AttributeError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{type(la).__name__}.sample failed ({type(e).__name__}: {e}); fit the "
                              f"approximation first: la.fit(train_loader)") from None
    total = sum(p.numel() for _, p in entries)
    if draws.ndim != 2 or draws.shape[1] != total:
        raise CheckpointError(f"{type(la).__name__}.sample gave shape {tuple(draws.shape)}, expected "
                              f"({n_samples}, {total}) for the parameters {[n for n, _ in entries][:4]}...")
    net = network(la)
    sampled, at = {}, 0
    for name, p in entries:
        sampled[name] = draws[:, at:at + p.numel()].reshape(n_samples, *p.shape).to(p.dtype)
        at += p.numel()
    state = net.state_dict(keep_vars=True)
    by_id = {id(p): sampled[n] for n, p in entries if n in sampled}
    out = {}
    for k, v in state.items():
        if k in sampled:
            out[k] = sampled[k].to(v.device).clone()
        elif id(v) in by_id:  # a name tied to a sampled parameter
            out[k] = by_id[id(v)].to(v.device).clone()
        else:  # not sampled: the MAP, for every draw
            out[k] = v.detach().unsqueeze(0).expand(n_samples, *v.shape).clone()
    return out
