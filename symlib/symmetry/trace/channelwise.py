r"""Rules for the operations without parameters that treat each channel (feature) on its own: activations,
pooling and dropout, arithmetic with broadcasting, reductions over positions, concatenation (book:
chapter "Symmetries of real architectures"; paper App. D.4). See :mod:`symlib.symmetry.trace`; the table
that picks these rules is :mod:`~symlib.symmetry.trace.rules`.

* ReLU, LeakyReLU, max / average pooling, dropout, identity: both labels pass; they commute with a
  permutation of the channels and are positively homogeneous,
  :math:`\mathrm{relu}(\lambda z) = \lambda\,\mathrm{relu}(z)` for :math:`\lambda > 0`.
* tanh, GELU, SiLU, sigmoid, softmax, ...: the permutation passes, the scale is fixed, and the layer is
  recorded in ``Spec.no_scaling``.
* ``a + b`` (a residual) merges the labels of both sides; ``a * b`` (a gate) merges their permutations and
  keeps the scale of one factor, the other's fixed; ``a / b`` keeps ``a``'s scale; a number added fixes the
  scale, a number multiplied keeps it. A parameter of the model used in such an operation (a layer-scale
  vector, a bias) moves with the channels it meets.
* ``torch.where(c, a, b)`` with a fixed condition that is the same on every channel (a mask over
  positions): the branches' labels merge as a sum's do; a condition that varies along the channels fixes
  them, and a branch that is a nonzero number or a fixed tensor fixes the scale.
* mean / sum / amax over positions (a global pool): the labels stay on their axis; over the channel axis,
  a statistic of the whole feature vector (below).
* ``torch.cat`` along the channel axis lays its parts' labels end to end (``Action.start``); along another
  axis its parts must carry the same labels.

Normalisations written out as arithmetic, as Hugging Face writes its RMSNorms (book: chapter "Transformers:
permutations without scalings"): Llama, Mistral and Qwen2 normalise the residual stream
:math:`x \in \mathbb{R}^C` with

.. math:: \mathrm{rms}(x) = \gamma \odot \frac{x}{\sqrt{\tfrac{1}{C}\sum_i x_i^2 + \epsilon}}

as ``weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))``, not as ``F.rms_norm``. Two rules
(:func:`norm_reduce`, :func:`norm_mul`) cover it, and any normalisation written out the same way (a
LayerNorm's ``x - x.mean(-1, keepdim=True)``):

* a reduction (``mean``, ``sum``, ``amax``) over the labelled feature axis is a statistic of the whole
  vector: a permutation of the features leaves it unchanged, :math:`\sum_i x_{\pi(i)} = \sum_i x_i`, so
  the result carries no label; a per-feature scale :math:`\lambda` does not (the sum mixes features), so
  the input's scales are fixed. The normalised :math:`x / s(x)` then carries :math:`x`'s permutation with
  its scale fixed, as after ``nn.RMSNorm``;
* a parameter vector times features whose scales are all fixed (the gain :math:`\gamma` after the
  normalisation) opens a new scale, on :math:`\gamma` (power +1) and, through the walk, on the columns of
  the next layers (power -1), as a LayerNorm's ``weight`` does:
  :math:`(\mu\gamma) \odot \hat x` read by :math:`W\,\mathrm{diag}(\mu)^{-1}` is the same function.

When the gain multiplies :math:`x \cdot \mathrm{rsqrt}(\mathrm{mean}(x^2) + \epsilon)` its weight is recorded
as an RMSNorm's (``Records.norms``, kind ``"rms"``).

Every rule is ``rule(walker, node, op) -> state`` (:mod:`~symlib.symmetry.trace.rules`).
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Seg, State
from symlib.symmetry.trace.walker import module_path, name_of


# ---------------------------------------------------------------------------------------- activations
def passthrough(w, node, op=None) -> State:
    """Permutation-equivariant and positively homogeneous: the input's labels pass."""
    return w.input(node)


