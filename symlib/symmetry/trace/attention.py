r"""Rules for attention (book: chapter "Transformers: permutations without scalings"; Tran et al. 2024 for
the group of attention). See :mod:`symlib.symmetry.trace`; the table that picks these rules is
:mod:`~symlib.symmetry.trace.rules`.

Multi-head attention with ``h`` heads of width ``d_k`` (queries, keys) and ``d_v`` (values) computes, per
head :math:`i`, :math:`\mathrm{softmax}(Q_i K_i^\top / \sqrt{d_k}) V_i`, then :math:`W_O` of the
concatenated heads. Its symmetries, all found here from the operations themselves:

* ``Q @ K.T`` (or ``scaled_dot_product_attention``) contracts the query and key features: their labels
  merge into one permutation label (the in-head query-key permutation), the keys on the opposite side of
  the bilinear form (``Action.power`` -1), so the continuous group
  :math:`Q_i \to Q_i A_i,\ K_i \to K_i A_i^{-\top}` (:math:`A_i \in GL(d_k)`) acts as the label's
  scaling would; no scaling label is kept for them, their scales being part of that group;
* ``weights @ V`` carries the value features to the output projection unchanged (in-head value
  permutation, and :math:`V_i \to V_i B_i,\ W_{O,i} \to B_i^{-1} W_{O,i}`, :math:`B_i \in GL(d_v)`);
* heads: features split into ``(h, d)`` axes (:class:`~.labels.Grid`, made by a reshape,
  :mod:`~symlib.symmetry.trace.views`) form blocks of their label (``Spec.blocks``), and the scores of
  the heads (:class:`~.labels.Scores`) tie the query-key and value labels of one attention, so their heads
  move together; a parameter indexed by heads (a relative position bias table) gets a label of its own in
  the same tie, and so does a table looked up with positions whose columns are the heads (T5's relative
  position bias, an embedding: its label of one entry per head joins the tie of every attention whose
  scores it is added to, so attentions sharing one bias move their heads together). On features split
  into heads only reshapes, axis moves, copies and scaling by numbers are known; on scores also masks
  (added, or selected with ``torch.where``), biases, softmax and element-wise activations (they keep the
  heads);
* ``nn.MultiheadAttention`` and torchvision's ``shifted_window_attention`` (Swin) take their parameters
  directly: they are rules of their own, with the same labels, opened by one input projection
  (:func:`project_qkv`).

The labels of queries and keys (``"qk"``) and of values (``"vo"``) are recorded with the walker
(``Records.kinds``), and the assembly puts them in ``Spec.continuous``
(:mod:`symlib.symmetry.continuous`).

Every rule is ``rule(walker, node, op) -> state`` (:mod:`~symlib.symmetry.trace.rules`).
"""

from __future__ import annotations

import inspect

import torch
import torch.fx
from torch import nn

from symlib.symmetry.trace import heads, layers
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Grid, Multi, Scores, Seg, State
from symlib.symmetry.trace.walker import name_of


# ------------------------------------------------------------------------------------ queries and keys
def _features(w, node, arg, on: int):
    """``(segment, heads, per_head, head_axis)`` of queries, keys or values whose features lie on axis
    ``on`` (-1, or -2 for transposed keys), inside heads (a two-axis grid) or alone; ``segment`` is
    ``None`` for fixed features."""
    st = w.states.get(arg)
    shape = w.shape(arg)
    nd = len(shape)
    on %= nd
    if w.is_fixed(st):
        return None, 1, shape[on], None
    if isinstance(st, State) and st.axis == on and len(st.segs) == 1 and st.segs[0].inner == 1:
        return st.segs[0], 1, shape[on], None
    if (isinstance(st, Grid) and len(st.axes) == 2 and st.axes[1] == on and len(st.segs) == 1
            and (st.segs[0].inner == 1 or heads.heads_only(st))):  # in-head labels, or whole heads
        return st.segs[0], st.sizes[0], st.sizes[1], st.axes[0] - nd
    raise w.refuse(node, "an attention whose features are not one label laid out as (heads, features) on "
                   "the last axes", "project queries, keys and values with one linear layer each (or one "
                   "fused layer) and split the heads with a reshape")


