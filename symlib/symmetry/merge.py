r"""Merging two networks: average their weights after matching their neurons (book: chapter "Aligning
variational posteriors"; weight and activation matching of Ainsworth, Hayase & Srinivasa 2023, "Git
Re-Basin").

Two networks :math:`\theta_a, \theta_b` of one architecture compute the same kind of function with their
hidden neurons in arbitrary order, so their plain average mixes unrelated neurons. :func:`merge` first
moves :math:`\theta_b` along its permutation orbit towards :math:`\theta_a` (:func:`match`: one
permutation :math:`P` per label of the :class:`~symlib.symmetry.spec.Spec`, applied by
:func:`symlib.symmetry.ops.permute`, so :math:`P\theta_b` computes exactly the function of
:math:`\theta_b`), then averages

.. math:: \theta_t = (1 - t)\,\theta_a + t\,P\theta_b .

``how`` chooses :math:`P`:

* ``"none"``: the identity (the plain average);
* ``"weights"``: weight matching, :math:`\min_P \lVert \theta_a - P\theta_b\rVert^2` by coordinate
  descent over the labels (:func:`symlib.symmetry.align.align`, cost ``"weights"``);
* ``"activations"``: activation matching on a batch :math:`x`: for each label, the permutation that
  best pairs the features of the two networks by their correlation on :math:`x`, attention heads and
  the groups of grouped convolutions matched as whole blocks first
  (``symlib.symmetry.align.activations``).

With ``orthogonal=True``, a network with a residual stream (a transformer: LayerNorm or RMSNorm keep
the stream's rotations) is also rotated onto the other by orthogonal Procrustes after the permutation
step (``align_stream`` of ``symlib.symmetry.stream``), and each attention head's queries and keys, and
values and outputs, by one orthogonal matrix per head, the orthogonal part of the heads' :math:`GL(d_k)`
and :math:`GL(d_v)` (``align_heads`` of ``symlib.symmetry.continuous``). Non-floating tensors (BatchNorm's
``num_batches_tracked``) are taken from :math:`\theta_a`; BatchNorm running statistics are averaged like
every other tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from symlib.params import Params
from symlib.symmetry import ops
from symlib.symmetry.align.activations import activation_perms
from symlib.symmetry.spec import Spec, SymmetryError

__all__ = ["HOWS", "activation_perms", "match", "merge", "rotate_onto"]

#: How :func:`merge` matches the neurons of the two networks (module docstring).
HOWS = ("none", "weights", "activations")


def merge(
    a: Params,
    b: Params,
    spec: Spec,
    how: str = "weights",
    batch: torch.Tensor | tuple | None = None,
    t: float = 0.5,
    orthogonal: bool = False,
    model: nn.Module | None = None,
    seed: int = 0,
    max_rounds: int = 100,
    orthogonal_rounds: int = 5,
) -> Params:
    r"""The average :math:`(1-t)\,\theta_a + t\,P\theta_b` of two networks after matching ``b``'s neurons
    to ``a``'s (module docstring; book: chapter "Aligning variational posteriors").

    Args:
        a, b: full state dicts of one network each (no batch dimensions), of the architecture of ``spec``.
        spec: the architecture's symmetries (:func:`symlib.spec_of`).
        how: ``"none"`` (plain average), ``"weights"`` (weight matching) or ``"activations"``
            (activation matching on ``batch``, needs ``model``).
        batch: inputs ``(n, *input_shape)`` (or ``(inputs, targets)``) for ``how="activations"``.
        t: weight of ``b`` in the average (0: ``a``, 1: ``b`` matched to ``a``).
        orthogonal: also rotate ``b``'s residual stream onto ``a``'s after the permutations, and turn each
            attention head by an orthogonal matrix (transformers; nothing to rotate in a network without a
            residual stream or heads).
        model: the ``nn.Module`` of ``spec`` (``how="activations"``: its layers' outputs are recorded with
            forward hooks; it is not modified).
        seed, max_rounds: of the weight matching's coordinate descent (:func:`symlib.align`).
        orthogonal_rounds: turns of the stream's and the heads' rotations, one after the other (each
            solved with the other held).

    Returns:
        A new state dict; ``a`` and ``b`` are not modified.

    Raises:
        SymmetryError: ``a`` or ``b`` do not fit ``spec`` (another architecture, a stack of networks), or a
            label whose activations cannot be recorded (``how="activations"``).
        ValueError: an unknown ``how``, or ``how="activations"`` without ``batch`` or ``model``.
    """
    from symlib.symmetry.align import interpolate

    moved = match(a, b, spec, how, batch, orthogonal=orthogonal, model=model, seed=seed,
                  max_rounds=max_rounds, orthogonal_rounds=orthogonal_rounds)
    return interpolate(a, None, moved, None, t)[0]


def match(
    a: Params,
    b: Params,
    spec: Spec,
    how: str = "weights",
    batch: torch.Tensor | tuple | None = None,
    orthogonal: bool = False,
    model: nn.Module | None = None,
    seed: int = 0,
    max_rounds: int = 100,
    orthogonal_rounds: int = 5,
) -> Params:
    """``b`` moved along its symmetry orbit towards ``a`` (same function as ``b``): permuted as ``how``
    asks, then, with ``orthogonal``, its residual stream rotated and each attention head turned by an
    orthogonal matrix (:func:`rotate_onto`; arguments of :func:`merge`)."""
    if how not in HOWS:
        raise ValueError(f"unknown how={how!r}; choose one of {HOWS}")
    _check_pair(a, b, spec)
    if how == "weights":
        from symlib.symmetry.align import align

        perms = align(a, b, spec, cost="weights", seed=seed, max_rounds=max_rounds).perms
    elif how == "activations":
        if batch is None or model is None:
            raise ValueError("how='activations' needs a batch of inputs (batch=) and the network (model=) to "
                             "record the hidden activations on; or use how='weights', which needs neither")
        perms = activation_perms(a, b, spec, model, batch)
    else:
        perms = {}
    moved = ops.permute(b, spec, perms) if perms else dict(b)
    if orthogonal:
        moved = rotate_onto(a, moved, spec, orthogonal_rounds)
    return moved


def rotate_onto(a: Params, b: Params, spec: Spec, rounds: int = 5, tol: float = 1e-12) -> Params:
    """``b`` with its residual stream rotated onto ``a``'s and each attention head turned by an orthogonal
    matrix, in turn, ``rounds`` times or until neither moves ``b``: the same function as ``b``. Each step
    solves its orthogonal Procrustes problem with the other held, so the inner product with ``a`` never
    decreases; the error to an exactly rotated copy falls about five-fold per round. One network each,
    without batch dimensions; a network with neither a stream that only norms read nor attention heads
    comes back as it is."""
    from symlib.symmetry import continuous

    scale = max(float(v.abs().max()) for v in b.values() if v.is_floating_point()) or 1.0
    for _ in range(rounds):
        before = b
        b = _rotate_stream(a, b, spec)
        if spec.continuous:  # each head's queries and keys, values and outputs: one rotation per head
            b = continuous.align_heads(a, b, spec)
        moved = max(float((b[k] - before[k]).abs().max()) for k in b if b[k].is_floating_point())
        if moved <= tol * scale:
            break
    return b


def _check_pair(a: Params, b: Params, spec: Spec) -> None:
    """Refuse ``a``, ``b`` that are not one network each of the architecture of ``spec``."""
    for side, d in (("a", a), ("b", b)):
        batch = spec.batch_shape(d)  # raises on missing tensors and wrong shapes
        if batch != ():
            raise SymmetryError(f"{side} holds a stack of networks (batch shape {batch}); merge one network "
                                f"with one network (symlib.params.unstack(params, i) takes one out)")
    extra = sorted(set(a) ^ set(b))
    if extra:
        raise SymmetryError(f"a and b hold different tensors ({extra[:3]} only in one of them): merge two "
                            f"networks of one architecture")


def _rotate_stream(a: Params, b: Params, spec: Spec) -> Params:
    """``b`` with its residual streams rotated onto ``a``'s (``symlib.symmetry.stream.align_stream``), or
    ``b`` as is when the spec has no stream that only norms read (``stream_labels``: MLPs, CNNs, post-norm
    transformers)."""
    from symlib.symmetry import stream

    if not stream.stream_labels(spec):
        if spec.norms and not spec.scales:  # the norms are there, but not the scale labels that find streams
            raise SymmetryError("orthogonal=True: this spec was traced with scalings='none', which drops the "
                                "norms' scale labels that locate a residual stream; trace the network with "
                                "scalings='partial' (--scalings partial) to rotate its stream")
        return b
    return stream.align_stream(a, b, spec)
