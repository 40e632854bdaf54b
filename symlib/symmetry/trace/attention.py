r"""Rules for attention, embeddings and layers given as functions of their parameters (book: chapter
"Transformers: permutations without scalings"; Tran et al. 2024 for the group of attention). See
:mod:`symlib.symmetry.trace`.

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
* heads: features split into ``(h, d)`` axes form blocks of their label (``Spec.blocks``), and the scores
  of the heads tie the query-key and value labels of one attention, so their heads move together; a
  parameter indexed by heads (a relative position bias table) gets a label of its own in the same tie;
* ``nn.MultiheadAttention`` and torchvision's ``shifted_window_attention`` (Swin) take their parameters
  directly: they are rules of their own, with the same labels;
* ``F.linear``, ``x @ W``, ``torch.addmm(b, x, W)`` (Hugging Face's ``Conv1D``) with a parameter ``W`` act
  as a linear layer; an embedding opens a label on the features of its table.

The labels of queries and keys (``"qk"``) and of values (``"vo"``) are recorded with the walker, which
puts them in ``Spec.continuous`` (:mod:`symlib.symmetry.continuous`).
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from symlib.symmetry.trace import heads, rules
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Grid, Multi, Scores, Seg, State

MATMUL = {operator.matmul, torch.matmul, torch.bmm, torch.mm}
MATMUL_METHODS = {"matmul", "bmm", "mm", "__matmul__"}
SOFTMAX = {F.softmax, torch.softmax, F.log_softmax, torch.log_softmax}
SOFTMAX_METHODS = {"softmax", "log_softmax", "masked_fill", "masked_fill_", "type_as"}
SDPA = {F.scaled_dot_product_attention}
# Operations that leave features split into heads as they are (an activation would not: it breaks the
# continuous symmetries of queries, keys and values).
GRID_PASS_METHODS = {"contiguous", "clone", "detach", "to", "float", "double", "type_as", "alias"}
GRID_PASS_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d}
WRAPPED = {
    ("torchvision.models.swin_transformer", "shifted_window_attention"): "swin",
    ("torchvision.models.swin_transformer", "_patch_merging_pad"): "patch_merging",
}


def function(w, node, target, is_method: bool):
    """The rules of this module for a function or method node; ``NotImplemented`` for the others."""
    name = rules.name_of(target)
    key = (getattr(target, "__module__", None), getattr(target, "__name__", None))
    if WRAPPED.get(key) == "swin":
        return swin(w, node)
    if WRAPPED.get(key) == "patch_merging":  # (..., H, W, C) -> (..., H/2, W/2, 4C): four position subsamples
        st = w.input(node)
        if not st.segs:
            return UNLABELLED
        if st.axis != len(w.shape(node)) - 1:
            raise w.refuse(node, "a patch merging of a tensor whose channels are not last",
                           "use (B, H, W, C)")
        return State(st.axis, st.segs * 4, st.producer)
    if target is operator.getitem or (not is_method and name in ("select", "slice")):
        return heads.index(w, node)
    if (target in MATMUL_METHODS) if is_method else (target in MATMUL):
        return matmul(w, node)
    if not is_method and target in SDPA:
        return sdpa(w, node)
    if not is_method and target is F.linear:
        return linear(w, node, node.args[0], _arg(node, 1, "weight"), _arg(node, 2, "bias"))
    if not is_method and target is torch.addmm:
        return linear(w, node, node.args[1], node.args[2], node.args[0], transposed=True)
    if not is_method and target is F.embedding:
        return embedding(w, node, node.args[1] if len(node.args) > 1 else node.kwargs["weight"], node.name)
    if not is_method and target == "embedding":  # aten.embedding(weight, indices)
        return embedding(w, node, node.args[0], node.name)
    st = w.states.get(next(iter(w.tensor_args(node)), None))
    if isinstance(st, (Grid, Scores)) or any(isinstance(w.states.get(a), (Grid, Scores))
                                             for a in w.tensor_args(node)):
        return on_heads(w, node, target, name, is_method)
    if (target in SOFTMAX_METHODS) if is_method else (target in SOFTMAX):
        return w.nonhomogeneous(node, node.name, name)
    return NotImplemented


def _arg(node, i, key, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)


# ------------------------------------------------------------------------------------ parameters
def param(w, node, arg, what: str) -> Attr | None:
    """The parameter behind argument ``arg`` (a view of one), or ``None`` for ``None``; refused otherwise."""
    if arg is None:
        return None
    st = w.states.get(arg) if isinstance(arg, torch.fx.Node) else None
    if isinstance(st, Attr) and st.in_state_dict and not st.opaque:
        return st
    raise w.refuse(node, f"the {what} {arg!r}, which is not a parameter of the model (or a view of one)",
                   "pass the model's own parameters")


def act_on(w, attr: Attr, axis: int, segs, power: int, with_scale: bool = True) -> None:
    """Labels ``segs`` act on the parameter behind axis ``axis`` of the view ``attr``."""
    pa = attr.param_axis(axis)
    pos = 0
    for s in segs:
        w.act(attr.name, pa, s.perm, s.scale if with_scale else FIXED, power, start=pos, inner=s.inner)
        pos += s.size


def layer_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def linear(w, node, x, weight, bias, transposed: bool = False) -> State:
    """``x @ W.T + b`` (``transposed``: ``b + x @ W``) with ``W`` a parameter: a linear layer."""
    wt = param(w, node, weight, "weight")
    b = param(w, node, bias, "bias")
    st = w.states.get(x)
    shape = w.shape(x)
    if isinstance(st, (Grid, Scores)) or (isinstance(st, State) and st.segs and st.axis != len(shape) - 1):
        raise w.refuse(node, "a linear layer reading a tensor whose features are not on its last axis",
                       "apply it to (..., features) tensors, e.g. after merging the heads back")
    if len(wt.shape) != 2:
        raise w.refuse(node, f"the weight {wt.name!r} of shape {wt.shape}", "a linear weight is 2-D")
    rows, cols = (1, 0) if transposed else (0, 1)
    segs = w.segments(st if isinstance(st, State) else None, shape[-1])
    w.weights.add(wt.name)
    act_on(w, wt, cols, segs, -1)
    n = wt.shape[rows]
    layer = layer_of(wt.name)
    label = w.new(layer, n)
    w.act(wt.name, wt.param_axis(rows), label, label, 1)
    if b is not None:
        w.act(b.name, b.param_axis(0), label, label, 1)
    return State(len(w.shape(node)) - 1, (Seg(label, label, n),), layer)


def embedding(w, node, weight, layer: str) -> State:
    """A lookup in a ``(vocabulary, d)`` table: its ``d`` features open a label, like a layer's outputs."""
    wt = param(w, node, weight, "embedding table")
    ids = [a for a in w.tensor_args(node) if a is not weight]
    if ids and not w.is_fixed(w.states.get(ids[0])):
        raise w.refuse(node, "an embedding of labelled indices", "embed the network's input tokens")
    return _open_table(w, wt, layer_of(wt.name), len(w.shape(node)) - 1)