def nonhomogeneous(w, node, op) -> State:
    """Element-wise but not positively homogeneous: the permutation passes, the scale is fixed."""
    layer, what = (node.target, type(op).__name__) if isinstance(op, nn.Module) else (node.name, name_of(op))
    return w.fix_scales(w.input(node), layer, f"uses {what}, which is not positively homogeneous")


def pad(w, node, op=None) -> State:
    r"""``F.pad`` (ATen ``constant_pad_nd``): padding positions moves no channel, so the labels pass. Zero
    padding and the copying modes (reflect, replicate, circular) are positively homogeneous
    (:math:`\lambda \cdot 0 = 0`); a nonzero constant fixes the scale. Padding the labelled axis itself
    would add entries that no label covers: refused."""
    st = w.input(node)
    pads = w.arg(node, 1, "pad")
    mode = w.arg(node, 2, "mode", "constant")
    value = w.arg(node, 3 if name_of(op) != "constant_pad_nd" else 2, "value", None)
    nd = len(w.shape(node))

    def known(x):  # an int, or a traced int whose value shape propagation recorded
        return x.meta.get("val") if isinstance(x, torch.fx.Node) else x

    touched = {nd - 1 - i // 2 for i, p in enumerate(pads or ()) if known(p) != 0}
    if st.segs and st.axis % nd in touched:
        raise w.refuse(node, "padding of the labelled channel axis",
                       "pad positions only (the channels would gain entries no label covers)")
    if mode == "constant" and known(value) not in (None, 0, 0.0):
        return nonhomogeneous(w, node, op)
    return st


def roll(w, node, op=None) -> State:
    """``torch.roll`` along positions (Swin's shifted windows): a permutation of positions moves no channel,
    so the labels pass; rolling the labelled axis is refused."""
    st = w.input(node)
    dims = w.arg(node, 2, "dims", None)
    nd = len(w.shape(node))
    dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
    if st.segs and (not dims or st.axis % nd in {d % nd for d in dims}):
        raise w.refuse(node, "a roll of the labelled channel axis (or of the flattened tensor)",
                       "roll positions only, with dims that leave the channel axis alone")
    return st


# ---------------------------------------------------------------------------------------- arithmetic
def add(w, node, op=None) -> State:
    """``a + b``, ``a - b`` (module docstring)."""
    return elementwise(w, node, "add")


def mul(w, node, op=None) -> State:
    """``a * b`` (module docstring)."""
    return elementwise(w, node, "mul")


def div(w, node, op=None) -> State:
    """``a / b`` (module docstring)."""
    return elementwise(w, node, "div")


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


def where(w, node, op=None) -> State:
    r"""``torch.where(c, a, b)``: entry by entry ``a`` where ``c`` holds, else ``b``.

    A fixed condition that is the same on every channel (a mask over positions) commutes with a
    permutation :math:`P` of the channels, :math:`\mathrm{where}(c, Pa, Pb) = P\,\mathrm{where}(c, a, b)`,
    so the branches' labels merge as a sum's do (a fixed branch that varies along the channels fixes
    them). A condition that varies along the labelled channels selects per channel: the labels are fixed.
    Scales: :math:`\mathrm{where}(c, \lambda a, \lambda b) = \lambda\,\mathrm{where}(c, a, b)`, so the
    branches' scales merge; a branch that is a number other than 0, or a fixed tensor, fixes them. A
    labelled condition is refused."""
    out_shape = tuple(w.shape(node))
    nd = len(out_shape)
    cond, a, b = (w.arg(node, i, k) for i, k in enumerate(("condition", "input", "other")))
    if isinstance(cond, torch.fx.Node) and not w.is_fixed(w.states.get(cond)):
        raise w.refuse(node, "a selection (where) by a condition computed from labelled channels",
                       "compute the condition from unlabelled tensors (positions, masks)")
    branches, constant = [], False
    for arg in (a, b):
        if not isinstance(arg, torch.fx.Node) or w.shape(arg) is None:
            constant |= arg not in (0, 0.0, False)
            continue
        st = w.states.get(arg)
        branches.append((st, (1,) * (nd - len(w.shape(arg))) + tuple(w.shape(arg)), nd - len(w.shape(arg))))
    labelled = [(st, off) for st, _, off in branches if isinstance(st, State) and not w.is_fixed(st)]
    if not labelled:
        return UNLABELLED
    axes = {st.axis + off for st, off in labelled}
    if len(axes) != 1:
        raise w.refuse(node, "a selection (where) between tensors labelled on different axes",
                       "select between tensors with the same layout")
    axis = axes.pop()
    size = out_shape[axis]
    main = labelled[0][0]
    segs = main.segs
    for st, shape, _ in branches:
        if st is main or shape[axis] == 1:
            continue
        fixed = not (isinstance(st, State) and not w.is_fixed(st))
        constant |= fixed
        segs = w.merge(segs, w.segments(None if fixed else st, size), node)
    constant |= any(shape[axis] == 1 and not (isinstance(st, State) and not w.is_fixed(st))
                    for st, shape, _ in branches)
    out = State(axis, tuple(segs), main.producer)
    c_shape = w.shape(cond) if isinstance(cond, torch.fx.Node) else None
    if c_shape is not None and ((1,) * (nd - len(c_shape)) + tuple(c_shape))[axis] != 1:
        w.fix(out)  # the selection differs between channels: they cannot move
    if constant:
        w.fix_scales(out, node.name, "selects a constant, which breaks positive homogeneity")
    return out


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
    w.act_on(attr.name, pa, segs, 1 if with_scale else 0, scales=with_scale)


# ------------------------------------------------------------------------------- reductions, concatenation
def reduce(w, node, op=None) -> State:
    """mean / sum / amax over positions (a global pool): the labels stay; over the channel axis: refused."""
    st = w.input(node)
    in_shape = w.shape(w.tensor_args(node)[0])
    if w.is_fixed(st):
        return UNLABELLED
    dims = w.arg(node, 1, "dim")
    if dims is None:
        raise w.refuse(node, "a reduction of a labelled tensor over all its axes", "reduce over positions")
    dims = {d % len(in_shape) for d in ((dims,) if isinstance(dims, int) else tuple(dims))}
    keepdim = w.arg(node, 2, "keepdim", False)
    if st.axis in dims or 0 in dims or any(s.inner != 1 for s in st.segs):
        raise w.refuse(
            node, f"a reduction over axes {sorted(dims)} of a tensor labelled on axis {st.axis}",
            "reduce over positions (a global pool), not over channels or the batch",
        )
    return st.moved(st.axis if keepdim else st.axis - sum(d < st.axis for d in dims))


def cat(w, node, op=None) -> State:
    """``torch.cat``: along the labelled axis the parts' labels are laid end to end; along another axis
    the parts must carry the same labels."""
    parts = w.arg(node, 0, "tensors")
    dim = w.arg(node, 1, "dim", 0)
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

# --------------------------------------------------------------------------------------- statistics
def norm_reduce(w, node, op=None) -> State:
    """mean / sum / amax: over the labelled feature axis a statistic (module docstring), else
    :func:`.reduce` (a pool over positions)."""
    st = w.input(node)
    src = w.tensor_args(node)[0]
    dims = w.arg(node, 1, "dim")
    if w.is_fixed(st) or dims is None:
        return reduce(w, node, op)
    nd = len(w.shape(src))
    dims = {d % nd for d in ((dims,) if isinstance(dims, int) else tuple(dims))}
    if st.axis not in dims or 0 in dims:
        return reduce(w, node, op)
    layer = module_path(node) or node.name
    why = "normalises across features (a statistic over them), so no per-feature scaling"
    if src.name in w.no_scaling:  # x.pow(2) fixed the scales first: the norm is the reason, named by module
        del w.no_scaling[src.name]
        w.no_scaling[layer] = why
    w.fix_scales(st, layer, why)
    return UNLABELLED


# ---------------------------------------------------------------------------------------------- gains
def norm_mul(w, node, op=None) -> State:
    """``a * b``: a parameter vector times features whose scales are fixed opens a scale (module
    docstring); anything else is :func:`.mul`."""
    found = _gain(w, node)
    if found is None:
        return mul(w, node, op)
    st, attr = found
    pa = attr.param_axis(st.axis - (len(w.shape(node)) - len(attr.shape)))
    layer = module_path(node) or attr.name.rsplit(".", 1)[0]
    out = []
    for s in st.segs:
        new = w.new(layer, s.n)
        w.perm_uf.union(new, FIXED)  # only its scale is new
        out.append(Seg(s.perm, new, s.n, s.inner))
    w.weights.add(attr.name)
    w.act_on(attr.name, pa, out, 1)
    if _normalised_by_rms(w, node):
        w.norms[attr.name] = "rms"
    return State(st.axis, tuple(out), st.producer)


def _gain(w, node) -> tuple[State, Attr] | None:
    """``(features, parameter)`` when ``node`` multiplies labelled features whose scales are all fixed by a
    parameter vector along their labelled axis (size 1 elsewhere), and nothing else; else ``None``."""
    args = list(node.args[:2]) + [node.kwargs[k] for k in ("other",) if k in node.kwargs]
    if len(args) != 2 or not all(isinstance(a, torch.fx.Node) for a in args):
        return None
    states = [w.states.get(a) for a in args]
    feats = [s for s in states if isinstance(s, State) and not w.is_fixed(s)]
    attrs = [s for s in states if isinstance(s, Attr) and s.in_state_dict and not s.opaque]
    if len(feats) != 1 or len(attrs) != 1:
        return None
    st, attr = feats[0], attrs[0]
    nd = len(w.shape(node))
    shape = (1,) * (nd - len(attr.shape)) + tuple(attr.shape)
    axis = st.axis
    if shape[axis] != w.shape(node)[axis] or any(n != 1 for i, n in enumerate(shape) if i != axis):
        return None
    if attr.param_axis(axis - (nd - len(attr.shape))) is None:
        return None
    if any(w.scale_uf.find(s.scale) != FIXED for s in st.segs):
        return None
    return st, attr


_COPIES = {"to", "_to_copy", "alias", "contiguous", "clone", "type_as", "float", "double"}


def _through_copies(x):
    while isinstance(x, torch.fx.Node) and x.op in ("call_function", "call_method") and \
            name_of(x.target) in _COPIES and x.args:
        x = x.args[0]
    return x


def _normalised_by_rms(w, node) -> bool:
    """Whether the features of the gain ``node`` are ``x * rsqrt(mean(x ** 2, -1) + eps)`` (or
    ``x / sqrt(...)``), copies and casts aside."""
    feats = next(a for a in node.args[:2] if isinstance(w.states.get(a), State))
    prod = _through_copies(feats)
    if not isinstance(prod, torch.fx.Node) or name_of(prod.target) not in ("mul", "div", "truediv") \
            or len(prod.args) != 2:
        return False
    x, r = (_through_copies(a) for a in prod.args)
    want = "div" if name_of(prod.target) != "mul" else "mul"
    for a, b in ((x, r), (r, x)) if want == "mul" else ((x, r),):
        root = {"mul": "rsqrt", "div": "sqrt"}[want]
        if isinstance(b, torch.fx.Node) and name_of(b.target) == root:
            stat = b.args[0]
            if isinstance(stat, torch.fx.Node) and name_of(stat.target) in ("add", "__add__"):
                stat = stat.args[0]
            if isinstance(stat, torch.fx.Node) and name_of(stat.target) == "mean":
                sq = stat.args[0]
                if isinstance(sq, torch.fx.Node) and name_of(sq.target) in ("pow", "__pow__") \
                        and sq.args[1:2] == (2,) and _through_copies(sq.args[0]) == a:
                    return True
    return False
