"""The walk behind :func:`symlib.symmetry.trace.spec_of` (book: chapter "Symmetries of real architectures"):
one visit per node of the traced graph, in order, giving each node's result its state (the labels of a
tensor, :mod:`~symlib.symmetry.trace.labels`), and what the visits record.

The walker visits the graph's own nodes itself (the input, a parameter read, the output, which fixes the
labels reaching it); every other node goes to the rule table (:func:`.rules.apply`), which spec_of hands
the walker. The rules write through the walker's bookkeeping (:meth:`Walker.new` opens a label,
:meth:`Walker.act` records an :class:`~symlib.symmetry.actions.Action` of a label on a parameter axis,
:meth:`Walker.merge` ties the labels of two tensors, ...) and read the graph through its node helpers
(``Walker.shape``, ``Walker.arg``, ``Walker.refuse``, ...).

What a walk records is a :class:`Records`: the union-finds of the permutation and scaling labels, the
actions on the labels as they were when recorded, and the facts the spec needs besides (weights, layers
without scalings, tied heads, attention labels). ``assemble`` (in :mod:`symlib.symmetry.trace.build`) turns it
into the :class:`~symlib.symmetry.spec.Spec`; the walker knows nothing of that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from symlib.symmetry.spec import Action, SymmetryError
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Grid, Multi, Scores, Seg, State, UnionFind


def name_of(target) -> str:
    """A readable name of a node's target (``"linear"`` for ``torch.ops.aten.linear.default``)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def module_path(node) -> str | None:
    """The innermost module ``node`` was traced in, from ``node.meta["nn_module_stack"]`` (``torch.fx`` and
    ``torch.export`` record it): ``"model.layers.0.self_attn"``; ``None`` at the model's top level."""
    stack = node.meta.get("nn_module_stack") if isinstance(node, torch.fx.Node) else None
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    return path or None


def _where(node) -> str:
    """`` in module 'path' (Class)`` for a node traced inside a submodule, else ``""``."""
    stack = node.meta.get("nn_module_stack") if isinstance(node, torch.fx.Node) else None
    path = module_path(node)
    if path is None:
        return ""
    cls = list(stack.values())[-1][1]
    cls = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return f" in module {path!r} ({cls})"


@dataclasses.dataclass
class Records:
    """What a walk records, and all that ``assemble`` (:mod:`symlib.symmetry.trace.build`) reads.

    Attributes:
        perm_uf, scale_uf: the permutation and scaling labels, merged and cut as the rules said.
        actions: every action of a label on a parameter axis, naming the label as it was when recorded
            (its final class and parts are read from the union-finds).
        weights: the parameters that are weights (``Spec.weights``).
        no_scaling: layer -> why it has no scaling symmetry.
        grouped: ``(label, label, G)``: both labels have ``G`` blocks (groups of a convolution, heads of an
            attention) that must move together; a label tied to :data:`~.labels.FIXED` keeps its blocks.
        kinds: label -> ``"qk"`` (queries and keys) or ``"vo"`` (values): the attention labels.
        no_bias_shift: attention labels whose biases are not redundant (``add_zero_attn``).
        output_producers: the layers whose outputs reach the network's output, in order.
        norms: the weight of every LayerNorm (``"layer"``) and RMSNorm (``"rms"``) with one (``Spec.norms``).
        opaque: the operations with parameters but no rule that read unlabelled tensors (the input): their
            results carry no label, so the symmetries of their outputs are missed (``SmallSpecWarning``).
        rotated: heads labels of features multiplied by a factor that varies along each head's features
            (rotary embeddings' ``cos`` and ``sin``).
        rotary: ``(query actions, key actions, per_head)`` of every product of rotated queries and keys:
            the actions on the rows that produce them when they met (``Spec.rotary``).
    """

    perm_uf: UnionFind = dataclasses.field(default_factory=UnionFind)
    scale_uf: UnionFind = dataclasses.field(default_factory=UnionFind)
    actions: list[Action] = dataclasses.field(default_factory=list)
    weights: set[str] = dataclasses.field(default_factory=set)
    no_scaling: dict[str, str] = dataclasses.field(default_factory=dict)
    grouped: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    no_bias_shift: set[str] = dataclasses.field(default_factory=set)
    output_producers: list[str | None] = dataclasses.field(default_factory=list)
    norms: dict[str, str] = dataclasses.field(default_factory=dict)
    opaque: list[str] = dataclasses.field(default_factory=list)
    rotated: set[str] = dataclasses.field(default_factory=set)
    rotary: list[tuple[list[Action], list[Action], int]] = dataclasses.field(default_factory=list)


