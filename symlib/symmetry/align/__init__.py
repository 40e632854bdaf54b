r"""Aligning networks and mean-field Gaussian posteriors by permutations (book: chapter "Aligning
variational posteriors"; Rossi, Singh & Hannagan 2023, App. A; weight matching of Ainsworth et al. 2023).

Two networks, or two mean-field Gaussian posteriors :math:`q_0 = \mathcal N(m_0, \mathrm{diag}(s_0^2))`
and :math:`q_1 = \mathcal N(m_1, \mathrm{diag}(s_1^2))` (means and standard deviations as state
dicts), are aligned by the permutation :math:`P` of the hidden neurons that brings side 1 closest to
side 0. :math:`P` holds one permutation per label of a :class:`~symlib.symmetry.spec.Spec` and acts through
:func:`symlib.symmetry.ops.permute`, so residual ties, BatchNorm and grouped convolutions need no code of
their own. Every cost below is, up to a constant, a sum of bilinear terms

.. math:: c(P) = \sum_{\text{tensors } t}\ \sum_k \big\langle F_k(t_0),\ P\,G_k(t_1) \big\rangle,

linear in each label's permutation when the others are held, so coordinate descent over the labels
solves one linear assignment problem per step (``scipy.optimize.linear_sum_assignment``), on a cost
matrix built from whole layers with one matrix product per tensor.

Costs (``cost=``), with :math:`m_1' = P m_1` and :math:`s_1' = P s_1`:

* ``"weights"``: weight matching of point estimates,
  :math:`\lVert m_0 - P m_1\rVert^2 = \text{const} - 2\langle m_0, P m_1\rangle`.
* ``"wasserstein"``: the squared 2-Wasserstein distance between the diagonal Gaussians,
  :math:`W_2^2(q_0, P_\# q_1) = \lVert m_0 - P m_1\rVert^2 + \lVert s_0 - P s_1\rVert^2`.
* ``"kl"``: the exact :math:`\mathrm{KL}[P_\# q_1 \,\|\, q_0]
  = \sum_i \log\frac{s_{0,i}}{s'_{1,i}} + \frac{s_{1,i}'^2 + (m_{0,i} - m'_{1,i})^2}{2 s_{0,i}^2} - \frac12`.
  The log term does not depend on :math:`P` (a permutation keeps the product of the
  :math:`s_1`), but the variance-ratio term :math:`\sum_i s_{1,i}'^2 / (2 s_{0,i}^2)` does unless
  :math:`s_0` is constant: the appendix's Eq. 1-2 count it among the :math:`P`-free terms.
* ``"kl-mean"``: the appendix's reduction, the precision-weighted distance between means
  :math:`\sum_i (m_{0,i} - m'_{1,i})^2 / (2 s_{0,i}^2)` alone (its Eq. 2), which ignores
  :math:`s_1` entirely; the appendix's Figure A1 is its failure case.

Grouped convolutions are aligned on their block-diagonal dense weights
(:func:`symlib.symmetry.ops.dense_weight`). A grouped label is solved inside its blocks (one assignment per
block, the block permutation held), and each tie of grouped labels gets a step of its own that moves
whole blocks: one assignment over the ``G`` blocks, every label of the tie moving together, which
keeps every permutation a symmetry (``Spec.blocks``).
"""


from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from symlib import threads
from symlib.params import Params
from symlib.symmetry import ops
from symlib.symmetry.align.costs import (
    COSTS,
    Alignment,
    Cost,
    barrier,
    features,
    interpolate,
    kl_diag,
    touched,
    w2_diag,
)
from symlib.symmetry.align.descent import Descent, block_step, label_step, permute_partial
from symlib.symmetry.spec import Spec, SymmetryError

__all__ = ["COSTS", "Alignment", "align", "align_many", "barrier", "interpolate", "kl_diag", "w2_diag"]


