r"""Features spread over several axes, and tensors cut into pieces (book: chapter "Transformers:
permutations without scalings"). See :mod:`symlib.symmetry.trace`.

* reshape: axes are matched in groups of equal products. A labelled axis alone in its group moves; merged
  with the axes after it, it becomes a flatten (``Action.inner``); split into several axes, its features
  become a :class:`~.labels.Grid` (``(..., h * k) -> (..., h, k)``: heads); grid axes merged back in their
  row-major order become one labelled axis again. Interleaving the parts of a label (a channel shuffle)
  is refused.
* indexing, ``split``, ``chunk``, ``unbind``: along an unlabelled axis each piece keeps the labels; along
  the labelled axis (or the slowest axis of a grid) the labels are cut at the pieces' boundaries
  (:meth:`~.labels.UnionFind.cut`), so a fused query-key-value output becomes three labels.
* views of a parameter (``expand``, ``unsqueeze``, ``permute``, ``.T``, ``view`` adding or removing axes of
  size 1) stay that parameter, with a map from the view's axes to the parameter's
  (:class:`~.labels.Attr`), so a class token expanded to the batch and concatenated to the patch
  embeddings moves with them.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from symlib.symmetry.trace import rules
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Grid, Multi, Scores, Seg, State

SHUFFLE = (
    "a reshape may merge the channel axis with the axes after it (a flatten), split it into heads and "
    "merge them back in order; interleaving the parts of a label (a channel shuffle does) would split it "
    "into strided pieces, which no permutation label expresses"
)


# ------------------------------------------------------------------------------------ axis groups
def groups(a: tuple[int, ...], b: tuple[int, ...], keep=()) -> list[tuple[list[int], list[int]]]:
    """Consecutive axes of shape ``a`` and of shape ``b`` with equal products, in order; axes of size 1 are
    left out of each group unless listed in ``keep`` (axes of ``a``)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                pa, i = pa * a[i], i + 1
                gi.append(i - 1)
            elif j < len(b):
                pb, j = pb * b[j], j + 1
                gj.append(j - 1)
            else:
                raise ValueError(f"shapes {a} and {b} have different sizes")
        out.append((gi, gj))
    out.append((list(range(i, len(a))), list(range(j, len(b)))))
    result = []
    for gi, gj in out:
        big = [y for y in gj if b[y] != 1]
        if not big and gj and any(x in keep for x in gi):  # a kept axis of size 1 keeps its partner
            big = gj[:1]
        result.append(([x for x in gi if a[x] != 1 or x in keep], big))
    return result


def labelled_axes(st) -> tuple[int, ...]:
    if isinstance(st, State):
        return (st.axis,) if st.segs else ()
    if isinstance(st, Grid):
        return st.axes
    if isinstance(st, Scores):
        return (st.axis,)
    return ()


def reshape(w, node):
    """A reshape of a labelled tensor (module docstring)."""
    src = w.tensor_args(node)[0]
    st = w.states.get(src)
    if isinstance(st, Attr) or w.is_fixed(st):
        return UNLABELLED
    in_shape, out_shape = tuple(w.shape(src)), tuple(w.shape(node))
    axes = labelled_axes(st)
    moved: dict[int, int] = {}  # a labelled axis alone in its group -> its new axis
    layout: list[tuple[list[int], list[int]]] = []  # grid regroupings: (labelled in axes, out axes)
    for gi, gj in groups(in_shape, out_shape, keep=axes):
        mine = [x for x in gi if x in axes]
        if not mine:
            continue
        if isinstance(st, State):
            a = st.axis
            if gi == [a] and len(gj) == 1:
                moved[a] = gj[0]
            elif gi[0] == a and len(gj) == 1:  # a flatten: each entry now covers a block of features
                block = math.prod(in_shape[x] for x in gi[1:])
                segs = tuple(Seg(s.perm, s.scale, s.n, s.inner * block) for s in st.segs)
                return State(gj[0], segs, st.producer)
            elif gi == [a] and all(s.inner == 1 for s in st.segs):  # split into a grid (heads)
                return Grid(tuple(gj), tuple(out_shape[y] for y in gj), st.segs, st.producer)
            else:
                raise w.refuse(node, f"a reshape of a tensor labelled on axis {a} from {in_shape} to "
                               f"{out_shape}", SHUFFLE)
        elif isinstance(st, Scores):
            if gi != [st.axis] or len(gj) != 1:
                raise w.refuse(node, "a reshape that mixes the heads of attention scores with other axes",
                               "keep the heads on an axis of their own")
            moved[st.axis] = gj[0]
        else:
            if mine != gi or not _consecutive(st, gi):
                raise w.refuse(node, f"a reshape of features spread over axes {st.axes} from {in_shape} to "
                               f"{out_shape}", SHUFFLE)
            layout.append((gi, gj))
    if isinstance(st, State):
        return State(moved[st.axis], st.segs, st.producer)
    if isinstance(st, Scores):
        return Scores(moved[st.axis], st.heads, st.follows)
    layout.sort(key=lambda g: st.axes.index(g[0][0]))
    new_axes = [y for _, gj in layout for y in gj]
    if len(new_axes) == 1:
        return State(new_axes[0], st.segs, st.producer)
    return Grid(tuple(new_axes), tuple(out_shape[y] for y in new_axes), st.segs, st.producer)


