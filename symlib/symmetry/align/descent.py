r"""Coordinate descent over the permutation labels of a spec, one linear assignment per step (book: chapter
"Aligning variational posteriors").

A label's cost matrix is linear in its permutation when the others are held (:class:`Descent`); a grouped
label is solved inside its blocks, and a tie of grouped labels gets a step that moves whole blocks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import torch
from scipy.optimize import linear_sum_assignment

from symlib.params import Params
from symlib.symmetry import ops
from symlib.symmetry.align.costs import Act
from symlib.symmetry.spec import Spec, SymmetryError

__all__ = ["Descent"]


def _lap(c: torch.Tensor) -> torch.Tensor:
    """Columns of the minimum-cost assignment of a square cost matrix (row ``i`` gets column ``out[i]``)."""
    _, cols = linear_sum_assignment(c.detach().cpu().numpy())
    return torch.as_tensor(cols, dtype=torch.long)


def _block_move(sigma: torch.Tensor, k: int) -> torch.Tensor:
    """The permutation that moves block ``g`` (``k`` entries) to block ``sigma[g]``, keeping the inside."""
    return (sigma[:, None] * k + torch.arange(k)).reshape(-1)


class Descent:
    """Coordinate descent over the labels of ``spec`` for the bilinear cost of ``fa``, ``fb``."""

    def __init__(self, spec: Spec, fa, fb, acts: list[Act]):
        self.spec = spec
        # Grouped weights become block-diagonal dense tensors: every action is then an ordinary axis.
        self.fa = {k: [ops.dense_weight({k: t}, spec, k) for t in ts] for k, ts in fa.items()}
        self.fb = {k: [ops.dense_weight({k: t}, spec, k) for t in ts] for k, ts in fb.items()}
        self.acts = acts
        self.by_label: dict[str, list[Act]] = {}
        self.by_param: dict[str, list[Act]] = {}
        for a in acts:
            self.by_label.setdefault(a.label, []).append(a)
            self.by_param.setdefault(a.param, []).append(a)
        # Side 0 is fixed: its matrices (n, rest) are built once per action.
        self.mat_a = {a: self._mat(self.fa[a.param], a) for a in acts}

    @staticmethod
    def _mat(ts: list[torch.Tensor], a: Act) -> torch.Tensor:
        return torch.cat([a.rows(t) for t in ts], dim=1)

    def _side1(self, param: str, perms: Mapping[str, torch.Tensor], skip=()) -> list[torch.Tensor]:
        """Side-1 features of ``param`` permuted by every action except those of the labels in ``skip``."""
        out = []
        for t in self.fb[param]:
            for a in self.by_param[param]:
                if a.label not in skip:
                    t = a.permute(t, perms[a.label])
            out.append(t)
        return out

    def label_matrix(self, label: str, perms) -> torch.Tensor:
        """``C[i, j]``: the cost of sending side-1 neuron ``j`` to position ``i`` of ``label``, the
        other labels held (one matrix product per action of the label; actions of one label on
        disjoint slices of an axis add up, each slice reading only its own entries)."""
        n = self.spec.perms[label]
        c = torch.zeros(n, n, dtype=torch.float64)
        side1: dict[str, list[torch.Tensor]] = {}
        for a in self.by_label.get(label, []):
            if a.param not in side1:
                side1[a.param] = self._side1(a.param, perms, skip=(label,))
            c += (self.mat_a[a] @ self._mat(side1[a.param], a).T).cpu()
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
            mine = [a for a in acts if a.label in tied]
            axes = sorted({a.axis for a in mine})
            if not axes:
                continue
            side1 = self._side1(param, cur)
            for ta, tb in zip(self.fa[param], side1, strict=True):
                if len(axes) == 1:  # one axis, one or several slices (queries, keys, values)
                    for a in mine:
                        x, y = a.blocks(ta, groups), a.blocks(tb, groups)
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
                mb = self._mat(self._side1(a.param, perms, skip=(q,)), a)
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


def gain_ok(c: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether the assignment ``new`` is strictly cheaper than ``old`` beyond rounding."""
    rows = torch.arange(c.shape[0])
    v_new, v_old = float(c[rows, new].sum()), float(c[rows, old].sum())
    eps = 1e-12 * c.shape[0] * max(float(c.abs().max()), 1e-300)
    return v_new < v_old - eps


def permute_partial(std: Params, like: Params, spec: Spec, perms) -> Params:
    """Permute a dict holding some of the tensors (missing ones filled with zeros, then dropped)."""
    if not std:
        return {}
    full = {k: std[k] if k in std else torch.zeros_like(v) for k, v in like.items()}
    out = ops.permute(full, spec, perms)
    return {k: out[k] for k in std}


def label_step(d: Descent, spec: Spec, key: str, perms):
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
    return new if gain_ok(c, new, old) else None


def block_step(d: Descent, spec: Spec, labels: list[str], perms, total_cost):
    """Move whole blocks of the grouped labels of one tie: the new permutations or ``None``.

    Candidates for the block permutation: all ``G!`` when ``G <= 4``, else two assignments over
    blocks, of :meth:`Descent.block_matrix` (inner arrangements held) and of
    :meth:`Descent.block_values` (inner arrangements re-solved on the tensors outside the tie).
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
                    new = label_step(d, spec, q, p)
                    if new is not None:
                        p[q], changed = new, True
        c = total_cost(p)
        if c < best_cost - 1e-12 * abs(best_cost):
            best, best_cost = p, c
    return None if best is None else {q: best[q] for q in labels}