def _open_table(w, wt: Attr, layer: str, axis: int) -> State:
    w.weights.add(wt.name)
    n = wt.shape[1]
    label = w.new(layer, n)
    w.act(wt.name, wt.param_axis(1), label, label, 1)
    return State(axis, (Seg(label, label, n),), layer)


def embedding_module(w, node, mod: nn.Embedding) -> State:
    if not w.fixed_inputs(node):
        raise w.refuse(node, f"the embedding {node.target!r} of labelled indices", "embed the input tokens")
    wt = Attr(f"{node.target}.weight", tuple(mod.weight.shape), True)
    return _open_table(w, wt, node.target, len(w.shape(node)) - 1)


# ------------------------------------------------------------------------------------ heads
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
            and st.segs[0].inner == 1):
        return st.segs[0], st.sizes[0], st.sizes[1], st.axes[0] - nd
    raise w.refuse(node, "an attention whose features are not one label laid out as (heads, features) on "
                   "the last axes", "project queries, keys and values with one linear layer each (or one "
                   "fused layer) and split the heads with a reshape")


def _fix(w, seg) -> None:
    if seg is not None:
        w.perm_uf.union(seg.perm, FIXED)
        w.scale_uf.union(seg.scale, FIXED)


def pair_qk(w, node, q, k):
    """Queries and keys contracted: one label, keys on the opposite side; the scores' state."""
    (sq, hq, dq, aq), (sk, hk, dk, ak) = q, k
    if sq is None or sk is None:
        _fix(w, sq)
        _fix(w, sk)
        return UNLABELLED
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


def matmul(w, node):
    """``a @ b``: queries times keys, attention weights times values, or features times a parameter."""
    a, b = node.args[0], node.args[1]
    sa, sb = w.states.get(a), w.states.get(b)
    if isinstance(sb, Attr) and not isinstance(sa, (Grid, Scores)) and len(sb.shape) == 2:
        return linear(w, node, a, b, None, transposed=True)
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


def sdpa(w, node):
    """``scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``."""
    if _arg(node, 7, "enable_gqa", False):
        raise w.refuse(node, "grouped-query attention (enable_gqa=True)", "give keys the heads of queries")
    q, k, v = (_features(w, node, node.args[i] if len(node.args) > i else node.kwargs[n], -1)
               for i, n in enumerate(("query", "key", "value")))
    scores = pair_qk(w, node, q, k)
    mask = _arg(node, 3, "attn_mask")
    if isinstance(mask, torch.fx.Node) and w.shape(mask) is not None:
        scores = _add_to_scores(w, node, scores, mask, len(w.shape(node)))
    return attend(w, node, scores, v)


