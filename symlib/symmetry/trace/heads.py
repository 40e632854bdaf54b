r"""Features that move only as whole heads: rotary position embeddings and grouped-query attention (book:
chapter "Transformers: permutations without scalings"; page "Architectures"). See
:mod:`symlib.symmetry.trace` and :mod:`~symlib.symmetry.trace.attention`; the table that picks these rules is
:mod:`~symlib.symmetry.trace.rules`.

**Rotary embeddings** (Llama, Mistral, Qwen2: ``q * cos + rotate_half(q) * sin``) turn the pair
:math:`(q_i, q_{i+d/2})` of a head of :math:`d` features (Hugging Face's ``rotate_half`` convention) at
position :math:`m` by the angle :math:`m\,\omega_i`, one frequency per pair:

.. math:: \tilde q_m = R_m q_m,\qquad R_m = \bigoplus_{i<d/2}
          \begin{pmatrix}\cos m\omega_i & -\sin m\omega_i\\ \sin m\omega_i & \cos m\omega_i\end{pmatrix},
          \qquad
          \tilde q_m^\top \tilde k_n = q_m^\top R_{n-m}\, k_n .

A change of basis :math:`q \to A q,\ k \to A^{-\top} k` keeps the scores for every :math:`m, n` exactly when
:math:`A^\top R_{n-m} A^{-\top} = R_{n-m}` for all offsets, i.e. when :math:`A` commutes with every
:math:`R_\delta`. The frequencies :math:`\omega_i` differ, so :math:`A` is block-diagonal over the pairs,
and a :math:`2\times 2` block commuting with all rotations is a rotation times a scale,
:math:`A_i = s_i R(\phi_i)` (a complex number; then :math:`A_i^{-\top} = s_i^{-1} R(\phi_i)`, and 2-D
rotations commute). So no permutation of a head's query-key features survives (it would move a pair to
another frequency; swapping the two entries of a pair is a reflection, which turns :math:`R_\delta` into
:math:`R_{-\delta}`), while the heads still move (every head has the same frequencies). What survives per
head of queries and keys: :math:`(\mathbb{C}^\times)^{d/2}`, :math:`d` real dimensions (:math:`d/2`
angles, :math:`d/2` scales) instead of :math:`GL(d)`'s :math:`d^2`. The spec keeps the head permutations,
and records these :math:`2\times 2` blocks apart from ``Spec.continuous`` (:math:`GL(k)` per block), in
``Spec.rotary`` (:class:`~symlib.symmetry.actions.Rotary`): when ``rotate_half``'s two halves make whole heads
of queries and of keys (``_mark_rotate_half``), their product records the rows that produce them
(``_record_rotary``). Under grouped-query attention one key head serves :math:`r` query heads, so the
group is :math:`(\mathbb{C}^\times)^{d/2}` per key-value head, acting alike on its :math:`r` query heads.
Values and the output projection keep their in-head permutations and :math:`GL(d_v)`.

**Grouped-query attention** (``repeat_kv``: keys and values of :math:`g` heads expanded to
:math:`g \times r` query heads, or ``scaled_dot_product_attention(..., enable_gqa=True)``): query head
:math:`(j, t)` reads key-value head :math:`j`. The heads may move by :math:`\sigma \in S_g` on the groups
(key, value and the group's query heads together) and, inside group :math:`j`, by
:math:`\tau_j \in S_r` on its query heads (and the matching blocks of the output projection's columns):
:math:`g!\,(r!)^g` head permutations, one label of query heads with :math:`g` blocks (``Spec.blocks``) tied
with the key and value heads. A value head feeds the :math:`r` query heads of its group, so a permutation
of its features would act on the output projection's columns at :math:`r` strided places, and it would
overlap the query heads' action there: no action of the spec expresses it, so under grouped-query
attention the values' in-head permutations and :math:`GL(d_v)` are not kept (a smaller, exact group).

How: features split into heads are a :class:`~.labels.Grid`; one whose label entries each cover whole
heads (a segment with ``inner`` a multiple of the features per head) is *heads only*. An operation that
breaks in-head permutations (a product with a tensor that varies along a head's features, a slice of
every head, a repeat of the heads) first *collapses* the grid (:func:`collapse`): a new label with one
entry per head acts, in blocks of the head's width, wherever the old label acted, and the old label is
fixed; states already computed are rewritten to the new label. Then rotary arithmetic (products with
``cos``/``sin``, ``rotate_half``'s slices, negation and concatenation, the sum) keeps the heads, and the
attention products tie the heads of queries, keys and values (:func:`pair`, :func:`attend`).

Every rule is ``rule(walker, node, op) -> state`` (:mod:`~symlib.symmetry.trace.rules`).
"""

