r"""Rules for the operations that move a tensor's entries without arithmetic: reshapes, axis moves,
indexing and splits, of labelled tensors and of parameters (book: chapters "Symmetries of real
architectures" and "Transformers: permutations without scalings"). See :mod:`symlib.symmetry.trace`; the
table that picks these rules is :mod:`~symlib.symmetry.trace.rules`.

* reshape (``view``, ``reshape``, ``flatten``, ``squeeze``, ``unsqueeze``, ``nn.Flatten``): axes are matched
  in groups of equal products (:func:`groups`). A labelled axis alone in its group moves; merged with
  the axes after it, it becomes a flatten (a channel label acts on blocks of ``H*W`` inputs of the next
  linear layer, ``Action.inner``); split into several axes, its features become a
  :class:`~.labels.Grid` (``(..., h * k) -> (..., h, k)``: heads); grid axes merged back in their
  row-major order become one labelled axis again. Interleaving the parts of a label (a channel shuffle)
  is refused.
* ``permute``, ``transpose``, ``.t()``, ``movedim``: the labels follow their axes.
* indexing, ``select``, ``slice``, ``split``, ``chunk``, ``unbind``: along an unlabelled axis each piece keeps
  the labels; along the labelled axis (or the slowest axis of a grid) the labels are cut at the pieces'
  boundaries (:meth:`~.labels.UnionFind.cut`), so a fused query-key-value output becomes three labels.
* Swin's patch merging ``(..., H, W, C) -> (..., H/2, W/2, 4C)`` lays four copies of the channels' labels
  end to end.
* views of a parameter (``expand``, ``unsqueeze``, ``permute``, ``.T``, ``view`` adding or removing axes of
  size 1, ...) stay that parameter, with a map from the view's axes to the parameter's
  (:class:`~.labels.Attr`), so a class token expanded to the batch and concatenated to the patch
  embeddings moves with them; anything else computed from parameters alone is opaque (no label may
  act on it).

Every rule is ``rule(walker, node, op) -> state`` (:mod:`~symlib.symmetry.trace.rules`).
"""

from __future__ import annotations

import math

import torch
import torch.fx

from symlib.symmetry.trace import heads
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Grid, Multi, Scores, Seg, State
from symlib.symmetry.trace.walker import name_of

SHUFFLE = (
    "a reshape may merge the channel axis with the axes after it (a flatten), split it into heads and "
    "merge them back in order; interleaving the parts of a label (a channel shuffle does) would split it "
    "into strided pieces, which no permutation label expresses"
)


# ------------------------------------------------------------------------------------------ reshape
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


def reshape(w, node, op=None):
    """A reshape of a labelled tensor, of features split into heads or of attention scores (module
    docstring)."""
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
            elif gi[-1] == a and len(gj) == 1 and all(s.inner == 1 for s in st.segs):
                # positions merged into the channels before them (timm's patch merging): k copies of the
                # label laid end to end, as a concatenation of k parts with one label would be
                k = math.prod(in_shape[x] for x in gi[:-1])
                return State(gj[0], st.segs * k, st.producer)
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


# --------------------------------------------------------------------------------------- axis moves
def _order(node, ndim: int) -> list[int]:
    """The axis order of a permute / transpose / ``.T`` node: output axis ``i`` is input axis ``order[i]``."""
    name = name_of(node.target)
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


def move(w, node, op=None):
    """permute / transpose: the labels follow their axis (a grid's axes, the heads of scores)."""
    st = w.states.get(w.tensor_args(node)[0])
    if isinstance(st, Grid):
        order = _order(node, len(w.shape(node)))
        return Grid(tuple(order.index(a) for a in st.axes), st.sizes, st.segs, st.producer)
    if isinstance(st, Scores):
        return Scores(_order(node, len(w.shape(node))).index(st.axis), st.heads, st.follows)
    if w.is_fixed(st) or isinstance(st, Attr):
        return UNLABELLED
    return st.moved(_order(node, len(w.shape(node))).index(st.axis))


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
    if dim != st.axes[0]:  # the same features of every head (rotate_half): only whole heads move
        return _inside_heads(w, node, heads.collapse(w, node, st), dim, lo, hi, drop, shift)
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