def align(
    mean0: Params,
    mean1: Params,
    spec: Spec,
    std0: Params | None = None,
    std1: Params | None = None,
    cost: str = "wasserstein",
    names=None,
    max_rounds: int = 100,
    seed: int = 0,
    init: Mapping[str, torch.Tensor] | None = None,
    widest_first: bool | None = None,
) -> Alignment:
    r"""Align side 1 to side 0 by the permutation that minimises ``cost`` (book: chapter "Aligning
    variational posteriors").

    Coordinate descent as in weight matching (Ainsworth et al. 2023): each round visits the units in
    the order ``numpy.random.default_rng(seed).permutation`` draws (one draw per round); a unit is a
    label (one linear assignment, or one per block for a grouped label) or, for each tie of grouped
    labels that may move blocks, the block step (``widest_first`` orders the first round by size). A
    unit's new permutation is kept only when it is strictly cheaper, so the cost never increases; the
    descent stops after a round without change.

    Args:
        mean0, mean1: full state dicts of one network each (means, or point estimates); no batch dims.
        spec: the architecture's symmetries (e.g. :func:`symlib.symmetry.trace.spec_of`).
        std0, std1: standard deviations of the mean-field posteriors, dicts with some or all of the
            keys; a missing tensor counts as deterministic (std 0). Needed for ``"kl"``/``"kl-mean"``
            (``std0`` on every aligned tensor, positive).
        cost: ``"weights"``, ``"wasserstein"``, ``"kl"`` or ``"kl-mean"`` (module docstring).
        names: tensors entering the cost; default every floating tensor some permutation acts on
            (weights, biases, BatchNorm parameters and running statistics), for the KL costs those
            of them that ``std0`` holds.
        max_rounds: stop after this many rounds even without convergence (0 evaluates ``init``).
        seed: seed of the visiting order.
        init: starting permutations (default the identity); they must be symmetries of ``spec``.
        widest_first: visit the units of the first round in decreasing order of the entries they move,
            rather than in random order. A transformer's residual stream, one label on almost every
            tensor, then goes first, anchored by the tensors it alone moves (embeddings, LayerNorm
            parameters, biases); visited after the heads and MLP units, it can stay where they settled.
            Weight matching of a randomly permuted small ViT, Swin or timm model then finds the
            permutation back where the random order often stops short
            (``tests/symmetry/test_transformers.py``). ``None`` (the default): widest first for a spec with
            attention (a non-empty ``spec.continuous``), the random order otherwise.

    Returns:
        An :class:`Alignment`: the permutations, the aligned means and stds, the cost trace.
    """
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; choose one of {COSTS}")
    for side, d in (("mean0", mean0), ("mean1", mean1)):
        if spec.batch_shape(d) != ():
            raise SymmetryError(
                f"{side} holds a stack of networks (batch shape {spec.batch_shape(d)}); align one network "
                "at a time, e.g. with align_many"
            )
    std0 = {} if std0 is None else dict(std0)
    std1_given = std1 is not None
    std1 = {} if std1 is None else dict(std1)
    names = _aligned_names(spec, cost, names, mean0, mean1, std0, std1)
    acts = touched(spec, names)
    fa, fb = features(cost, mean0, std0, mean1, std1, names)
    d = Descent(spec, fa, fb, acts)

    perms = {k: torch.arange(n) for k, n in spec.perms.items()}
    if init is not None:
        perms.update({k: torch.as_tensor(v).long().cpu() for k, v in init.items()})
        ops.permute(mean1, spec, {k: v.to(mean1[next(iter(mean1))].device) for k, v in perms.items()})

    tracker = Cost(cost, spec, mean0, std0, mean1, std1, names, d.by_param)
    first, tracker.terms = tracker.value(perms)

    units, ties = _units(spec, d)
    rng = np.random.default_rng(seed)
    costs = [first]
    steps: list[str] = []
    converged, rounds = False, 0
    while rounds < max_rounds:
        rounds += 1
        changed = False
        order = rng.permutation(len(units))
        if rounds == 1 and (widest_first if widest_first is not None else bool(spec.continuous)):
            order = sorted(range(len(units)), key=lambda i: -_reach(d, units[i]))
        for i in order:
            kind, key = units[i]
            if kind == "label":
                new = label_step(d, spec, key, perms)
                new = None if new is None else {key: new}
            else:
                labels = ties[key]
                new = block_step(d, spec, labels, perms, lambda p, q=labels: tracker.value(p, q)[0])
            if new is None:
                continue
            perms.update(new)
            changed = True
            steps.append(key if kind == "label" else f"blocks:{key}")
            value, tracker.terms = tracker.value(perms, new)
            costs.append(value)
        if not changed:
            converged = True
            break
    dev = next(iter(mean1.values())).device
    out = {k: v.to(dev) for k, v in perms.items()}
    return Alignment(
        perms=out,
        mean=ops.permute(mean1, spec, out),
        std=permute_partial(std1, mean1, spec, out) if std1_given else None,
        cost=costs[-1],
        costs=costs,
        steps=steps,
        rounds=rounds,
        converged=converged,
    )