def pair_qk(w, node, q, k):
    """Queries and keys contracted: one label, keys on the opposite side; the scores' state."""
    (sq, hq, dq, aq), (sk, hk, dk, ak) = q, k
    if sq is None or sk is None:
        for seg in (sq, sk):
            if seg is not None:
                w.fix_seg(seg)
        return UNLABELLED
    if sq.inner > 1 or sk.inner > 1:  # heads only (rotary embeddings, repeated keys)
        return heads.pair(w, node, q, k)
    if (hq, dq, aq) != (hk, dk, ak):
        raise w.refuse(node, f"queries of {hq} heads of {dq} and keys of {hk} heads of {dk}",
                       "give queries and keys the same heads (grouped-query attention is not supported)")
    w.perm_uf.union(sq.perm, sk.perm, odd=True)
    w.scale_uf.union(sq.scale, FIXED)
    w.scale_uf.union(sk.scale, FIXED)
    w.kinds[sq.perm] = "qk"
    if hq == 1:
        return UNLABELLED
    w.grouped.append((sq.perm, sk.perm, hq))
    return Scores(len(w.shape(node)) + aq, hq, sq.perm)


def attend(w, node, scores, v):
    """Values weighted by attention scores: the values' labels pass, their heads tie with the scores'."""
    sv, hv, dv, av = v
    nd = len(w.shape(node))
    if sv is None:
        if isinstance(scores, Scores):
            w.grouped.append((scores.follows, FIXED, scores.heads))
        return UNLABELLED
    if sv.inner > 1:  # values repeated for grouped-query attention
        return heads.attend(w, node, scores, v)
    if isinstance(scores, Scores):
        if scores.heads != hv or scores.axis - nd != av:
            raise w.refuse(node, f"attention weights of {scores.heads} heads on values of {hv} heads",
                           "give the values the heads of the queries")
        w.grouped.append((scores.follows, sv.perm, hv))
    elif hv > 1:  # weights that do not depend on labels: the heads cannot move
        w.grouped.append((sv.perm, FIXED, hv))
    w.scale_uf.union(sv.scale, FIXED)
    w.kinds[sv.perm] = "vo"
    seg = Seg(sv.perm, FIXED, sv.n)
    if hv == 1:
        return State(nd - 1, (seg,), None)
    return Grid((nd + av, nd - 1), (hv, dv), (seg,), None)


def matmul(w, node, op=None):
    """``a @ b``: queries times keys, attention weights times values, or features times a parameter (a
    linear layer, :func:`.layers.linear`)."""
    a, b = node.args[0], node.args[1]
    sa, sb = w.states.get(a), w.states.get(b)
    if isinstance(sb, Attr) and not isinstance(sa, (Grid, Scores)) and len(sb.shape) == 2:
        return layers.linear(w, node, a, b, None, transposed=True)
    if w.is_fixed(sa) and w.is_fixed(sb):
        return UNLABELLED
    if isinstance(sa, Attr) or isinstance(sb, Attr):
        raise w.refuse(node, "a product of a labelled tensor and a parameter other than x @ W (W 2-D)"
                       + w.parameter_note(node), "use the parameter through an nn.Linear layer")
    if isinstance(sa, Scores) or (w.is_fixed(sa) and not _on(sb, -2, w.shape(b))):
        return attend(w, node, sa if isinstance(sa, Scores) else None, _features(w, node, b, -1))
    if _on(sa, -1, w.shape(a)) or _on(sb, -2, w.shape(b)):
        return pair_qk(w, node, _features(w, node, a, -1), _features(w, node, b, -2))
    raise w.refuse(node, "a matrix product of labelled tensors that is neither queries times keys nor "
                   "attention weights times values", "its symmetries are unknown to symlib")