def _add_to_scores(w, node, scores, arg, nd: int):
    """A tensor added to attention scores: a parameter per head moves with the heads; anything else that
    differs between heads keeps them in place; labelled features are refused."""
    st = w.states.get(arg)
    shape = (1,) * (nd - len(w.shape(arg))) + tuple(w.shape(arg))
    if isinstance(st, (State, Grid)) and not w.is_fixed(st):
        raise w.refuse(node, "labelled features added to attention scores", "this is not attention")
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


def heads_param(w, scores: Scores, attr: Attr, axis: int) -> None:
    """A parameter indexed by the heads of ``scores`` on (view) axis ``axis``: a label of one entry per
    head, in the tie of the attention's labels."""
    label = w.new(f"{layer_of(attr.name)}.heads", scores.heads)
    w.scale_uf.union(label, FIXED)
    w.grouped.append((scores.follows, label, scores.heads))
    w.weights.add(attr.name)
    w.act(attr.name, attr.param_axis(axis), label, FIXED, 1)


def on_heads(w, node, target, name: str, is_method: bool):
    """Operations on features spread over heads, or on attention scores."""
    st = w.states.get(w.tensor_args(node)[0])
    if has(target, is_method, rules.RESHAPE_METHODS, rules.RESHAPE_FUNCTIONS):
        return heads.reshape(w, node)
    if has(target, is_method, rules.MOVE_METHODS, rules.MOVE_FUNCTIONS):
        return heads.move(w, node, heads._order(node, len(w.shape(node))))
    if has(target, is_method, GRID_PASS_METHODS, GRID_PASS_FUNCTIONS) or rules.is_eval_identity(target):
        return st
    if isinstance(st, Scores) and has(target, is_method, rules.PASS_METHODS, rules.PASS_FUNCTIONS):
        return st
    if isinstance(st, Scores) and (has(target, is_method, SOFTMAX_METHODS, SOFTMAX)
                                   or has(target, is_method, rules.NONHOMOGENEOUS_METHODS,
                                          rules.NONHOMOGENEOUS_FUNCTIONS)):
        return st
    arith = [rules.ADD_METHODS | rules.MUL_METHODS | rules.DIV_METHODS,
             rules.ADD_FUNCTIONS | rules.MUL_FUNCTIONS | rules.DIV_FUNCTIONS]
    if has(target, is_method, *arith):
        return _arith(w, node, name)
    kind = "attention scores" if isinstance(st, Scores) else "features split into heads"
    raise w.refuse(node, f"{'.' + name + '()' if is_method else name} on {kind}",
                   "only reshapes, permutes, scaling by numbers, masks, softmax and the attention products "
                   "are known on them")


def has(target, is_method, methods, functions) -> bool:
    return target in methods if is_method else target in functions


def _arith(w, node, name: str):
    """Scores plus masks or position biases; heads or scores times or divided by numbers."""
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


# ------------------------------------------------------------------------------------ whole layers
def _signature_args(node, fn) -> dict:
    return inspect.signature(fn).bind(*node.args, **node.kwargs).arguments


