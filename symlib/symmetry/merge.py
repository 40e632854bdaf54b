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
* ``"activations"``: activation matching on a batch :math:`x`. For each label, the outputs
  :math:`z^a_i(x), z^b_j(x)` of the layers that open it (the ``Linear`` or convolution whose rows the
  label permutes; every spatial position counts as a sample) give the correlation matrix
  :math:`C_{ij} = \mathrm{corr}(z^a_i, z^b_j)` (summed over the layers a residual tie joins), and
  :math:`P = \arg\max_P \sum_i C_{i, P(i)}`, one linear assignment per label
  (``scipy.optimize.linear_sum_assignment``). A network's hidden activations at one label do not depend
  on its permutations of the other labels, so every label is solved once, on one forward pass per
  network.

With ``orthogonal=True``, a network with a residual stream (a transformer: LayerNorm or RMSNorm keep
the stream's rotations) is also rotated onto the other by orthogonal Procrustes after the permutation
step (``align_stream`` of ``symlib.symmetry.stream``), and each attention head's queries and keys, and
values and outputs, by one orthogonal matrix per head, the orthogonal part of the heads' :math:`GL(d_k)`
and :math:`GL(d_v)` (``align_heads`` of ``symlib.symmetry.continuous``). Non-floating tensors (BatchNorm's
``num_batches_tracked``) are taken from :math:`\theta_a`; BatchNorm running statistics are averaged like
every other tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from symlib.params import Params
from symlib.symmetry import ops
from symlib.symmetry.spec import Spec, SymmetryError

__all__ = ["HOWS", "activation_perms", "match", "merge"]

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
    orthogonal matrix (arguments of :func:`merge`)."""
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
        moved = _orthogonal_steps(a, moved, spec, orthogonal_rounds)
    return moved


def _orthogonal_steps(a: Params, b: Params, spec: Spec, rounds: int, tol: float = 1e-12) -> Params:
    """The stream's rotation and the heads' rotations, in turn, ``rounds`` times or until neither moves
    ``b`` (each solves its Procrustes problem with the other held, so the inner product with ``a`` never
    decreases; the error to an exactly rotated copy falls about five-fold per round)."""
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


# ----------------------------------------------------------------------------- activation matching
def _openers(spec: Spec, model: nn.Module) -> dict[str, list[tuple[str, int]]]:
    """For every permutation label, the layers whose outputs carry it: ``(module name, channel axis of
    the output)`` for each ``Linear`` (last axis) or convolution (axis 1) whose weight rows the label
    permutes whole."""
    modules = dict(model.named_modules())
    out: dict[str, list[tuple[str, int]]] = {k: [] for k in spec.perms}
    for a in spec.actions:
        if a.perm is None or a.axis != 0 or a.power <= 0 or not a.plain or not a.param.endswith(".weight"):
            continue
        name = a.param[: -len(".weight")]
        mod = modules.get(name)
        if isinstance(mod, nn.Linear):
            out[a.perm].append((name, -1))
        elif isinstance(mod, nn.Conv1d | nn.Conv2d | nn.Conv3d) and mod.groups == 1:
            out[a.perm].append((name, 1))
    return out


def _record(model: nn.Module, params: Params, x: torch.Tensor, where: dict[str, int]
            ) -> dict[str, torch.Tensor]:
    """The outputs of the modules ``where`` names on inputs ``x``, each as ``(samples, channels)``."""
    got: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())

    def hook(name: str, axis: int):
        def fn(_module, _inputs, output):
            z = output.detach().movedim(axis, -1)
            got[name] = z.reshape(-1, z.shape[-1])
        return fn

    handles = [modules[n].register_forward_hook(hook(n, ax)) for n, ax in where.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            torch.func.functional_call(model, params, (x,))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return got


def _standardized(z: torch.Tensor) -> torch.Tensor:
    z = z.to(torch.float64)
    z = z - z.mean(0)
    return z / (z.norm(dim=0) + 1e-12)


def activation_perms(a: Params, b: Params, spec: Spec, model: nn.Module, batch: torch.Tensor | tuple
                     ) -> dict[str, torch.Tensor]:
    r"""Activation matching: for every label, the permutation of ``b``'s neurons that maximises the summed
    correlation of their activations with ``a``'s on ``batch`` (module docstring).

    Args:
        a, b: one network each, of ``spec``'s architecture.
        spec: the symmetries of ``model``.
        model: the network (``Linear`` and convolution layers open the labels).
        batch: inputs ``(n, *input_shape)``, or ``(inputs, targets)``.

    Returns:
        ``{label: perm}``; ``ops.permute(b, spec, perms)`` is ``b`` matched to ``a``.

    Raises:
        SymmetryError: a label with a block structure (grouped convolutions, attention heads) or opened by
            no ``Linear`` or convolution layer, whose activations cannot be matched here.
    """
    from scipy.optimize import linear_sum_assignment

    x = batch[0] if isinstance(batch, tuple | list) else batch
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        raise ValueError("batch must be a tensor of inputs (n, *input_shape), or (inputs, targets)")
    openers = _openers(spec, model)
    for label, where in openers.items():
        if label in spec.blocks or not where:
            why = ("has a block structure (a grouped convolution or attention heads)" if label in spec.blocks
                   else "is opened by no Linear or convolution layer whose outputs could be recorded")
            raise SymmetryError(f"label {label!r} {why}: activation matching solves one unconstrained "
                                f"assignment per label on recorded outputs; merge with how='weights'")
    where = {name: ax for w in openers.values() for name, ax in w}
    ref = next(iter(a.values()))
    if x.is_floating_point():
        x = x.to(ref.dtype if ref.is_floating_point() else x.dtype)
    x = x.to(ref.device)
    za, zb = _record(model, a, x, where), _record(model, b, x, where)
    perms = {}
    for label, layers in openers.items():
        corr = sum(_standardized(za[n]).T @ _standardized(zb[n]) for n, _ in layers)
        _, cols = linear_sum_assignment(corr.cpu().numpy(), maximize=True)
        perms[label] = torch.as_tensor(np.asarray(cols), dtype=torch.long, device=ref.device)
    return perms