def _inside_heads(w, node, st: Grid, dim: int, lo: int, hi: int, drop: bool, shift):
    """Entries ``lo:hi`` of the inner grid axis ``dim`` of a heads-only (or fixed) grid: each label entry
    keeps its heads, now with fewer features each."""
    if w.is_fixed(st):
        return UNLABELLED
    k = st.axes.index(dim)
    sizes = list(st.sizes)
    seg = st.segs[0]
    inner = seg.inner // sizes[k] * (hi - lo)
    axes = list(st.axes)
    if drop:
        del axes[k], sizes[k]
    else:
        sizes[k] = hi - lo
    axes = [shift(a) for a in axes]
    out = (Seg(seg.perm, seg.scale, seg.n, inner),)
    if len(axes) == 1:
        return State(axes[0], out, st.producer)
    return Grid(tuple(axes), tuple(sizes), out, st.producer)


def pieces(w, node, op=None) -> Multi | None:
    """``split`` / ``chunk`` / ``unbind`` / ``tensor_split`` of a labelled tensor (a
    :class:`~.labels.Multi`)."""
    src = w.tensor_args(node)[0]
    st = w.states.get(src)
    if w.is_fixed(st) or isinstance(st, Attr):
        return None
    metas = node.meta.get("tensor_meta")
    shapes = [tuple(m.shape) for m in metas]
    in_shape = tuple(w.shape(src))
    unbind = "unbind" in name_of(node.target)
    dim = w.arg(node, 1 if unbind else 2, "dim", 0)
    dim %= len(in_shape)
    if unbind:
        return Multi(tuple(_piece(w, node, st, dim, i, i + 1, True) for i in range(len(shapes))))
    out, pos = [], 0
    for shp in shapes:
        out.append(_piece(w, node, st, dim, pos, pos + shp[dim], False))
        pos += shp[dim]
    return Multi(tuple(out))


def index(w, node, op=None):
    """``x[idx]`` (``operator.getitem``) and ``aten.select`` / ``aten.slice`` of a tensor (an item of a
    tuple is the walk's own: :func:`.rules.apply`)."""
    src = node.args[0]
    st = w.states.get(src) if isinstance(src, torch.fx.Node) else None
    if isinstance(st, Attr) or w.is_fixed(st):
        return UNLABELLED
    in_shape = tuple(w.shape(src))
    name = name_of(node.target)
    if name == "select":
        dim = w.arg(node, 1, "dim", 0) % len(in_shape)
        i = w.arg(node, 2, "index", 0) % in_shape[dim]
        return _piece(w, node, st, dim, i, i + 1, True)
    if name == "slice":
        dim = w.arg(node, 1, "dim", 0) % len(in_shape)
        lo, hi, step = w.arg(node, 2, "start"), w.arg(node, 3, "end"), w.arg(node, 4, "step", 1)
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
    if dim not in labelled_axes(st):  # positions cut: no label moves (bounds may be traced ints)
        return st
    known = [x.meta.get("val") if isinstance(x, torch.fx.Node) else x for x in (sl.start, sl.stop, sl.step)]
    if any(isinstance(x, torch.fx.Node) or (x is not None and not isinstance(x, int)) for x in known):
        raise w.refuse(node, "a slice of a labelled axis with bounds known only at run time",
                       "slice labelled axes with constant bounds")
    lo, hi, step = slice(*known).indices(in_shape[dim])
    if (lo, hi, step) == (0, in_shape[dim], 1):
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


