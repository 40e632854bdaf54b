r"""Rules for the operations without parameters, and the dispatch of function and method nodes (book:
chapter "Symmetries of real architectures"; paper App. D.4). See :mod:`symlib.symmetry.trace`.

* element-wise activations pass the permutation; only positively homogeneous ones (ReLU, LeakyReLU,
  pooling, dropout) pass the scale;
* flatten / view / reshape: merging the channel axis with the axes after it keeps the labels, each entry
  now covering a block of features (``Action.inner``); splitting the channel axis is refused;
* mean / sum / amax over positions, permute and transpose move or keep the channel axis;
* ``torch.cat`` along the channel axis lays its parts' labels end to end (``Action.start``); along another
  axis its parts must carry the same labels;
* ``a + b`` (residual) merges the labels of both sides; ``a * b`` (a gate) merges their permutations and
  keeps the scale of one factor, the other's fixed; ``a / b`` keeps ``a``'s scale; a number added fixes the
  scale, a number multiplied keeps it. A parameter of the model used in such an operation (a layer-scale
  vector, a bias) moves with the channels it meets.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.nn import functional as F

from symlib.symmetry.trace import attention, heads, layers, rules
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, State


def function(w, node, target, is_method: bool) -> State:
    target, is_method = rules.normalize(target, is_method)

    def has(methods, functions):
        return target in methods if is_method else target in functions

    special = attention.function(w, node, target, is_method)
    if special is not NotImplemented:
        return special
    if has(rules.ADD_METHODS, rules.ADD_FUNCTIONS):
        return elementwise(w, node, "add")
    if has(rules.MUL_METHODS, rules.MUL_FUNCTIONS):
        return elementwise(w, node, "mul")
    if has(rules.DIV_METHODS, rules.DIV_FUNCTIONS):
        return elementwise(w, node, "div")
    if has(rules.PASS_METHODS, rules.PASS_FUNCTIONS) or (not is_method and rules.is_eval_identity(target)):
        return w.input(node)
    if has(rules.NONHOMOGENEOUS_METHODS, rules.NONHOMOGENEOUS_FUNCTIONS):
        return nonhomogeneous(w, node, node.name, rules.name_of(target))
    if has(rules.RESHAPE_METHODS, rules.RESHAPE_FUNCTIONS):
        return reshape(w, node)
    if has(rules.REDUCE_METHODS, rules.REDUCE_FUNCTIONS):
        return reduce(w, node)
    if has(rules.MOVE_METHODS, rules.MOVE_FUNCTIONS):
        return move(w, node)
    if not is_method and target in rules.CAT_FUNCTIONS:
        return cat(w, node)
    if not is_method and target in rules.LAYER_NORM_FUNCTIONS:
        shape = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        bias = None
        if target is F.layer_norm:
            bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
        weight, bias = layers.attr_name(w, node, weight), layers.attr_name(w, node, bias)
        return layers.layernorm(w, node, tuple(shape), weight, bias,
                                weight.rsplit(".", 1)[0] if weight else node.name)
    if w.fixed_inputs(node):
        return UNLABELLED
    what = f"the method .{target}()" if is_method else f"the function {rules.name_of(target)}"
    param = w.parameter_note(node)
    raise w.refuse(
        node, what + " on a labelled tensor" + param,
        ("use the parameter through an nn.Module layer (nn.Linear, nn.Conv2d, ...) so the spec knows its "
         "axes; " if param else "") + "its symmetries are unknown to symlib (matrix products "
        "are supported as attention, queries times keys and weights times values); write the Spec by hand "
        "or express the layer with supported modules",
    )


def nonhomogeneous(w, node, layer: str, what: str) -> State:
    st = w.input(node)
    return w.fix_scales(st, layer, f"uses {what}, which is not positively homogeneous")


# ------------------------------------------------------------------------------------------- shapes
def reshape(w, node) -> State:
    """flatten / view / reshape / squeeze / unsqueeze of a labelled tensor (:func:`.heads.reshape`)."""
    return heads.reshape(w, node)


def reduce(w, node) -> State:
    """mean / sum / amax over positions (a global pool): the labels stay; over the channel axis: refused."""
    st = w.input(node)
    in_shape = w.shape(w.tensor_args(node)[0])
    if w.is_fixed(st):
        return UNLABELLED
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        raise w.refuse(node, "a reduction of a labelled tensor over all its axes", "reduce over positions")
    dims = {d % len(in_shape) for d in ((dims,) if isinstance(dims, int) else tuple(dims))}
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if st.axis in dims or 0 in dims or any(s.inner != 1 for s in st.segs):
        raise w.refuse(
            node, f"a reduction over axes {sorted(dims)} of a tensor labelled on axis {st.axis}",
            "reduce over positions (a global pool), not over channels or the batch",
        )
    return st.moved(st.axis if keepdim else st.axis - sum(d < st.axis for d in dims))


def move(w, node) -> State:
    """permute / transpose: the labels follow their axis."""
    st = w.states.get(w.tensor_args(node)[0])
    if w.is_fixed(st) or isinstance(st, Attr):
        return UNLABELLED
    order = heads._order(node, len(w.shape(node)))
    if not isinstance(st, State):
        return heads.move(w, node, order)
    return st.moved(order.index(st.axis))


def cat(w, node) -> State:
    """``torch.cat``: along the labelled axis the parts' labels are laid end to end; along another axis
    the parts must carry the same labels."""
    parts = node.args[0] if node.args else node.kwargs["tensors"]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= len(w.shape(node))
    states = [(t, w.states.get(t)) for t in parts]
    labelled = [st for _, st in states if not w.is_fixed(st)]
    if not labelled:
        return UNLABELLED
    if any(not isinstance(st, State) for st in labelled):
        raise w.refuse(node, "a concatenation of features split into heads or of attention scores",
                       "merge the heads back first")
    if len({st.axis for st in labelled}) != 1:
        raise w.refuse(node, "a concatenation of tensors labelled on different axes",
                       "concatenate tensors with the same layout")
    axis = labelled[0].axis
    if axis == dim:
        segs = []
        for t, st in states:
            segs += w.segments(None if w.is_fixed(st) else st, w.shape(t)[dim])
        return State(axis, tuple(segs), labelled[-1].producer)
    segs = labelled[0].segs
    for t, st in states:
        if isinstance(st, Attr) and st.in_state_dict and not st.opaque:
            continue  # a parameter (a class token) concatenated to labelled features moves with them
        segs = w.merge(segs, w.segments(None if w.is_fixed(st) else st, w.shape(t)[axis]), node)
    for _, st in states:
        if isinstance(st, Attr) and st.in_state_dict and not st.opaque:
            _attr_actions(w, node, st, segs, axis, with_scale=True)
    return State(axis, segs, labelled[-1].producer)


# ---------------------------------------------------------------------------------------- arithmetic
def elementwise(w, node, op: str) -> State:
    """``a + b``, ``a - b``, ``a * b``, ``a / b`` with broadcasting (module docstring)."""
    out_shape = tuple(w.shape(node))
    nd = len(out_shape)
    args = list(node.args[:2]) + [node.kwargs[k] for k in ("other",) if k in node.kwargs]
    items, numbers = [], 0  # (state or Attr or None, shape padded to the output's rank, axis offset)
    for arg in args:
        node_arg = isinstance(arg, torch.fx.Node)
        st = w.states.get(arg) if node_arg else None
        shape = st.shape if isinstance(st, Attr) else (w.shape(arg) if node_arg else None)
        if shape is None:
            numbers += 1
            continue
        items.append((st, (1,) * (nd - len(shape)) + tuple(shape), nd - len(shape)))
    labelled = [(st, shape, off) for st, shape, off in items if isinstance(st, State) and not w.is_fixed(st)]
    if not labelled:
        return UNLABELLED
    axes = {st.axis + off for st, _, off in labelled}
    if len(axes) != 1:
        raise w.refuse(node, "an element-wise operation on tensors labelled on different axes",
                       "combine tensors with the same layout")
    axis = axes.pop()
    size = out_shape[axis]
    full = [st for st, shape, _ in labelled if shape[axis] == size]
    if not full:  # only channel-independent labelled operands (e.g. a (N, 1, H, W) map): no scale survives
        for st, _, _ in labelled:
            w.fix_scales(st)
        return UNLABELLED
    main = full[0]
    if op == "mul":  # the product keeps the scale of a factor that still has one (x * gate, act(g) * v)
        main = next((st for st in full if any(w.scale_uf.find(x.scale) != FIXED for x in st.segs)), main)
    scales = op == "add"  # a sum ties the scales of its terms; a product keeps one factor's scale
    segs = main.segs
    for st, shape, _ in items:
        if shape[axis] == size and st is not main and not isinstance(st, Attr):
            segs = w.merge(segs, w.segments(None if w.is_fixed(st) else st, size), node, scales=scales)
    if op == "add":
        for st, shape, _ in labelled:
            if shape[axis] == 1:
                w.fix_scales(st)  # a channel-independent term ties every channel's scale: fix them
        if numbers or any(shape[axis] == 1 and not (isinstance(st, State) and not w.is_fixed(st))
                          for st, shape, _ in items):
            w.fix_scales(State(axis, segs), node.name, "adds a constant, which breaks positive homogeneity")
    else:
        first = args[0] if args else None
        numerator = isinstance(first, torch.fx.Node) and w.states.get(first) is main
        keep = main if op == "mul" or numerator else None
        for st, _, _ in labelled:
            if st is not keep:
                w.fix_scales(st)
    for st, shape, off in items:
        if isinstance(st, Attr) and shape[axis] != 1:
            _attr_actions(w, node, st, segs, axis - off, with_scale=op == "add")
        elif isinstance(st, Attr) and op == "add":
            w.fix_scales(State(axis, segs), node.name, "adds a constant, which breaks positive homogeneity")
    return State(axis, tuple(segs), main.producer)


def _attr_actions(w, node, attr: Attr, segs, axis: int, with_scale: bool) -> None:
    """A parameter combined with labelled channels moves with them; added to them, it also scales with
    them (as a bias does)."""
    if not attr.in_state_dict:
        raise w.refuse(node, f"the constant {attr.name!r} combined with labelled channels",
                       "make it a parameter or buffer of the model, or keep it off labelled tensors")
    if len(attr.shape) == 0 or axis < 0:
        return
    pa = attr.param_axis(axis)
    if pa is None:
        raise w.refuse(node, f"the parameter {attr.name!r} used outside a layer, computed into a tensor that "
                       "meets labelled channels", "use the parameter itself (or a view of it: expand, "
                       "unsqueeze, permute), or through an nn.Module layer")
    pos = 0
    for s in segs:
        w.act(attr.name, pa, s.perm, s.scale if with_scale else FIXED, 1 if with_scale else 0,
              start=pos, inner=s.inner)
        pos += s.size