def _consecutive(st: Grid, gi: list[int]) -> bool:
    """Whether tensor axes ``gi`` (in tensor order) are consecutive axes of the grid's row-major order."""
    pos = [st.axes.index(x) for x in gi]
    return pos == list(range(pos[0], pos[0] + len(pos)))


def move(w, node, order: list[int]):
    """permute / transpose of a tensor whose features span several axes (or of attention scores)."""
    st = w.states.get(w.tensor_args(node)[0])
    if isinstance(st, Grid):
        return Grid(tuple(order.index(a) for a in st.axes), st.sizes, st.segs, st.producer)
    return Scores(order.index(st.axis), st.heads, st.follows)


# ------------------------------------------------------------------------------------ cutting labels
def cut_segs(w, node, segs, points) -> tuple[Seg, ...]:
    """``segs`` with their labels cut at the given offsets of the axis (:meth:`~.labels.UnionFind.cut`)."""
    out, pos = [], 0
    for s in segs:
        inside = [p - pos for p in points if pos < p < pos + s.size]
        pos += s.size
        if not inside:
            out.append(s)
            continue
        if any(o % s.inner for o in inside):
            raise w.refuse(node, "a cut through the block of features of one channel of a flattened map",
                           "cut between channels")
        for o in inside:
            w.perm_uf.cut(s.perm, o // s.inner)
            w.scale_uf.cut(s.scale, o // s.inner)
        for c in w.perm_uf.cuts(s.perm):  # the permutation and the scale cut at the same places
            w.scale_uf.cut(s.scale, c)
        for c in w.scale_uf.cuts(s.scale):
            w.perm_uf.cut(s.perm, c)
        perms = w.perm_uf.leaves(s.perm, s.n)
        scales = w.scale_uf.leaves(s.scale, s.n)
        if [n for _, _, n in scales] != [n for _, _, n in perms]:
            scales = [(FIXED, False, n) for _, _, n in perms]
        if any(p for _, p, _ in perms):
            raise w.refuse(node, "a cut of features that pair with others as the keys of an attention",
                           "use the keys only in the attention")
        for (p, _, n), (sc, _, _) in zip(perms, scales, strict=True):
            out.append(Seg(p, sc, n, s.inner))
    return tuple(out)


def _take(segs, lo: int, hi: int) -> tuple[Seg, ...]:
    """The segments lying in ``[lo, hi)`` of the axis (they must not straddle its ends)."""
    out, pos = [], 0
    for s in segs:
        if lo <= pos and pos + s.size <= hi:
            out.append(s)
        pos += s.size
    return tuple(out)


def _piece(w, node, st, dim: int, lo: int, hi: int, drop: bool):
    """Entries ``lo:hi`` of axis ``dim`` of a tensor of state ``st`` (the axis removed when ``drop``)."""
    def shift(a: int) -> int:
        return a - 1 if drop and a > dim else a

    if isinstance(st, State):
        if dim != st.axis:
            return State(shift(st.axis), st.segs, st.producer)
        if drop:
            raise w.refuse(node, "a single entry of a labelled axis", "keep whole labelled axes")
        segs = cut_segs(w, node, st.segs, [lo, hi])
        return State(st.axis, _take(segs, lo, hi), st.producer)
    if isinstance(st, Scores):
        if dim == st.axis:
            raise w.refuse(node, "a selection of some heads of attention scores", "keep every head")
        return Scores(shift(st.axis), st.heads, st.follows)
    if dim not in st.axes:
        return Grid(tuple(shift(a) for a in st.axes), st.sizes, st.segs, st.producer)
    if dim != st.axes[0]:
        raise w.refuse(node, "a selection along an inner axis of features spread over several axes",
                       "select along the slowest axis (e.g. queries, keys, values), not inside a head")
    unit = math.prod(st.sizes[1:])
    segs = cut_segs(w, node, st.segs, [lo * unit, hi * unit])
    segs = _take(segs, lo * unit, hi * unit)
    axes, sizes = list(st.axes), list(st.sizes)
    if drop:
        axes, sizes = axes[1:], sizes[1:]
    else:
        sizes[0] = hi - lo
    axes = [shift(a) for a in axes]
    if len(axes) == 1:
        return State(axes[0], segs, st.producer)
    return Grid(tuple(axes), tuple(sizes), segs, st.producer)


def pieces(w, node) -> Multi | None:
    """``split`` / ``chunk`` / ``unbind`` / ``tensor_split`` of a labelled tensor (a
    :class:`~.labels.Multi`)."""
    src = w.tensor_args(node)[0]
    st = w.states.get(src)
    if w.is_fixed(st) or isinstance(st, Attr):
        return None
    metas = node.meta.get("tensor_meta")
    shapes = [tuple(m.shape) for m in metas]
    in_shape = tuple(w.shape(src))
    name = rules.name_of(node.target)
    unbind = "unbind" in name
    dim = _arg(node, 1 if unbind else 2, "dim", 0)
    dim %= len(in_shape)
    if unbind:
        return Multi(tuple(_piece(w, node, st, dim, i, i + 1, True) for i in range(len(shapes))))
    out, pos = [], 0
    for shp in shapes:
        out.append(_piece(w, node, st, dim, pos, pos + shp[dim], False))
        pos += shp[dim]
    return Multi(tuple(out))


def _arg(node, i: int, key: str, default):
    return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)


def index(w, node):
    """``x[idx]`` (``operator.getitem``) and ``aten.select`` / ``aten.slice``; an item of a tuple."""
    src = node.args[0]
    st = w.states.get(src) if isinstance(src, torch.fx.Node) else None
    if isinstance(st, Multi):
        return st.items[node.args[1]]
    if isinstance(st, Attr) or w.is_fixed(st):
        return UNLABELLED
    in_shape = tuple(w.shape(src))
    name = rules.name_of(node.target)
    if name == "select":
        dim = _arg(node, 1, "dim", 0) % len(in_shape)
        i = _arg(node, 2, "index", 0) % in_shape[dim]
        return _piece(w, node, st, dim, i, i + 1, True)
    if name == "slice":
        dim = _arg(node, 1, "dim", 0) % len(in_shape)
        lo, hi, step = _arg(node, 2, "start", None), _arg(node, 3, "end", None), _arg(node, 4, "step", 1)
        return _sliced(w, node, st, dim, slice(lo, hi, step), in_shape)
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if any(isinstance(i, (torch.fx.Node, list, torch.Tensor)) for i in idx):
        raise w.refuse(node, "advanced (tensor) indexing of a labelled tensor", "index with ints and slices")
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        fill = len(in_shape) - sum(i is not None for i in idx if i is not Ellipsis)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
    idx = idx + (slice(None),) * (len(in_shape) - sum(i is not None for i in idx))
    axis, out_axis = 0, 0
    for i in idx:  # selections first, along the original axes; then the new axes of None
        if i is None:
            continue
        if isinstance(i, int):
            st = _piece(w, node, st, axis, i % in_shape[axis], i % in_shape[axis] + 1, True)
            in_shape = in_shape[:axis] + in_shape[axis + 1:]
            continue
        st = _sliced(w, node, st, axis, i, in_shape)
        axis += 1
    for i in idx:
        if i is None:
            st = _insert_axis(st, out_axis)
            out_axis += 1
        elif not isinstance(i, int):
            out_axis += 1
    return st


def _sliced(w, node, st, dim, sl: slice, in_shape):
    lo, hi, step = sl.indices(in_shape[dim])
    if (lo, hi, step) == (0, in_shape[dim], 1):
        return st
    if dim not in labelled_axes(st):
        return st
    if step != 1:
        raise w.refuse(node, "a strided slice of a labelled axis", "slice labelled axes with step 1")
    return _piece(w, node, st, dim, lo, hi, False)


def _insert_axis(st, at: int):
    def up(a):
        return a + 1 if a >= at else a

    if isinstance(st, State):
        return State(up(st.axis), st.segs, st.producer) if st.segs else st
    if isinstance(st, Scores):
        return Scores(up(st.axis), st.heads, st.follows)
    return Grid(tuple(up(a) for a in st.axes), st.sizes, st.segs, st.producer)


# ------------------------------------------------------------------------------------ parameter views
_SAME = {"contiguous", "clone", "detach", "to", "float", "double", "half", "type_as", "alias", "_to_copy",
         "lift_fresh_copy"}
_EXPAND = {"expand", "expand_as", "broadcast_to"}
_RESHAPE = {"view", "reshape", "unsqueeze", "squeeze", "flatten", "_unsafe_view", "unflatten"}
_MOVE = {"permute", "transpose", "t", "movedim"}
# Functions that are views of their first argument, known by module and name: output axis -> input axis.
WRAPPED_VIEWS = {
    # (1, heads, N, N) from the (positions, heads) table: the heads axis is the table's last axis
    ("torchvision.models.swin_transformer", "_get_relative_position_bias"):
        lambda ndim: (None, 1, None, None),
}


def attr_view(w, node) -> Attr:
    """The state of a tensor computed from parameters alone (module docstring)."""
    srcs = [a for a in w.nested_nodes((node.args, node.kwargs)) if isinstance(w.states.get(a), Attr)]
    src = w.states[srcs[0]]
    out_shape = tuple(w.shape(node) or ())
    name = rules.name_of(node.target)
    key = (getattr(node.target, "__module__", None), getattr(node.target, "__name__", None))
    opaque = Attr(src.name, out_shape, src.in_state_dict, opaque=True)
    if key in WRAPPED_VIEWS:
        return Attr(src.name, out_shape, src.in_state_dict, WRAPPED_VIEWS[key](len(out_shape)))
    if src.opaque or len(srcs) != 1 and name not in _EXPAND:
        return opaque
    in_shape = src.shape
    axes = tuple(src.param_axis(i) for i in range(len(in_shape)))
    if name in _SAME:
        new = axes
    elif name in _EXPAND:
        pad = len(out_shape) - len(in_shape)
        new = (None,) * pad + tuple(a if in_shape[i] == out_shape[pad + i] else None
                                    for i, a in enumerate(axes))
    elif name in _RESHAPE:
        new = [None] * len(out_shape)
        for gi, gj in groups(in_shape, out_shape):
            if len(gi) == 1 and len(gj) == 1:
                new[gj[0]] = axes[gi[0]]
            elif gi or gj:
                return opaque
        new = tuple(new)
    elif name in _MOVE or (node.target is getattr and node.args[1] in ("T", "mT")):
        order = _order(node, len(in_shape))
        new = tuple(axes[o] for o in order)
    elif node.target is operator.getitem or name == "getitem":
        new = _attr_index(node, axes, in_shape)
        if new is None:
            return opaque
    else:
        return opaque
    return Attr(src.name, out_shape, src.in_state_dict, new)


def _order(node, ndim: int) -> list[int]:
    """The axis order of a permute / transpose / ``.T`` node: output axis ``i`` is input axis ``order[i]``."""
    name = rules.name_of(node.target)
    order = list(range(ndim))
    if node.target is getattr or name == "t":
        return order[::-1]
    args = list(node.args[1:])
    if name == "transpose":
        d0 = args[0] if args else node.kwargs["dim0"]
        d1 = args[1] if len(args) > 1 else node.kwargs["dim1"]
        order[d0 % ndim], order[d1 % ndim] = order[d1 % ndim], order[d0 % ndim]
        return order
    if name == "movedim":
        src, dst = args[0] % ndim, args[1] % ndim
        order.remove(src)
        order.insert(dst, src)
        return order
    dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
    return [int(d) % ndim for d in (dims or node.kwargs["dims"])]


def _attr_index(node, axes, in_shape):
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if any(i is Ellipsis or isinstance(i, (torch.fx.Node, list)) for i in idx):
        return None
    out, k = [], 0
    for i in idx:
        if i is None:
            out.append(None)
        elif isinstance(i, int):
            k += 1
        elif isinstance(i, slice) and i.indices(in_shape[k]) == (0, in_shape[k], 1):
            out.append(axes[k])
            k += 1
        else:
            return None
    return tuple(out) + tuple(axes[k:])