def patch_merging(w, node, op=None) -> State:
    """torchvision's ``_patch_merging_pad``: ``(..., H, W, C) -> (..., H/2, W/2, 4C)``, four position
    subsamples side by side, each with the channels' labels."""
    st = w.input(node)
    if not st.segs:
        return UNLABELLED
    if st.axis != len(w.shape(node)) - 1:
        raise w.refuse(node, "a patch merging of a tensor whose channels are not last", "use (B, H, W, C)")
    return State(st.axis, st.segs * 4, st.producer)


# ------------------------------------------------------------------------------------ parameter views
def _param_inputs(w, node) -> list[torch.fx.Node]:
    """The inputs of ``node`` that are parameters (or views of them)."""
    return [a for a in w.nested_nodes((node.args, node.kwargs)) if isinstance(w.states.get(a), Attr)]


def _param_view(w, node, axes_of, sources: int | None = 1) -> Attr:
    """The state of ``node``, computed from parameters alone: the parameter of its first input, with the
    axis map ``axes_of(node, axes, in_shape, out_shape)`` gives (``None``: opaque). ``sources`` is how many
    parameter inputs the view may read (``None``: any)."""
    srcs = _param_inputs(w, node)
    src = w.states[srcs[0]]
    out_shape = tuple(w.shape(node) or ())
    new = None
    if not src.opaque and (sources is None or len(srcs) == sources):
        axes = tuple(src.param_axis(i) for i in range(len(src.shape)))
        new = axes_of(node, axes, src.shape, out_shape)
    if new is None:
        return Attr(src.name, out_shape, src.in_state_dict, opaque=True)
    return Attr(src.name, out_shape, src.in_state_dict, new)


def opaque_param(w, node, op=None) -> Attr:
    """A tensor computed from parameters by anything but a view: no label may act on it."""
    return _param_view(w, node, lambda *_: None)


def same_param(w, node, op=None) -> Attr:
    """``contiguous``, ``clone``, ``to``, ...: the parameter itself."""
    return _param_view(w, node, lambda node, axes, i, o: axes)


def expanded_param(w, node, op=None) -> Attr:
    """``expand`` / ``expand_as`` / ``broadcast_to``: the new and broadcast axes map to no parameter axis."""
    def axes_of(node, axes, in_shape, out_shape):
        pad = len(out_shape) - len(in_shape)
        return (None,) * pad + tuple(a if in_shape[i] == out_shape[pad + i] else None
                                     for i, a in enumerate(axes))

    return _param_view(w, node, axes_of, sources=None)


def reshaped_param(w, node, op=None) -> Attr:
    """A reshape adding or removing axes of size 1 (any other reshape of a parameter is opaque)."""
    def axes_of(node, axes, in_shape, out_shape):
        new = [None] * len(out_shape)
        for gi, gj in groups(in_shape, out_shape):
            if len(gi) == 1 and len(gj) == 1:
                new[gj[0]] = axes[gi[0]]
            elif gi or gj:
                return None
        return tuple(new)

    return _param_view(w, node, axes_of)


def moved_param(w, node, op=None) -> Attr:
    """``permute`` / ``transpose`` / ``.t()`` / ``movedim`` / ``.T`` / ``.mT`` of a parameter (another
    attribute read with ``getattr`` is opaque)."""
    if node.target is getattr and node.args[1] not in ("T", "mT"):
        return opaque_param(w, node)

    def axes_of(node, axes, in_shape, out_shape):
        return tuple(axes[k] for k in _order(node, len(in_shape)))

    return _param_view(w, node, axes_of)


def indexed_param(w, node, op=None) -> Attr:
    """A parameter indexed by whole slices and ints, with new axes (``None``); other indexing is opaque."""
    def axes_of(node, axes, in_shape, out_shape):
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

    return _param_view(w, node, axes_of)


def relative_position_bias(w, node, op=None) -> Attr:
    """torchvision's ``_get_relative_position_bias``: ``(1, heads, N, N)`` from the ``(positions, heads)``
    table, the heads axis being the table's last axis."""
    src = w.states[_param_inputs(w, node)[0]]
    return Attr(src.name, tuple(w.shape(node) or ()), src.in_state_dict, (None, 1, None, None))