class Walker(Records):
    """Walks a traced graph once, giving every node's result its state; what it records as it walks
    (its :class:`Records`) is what :meth:`walk` yields.

    Args:
        model: the traced model (its modules and state-dict names).
        gm: its graph, with shapes propagated (``node.meta["tensor_meta"]``).
        apply: the rule table's entry point, ``apply(walker, node) -> state`` (:func:`.rules.apply`).
    """

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, apply: Callable):
        super().__init__()
        self.model = model
        self.gm = gm
        self.apply = apply
        self.modules = dict(gm.named_modules())
        self.state_names = set(model.state_dict())
        self.states: dict[torch.fx.Node, State | Attr | Grid | Scores | Multi | None] = {}
        self.from_params: set[torch.fx.Node] = set()
        self.tail: set[torch.fx.Node] = set()

    # ------------------------------------------------------------------------------------------ labels
    def new(self, name: str, size: int) -> str:
        """A fresh label (permutation and scale) named after the layer that opens it."""
        label, i = name, 1
        while label in self.perm_uf.parent or label in self.scale_uf.parent:
            label = f"{name}#{i}"
            i += 1
        self.perm_uf.add(label, size)
        self.scale_uf.add(label, size)
        return label

    def act(self, param: str, axis: int, perm: str | None, scale: str | None, power: int, groups: int = 1,
            offset: float = 0.0, start: int = 0, inner: int = 1) -> None:
        """Record that labels ``perm`` and ``scale`` act on axis ``axis`` of ``param`` (an
        :class:`~symlib.symmetry.actions.Action`, its labels resolved by the assembly)."""
        self.actions.append(Action(param, axis, perm, scale, power, groups, offset, start, inner))

    def act_on(self, param: str, axis: int, segs, power: int, scales: bool = True,
               offset: float = 0.0) -> None:
        """The labels of segments ``segs``, laid end to end on axis ``axis`` of ``param``, act on it, each
        from where its segment starts (``Action.start``) and on blocks of ``inner`` entries; with
        ``scales=False`` the permutations only."""
        pos = 0
        for s in segs:
            self.act(param, axis, s.perm, s.scale if scales else FIXED, power, offset=offset, start=pos,
                     inner=s.inner)
            pos += s.size

    def seg_fixed(self, s: Seg) -> bool:
        return self.perm_uf.find(s.perm) == FIXED and self.scale_uf.find(s.scale) == FIXED

    def is_fixed(self, st) -> bool:
        if isinstance(st, Scores):
            return False
        if isinstance(st, Multi):
            return all(self.is_fixed(x) for x in st.items)
        return st is None or isinstance(st, Attr) or all(self.seg_fixed(s) for s in st.segs)

    def fix(self, st) -> None:
        """Merge every label of ``st`` with the fixed class (the heads of scores stay in place)."""
        if isinstance(st, Multi):
            for x in st.items:
                self.fix(x)
        elif isinstance(st, Scores):
            self.grouped.append((st.follows, FIXED, st.heads))
        elif isinstance(st, (State, Grid)):
            for s in st.segs:
                self.fix_seg(s)

    def fix_seg(self, s: Seg) -> None:
        """Merge the labels of segment ``s`` with the fixed class."""
        self.perm_uf.union(s.perm, FIXED)
        self.scale_uf.union(s.scale, FIXED)

    def fix_scales(self, st: State, layer: str | None = None, why: str | None = None) -> State:
        """``st`` with every scale fixed; a layer that is not positively homogeneous is recorded."""
        if layer is not None and any(self.scale_uf.find(s.scale) != FIXED for s in st.segs):
            self.no_scaling[layer] = why
        for s in st.segs:
            self.scale_uf.union(s.scale, FIXED)
        return st

    def segments(self, st: State | None, size: int) -> tuple[Seg, ...]:
        """The segments of ``st`` on an axis of ``size`` entries (one fixed segment when it has none)."""
        if st is None or isinstance(st, Attr) or not st.segs:
            return (Seg(FIXED, FIXED, size),)
        return st.segs

    def merge(self, a: tuple[Seg, ...], b: tuple[Seg, ...], node, scales: bool = True) -> tuple[Seg, ...]:
        """Segments of two tensors whose entries must carry the same labels (a sum, a concatenation along
        another axis): labels on the same slice merge; a label that meets fixed entries becomes fixed.
        With ``scales=False`` (the factors of a product) only the permutations merge."""
        if sum(s.size for s in a) != sum(s.size for s in b):
            raise self.refuse(node, "tensors whose labelled axes differ in size", "this is unexpected")
        spans_a, spans_b = _spans(a), _spans(b)
        in_b = {(lo, hi, t.n, t.inner): t for lo, hi, t in spans_b}
        in_a = {(lo, hi, s.n, s.inner) for lo, hi, s in spans_a}
        keep = {}
        for lo, hi, s in spans_a:
            t = in_b.get((lo, hi, s.n, s.inner))
            if t is not None:
                self.perm_uf.union(s.perm, t.perm)
                if scales:
                    self.scale_uf.union(s.scale, t.scale)
                keep[lo] = s
        loose_a = [(lo, hi, s) for lo, hi, s in spans_a if (lo, hi, s.n, s.inner) not in in_b]
        loose_b = [(lo, hi, t) for lo, hi, t in spans_b if (lo, hi, t.n, t.inner) not in in_a]
        if any(lo < hi2 and lo2 < hi and not self.seg_fixed(s) and not self.seg_fixed(t)
               for lo, hi, s in loose_a for lo2, hi2, t in loose_b):
            raise self.refuse(
                node, "tensors whose labels are laid out differently on one axis (e.g. a sum of two "
                "concatenations with different parts)", "give both tensors the same layout of channels",
            )
        if not loose_a and not loose_b:
            return tuple(a)
        for _, _, s in loose_a + loose_b:  # a label that meets fixed entries cannot move them (nor scale
            self.fix_seg(s)  # them, since the result's entries are fixed)
        cuts = sorted({hi for _, hi, _ in spans_a + spans_b})
        merged, pos = [], 0
        for hi in cuts:
            merged.append(keep[pos] if pos in keep else Seg(FIXED, FIXED, hi - pos))
            pos = hi
        return tuple(merged)

    # ------------------------------------------------------------------------------------------- nodes
    @staticmethod
    def shape(node) -> tuple[int, ...] | None:
        meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
        return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None

    @staticmethod
    def arg(node, i: int, key: str, default=None):
        """Argument ``i`` of ``node``, or its keyword ``key``, or ``default``."""
        return node.args[i] if len(node.args) > i else node.kwargs.get(key, default)

    @staticmethod
    def nested_nodes(args) -> list[torch.fx.Node]:
        out: list[torch.fx.Node] = []
        torch.fx.node.map_arg(args, lambda n: out.append(n))
        return out

    def tensor_args(self, node) -> list[torch.fx.Node]:
        """Tensor-valued inputs of ``node``, including those inside lists and tuples."""
        return [a for a in self.nested_nodes((node.args, node.kwargs)) if self.shape(a) is not None]

    def input(self, node) -> State:
        args = self.tensor_args(node)
        if not args:
            raise SymmetryError(f"node {node.name!r} ({node.target}){_where(node)} has no tensor input")
        st = self.states[args[0]]
        if isinstance(st, (Grid, Scores, Multi)):
            raise self.refuse(node, "an operation on features split into heads or on attention scores",
                              "its symmetries are unknown to symlib; merge the heads back first")
        return UNLABELLED if st is None or isinstance(st, Attr) else st

    def refuse(self, node, what: str, fix: str) -> SymmetryError:
        target = node.target if isinstance(node.target, str) else name_of(node.target)
        return SymmetryError(f"spec_of cannot handle {what} at node {node.name!r} (target {target!r})"
                             f"{_where(node)}: {fix}")

    def fixed_inputs(self, node) -> bool:
        return all(self.is_fixed(self.states.get(a)) for a in self.nested_nodes((node.args, node.kwargs)))

    def fix_inputs(self, node) -> State:
        """An operation between the last layer and the output: its inputs reach the output anyway."""
        self._fix_reaching_output(self.nested_nodes((node.args, node.kwargs)))
        return UNLABELLED

    def _fix_reaching_output(self, nodes) -> None:
        for a in nodes:
            st = self.states.get(a)
            if isinstance(st, (Grid, Scores, Multi)) or (isinstance(st, State) and st.segs):
                self.fix(st)
                self.output_producers.append(getattr(st, "producer", None))

    def has_parameters(self, node) -> bool:
        """A layer with parameters, or an operation reading a parameter of the model (``get_attr``)."""
        if node.op == "call_module":
            return any(True for _ in self.modules[node.target].parameters())
        return any(a in self.from_params for a in self.nested_nodes((node.args, node.kwargs)))

    def parameter_note(self, node) -> str:
        """`` and the parameter 'w' used outside a layer`` when ``node`` reads one, else ``""``."""
        seen, todo = set(), self.nested_nodes((node.args, node.kwargs))
        while todo:
            a = todo.pop()
            if a in seen or a not in self.from_params:
                continue
            seen.add(a)
            if a.op == "get_attr":
                return f" and the parameter {a.target!r} used outside a layer"
            todo += self.nested_nodes((a.args, a.kwargs))
        return ""

    # -------------------------------------------------------------------------------------------- walk
    def _tail(self) -> set[torch.fx.Node]:
        """Nodes from which every path reaches the output without passing through a layer with
        parameters (e.g. a final softmax): operations there cannot break a symmetry."""
        tail: set[torch.fx.Node] = set()
        for node in reversed(self.gm.graph.nodes):
            if node.op == "output":
                continue
            users = list(node.users)
            if users and all(u.op == "output" or (u in tail and not self.has_parameters(u)) for u in users):
                tail.add(node)
        return tail

    def _params_only(self) -> set[torch.fx.Node]:
        """Tensors computed from the model's parameters and buffers alone (``get_attr``, ``w.T``, a class
        token expanded to the batch size, ...); sizes read from other tensors may enter."""
        out: set[torch.fx.Node] = set()
        for node in self.gm.graph.nodes:
            if node.op == "get_attr" and node.target in self.state_names:
                out.add(node)
            elif node.op in ("call_function", "call_method") and self.shape(node) is not None:
                ins = [a for a in self.nested_nodes((node.args, node.kwargs))
                       if self.shape(a) is not None or a.op == "get_attr"]
                if ins and all(a in out for a in ins):
                    out.add(node)
        return out

    def walk(self) -> Records:
        """Visit every node in order; what the walk recorded."""
        self.from_params = self._params_only()
        self.tail = self._tail()
        for node in self.gm.graph.nodes:
            self.states[node] = self.visit(node)
        return self

    def visit(self, node):
        """The state of ``node``'s result: the graph's own nodes here, every operation by the rule table."""
        if node.op == "placeholder":
            return UNLABELLED if self.shape(node) is not None else None
        if node.op == "output":
            self._fix_reaching_output(self.nested_nodes(node.args))
            return None
        if node.op == "get_attr":
            return Attr(node.target, self.shape(node) or (), node.target in self.state_names)
        if node.op in ("call_module", "call_function", "call_method"):
            return self.apply(self, node)
        raise self.refuse(node, f"the graph node kind {node.op!r}", "this is unexpected; report it")


def _spans(segs) -> list[tuple[int, int, Seg]]:
    out, pos = [], 0
    for s in segs:
        out.append((pos, pos + s.size, s))
        pos += s.size
    return out