from __future__ import annotations

import math

import torch.fx

from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Grid, Multi, Scores, Seg, State
from symlib.symmetry.trace.walker import name_of


# ------------------------------------------------------------------------------------------ collapse
def per_head(st: Grid) -> int:
    """The features of one entry of the grid's slowest axis (one head)."""
    return math.prod(st.sizes[1:])


def heads_only(st) -> bool:
    """Whether each label entry of grid ``st`` covers whole heads (no label inside a head)."""
    return (isinstance(st, Grid) and len(st.segs) == 1 and st.segs[0].inner > 1
            and st.segs[0].inner % per_head(st) == 0)


def collapse(w, node, st: Grid) -> Grid:
    """``st`` with its heads as the only label (module docstring); a heads-only or fixed grid as it is."""
    if heads_only(st) or w.is_fixed(st):
        return st
    if len(st.segs) != 1 or st.segs[0].inner != 1:
        raise w.refuse(node, "features split into heads that carry several labels, or flattened channels",
                       "split the output of one linear layer into heads")
    return Grid(st.axes, st.sizes, (collapse_label(w, node, st.segs[0], per_head(st)),), st.producer)


def collapse_label(w, node, seg: Seg, d: int) -> Seg:
    """The heads-only segment of ``seg`` (heads of ``d`` features): a new label of one entry per head acts,
    in blocks of ``d``, wherever ``seg``'s permutation acted; that permutation is fixed, and every state
    already computed that carried it is rewritten."""
    uf = w.perm_uf
    root = uf.find(seg.perm)
    if root == FIXED:
        w.scale_uf.union(seg.scale, FIXED)
        return Seg(FIXED, FIXED, seg.n, seg.inner)
    if root in uf.parts or seg.n % d:
        raise w.refuse(node, "heads whose label was cut into parts inside a head",
                       "split queries, keys and values into heads whole")
    heads = w.new(f"{root}.heads", seg.n // d)
    w.scale_uf.union(heads, FIXED)
    for a in list(w.actions):
        if a.perm is None:
            continue
        pos = 0
        for leaf, _, n in uf.leaves(a.perm):
            if leaf == root:
                if a.groups != 1:
                    raise w.refuse(node, "heads of a grouped convolution's channels", "this is not attention")
                w.act(a.param, a.axis, heads, FIXED, a.power, start=a.start + pos * a.inner,
                      inner=a.inner * d)
            pos += n
    members = {x for x in uf.parent if x != FIXED and uf.find(x) == root}
    w.grouped = [(heads if uf.find(p) == root else p, heads if uf.find(q) == root else q, g)
                 for p, q, g in w.grouped]
    for label in [k for k in w.kinds if uf.find(k) == root]:
        del w.kinds[label]
    uf.union(root, FIXED)
    w.scale_uf.union(seg.scale, FIXED)

    def seg_of(s: Seg) -> Seg:
        return Seg(heads, FIXED, s.n // d, s.inner * d) if s.perm in members else s

    def rewrite(x):
        if isinstance(x, State) and x.segs:
            return State(x.axis, tuple(seg_of(s) for s in x.segs), x.producer)
        if isinstance(x, Grid):
            return Grid(x.axes, x.sizes, tuple(seg_of(s) for s in x.segs), x.producer)
        if isinstance(x, Scores) and x.follows in members:
            return Scores(x.axis, x.heads, heads)
        if isinstance(x, Multi):
            return Multi(tuple(rewrite(i) for i in x.items))
        return x

    for n, x in list(w.states.items()):
        w.states[n] = rewrite(x)
    return seg_of(seg)


# ------------------------------------------------------------------------------------- rotary arithmetic
def arithmetic(w, node, op):
    """Features split into heads plus, times or divided by something: two heads-only grids added (the two
    terms of a rotary embedding), or a grid times a tensor without labels (``cos``, ``sin``): one constant
    over the heads' features keeps the grid, one that varies along them collapses it, one that varies
    over the heads fixes it. Anything else is ``None``: the rule table then asks
    :func:`.attention.arithmetic`."""
    name = name_of(op)
    nd = len(w.shape(node))
    args = [a for a in list(node.args[:2]) + list(node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    states = [w.states.get(a) for a in args]
    grids = [a for a, s in zip(args, states, strict=True) if isinstance(s, Grid)]
    rest = [a for a, s in zip(args, states, strict=True) if not isinstance(s, Grid)]
    if len(grids) == 2 and not rest and ("add" in name or "sub" in name):
        return _sum(w, node, grids, nd)
    plain = all(w.is_fixed(w.states.get(a)) for a in rest)  # numbers, cos and sin, parameters left alone
    first = node.args[0] if node.args else None
    if len(grids) == 1 and rest and plain and ("mul" in name or ("div" in name and first is grids[0])):
        return _times(w, node, grids[0], rest, nd)
    return None


def _aligned(w, a, nd: int) -> tuple[int, ...]:
    """The grid axes of node ``a`` in the numbering of a result of ``nd`` axes (broadcasting pads left)."""
    return tuple(x + nd - len(w.shape(a)) for x in w.states[a].axes)


def _sum(w, node, grids, nd: int):
    a, b = grids
    if _aligned(w, a, nd) != _aligned(w, b, nd) or w.states[a].sizes != w.states[b].sizes:
        return None
    if heads_only(w.states[a]) != heads_only(w.states[b]):
        for x in grids:
            collapse(w, node, w.states[x])
    sa, sb = w.states[a], w.states[b]
    segs = w.merge(sa.segs, sb.segs, node)
    return Grid(_aligned(w, a, nd), sa.sizes, segs, sa.producer)


def _times(w, node, grid, rest, nd: int):
    st = w.states[grid]
    axes = _aligned(w, grid, nd)
    varies = set()
    for a in rest:
        shape = (1,) * (nd - len(w.shape(a))) + tuple(w.shape(a))
        varies |= {i for i, x in enumerate(axes) if shape[x] != 1}
    if 0 in varies:  # a factor per head: the heads cannot move
        w.fix(st)
        return UNLABELLED
    if varies:  # a factor per feature of every head: only whole heads move
        st = collapse(w, node, st)
    return Grid(axes, st.sizes, st.segs, st.producer)


def neg(w, node, op=None):
    """``-x`` of features split into heads: the grid as it is."""
    return w.states.get(w.tensor_args(node)[0])


# ------------------------------------------------------------------------------------ rotate_half, repeat
def cat(w, node, op=None):
    """``torch.cat`` of grids: along a head's features (``rotate_half``) the heads-only parts, with one
    heads label, lie side by side in every head; along an axis outside the grid, the parts' labels merge."""
    parts = w.arg(node, 0, "tensors")
    nd = len(w.shape(node))
    dim = w.arg(node, 1, "dim", 0) % nd
    if not all(isinstance(w.states.get(p), Grid) for p in parts):
        raise w.refuse(node, "a concatenation of features split into heads with other tensors",
                       "merge the heads back first")
    axes = {_aligned(w, p, nd) for p in parts}
    if len(axes) != 1:
        raise w.refuse(node, "a concatenation of grids of heads laid out differently", "this is unexpected")
    axes = axes.pop()
    if dim not in axes:
        first = w.states[parts[0]]
        segs = first.segs
        for p in parts[1:]:
            segs = w.merge(segs, w.states[p].segs, node)
        return Grid(axes, first.sizes, segs, first.producer)
    k = axes.index(dim)
    if k == 0:
        raise w.refuse(node, "a concatenation of the heads of several tensors",
                       "concatenate before the split")
    for p in parts:
        collapse(w, node, w.states[p])
    states = [w.states[p] for p in parts]
    if any(not heads_only(s) and not w.is_fixed(s) for s in states) or \
            len({s.segs[0].n for s in states}) != 1:
        raise w.refuse(node, "a concatenation of heads that differ in number", "this is unexpected")
    _mark_rotate_half(w, states, k)
    labelled = [s for s in states if not w.is_fixed(s)]
    for s in labelled[1:]:
        w.perm_uf.union(labelled[0].segs[0].perm, s.segs[0].perm)
    sizes = list(states[0].sizes)
    sizes[k] = sum(s.sizes[k] for s in states)
    n = states[0].segs[0].n
    base = labelled[0].segs[0].perm if labelled else FIXED
    return Grid(axes, tuple(sizes), (Seg(base, FIXED, n, math.prod(sizes) // n),), states[0].producer)


def _mark_rotate_half(w, states, k: int) -> None:
    """``rotate_half``: the two halves of every head side by side, along the head's features
    (``torch.cat((-x2, x1), -1)``): when the halves make whole heads (every feature rotates), the heads label
    is rotated (``Records.rotated``), and a product of rotated queries and keys records a rotary group
    (:func:`pair`)."""
    if len(states) != 2 or k != len(states[0].sizes) - 1 or states[0].sizes[k] != states[1].sizes[k]:
        return
    width = 2 * states[0].sizes[k]
    for st in states:
        if w.is_fixed(st):
            continue
        root = w.perm_uf.find(st.segs[0].perm)
        inner = {a.inner for a in w.actions if a.perm is not None and w.perm_uf.find(a.perm) == root}
        if inner == {width}:
            w.rotated.add(root)


def _record_rotary(w, sq: Seg, sk: Seg, d: int) -> None:
    """Rotated queries meet rotated keys (:func:`_mark_rotate_half` saw both): the actions that produce them,
    before they tie, are the rows the rotary group acts on (``Records.rotary``, ``Spec.rotary``)."""
    uf = w.perm_uf
    rq, rk = uf.find(sq.perm), uf.find(sk.perm)
    rotated = {uf.find(x) for x in w.rotated}
    if FIXED in (rq, rk) or rq not in rotated or rk not in rotated:
        return

    def rows(root):
        return [a for a in w.actions if a.perm is not None and uf.find(a.perm) == root]

    w.rotary.append((rows(rq), rows(rk), d))


def expand(w, node, op=None):
    """``expand`` of heads on a new axis right after the heads' axis (``repeat_kv`` of grouped-query
    attention, then a reshape merging the two): label entry ``j`` covers the ``r`` copies of its heads."""
    src = w.tensor_args(node)[0]
    st = w.states.get(src)
    if w.is_fixed(st):
        return UNLABELLED
    in_shape, out_shape = tuple(w.shape(src)), tuple(w.shape(node))
    pad = len(out_shape) - len(in_shape)
    axes = tuple(a + pad for a in st.axes)
    grown = [i for i in range(len(out_shape)) if i >= pad and in_shape[i - pad] == 1 and out_shape[i] != 1]
    if not grown:
        return Grid(axes, st.sizes, st.segs, st.producer)
    if grown != [axes[0] + 1] or axes[0] + 1 in axes:
        raise w.refuse(node, "an expand of features split into heads other than a repeat of every head",
                       "repeat key and value heads as repeat_kv does (a new axis after the heads)")
    r = out_shape[grown[0]]
    st = collapse(w, node, st)
    seg = st.segs[0]
    return Grid((axes[0], grown[0], *axes[1:]), (st.sizes[0], r, *st.sizes[1:]),
                (Seg(seg.perm, FIXED, seg.n, seg.inner * r),), st.producer)


def repeat(w, node, feats, r: int):
    """The features ``(segment, heads, per_head, head_axis)`` of keys or values with each head repeated
    ``r`` times (``scaled_dot_product_attention(..., enable_gqa=True)``)."""
    seg, h, d, axis = feats
    if seg is None or r == 1:
        return (seg, h * r, d, axis)
    if seg.inner == 1:
        seg = collapse_label(w, node, seg, d)
    return (Seg(seg.perm, FIXED, seg.n, seg.inner * r), h * r, d, axis)


# ------------------------------------------------------------------------------------ attention products
def _tie(w, node, a: Seg, b: Seg) -> None:
    """Two heads labels that move together: one label when they have as many entries, else the finer one's
    blocks follow the coarser one's entries (query heads in the groups of key-value heads)."""
    if a.n == b.n:
        w.perm_uf.union(a.perm, b.perm)
        return
    fine, coarse = (a, b) if a.n > b.n else (b, a)
    if fine.n % coarse.n:
        raise w.refuse(node, f"{fine.n} heads grouped over {coarse.n}", "use a number of query heads that "
                       "is a multiple of the key-value heads")
    w.grouped.append((fine.perm, coarse.perm, coarse.n))


def pair(w, node, q, k) -> Scores:
    """Queries times keys where one side moves only as whole heads (rotary embeddings, repeated keys): the
    other side is collapsed too, and the heads tie; rotated queries and keys record their rotary group
    (module docstring)."""
    (sq, hq, dq, aq), (sk, hk, dk, ak) = q, k
    if (hq, dq, aq) != (hk, dk, ak):
        raise w.refuse(node, f"queries of {hq} heads of {dq} and keys of {hk} heads of {dk}",
                       "give queries and keys the same heads (repeat key heads as repeat_kv does)")
    sq = collapse_label(w, node, sq, dq) if sq.inner == 1 else sq
    sk = collapse_label(w, node, sk, dk) if sk.inner == 1 else sk
    for s in (sq, sk):
        w.scale_uf.union(s.scale, FIXED)
    _record_rotary(w, sq, sk, dq)
    _tie(w, node, sq, sk)
    return Scores(len(w.shape(node)) + aq, hq, w.perm_uf.find(sq.perm))


def attend(w, node, scores, v):
    """Attention weights times heads-only values (repeated values): the values' heads tie with the scores'
    heads, and the result moves with the finer of the two (a query head's output with the query head)."""
    sv, hv, dv, av = v
    nd = len(w.shape(node))
    if not isinstance(scores, Scores):
        w.fix_seg(sv)
        return UNLABELLED
    if scores.heads != hv or scores.axis - nd != av:
        raise w.refuse(node, f"attention weights of {scores.heads} heads on values of {hv} heads",
                       "give the values the heads of the queries")
    n = w.perm_uf.size[scores.follows]
    if n > hv or hv % n:  # queries with labels inside their heads: their heads are blocks of the label
        w.grouped.append((scores.follows, sv.perm, sv.n))
        out = sv
    else:
        follows = Seg(scores.follows, FIXED, n, hv * dv // n)
        _tie(w, node, follows, sv)
        out = follows if n >= sv.n else sv
    out = Seg(out.perm, FIXED, out.n, hv * dv // out.n)
    return Grid((nd + av, nd - 1), (hv, dv), (out,), None)