def _on(st, axis: int, shape) -> bool:
    """Whether labelled features of ``st`` lie on ``axis`` (the last axis of a grid)."""
    axis %= len(shape)
    return (isinstance(st, State) and bool(st.segs) and st.axis == axis) or (
        isinstance(st, Grid) and st.axes[-1] == axis)


def sdpa(w, node, op=None):
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``."""
    q, k, v = (_features(w, node, w.arg(node, i, n), -1) for i, n in enumerate(("query", "key", "value")))
    if w.arg(node, 7, "enable_gqa", False) and q[1] != k[1]:  # grouped-query attention: repeat key heads
        k, v = (heads.repeat(w, node, x, q[1] // x[1]) for x in (k, v))
    scores = pair_qk(w, node, q, k)
    mask = w.arg(node, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node) and w.shape(mask) is not None:
        scores = _add_to_scores(w, node, scores, mask, len(w.shape(node)))
    return attend(w, node, scores, v)


# -------------------------------------------------------------------------------------------- scores
def _add_to_scores(w, node, scores, arg, nd: int):
    """A tensor added to attention scores: a parameter per head moves with the heads; anything else that
    differs between heads keeps them in place; labelled features are refused."""
    st = w.states.get(arg)
    shape = (1,) * (nd - len(w.shape(arg))) + tuple(w.shape(arg))
    if isinstance(st, (State, Grid)) and not w.is_fixed(st):
        return _labelled_heads(w, node, scores, st, nd - len(w.shape(arg)))
    if not isinstance(scores, Scores) or shape[scores.axis] == 1:
        return scores
    axis = scores.axis - (nd - len(w.shape(arg)))
    if isinstance(st, Attr) and st.in_state_dict and st.param_axis(axis) is not None:
        heads_param(w, scores, st, axis)
    elif isinstance(st, Scores):
        w.grouped.append((scores.follows, st.follows, scores.heads))
    else:
        w.grouped.append((scores.follows, FIXED, scores.heads))
    return scores


def _labelled_heads(w, node, scores, st, shift: int):
    """A labelled tensor added to attention scores: one label of one entry per head on the scores' heads
    axis (a relative position bias looked up in an embedding whose columns are the heads) joins the tie
    of the attention's labels, its scale fixed (the softmax is not homogeneous); fixed scores (heads that
    cannot move) fix it. Anything else is refused."""
    segs = st.segs if isinstance(st, State) else ()
    if not (isinstance(st, State) and len(segs) == 1 and segs[0].inner == 1
            and (not isinstance(scores, Scores) or (st.axis + shift == scores.axis
                                                    and segs[0].n == scores.heads))):
        raise w.refuse(node, "labelled features added to attention scores, other than one label of one "
                       "entry per head on the heads' axis", "add to the scores only tensors indexed by "
                       "heads and positions (a per-head bias looked up in a table whose columns are the "
                       "heads)")
    w.scale_uf.union(segs[0].scale, FIXED)
    if isinstance(scores, Scores):
        w.grouped.append((scores.follows, segs[0].perm, scores.heads))
    else:
        w.fix(st)
    return scores


def where(w, node, op=None):
    """``torch.where(c, a, b)`` with attention scores as a branch (a mask written as a selection): the
    condition and the other branch act on the scores as a mask or a bias added to them do (per head they
    tie or pin the heads). Features split into heads are refused."""
    args = [w.arg(node, i, k) for i, k in enumerate(("condition", "input", "other"))]
    args = [a for a in args if isinstance(a, torch.fx.Node) and w.shape(a) is not None]
    states = [w.states.get(a) for a in args]
    if any(isinstance(s, Grid) for s in states):
        raise w.refuse(node, "a selection (where) of features split into heads",
                       "merge the heads back first, or select on the attention scores")
    nd = len(w.shape(node))
    main_arg = next(a for a, s in zip(args, states, strict=True) if isinstance(s, Scores))
    main = w.states[main_arg]
    scores = Scores(main.axis + nd - len(w.shape(main_arg)), main.heads, main.follows)
    for a in args:
        if a is not main_arg:
            scores = _add_to_scores(w, node, scores, a, nd)
    return scores


def heads_param(w, scores: Scores, attr: Attr, axis: int) -> None:
    """A parameter indexed by the heads of ``scores`` on (view) axis ``axis``: a label of one entry per
    head, in the tie of the attention's labels."""
    label = w.new(f"{layers.layer_of(attr.name)}.heads", scores.heads)
    w.scale_uf.union(label, FIXED)
    w.grouped.append((scores.follows, label, scores.heads))
    w.weights.add(attr.name)
    w.act(attr.name, attr.param_axis(axis), label, FIXED, 1)


