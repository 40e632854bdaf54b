"""The graph walk behind :func:`symlib.symmetry.trace.spec_of`: one visit per ``torch.fx`` node, the
label bookkeeping every rule shares, and the assembly of the :class:`~symlib.symmetry.spec.Spec` (book:
chapter "Symmetries of real architectures"). The rules live in :mod:`~symlib.symmetry.trace.layers`
(layers with parameters) and :mod:`~symlib.symmetry.trace.tensors` (everything else)."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from symlib.symmetry.spec import Action, Spec, SymmetryError
from symlib.symmetry.trace import layers, rules, tensors
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Seg, State, UnionFind


class Walker:
    """Walks a traced graph once, giving every tensor its :class:`~.labels.State`."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule):
        self.model = model
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.state_names = set(model.state_dict())
        self.perm_uf, self.scale_uf = UnionFind(), UnionFind()
        self.sizes: dict[str, int] = {}
        self.raw: list[tuple] = []
        self.weights: set[str] = set()
        self.no_scaling: dict[str, str] = {}
        self.grouped: list[tuple[str, str, int]] = []
        self.states: dict[torch.fx.Node, State | Attr | None] = {}
        self.output_producers: list[str | None] = []

    # ------------------------------------------------------------------ labels
    def new(self, name: str, size: int) -> str:
        """A fresh label (permutation and scale) named after the layer that opens it."""
        label, i = name, 1
        while label in self.perm_uf.parent or label in self.scale_uf.parent:
            label = f"{name}#{i}"
            i += 1
        self.perm_uf.add(label)
        self.scale_uf.add(label)
        self.sizes[label] = size
        return label

    def act(self, param, axis, perm, scale, power, groups=1, offset=0.0, start=0, inner=1) -> None:
        self.raw.append((param, axis, perm, scale, power, groups, offset, start, inner))

    def seg_fixed(self, s: Seg) -> bool:
        return self.perm_uf.find(s.perm) == FIXED and self.scale_uf.find(s.scale) == FIXED

    def is_fixed(self, st) -> bool:
        return st is None or isinstance(st, Attr) or all(self.seg_fixed(s) for s in st.segs)

    def fix(self, st: State | None) -> None:
        """Merge every label of ``st`` with the fixed class."""
        if isinstance(st, State):
            for s in st.segs:
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
        for _, _, s in loose_a + loose_b:  # a label that meets fixed entries cannot move them
            self.perm_uf.union(s.perm, FIXED)
            self.scale_uf.union(s.scale, FIXED)  # (nor scale them, since the result's entries are fixed)
        cuts = sorted({hi for _, hi, _ in spans_a + spans_b})
        merged, pos = [], 0
        for hi in cuts:
            merged.append(keep[pos] if pos in keep else Seg(FIXED, FIXED, hi - pos))
            pos = hi
        return tuple(merged)

    # the element-wise rules that layers.module also applies to modules (nn.GELU, nn.Flatten, ...)
    def nonhomogeneous(self, node, layer: str, what: str) -> State:
        return tensors.nonhomogeneous(self, node, layer, what)

    def reshape(self, node) -> State:
        return tensors.reshape(self, node)

    # ------------------------------------------------------------------- nodes
    @staticmethod
    def shape(node) -> tuple[int, ...] | None:
        meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
        return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None

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
            raise SymmetryError(f"node {node.name!r} ({node.target}) has no tensor input")
        st = self.states[args[0]]
        return UNLABELLED if st is None or isinstance(st, Attr) else st

    def refuse(self, node, what: str, fix: str) -> SymmetryError:
        target = node.target if isinstance(node.target, str) else rules.name_of(node.target)
        return SymmetryError(f"spec_of cannot handle {what} at node {node.name!r} (target {target!r}): {fix}")

    def fixed_inputs(self, node) -> bool:
        return all(self.is_fixed(self.states.get(a)) for a in self.nested_nodes((node.args, node.kwargs)))

    def fix_inputs(self, node) -> State:
        """An operation between the last layer and the output: its inputs reach the output anyway."""
        for a in self.nested_nodes((node.args, node.kwargs)):
            st = self.states.get(a)
            if isinstance(st, State) and st.segs:
                self.fix(st)
                self.output_producers.append(st.producer)
        return UNLABELLED

    def _tail(self) -> set[torch.fx.Node]:
        """Nodes from which every path reaches the output without passing through a layer with
        parameters (e.g. a final softmax): operations there cannot break a symmetry."""
        tail: set[torch.fx.Node] = set()
        for node in reversed(self.gm.graph.nodes):
            if node.op == "output":
                continue
            users = list(node.users)
            if users and all(u.op == "output" or (u in tail and not self._has_parameters(u)) for u in users):
                tail.add(node)
        return tail

    def _has_parameters(self, node) -> bool:
        """A layer with parameters, or an operation reading a parameter of the model (``get_attr``)."""
        if node.op == "call_module":
            return any(True for _ in self.modules[node.target].parameters())
        return any(a in self.from_params for a in self.nested_nodes((node.args, node.kwargs)))

    def _params_only(self) -> set[torch.fx.Node]:
        """Nodes computed from the model's parameters and buffers alone (``get_attr``, ``w.T``, ...)."""
        out: set[torch.fx.Node] = set()
        for node in self.gm.graph.nodes:
            if node.op == "get_attr" and node.target in self.state_names:
                out.add(node)
            elif node.op in ("call_function", "call_method"):
                ins = self.nested_nodes((node.args, node.kwargs))
                if ins and all(a in out for a in ins):
                    out.add(node)
        return out

    def walk(self) -> None:
        self.from_params = self._params_only()
        self.tail = self._tail()
        for node in self.gm.graph.nodes:
            self.states[node] = self.visit(node)

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

    def visit(self, node) -> State | Attr | None:
        shape = self.shape(node)
        if node.op == "placeholder":
            return UNLABELLED if shape is not None else None
        if node.op == "output":
            for a in self.nested_nodes(node.args):
                st = self.states.get(a)
                if isinstance(st, State) and st.segs:
                    self.fix(st)
                    self.output_producers.append(st.producer)
            return None
        if node.op == "get_attr":
            return Attr(node.target, shape or (), node.target in self.state_names)
        if shape is None:
            return self._not_a_tensor(node)
        if node in self.tail and not self._has_parameters(node):  # e.g. a softmax: the labels of its
            return self.fix_inputs(node)  # inputs reach the output anyway (no spurious no_scaling)
        if node.op == "call_module":
            return layers.module(self, node, self.modules[node.target])
        if node.op in ("call_function", "call_method"):
            return tensors.function(self, node, node.target, is_method=node.op == "call_method")
        raise self.refuse(node, f"the graph node kind {node.op!r}", "this is unexpected; report it")

    def _not_a_tensor(self, node) -> None:
        """Sizes and other non-tensor values are fine, unless a labelled tensor is split into pieces."""
        target = node.target
        query = target in rules.QUERY_METHODS if node.op == "call_method" else target in rules.QUERY_FUNCTIONS
        if query or self.fixed_inputs(node) or node in self.tail:
            return None
        if rules.name_of(target) in rules.SPLIT_NAMES:
            raise self.refuse(
                node, "a split of a labelled tensor into pieces",
                "each piece would carry part of a label, and a label permutes all its channels at once; "
                "splitting labelled channels is not supported (ShuffleNet's channel split, for one)",
            )
        raise self.refuse(
            node, f"{rules.name_of(target)} on a labelled tensor, which does not return a tensor",
            "its symmetries are unknown to symlib; write the Spec by hand",
        )

    # ------------------------------------------------------------------ result
    def spec(self, shapes) -> Spec:
        pf, sf = self.perm_uf.find, self.scale_uf.find
        perms = {r: self.sizes[r] for r in self.sizes if pf(r) == r and r != FIXED}
        scales = {r: self.sizes[r] for r in self.sizes if sf(r) == r and r != FIXED}
        actions, seen = [], set()
        for param, axis, p, s, power, groups, offset, start, inner in self.raw:
            p = None if pf(p) == FIXED else pf(p)
            s = None if sf(s) == FIXED else sf(s)
            if p is None and s is None:
                continue
            a = Action(param, axis, p, s, power, groups, offset, start, inner)
            if a not in seen:
                seen.add(a)
                actions.append(a)
        used_p = {a.perm for a in actions}
        used_s = {a.scale for a in actions}
        perms = {k: v for k, v in perms.items() if k in used_p}
        scales = {k: v for k, v in scales.items() if k in used_s}
        producers = [p for p in self.output_producers if p is not None]
        bias = f"{producers[-1]}.bias" if producers else None
        return Spec(
            shapes=shapes, perms=perms, scales=scales, actions=tuple(actions),
            weights=frozenset(self.weights), output_bias=bias if bias in shapes else None,
            no_scaling=dict(self.no_scaling), blocks=self._blocks(perms),
        )

    def _blocks(self, perms) -> dict[str, tuple[int, str | None]]:
        pf = self.perm_uf.find
        groups: dict[str, int] = {}
        tie = UnionFind()
        for p_in, p_out, g in self.grouped:
            for label in (pf(p_in), pf(p_out)):
                if label not in tie.parent:
                    tie.add(label)
                if label != FIXED and groups.setdefault(label, g) != g:
                    raise SymmetryError(
                        f"channels {label!r} feed or leave grouped convolutions with {groups[label]} and "
                        f"{g} groups; spec_of supports one group count per channel set"
                    )
            tie.union(pf(p_in), pf(p_out))
        ordered = [label for label in perms if label in groups]
        return {
            label: (groups[label], None if tie.find(label) == FIXED else tie.find(label))
            for label in ordered
        }


def _spans(segs) -> list[tuple[int, int, Seg]]:
    out, pos = [], 0
    for s in segs:
        out.append((pos, pos + s.size, s))
        pos += s.size
    return out
