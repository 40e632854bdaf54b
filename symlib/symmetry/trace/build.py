r"""The :class:`~symlib.symmetry.spec.Spec` built from what the walk of a traced graph recorded (book: page
"Architectures").

:func:`assemble` takes the walk's records (:class:`~symlib.symmetry.trace.walker.Records`: the actions,
the union-find of labels, blocks, attention and rotary records, norms) and the model, and returns the
spec: each recorded action on the final label classes, cut labels replaced by their parts, tied
parameters and their aliases (one tensor under several names acts under each), the blocks of grouped
convolutions and heads, the continuous groups of attention and the rotary groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from symlib.symmetry.spec import Action, Rotary, Spec, SymmetryError
from symlib.symmetry.trace.labels import FIXED, UnionFind

if TYPE_CHECKING:
    from symlib.symmetry.trace.walker import Records

__all__ = ["assemble"]


def assemble(records: Records, model: nn.Module) -> Spec:
    """The :class:`~symlib.symmetry.spec.Spec` of ``model`` from what the walk of its graph recorded: the
    actions on the final labels, in the order of the labels' layers, with blocks, continuous groups and
    the aliases of tied parameters (module docstring)."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names: dict[int, list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        names.setdefault(id(v), []).append(k)
    groups = [group for group in names.values() if len(group) > 1]
    twins = {k: [x for x in group if x != k] for group in groups for k in group}
    actions = _with_twins(_tied(_actions(records)), twins)
    weights = records.weights | {t for w in records.weights for t in twins.get(w, ())}
    perm_uf, scale_uf = records.perm_uf, records.scale_uf
    used_p = {a.perm for a in actions} - {None}
    used_s = {a.scale for a in actions} - {None}
    perms = {r: perm_uf.size[r] for r in sorted(used_p, key=perm_uf.position)}
    scales = {r: scale_uf.size[r] for r in sorted(used_s, key=scale_uf.position)}
    producers = [p for p in records.output_producers if p is not None]
    bias = f"{producers[-1]}.bias" if producers else None
    return Spec(
        shapes=shapes, perms=perms, scales=scales, actions=tuple(actions), weights=frozenset(weights),
        output_bias=bias if bias in shapes else None, no_scaling=dict(records.no_scaling),
        blocks=_blocks(records, perms), continuous=_continuous(records, perms, actions, shapes, weights),
        aliases={x: group[0] for group in groups for x in group[1:] if x in shapes},
        norms={k: v for k, v in records.norms.items() if k in shapes},
        rotary=_rotary(records, perms),
    )


def _pieces(uf: UnionFind, label: str) -> list[tuple[str | None, bool, int, int]]:
    """``(root or None when fixed, parity, offset, size)`` of the parts of ``label``'s class."""
    out, pos = [], 0
    for root, odd, n in uf.leaves(label):
        out.append((None if root == FIXED else root, odd, pos, n))
        pos += n
    return out


def _actions(records: Records) -> list[Action]:
    """The recorded actions on the final labels: each label replaced by the parts it was cut into, the
    power of a permutation on the far side of a bilinear form negated (attention keys)."""
    actions, seen = [], set()

    def add(a: Action) -> None:
        if (a.perm is not None or a.scale is not None) and a not in seen:
            seen.add(a)
            actions.append(a)

    for r in records.actions:
        ps, ss = _pieces(records.perm_uf, r.perm), _pieces(records.scale_uf, r.scale)
        if r.groups != 1 and (len(ps) > 1 or len(ss) > 1):
            raise SymmetryError(f"the grouped weight {r.param!r} reads a label that was cut into parts")
        if len(ss) == 1 and ss[0][0] is None:
            ss = [(None, False, o, n) for _, _, o, n in ps]
        if len(ps) == 1 and ps[0][0] is None:
            ps = [(None, False, o, n) for _, _, o, n in ss]
        aligned = [(o, n) for _, _, o, n in ps] == [(o, n) for _, _, o, n in ss]
        for i, (pr, odd, o, _) in enumerate(ps):
            sr = ss[i][0] if aligned else None
            at = {"start": r.start + o * r.inner}
            if odd and sr is not None:  # a flipped permutation cannot share the action of a scale
                add(dataclasses.replace(r, perm=None, scale=sr, **at))
                sr = None
            add(dataclasses.replace(r, perm=pr, scale=sr, power=-r.power if odd else r.power, **at))
        if not aligned:
            for sr, _, o, _ in ss:
                add(dataclasses.replace(r, perm=None, scale=sr, start=r.start + o * r.inner))
    return actions