def keep(w, node, op=None):
    """An operation that leaves features split into heads, or attention scores, as they are (a copy, a
    dropout; on scores also softmax and element-wise activations)."""
    return w.states.get(w.tensor_args(node)[0])


def arithmetic(w, node, op):
    """Scores plus masks or position biases; heads or scores times or divided by numbers."""
    name = name_of(op)
    nd = len(w.shape(node))
    args = [a for a in list(node.args[:2]) + list(node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    states = [w.states.get(a) for a in args]
    main = next(s for s in states if isinstance(s, (Grid, Scores)))
    numbers_only = len(args) == 1
    if isinstance(main, Grid):
        if not numbers_only or ("add" in name or "sub" in name):
            raise w.refuse(node, f"{name} of features split into heads with another tensor or a constant",
                           "only scaling by numbers is known on them")
        return main
    shift = nd - len(w.shape(args[states.index(main)]))
    scores = Scores(main.axis + shift, main.heads, main.follows)
    for a, s in zip(args, states, strict=True):
        if s is not main:
            scores = _add_to_scores(w, node, scores, a, nd)
    return scores


# ------------------------------------------------------------------------------------------ whole layers
def _bound_args(node, fn) -> dict:
    """The arguments of ``node`` bound to the parameters of ``fn``."""
    return inspect.signature(fn).bind(*node.args, **node.kwargs).arguments


def qkv_labels(w, prefix: str, e: int) -> tuple[str, str, str]:
    """New labels for the queries, keys and values (``e`` features each) of one attention."""
    q, k, v = (w.new(f"{prefix}.{part}", e) for part in ("query", "key", "value"))
    return q, k, v


def project_qkv(w, labels, e: int, heads: int, parts, bias: str | None) -> None:
    """The input projection of one attention writes its queries, keys and values ``labels``. ``parts``
    gives, for each, ``(weight, start, columns)``: ``columns`` (the segments of its input, or ``None``)
    act on the weight's input axis, then the label acts (power +1, no scale: the scales belong to
    :math:`GL(d_k)`, :math:`GL(d_v)`) on its rows from ``start``, and on ``bias`` from entry ``i * e``.
    The keys pair with the queries (opposite sides of the bilinear form); with several heads, the heads
    of all three are tied."""
    for i, (label, (weight, start, columns)) in enumerate(zip(labels, parts, strict=True)):
        if columns is not None:
            w.weights.add(weight)
            w.act_on(weight, 1, columns, -1)
        w.scale_uf.union(label, FIXED)
        w.act(weight, 0, label, FIXED, 1, start=start)
        if bias is not None:
            w.act(bias, 0, label, FIXED, 1, start=i * e)
    q, k, v = labels
    w.perm_uf.union(q, k, odd=True)
    w.kinds[q], w.kinds[v] = "qk", "vo"
    if heads > 1:
        w.grouped += [(q, k, heads), (q, v, heads)]


def _output_projection(w, weight: str, bias: str | None, v: str, n: int, axis: int) -> State:
    """The output projection of the heads: the value label acts on its input axis (power -1, no scale),
    its output axis opens a label (:func:`.layers.open_label`)."""
    w.weights.add(weight)
    w.act(weight, 1, v, FIXED, -1)
    return layers.open_label(w, layers.layer_of(weight), n, axis, (weight, 0),
                             *([(bias, 0)] if bias is not None else []))


def mha(w, node, mod: nn.MultiheadAttention) -> Multi:
    """``nn.MultiheadAttention``: its input projections, heads and output projection (module docstring)."""
    args = _bound_args(node, mod.forward)
    name = node.target
    h, e = mod.num_heads, mod.embed_dim
    segs = [layers.last_axis(w, node, args[a], f"the attention {name!r} on a tensor whose features are not "
                             "last", "give it (batch, tokens, features) or (tokens, batch, features) inputs")
            for a in ("query", "key", "value")]
    q, k, v = qkv_labels(w, name, e)
    if mod._qkv_same_embed_dim:
        merged = segs[0]
        for other in segs[1:]:
            merged = w.merge(merged, other, node)
        weight = f"{name}.in_proj_weight"
        w.weights.add(weight)
        w.act_on(weight, 1, merged, -1)
        parts = [(weight, i * e, None) for i in range(3)]
    else:
        parts = [(f"{name}.{p}_proj_weight", 0, sg) for p, sg in zip("qkv", segs, strict=True)]
    project_qkv(w, (q, k, v), e, h, parts, f"{name}.in_proj_bias" if mod.in_proj_bias is not None else None)
    if mod.bias_k is not None:
        w.act(f"{name}.bias_k", 2, k, FIXED, 1)
        w.act(f"{name}.bias_v", 2, v, FIXED, 1)
    if mod.add_zero_attn:
        w.no_bias_shift.update((q, v))
    mask = args.get("attn_mask")
    if h > 1 and isinstance(mask, torch.fx.Node) and len(w.shape(mask)) == 3:  # one mask per head
        w.grouped.append((q, FIXED, h))
    metas = node.meta.get("tensor_meta")
    bias = f"{name}.out_proj.bias" if mod.out_proj.bias is not None else None
    out = _output_projection(w, f"{name}.out_proj.weight", bias, v, e, len(metas[0].shape) - 1)
    weights = UNLABELLED
    if args.get("need_weights", True) and not args.get("average_attn_weights", True) and h > 1:
        weights = Scores(len(metas[1].shape) - 3, h, q)
    return Multi((out, weights))


def swin(w, node, op=None) -> State:
    """torchvision's ``shifted_window_attention(input, qkv_weight, proj_weight, relative_position_bias,
    window_size, num_heads, ...)``: attention inside windows (positions only move), with one relative
    position bias per head."""
    from torchvision.models.swin_transformer import shifted_window_attention

    args = _bound_args(node, shifted_window_attention)
    if args.get("logit_scale") is not None:
        raise w.refuse(node, "Swin V2's cosine attention (logit_scale)", "its normalised queries and keys "
                       "and per-head logit scales are not supported; use Swin (V1)")
    x = args["input"]
    segs = layers.last_axis(w, node, x, "a window attention on a tensor whose channels are not on its last "
                            "axis", "give it (batch, H, W, C) inputs")
    c = w.shape(x)[-1]
    qkv = layers.param(w, node, args["qkv_weight"], "weight")
    proj = layers.param(w, node, args["proj_weight"], "weight")
    qkv_b = layers.param(w, node, args.get("qkv_bias"), "bias")
    proj_b = layers.param(w, node, args.get("proj_bias"), "bias")
    h = int(args["num_heads"])
    w.weights.update((qkv.name, proj.name))
    w.act_on(qkv.name, 1, segs, -1)
    q, k, v = qkv_labels(w, layers.layer_of(qkv.name), c)
    project_qkv(w, (q, k, v), c, h, [(qkv.name, i * c, None) for i in range(3)],
                qkv_b.name if qkv_b is not None else None)
    if h > 1:
        _add_to_scores(w, node, Scores(1, h, q), args["relative_position_bias"], 4)
    return _output_projection(w, proj.name, proj_b.name if proj_b is not None else None, v, c,
                              len(w.shape(node)) - 1)