def _aligned_names(spec: Spec, cost: str, names, mean0: Params, mean1: Params, std0: Params,
                   std1: Params) -> list[str]:
    """The tensors entering the cost: ``names``, by default every floating tensor some permutation acts
    on (for the KL costs, those of them ``std0`` holds); checked to be some, with the positive stds the
    KL costs need and finite values on every side.

    Raises:
        ValueError: no tensor, a missing or non-positive std, a NaN or infinite value.
    """
    if names is None:
        names = [k for k in spec.shapes if mean0[k].is_floating_point()
                 and any(a.param == k and a.perm is not None for a in spec.actions)
                 and (cost not in ("kl", "kl-mean") or k in std0)]
    names = list(names)
    if not names:
        raise ValueError(
            f"no tensor to align with cost {cost!r}: names is empty, or (KL costs) std0 holds none of the "
            "permuted tensors; pass the posterior's standard deviations or name the tensors with names="
        )
    if cost in ("kl", "kl-mean"):
        sides = (("std0", std0), ("std1", std1)) if cost == "kl" else (("std0", std0),)
        for side, std in sides:
            bad = [k for k in names if k not in std or not bool((std[k] > 0).all())]
            if bad:
                raise ValueError(
                    f"cost {cost!r} needs positive {side}, missing or not positive on {bad[:3]}; pass the "
                    "posteriors' standard deviations, or restrict the aligned tensors with names="
                )
    for side, d in (("mean0", mean0), ("mean1", mean1), ("std0", std0), ("std1", std1)):
        _check_finite(side, d, names)
    return names


def _units(spec: Spec, d: Descent) -> tuple[list[tuple[str, str]], dict]:
    """The units of the descent and the spec's tie classes: ``("label", label)`` for every label some
    aligned tensor carries, in the spec's order, then ``("blocks", tie)`` for every tie of grouped labels
    with more than one block (the block step)."""
    units: list[tuple[str, str]] = [("label", k) for k in spec.perms if k in d.by_label]
    ties = spec.tie_classes()
    for tie, labels in ties.items():
        if tie is not None and spec.blocks[labels[0]][0] > 1:
            units.append(("blocks", tie))
    return units, ties


def _reach(d: Descent, unit: tuple[str, str]) -> int:
    """Entries of the tensors a unit's permutation moves (a block step: all its labels')."""
    kind, key = unit
    labels = [key] if kind == "label" else [q for q, (_, t) in d.spec.blocks.items() if t == key]
    return sum(d.fa[a.param][0].numel() for q in labels for a in d.by_label.get(q, []))


def _check_finite(side: str, d: Params, names, batched: bool = False) -> None:
    """Refuse NaN or infinite values in the tensors ``names`` of ``d`` (the assignment solver cannot rank
    them), naming the side, the tensor and (``batched``) the networks of a stack."""
    for k in names:
        v = d.get(k)
        if v is None or not v.is_floating_point() or bool(torch.isfinite(v).all()):
            continue
        where = ""
        if batched:
            bad = (~torch.isfinite(v)).reshape(v.shape[0], -1).any(1).nonzero().flatten().tolist()
            where = f" (networks {bad[:10]}{'...' if len(bad) > 10 else ''})"
        raise ValueError(
            f"{side}: tensor {k!r} holds NaN or infinite values{where}, so no alignment cost can be "
            "computed; drop or fix this network (e.g. a diverged run) before aligning it"
        )


def align_many(mean_ref: Params, means: Params, spec: Spec, std_ref: Params | None = None,
               stds: Params | None = None, cost: str = "weights", **kwargs) -> tuple[Params, Params | None]:
    """Align every network of a stack ``(S, ...)`` to one reference (e.g. before an MMD).

    Args:
        mean_ref, std_ref: the reference (no batch dims).
        means, stds: stacked state dicts ``{name: (S, ...)}``.
        cost, kwargs: as in :func:`align`.

    Returns:
        ``(means, stds)`` aligned, stacked like the input (``stds`` ``None`` when not given).
    """
    batch = spec.batch_shape(means)
    if len(batch) != 1:
        raise SymmetryError(f"align_many takes one leading batch dimension, got batch shape {batch}")
    if batch[0] == 0:
        raise ValueError("align_many got an empty stack (0 networks); pass at least one network "
                         "{name: (S, ...)} with S >= 1")
    names = list(kwargs.get("names") or means)
    _check_finite("means", means, names, batched=True)
    if stds is not None:
        _check_finite("stds", stds, names, batched=True)
    out_m, out_s = [], []
    # One network at a time is a stream of small tensor operations: intra-op threads only wait for each
    # other there, and on a shared machine their spinning made the loop 4-5 times slower.
    with threads.single():
        for i in range(batch[0]):
            one_m = {k: v[i] for k, v in means.items()}
            one_s = None if stds is None else {k: v[i] for k, v in stds.items()}
            r = align(mean_ref, one_m, spec, std_ref, one_s, cost=cost, **kwargs)
            out_m.append(r.mean)
            out_s.append(r.std)
    mean = {k: torch.stack([m[k] for m in out_m]) for k in means}
    std = None if stds is None else {k: torch.stack([s[k] for s in out_s]) for k in stds}
    return mean, std
