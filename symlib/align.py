r"""Aligning networks and mean-field Gaussian posteriors by permutations (book: chapter "Alignment";
Rossi, Singh & Hannagan 2023, App. A; weight matching of Ainsworth et al. 2023).

Two networks, or two mean-field Gaussian posteriors :math:`q_0 = \mathcal N(m_0, \mathrm{diag}(s_0^2))`
and :math:`q_1 = \mathcal N(m_1, \mathrm{diag}(s_1^2))` (means and standard deviations as state
dicts), are aligned by the permutation :math:`P` of the hidden neurons that brings side 1 closest to
side 0. :math:`P` holds one permutation per label of a :class:`~symlib.spec.Spec` and acts through
:func:`symlib.ops.permute`, so residual ties, BatchNorm and grouped convolutions need no code of
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
(:func:`symlib.ops.dense_weight`). A grouped label is solved inside its blocks (one assignment per
block, the block permutation held), and each tie of grouped labels gets a step of its own that moves
whole blocks: one assignment over the ``G`` blocks, every label of the tie moving together, which
keeps every permutation a symmetry (``Spec.blocks``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from symlib import ops
from symlib.spec import Params, Spec, SymmetryError

COSTS = ("weights", "wasserstein", "kl", "kl-mean")


@dataclasses.dataclass
class Alignment:
    """The result of :func:`align`.

    Attributes:
        perms: one permutation ``(n,)`` per label; ``ops.permute(mean1, spec, perms)`` is aligned.
        mean: the aligned means (side 1 permuted), every tensor of ``mean1``.
        std: the aligned standard deviations, or ``None`` when no ``std1`` was given.
        cost: the objective at the returned permutations (see ``costs``).
        costs: the objective before the first step and after every accepted step; it never increases.
            Over the aligned tensors only: the squared distance for ``"weights"``, :math:`W_2^2` for
            ``"wasserstein"``, the full KL for ``"kl"``, the mean term for ``"kl-mean"``.
        steps: the unit of every coordinate step, in order: a label, or ``"blocks:<tie>"`` for a
            step that moves whole blocks of grouped labels.
        rounds: rounds of coordinate descent run (the last one changed nothing when ``converged``).
        converged: whether a whole round left every permutation unchanged.
    """

    perms: dict[str, torch.Tensor]
    mean: Params
    std: Params | None
    cost: float
    costs: list[float]
    steps: list[str]
    rounds: int
    converged: bool


# ----------------------------------------------------------------------------- closed forms
def _pairs(mean0, std0, mean1, std1):
    if isinstance(mean0, torch.Tensor):
        return [(mean0, std0, mean1, std1)]
    return [(mean0[k], std0[k], mean1[k], std1[k]) for k in mean0]


def w2_diag(mean0, std0, mean1, std1) -> torch.Tensor:
    r"""2-Wasserstein distance between diagonal Gaussians (book: chapter "Alignment").

    .. math:: W_2\big(\mathcal N(m_0, \mathrm{diag}\,s_0^2), \mathcal N(m_1, \mathrm{diag}\,s_1^2)\big)
              = \sqrt{\lVert m_0 - m_1\rVert^2 + \lVert s_0 - s_1\rVert^2},

    the general :math:`\lVert m_0 - m_1\rVert^2 + \mathrm{Tr}(\Sigma_0 + \Sigma_1
    - 2(\Sigma_0^{1/2}\Sigma_1\Sigma_0^{1/2})^{1/2})` for commuting (diagonal) covariances.

    Args:
        mean0, std0, mean1, std1: tensors, or state dicts with the keys of ``mean0`` (summed over).

    Returns:
        The distance (not squared), a 0-d tensor.
    """
    total = 0.0
    for m0, s0, m1, s1 in _pairs(mean0, std0, mean1, std1):
        total = total + ((m0 - m1) ** 2).sum() + ((s0 - s1) ** 2).sum()
    return torch.as_tensor(total).sqrt()


def kl_diag(mean_p, std_p, mean_q, std_q) -> torch.Tensor:
    r""":math:`\mathrm{KL}[p \,\|\, q]` between diagonal Gaussians ``p = N(mean_p, std_p^2)``,
    ``q = N(mean_q, std_q^2)``.

    .. math:: \sum_i \log\frac{s_{q,i}}{s_{p,i}} + \frac{s_{p,i}^2 + (m_{p,i} - m_{q,i})^2}{2 s_{q,i}^2}
              - \frac12 .

    Args:
        mean_p, std_p, mean_q, std_q: tensors, or state dicts with the keys of ``mean_p``.
    """
    total = 0.0
    for mp, sp, mq, sq in _pairs(mean_p, std_p, mean_q, std_q):
        total = total + (torch.log(sq / sp) + (sp**2 + (mp - mq) ** 2) / (2 * sq**2) - 0.5).sum()
    return torch.as_tensor(total)


def interpolate(mean0: Params, std0: Params | None, mean1: Params, std1: Params | None, t: float
                ) -> tuple[Params, Params | None]:
    r"""The posterior at ``t`` on the straight path from ``q_0`` (``t = 0``) to ``q_1`` (``t = 1``).

    Means and standard deviations move linearly: :math:`m_t = (1-t) m_0 + t m_1`,
    :math:`s_t = (1-t) s_0 + t s_1`. For diagonal Gaussians this is the 2-Wasserstein geodesic
    (:math:`W_2(q_0, q_t) = t\,W_2(q_0, q_1)`). Tensors that are not floating point (e.g. BatchNorm's
    ``num_batches_tracked``) are taken from side 0. Interpolate *aligned* posteriors (:func:`align`)
    to measure a loss barrier modulo permutations.

    Args:
        mean0, std0, mean1, std1: state dicts; the stds may be ``None`` (point estimates).
        t: position on the path, usually in [0, 1].

    Returns:
        ``(mean_t, std_t)``, new dicts (``std_t`` is ``None`` when either std is ``None``).
    """
    def lerp(a: Params, b: Params) -> Params:
        out = {}
        for k, v in a.items():
            if k not in b:
                raise KeyError(f"tensor {k!r} is missing from side 1; interpolate posteriors of one model")
            out[k] = (1 - t) * v + t * b[k] if v.is_floating_point() else v.clone()
        return out

    mean = lerp(mean0, mean1)
    std = lerp(std0, std1) if std0 is not None and std1 is not None else None
    return mean, std


# ----------------------------------------------------------------------------- the descent
@dataclasses.dataclass(frozen=True)
class _Act:
    param: str
    axis: int
    label: str


def _touched(spec: Spec, names) -> list[_Act]:
    acts = [_Act(a.param, a.axis, a.perm) for a in spec.actions if a.perm is not None and a.param in names]
    seen = set()
    for a in acts:
        if (a.param, a.label) in seen:
            raise SymmetryError(
                f"label {a.label!r} acts on two axes of {a.param!r}: its assignment is quadratic, not "
                "linear, and this alignment does not solve it; leave that tensor out with names="
            )
        seen.add((a.param, a.label))
    return acts


def _features(cost, mean0, std0, mean1, std1, names):
    """Feature tensors ``F_k`` (side 0) and ``G_k`` (side 1) with
    ``c(P) = const + sum_k <F_k, P G_k>`` (module docstring), per tensor name."""
    fa: dict[str, list[torch.Tensor]] = {}
    fb: dict[str, list[torch.Tensor]] = {}
    for k in names:
        m0 = mean0[k].to(torch.float64)
        m1 = mean1[k].to(torch.float64)
        s0 = std0[k].to(torch.float64) if k in std0 else torch.zeros_like(m0)
        s1 = std1[k].to(torch.float64) if k in std1 else torch.zeros_like(m1)
        if cost == "weights":
            fa[k], fb[k] = [m0], [-2 * m1]
        elif cost == "wasserstein":
            fa[k], fb[k] = [m0, s0], [-2 * m1, -2 * s1]
        else:
            w = 1.0 / s0**2
            second = m1**2 + s1**2 if cost == "kl" else m1**2
            fa[k], fb[k] = [w / 2, w * m0], [second, -m1]
    return fa, fb


class _Cost:
    """The exact objective as a sum of per-tensor terms, recomputed only for the tensors whose labels
    changed (grouped weights as dense tensors, their off-block zeros masked out)."""

    def __init__(self, cost, spec: Spec, mean0, std0, mean1, std1, names, by_param):
        self.cost, self.by_param = cost, by_param
        self.by_label: dict[str, set[str]] = {}
        for param, acts in by_param.items():
            for a in acts:
                self.by_label.setdefault(a.label, set()).add(param)
        self.t = {}
        for k in names:
            m0, m1 = mean0[k].to(torch.float64), mean1[k].to(torch.float64)
            s0 = std0[k].to(torch.float64) if k in std0 else torch.zeros_like(m0)
            s1 = std1[k].to(torch.float64) if k in std1 else torch.zeros_like(m1)
            grouped = spec.groups_of(k) > 1
            mask = ops.dense_weight({k: torch.ones_like(m0)}, spec, k).bool() if grouped else None
            self.t[k] = tuple(ops.dense_weight({k: x}, spec, k) for x in (m0, s0, m1, s1)) + (mask,)
        self.terms = {k: self._term(k, {}) for k in self.t}

    def _term(self, k, perms) -> float:
        m0, s0, m1, s1, mask = self.t[k]
        for a in self.by_param.get(k, []):
            if a.label in perms:
                m1 = m1.index_select(a.axis, perms[a.label].to(m1.device))
                s1 = s1.index_select(a.axis, perms[a.label].to(s1.device))
        if mask is not None:
            m0, s0, m1, s1 = m0[mask], s0[mask], m1[mask], s1[mask]
        if self.cost == "weights":
            return float(((m0 - m1) ** 2).sum())
        if self.cost == "wasserstein":
            return float(((m0 - m1) ** 2).sum() + ((s0 - s1) ** 2).sum())
        if self.cost == "kl":
            return float(kl_diag(m1, s1, m0, s0))
        return float(((m0 - m1) ** 2 / (2 * s0**2)).sum())

    def value(self, perms, labels=None) -> tuple[float, dict[str, float]]:
        """The objective at ``perms``, recomputing the tensors of ``labels`` (all when ``None``)."""
        keys = self.t if labels is None else {k for q in labels for k in self.by_label.get(q, ())}
        terms = {**self.terms, **{k: self._term(k, perms) for k in keys}}
        return math.fsum(terms.values()), terms


def _lap(c: torch.Tensor) -> torch.Tensor:
    """Columns of the minimum-cost assignment of a square cost matrix (row ``i`` gets column ``out[i]``)."""
    _, cols = linear_sum_assignment(c.detach().cpu().numpy())
    return torch.as_tensor(cols, dtype=torch.long)


def _block_move(sigma: torch.Tensor, k: int) -> torch.Tensor:
    """The permutation that moves block ``g`` (``k`` entries) to block ``sigma[g]``, keeping the inside."""
    return (sigma[:, None] * k + torch.arange(k)).reshape(-1)


class _Descent:
    """Coordinate descent over the labels of ``spec`` for the bilinear cost of ``fa``, ``fb``."""

    def __init__(self, spec: Spec, fa, fb, acts: list[_Act]):
        self.spec = spec
        # Grouped weights become block-diagonal dense tensors: every action is then an ordinary axis.
        self.fa = {k: [ops.dense_weight({k: t}, spec, k) for t in ts] for k, ts in fa.items()}
        self.fb = {k: [ops.dense_weight({k: t}, spec, k) for t in ts] for k, ts in fb.items()}
        self.acts = acts
        self.by_label: dict[str, list[_Act]] = {}
        self.by_param: dict[str, list[_Act]] = {}
        for a in acts:
            self.by_label.setdefault(a.label, []).append(a)
            self.by_param.setdefault(a.param, []).append(a)
        # Side 0 is fixed: its matrices (n, rest) are built once per action.
        self.mat_a = {a: self._mat(self.fa[a.param], a.axis) for a in acts}

    @staticmethod
    def _mat(ts: list[torch.Tensor], axis: int) -> torch.Tensor:
        n = ts[0].shape[axis]
        return torch.cat([t.movedim(axis, 0).reshape(n, -1) for t in ts], dim=1)

    def _side1(self, param: str, perms: Mapping[str, torch.Tensor], skip=()) -> list[torch.Tensor]:
        """Side-1 features of ``param`` permuted on every labelled axis except those of ``skip``."""
        out = []
        for t in self.fb[param]:
            for a in self.by_param[param]:
                if a.label not in skip:
                    t = t.index_select(a.axis, perms[a.label].to(t.device))
            out.append(t)
        return out

    def label_matrix(self, label: str, perms) -> torch.Tensor:
        """``C[i, j]``: the cost of sending side-1 neuron ``j`` to position ``i`` of ``label``, the
        other labels held (one matrix product per tensor the label acts on)."""
        n = self.spec.perms[label]
        c = torch.zeros(n, n, dtype=torch.float64)
        for a in self.by_label.get(label, []):
            mb = self._mat(self._side1(a.param, perms, skip=(label,)), a.axis)
            c += (self.mat_a[a] @ mb.T).cpu()
        return c

    def block_matrix(self, labels: list[str], groups: int, inner: Mapping[str, torch.Tensor], perms
                     ) -> torch.Tensor:
        """``M[g, h]``: the cost of moving side-1 block ``h`` of every label of a tie to block ``g``,
        with the labels' within-block arrangements ``inner`` and the other labels held. The cost of
        a block permutation ``sigma`` is ``const + sum_g M[g, sigma[g]]`` exactly."""
        m = torch.zeros(groups, groups, dtype=torch.float64)
        cur = {**perms, **inner}
        tied = set(labels)
        for param, acts in self.by_param.items():
            axes = [a.axis for a in acts if a.label in tied]
            if not axes:
                continue
            side1 = self._side1(param, cur)
            for ta, tb in zip(self.fa[param], side1, strict=True):
                if len(axes) == 1:
                    ax = axes[0]
                    x = ta.movedim(ax, 0).reshape(groups, ta.shape[ax] // groups, -1)
                    y = tb.movedim(ax, 0).reshape(groups, tb.shape[ax] // groups, -1)
                    m += torch.einsum("gkr,hkr->gh", x, y).cpu()
                elif len(axes) == 2 and self.spec.groups_of(param) > 1:
                    # A block-diagonal grouped weight: rows and columns move together, so only the
                    # diagonal blocks meet.
                    x = self._diag_blocks(ta, axes, groups)
                    y = self._diag_blocks(tb, axes, groups)
                    m += torch.einsum("gr,hr->gh", x, y).cpu()
                else:
                    raise SymmetryError(
                        f"{param!r} carries labels of one grouped tie on axes {axes} but is not a grouped "
                        "convolution weight: moving its blocks is not a linear assignment"
                    )
        return m

    def block_values(self, labels: list[str], groups: int, perms) -> torch.Tensor:
        """``V[g, h]``: for every label of a tie, the best within-block assignment of side-1 block ``h``
        to block ``g``, on the tensors that tie the label to labels outside the tie (those terms do not
        depend on the tie's other labels), summed over the labels; ``G^2`` small assignments each."""
        v = torch.zeros(groups, groups, dtype=torch.float64)
        tied = set(labels)
        for q in labels:
            n = self.spec.perms[q]
            k = n // groups
            c = torch.zeros(n, n, dtype=torch.float64)
            for a in self.by_label.get(q, []):
                if any(b.label in tied and b.label != q for b in self.by_param[a.param]):
                    continue
                mb = self._mat(self._side1(a.param, perms, skip=(q,)), a.axis)
                c += (self.mat_a[a] @ mb.T).cpu()
            for g in range(groups):
                for h in range(groups):  # loops over blocks, not neurons
                    blk = c[g * k:(g + 1) * k, h * k:(h + 1) * k]
                    v[g, h] += blk[torch.arange(k), _lap(blk)].sum()
        return v

    @staticmethod
    def _diag_blocks(t: torch.Tensor, axes, groups: int) -> torch.Tensor:
        a0, a1 = axes
        t = t.movedim((a0, a1), (0, 1))
        n0, n1 = t.shape[0], t.shape[1]
        t = t.reshape(groups, n0 // groups, groups, n1 // groups, -1)
        return torch.diagonal(t, dim1=0, dim2=2).movedim(-1, 0).reshape(groups, -1)


def _gain_ok(c: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether the assignment ``new`` is strictly cheaper than ``old`` beyond rounding."""
    rows = torch.arange(c.shape[0])
    v_new, v_old = float(c[rows, new].sum()), float(c[rows, old].sum())
    eps = 1e-12 * c.shape[0] * max(float(c.abs().max()), 1e-300)
    return v_new < v_old - eps


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
) -> Alignment:
    r"""Align side 1 to side 0 by the permutation that minimises ``cost`` (book: chapter "Alignment").

    Coordinate descent as in weight matching (Ainsworth et al. 2023): each round visits the units in
    the order ``numpy.random.default_rng(seed).permutation`` draws (one draw per round); a unit is a
    label (one linear assignment, or one per block for a grouped label) or, for each tie of grouped
    labels that may move blocks, the block step. A unit's new permutation is kept only when it is
    strictly cheaper, so the cost never increases; the descent stops after a round without change.

    Args:
        mean0, mean1: full state dicts of one network each (means, or point estimates); no batch dims.
        spec: the architecture's symmetries (e.g. :func:`symlib.trace.spec_of`).
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
    acts = _touched(spec, names)
    fa, fb = _features(cost, mean0, std0, mean1, std1, names)
    d = _Descent(spec, fa, fb, acts)

    perms = {k: torch.arange(n) for k, n in spec.perms.items()}
    if init is not None:
        perms.update({k: torch.as_tensor(v).long().cpu() for k, v in init.items()})
        ops.permute(mean1, spec, {k: v.to(mean1[next(iter(mean1))].device) for k, v in perms.items()})

    tracker = _Cost(cost, spec, mean0, std0, mean1, std1, names, d.by_param)
    first, tracker.terms = tracker.value(perms)

    units: list[tuple[str, str]] = [("label", k) for k in spec.perms if k in d.by_label]
    ties = spec.tie_classes()
    for tie, labels in ties.items():
        if tie is not None and spec.blocks[labels[0]][0] > 1:
            units.append(("blocks", tie))
    rng = np.random.default_rng(seed)
    costs = [first]
    steps: list[str] = []
    converged, rounds = False, 0
    while rounds < max_rounds:
        rounds += 1
        changed = False
        for i in rng.permutation(len(units)):
            kind, key = units[i]
            if kind == "label":
                new = _label_step(d, spec, key, perms)
                new = None if new is None else {key: new}
            else:
                labels = ties[key]
                new = _block_step(d, spec, labels, perms, lambda p, q=labels: tracker.value(p, q)[0])
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
        std=_permute_partial(std1, mean1, spec, out) if std1_given else None,
        cost=costs[-1],
        costs=costs,
        steps=steps,
        rounds=rounds,
        converged=converged,
    )


def _permute_partial(std: Params, like: Params, spec: Spec, perms) -> Params:
    """Permute a dict holding some of the tensors (missing ones filled with zeros, then dropped)."""
    if not std:
        return {}
    full = {k: std[k] if k in std else torch.zeros_like(v) for k, v in like.items()}
    out = ops.permute(full, spec, perms)
    return {k: out[k] for k in std}


def _label_step(d: _Descent, spec: Spec, key: str, perms):
    """One assignment for ``key``, the other labels held; the new permutation or ``None``."""
    c = d.label_matrix(key, perms)
    old = perms[key]
    if key not in spec.blocks:
        new = _lap(c)
    else:
        groups, tie = spec.blocks[key]
        k = spec.perms[key] // groups
        sigma = ops.block_perm(old, groups) if tie is not None else torch.arange(groups)
        new = torch.empty_like(old)
        for g in range(groups):  # one assignment per block (a loop over blocks, not neurons)
            rows = slice(g * k, (g + 1) * k)
            cols = slice(int(sigma[g]) * k, (int(sigma[g]) + 1) * k)
            new[rows] = int(sigma[g]) * k + _lap(c[rows, cols])
    return new if _gain_ok(c, new, old) else None


def _block_step(d: _Descent, spec: Spec, labels: list[str], perms, total_cost):
    """Move whole blocks of the grouped labels of one tie: the new permutations or ``None``.

    Candidates for the block permutation: all ``G!`` when ``G <= 4``, else two assignments over
    blocks, of :meth:`_Descent.block_matrix` (inner arrangements held) and of
    :meth:`_Descent.block_values` (inner arrangements re-solved on the tensors outside the tie).
    Each candidate moves the blocks of every label of the tie together, then re-solves the labels
    inside their blocks until no label changes; the best candidate is kept when its exact cost is
    strictly lower.
    """
    groups = spec.blocks[labels[0]][0]
    sigma = ops.block_perm(perms[labels[0]], groups)
    # perm = inner[move(sigma)]: ``inner`` keeps side 1's blocks in place and arranges their insides.
    inner = {q: perms[q][_block_move(ops.invert_perm(sigma), spec.perms[q] // groups)] for q in labels}
    if math.factorial(groups) <= 24:
        cands = [torch.as_tensor(c) for c in itertools.permutations(range(groups))]
    else:
        cands = [_lap(d.block_matrix(labels, groups, inner, perms)),
                 _lap(d.block_values(labels, groups, perms))]
    best, best_cost = None, total_cost(perms)
    for cand in cands:
        if torch.equal(cand, sigma):
            continue
        p = {**perms, **{q: inner[q][_block_move(cand, spec.perms[q] // groups)] for q in labels}}
        changed = True
        while changed:
            changed = False
            for q in labels:
                if q in d.by_label:
                    new = _label_step(d, spec, q, p)
                    if new is not None:
                        p[q], changed = new, True
        c = total_cost(p)
        if c < best_cost - 1e-12 * abs(best_cost):
            best, best_cost = p, c
    return None if best is None else {q: best[q] for q in labels}


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
    out_m, out_s = [], []
    for i in range(batch[0]):
        one_m = {k: v[i] for k, v in means.items()}
        one_s = None if stds is None else {k: v[i] for k, v in stds.items()}
        r = align(mean_ref, one_m, spec, std_ref, one_s, cost=cost, **kwargs)
        out_m.append(r.mean)
        out_s.append(r.std)
    mean = {k: torch.stack([m[k] for m in out_m]) for k in means}
    std = None if stds is None else {k: torch.stack([s[k] for s in out_s]) for k in stds}
    return mean, std


def barrier(values) -> float:
    r"""Loss barrier along a path: :math:`\max_t \big(L(t) - [(1-t) L(0) + t L(1)]\big)` for losses
    ``values`` measured at evenly spaced ``t`` from 0 to 1 (Frankle et al. 2020)."""
    v = [float(x) for x in values]
    if len(v) < 2 or not all(math.isfinite(x) for x in v):
        raise ValueError("barrier needs at least two finite losses, the path's ends included")
    n = len(v) - 1
    return max(x - ((1 - i / n) * v[0] + (i / n) * v[-1]) for i, x in enumerate(v))
