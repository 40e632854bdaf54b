r"""Redundant directions among the biases of a transformer outside attention (book: chapter "Transformers:
permutations without scalings"; page "Architectures").

A vector :math:`\delta \in \mathbb{R}^d` that one parameter adds to every token and another subtracts again
changes no token, so it moves the weights without changing the function:

* **a class token against its position embedding** (timm's and Hugging Face's ViT, the book's TinyViT):
  token 0 is :math:`x_0 = c + p_0`, so :math:`c \to c + \delta,\ p_0 \to p_0 - \delta` keeps it
  (:math:`d` dimensions; as many for a distillation token against :math:`p_1`);
* **a patch embedding's bias against the patch tokens' position embeddings**: patch token :math:`t` is
  :math:`W x_t + b + p_t`, so :math:`b \to b + \delta,\ p_t \to p_t - \delta` for every patch token
  (:math:`d`; only when learned position embeddings are added to the patch tokens);
* **two embedding tables summed** (GPT-2's token and position embeddings, untied): every row of one
  :math:`+\delta`, every row of the other :math:`-\delta` (:math:`d`);
* **a LayerNorm's bias against its readers' biases**: a LayerNorm's output :math:`y = g \odot \hat x +
  \beta` read only by affine layers :math:`W_j y + c_j` gives
  :math:`W_j (y + \delta) + c_j - W_j \delta = W_j y + c_j`, so
  :math:`\beta \to \beta + \delta,\ c_j \to c_j - W_j \delta` (:math:`d` per such LayerNorm; none when a
  reader has no bias, or when anything else reads :math:`y`, e.g. a post-norm residual).

Each is a translation of the weights, linearly independent of the others and of the permutations,
scalings, rotations and attention groups (it alone moves its ``plus`` parameter by :math:`\delta`), and it
holds no permutation. :func:`symlib.symmetry.trace.spec_of` finds them (``symlib.symmetry.trace.biases``, a
pass over the traced graph) and records them in ``Spec.shifts``
(:class:`~symlib.symmetry.actions.BiasShift`); :func:`dims` counts them per label (``bias_shifts`` in
:mod:`symlib.symmetry.counting`), :func:`random_shifts` draws one :math:`\delta` per direction and
:func:`shift` applies them.
"""

from __future__ import annotations

import torch

from symlib.params import Params
from symlib.symmetry.spec import BiasShift, Spec, SymmetryError

__all__ = ["dims", "random_shifts", "shift"]


def _size(spec: Spec, s: BiasShift) -> int:
    return spec.shapes[s.plus[0][0]][-1]


def _label(spec: Spec, s: BiasShift) -> str | None:
    """The permutation label on the last axis of the first parameter that moves by :math:`+\\delta`."""
    param = s.plus[0][0]
    last = len(spec.shapes[param]) - 1
    return next((a.perm for a in spec.actions if a.param == param and a.axis == last and a.perm), None)


def dims(spec: Spec) -> dict[str | None, int]:
    """Dimensions of the redundant bias directions (``Spec.shifts``) per permutation label of the vectors
    they move (``None``: vectors without one): :math:`d` each."""
    out: dict[str | None, int] = {}
    for s in spec.shifts:
        label = _label(spec, s)
        out[label] = out.get(label, 0) + _size(spec, s)
    return out


def random_shifts(spec: Spec, generator: torch.Generator | None = None, scale: float = 1.0,
                  dtype=torch.float64) -> list[torch.Tensor]:
    """One standard normal :math:`\\delta` (times ``scale``) per direction of ``Spec.shifts``, in order."""
    return [scale * torch.randn(_size(spec, s), generator=generator, dtype=torch.float64).to(dtype)
            for s in spec.shifts]


def shift(theta: Params, spec: Spec, deltas: list[torch.Tensor]) -> Params:
    r"""Move ``theta`` along ``Spec.shifts``: ``deltas[i]`` added to the rows ``plus`` of direction ``i``,
    subtracted from its rows ``minus``, and :math:`W_j \delta` subtracted from the bias of each reader
    (module docstring). One network, without batch dimensions."""
    if len(deltas) != len(spec.shifts):
        raise SymmetryError(f"{len(deltas)} shifts for {len(spec.shifts)} redundant bias directions: pass "
                            "one vector per direction of spec.shifts (random_shifts draws them)")
    out = dict(theta)
    for s, delta in zip(spec.shifts, deltas, strict=True):
        d = _size(spec, s)
        for rows, sign in ((s.plus, 1), (s.minus, -1)):
            for param, start, stop in rows:
                t = out[param]
                flat = t.reshape(-1, d).clone()
                flat[start:stop] += sign * delta.to(t.dtype)
                out[param] = flat.reshape(t.shape)
        for weight, bias, transposed in s.readers:
            w = out[weight]
            wd = delta.to(w.dtype) @ w if transposed else w @ delta.to(w.dtype)
            out[bias] = out[bias] - wd
    return out