def mha(w, node, mod: nn.MultiheadAttention) -> Multi:
    """``nn.MultiheadAttention``: its input projections, heads and output projection (module docstring)."""
    args = _signature_args(node, mod.forward)
    name = node.target
    h, e = mod.num_heads, mod.embed_dim
    ins = [args["query"], args["key"], args["value"]]
    sts = [w.states.get(a) for a in ins]
    for st in sts:
        if isinstance(st, (Grid, Scores, Multi)) or (isinstance(st, State) and st.segs
                                                      and st.axis != len(w.shape(ins[0])) - 1):
            raise w.refuse(node, f"the attention {name!r} on a tensor whose features are not last",
                           "give it (batch, tokens, features) or (tokens, batch, features) inputs")
    segs = [w.segments(st if isinstance(st, State) else None, w.shape(a)[-1]) for a, st in zip(ins, sts,
                                                                                              strict=True)]
    labels = [w.new(f"{name}.{part}", e) for part in ("query", "key", "value")]
    if mod._qkv_same_embed_dim:
        merged = segs[0]
        for other in segs[1:]:
            merged = w.merge(merged, other, node)
        weight = f"{name}.in_proj_weight"
        w.weights.add(weight)
        _act_segs(w, weight, 1, merged, -1)
        for i, label in enumerate(labels):
            w.act(weight, 0, label, FIXED, 1, start=i * e)
            if mod.in_proj_bias is not None:
                w.act(f"{name}.in_proj_bias", 0, label, FIXED, 1, start=i * e)
    else:
        for part, label, sg, i in zip(("q", "k", "v"), labels, segs, range(3), strict=True):
            weight = f"{name}.{part}_proj_weight"
            w.weights.add(weight)
            _act_segs(w, weight, 1, sg, -1)
            w.act(weight, 0, label, FIXED, 1)
            if mod.in_proj_bias is not None:
                w.act(f"{name}.in_proj_bias", 0, label, FIXED, 1, start=i * e)
    q, k, v = labels
    for label in labels:
        w.scale_uf.union(label, FIXED)
    w.perm_uf.union(q, k, odd=True)
    w.kinds[q], w.kinds[v] = "qk", "vo"
    if mod.bias_k is not None:
        w.act(f"{name}.bias_k", 2, k, FIXED, 1)
        w.act(f"{name}.bias_v", 2, v, FIXED, 1)
    if mod.add_zero_attn:
        w.no_bias_shift.update((q, v))
    if h > 1:
        w.grouped += [(q, k, h), (q, v, h)]
        mask = args.get("attn_mask")
        if isinstance(mask, torch.fx.Node) and len(w.shape(mask)) == 3:  # one mask per head
            w.grouped.append((q, FIXED, h))
    out = f"{name}.out_proj"
    w.weights.add(f"{out}.weight")
    w.act(f"{out}.weight", 1, v, FIXED, -1)
    label = w.new(out, e)
    w.act(f"{out}.weight", 0, label, label, 1)
    if mod.out_proj.bias is not None:
        w.act(f"{out}.bias", 0, label, label, 1)
    metas = node.meta.get("tensor_meta")
    nd = len(metas[0].shape)
    weights = UNLABELLED
    if args.get("need_weights", True) and not args.get("average_attn_weights", True) and h > 1:
        weights = Scores(len(metas[1].shape) - 3, h, q)
    return Multi((State(nd - 1, (Seg(label, label, e),), out), weights))


def _act_segs(w, param, axis, segs, power) -> None:
    pos = 0
    for s in segs:
        w.act(param, axis, s.perm, s.scale, power, start=pos, inner=s.inner)
        pos += s.size


def swin(w, node) -> State:
    """torchvision's ``shifted_window_attention(input, qkv_weight, proj_weight, relative_position_bias,
    window_size, num_heads, ...)``: attention inside windows (positions only move), with one relative
    position bias per head."""
    from torchvision.models.swin_transformer import shifted_window_attention

    args = _signature_args(node, shifted_window_attention)
    if args.get("logit_scale") is not None:
        raise w.refuse(node, "Swin V2's cosine attention (logit_scale)", "its normalised queries and keys "
                       "and per-head logit scales are not supported; use Swin (V1)")
    x = args["input"]
    st = w.states.get(x)
    c = w.shape(x)[-1]
    last = len(w.shape(x)) - 1
    if isinstance(st, (Grid, Scores)) or (isinstance(st, State) and st.segs and st.axis != last):
        raise w.refuse(node, "a window attention on a tensor whose channels are not on its last axis",
                       "give it (batch, H, W, C) inputs")
    qkv = param(w, node, args["qkv_weight"], "weight")
    proj = param(w, node, args["proj_weight"], "weight")
    qkv_b = param(w, node, args.get("qkv_bias"), "bias")
    proj_b = param(w, node, args.get("proj_bias"), "bias")
    h = int(args["num_heads"])
    layer = layer_of(qkv.name)
    w.weights.update((qkv.name, proj.name))
    _act_segs(w, qkv.name, 1, w.segments(st if isinstance(st, State) else None, c), -1)
    labels = [w.new(f"{layer}.{part}", c) for part in ("query", "key", "value")]
    for i, label in enumerate(labels):
        w.scale_uf.union(label, FIXED)
        w.act(qkv.name, 0, label, FIXED, 1, start=i * c)
        if qkv_b is not None:
            w.act(qkv_b.name, 0, label, FIXED, 1, start=i * c)
    q, k, v = labels
    w.perm_uf.union(q, k, odd=True)
    w.kinds[q], w.kinds[v] = "qk", "vo"
    if h > 1:
        w.grouped += [(q, k, h), (q, v, h)]
        bias = args["relative_position_bias"]
        _add_to_scores(w, node, Scores(1, h, q), bias, 4)
    w.act(proj.name, 1, v, FIXED, -1)
    out = layer_of(proj.name)
    label = w.new(out, c)
    w.act(proj.name, 0, label, label, 1)
    if proj_b is not None:
        w.act(proj_b.name, 0, label, label, 1)
    return State(len(w.shape(node)) - 1, (Seg(label, label, c),), out)