def _tied(actions: list[Action]) -> list[Action]:
    """A parameter read twice on one axis by one label (an embedding table reused as the classifier, once
    as rows, once as columns) is permuted once, and cannot scale both ways: its scales go."""
    seen: dict[tuple, Action] = {}
    twice, scales = set(), set()
    for a in actions:
        if a.perm is None:
            continue
        first = seen.setdefault((a.param, a.axis, a.perm, a.start, a.inner), a)
        if first is not a:
            twice.add(a)
            scales.update(x.scale for x in (first, a) if x.scale is not None)
    if not twice:
        return actions
    out = [dataclasses.replace(a, scale=None if a.scale in scales else a.scale)
           for a in actions if a not in twice]
    return [a for a in out if a.perm is not None or a.scale is not None]


def _with_twins(actions: list[Action], twins: Mapping[str, list[str]]) -> list[Action]:
    """The same actions on every other name of a tied parameter (a state dict lists a tied embedding and
    classifier under both names; the graph reads one), so both names stay equal."""
    out, acted = list(actions), {a.param for a in actions}
    for a in actions:
        out += [dataclasses.replace(a, param=t) for t in twins.get(a.param, ()) if t not in acted]
    return out


def _continuous(records: Records, perms, actions, shapes, weights) -> dict[str, tuple[str, int]]:
    """Attention labels with their general linear groups, and the dimensions of their redundant biases:
    a key bias only shifts each query's scores by a constant, and a value bias passes through the
    attention (its weights sum to 1) into the output projection's bias."""
    uf = records.perm_uf
    out: dict[str, tuple[str, int]] = {}
    bad = {uf.find(x) for x in uf.conflicts}
    no_shift = {uf.find(x) for x in records.no_bias_shift}
    for label, kind in records.kinds.items():
        leaves = uf.leaves(label)
        if len(leaves) != 1 or leaves[0][0] not in perms or leaves[0][0] in bad:
            continue
        root = leaves[0][0]
        mine = [a for a in actions if a.perm == root]
        biases = [a for a in mine if a.param not in weights and len(shapes[a.param]) == 1]
        extra = 0
        if root not in no_shift and kind == "qk" and any(a.power < 0 for a in biases):
            extra = perms[root]
        if root not in no_shift and kind == "vo" and any(a.power > 0 for a in biases):
            outs = [a.param for a in mine if a.param in weights and a.power < 0]
            if outs and all(f"{p.rsplit('.', 1)[0]}.bias" in shapes for p in outs):
                extra = perms[root]
        out[root] = (kind, extra)
    return {k: out[k] for k in perms if k in out}


def _rotary(records: Records, perms) -> dict[str, Rotary]:
    """The rotary groups (``Spec.rotary``), keyed by the key heads' final label: each recorded action on
    the rows of queries or keys covers whole heads of ``per_head`` features (``Action.inner``)."""
    uf = records.perm_uf
    out: dict[str, Rotary] = {}
    for queries, keys, d in records.rotary:
        def rows(acts, d=d):
            spans = set()
            for a in acts:
                if a.axis != 0 or a.inner != d or a.groups != 1:
                    return None
                n = sum(size for _, _, size in uf.leaves(a.perm))
                spans.add((a.param, a.start, a.start + n * d))
            return tuple(sorted(spans))

        q, k = rows(queries), rows(keys)
        label = uf.find(keys[0].perm) if keys else None
        if q and k and label in perms:
            out[label] = Rotary(q, k, (k[0][2] - k[0][1]) // d, d)
    return out


def _blocks(records: Records, perms) -> dict[str, tuple[int, str | None]]:
    """The permutation labels with blocks (groups of a convolution, heads), and the tie of each: labels
    tied together move their blocks alike; a tie with the fixed class keeps them in place (``None``)."""
    pf = records.perm_uf.find
    groups: dict[str, int] = {}
    tie = UnionFind()
    for p_in, p_out, g in records.grouped:
        for label in (pf(p_in), pf(p_out)):
            if label not in tie.parent:
                tie.add(label)
            if label != FIXED and groups.setdefault(label, g) != g:
                raise SymmetryError(
                    f"channels {label!r} feed or leave grouped convolutions (or attention heads) with "
                    f"{groups[label]} and {g} groups; spec_of supports one group count per channel set"
                )
        tie.union(pf(p_in), pf(p_out))
    ordered = [label for label in perms if label in groups]
    return {
        label: (groups[label], None if tie.find(label) == FIXED else tie.find(label))
        for label in ordered
    }
