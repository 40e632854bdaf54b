"""The graph walk behind :func:`symlib.symmetry.trace.spec_of`: one visit per ``torch.fx`` node, the
label bookkeeping every rule shares, and the assembly of the :class:`~symlib.symmetry.spec.Spec` (book:
chapter "Symmetries of real architectures"). The rules live in :mod:`~symlib.symmetry.trace.layers`
(layers with parameters) and :mod:`~symlib.symmetry.trace.tensors` (everything else)."""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import TensorMetadata

from symlib.symmetry.spec import Action, Spec, SymmetryError
from symlib.symmetry.trace import attention, heads, layers, rules, tensors
from symlib.symmetry.trace.labels import FIXED, UNLABELLED, Attr, Grid, Multi, Scores, Seg, State, UnionFind


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
        self.kinds: dict[str, str] = {}  # label -> "qk" (queries and keys) or "vo" (values), attention.py
        self.no_bias_shift: set[str] = set()  # attention labels whose biases are not redundant
        self.states: dict[torch.fx.Node, State | Attr | None] = {}
        self.output_producers: list[str | None] = []

    # ------------------------------------------------------------------ labels
    def new(self, name: str, size: int) -> str:
        """A fresh label (permutation and scale) named after the layer that opens it."""
        label, i = name, 1
        while label in self.perm_uf.parent or label in self.scale_uf.parent:
            label = f"{name}#{i}"
            i += 1
        self.perm_uf.add(label, size)
        self.scale_uf.add(label, size)
        self.sizes[label] = size
        return label

    def act(self, param, axis, perm, scale, power, groups=1, offset=0.0, start=0, inner=1) -> None:
        self.raw.append((param, axis, perm, scale, power, groups, offset, start, inner))

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
        if isinstance(st, (Grid, Scores, Multi)):
            raise self.refuse(node, "an operation on features split into heads or on attention scores",
                              "its symmetries are unknown to symlib; merge the heads back first")
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
            if isinstance(st, (Grid, Scores, Multi)) or (isinstance(st, State) and st.segs):
                self.fix(st)
                self.output_producers.append(getattr(st, "producer", None))
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
                if isinstance(st, (Grid, Scores, Multi)) or (isinstance(st, State) and st.segs):
                    self.fix(st)
                    self.output_producers.append(getattr(st, "producer", None))
            return None
        if node.op == "get_attr":
            return Attr(node.target, shape or (), node.target in self.state_names)
        if node.op == "call_module" and isinstance(self.modules[node.target], nn.MultiheadAttention):
            return attention.mha(self, node, self.modules[node.target])
        if node in self.from_params and node.op in ("call_function", "call_method"):
            return heads.attr_view(self, node)
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
        src = node.args[0] if node.args else None
        if isinstance(self.states.get(src), Multi) and target is operator.getitem:
            return None  # an item of a tuple that is not a tensor (attention weights not asked for)
        query = target in rules.QUERY_METHODS if node.op == "call_method" else (
            target in rules.QUERY_FUNCTIONS or rules.name_of(target) in rules.QUERY_NAMES)
        if query or self.fixed_inputs(node) or node in self.tail:
            return None
        if rules.name_of(target) in rules.SPLIT_NAMES:
            return heads.pieces(self, node)
        raise self.refuse(
            node, f"{rules.name_of(target)} on a labelled tensor, which does not return a tensor",
            "its symmetries are unknown to symlib; write the Spec by hand",
        )

    # ------------------------------------------------------------------ result
    def _pieces(self, uf: UnionFind, label: str) -> list[tuple[str | None, bool, int, int]]:
        """``(root or None when fixed, parity, offset, size)`` of the parts of ``label``'s class."""
        out, pos = [], 0
        for root, odd, n in uf.leaves(label):
            out.append((None if root == FIXED else root, odd, pos, n))
            pos += n
        return out

    def _actions(self) -> list[Action]:
        """The recorded actions on the final labels: each label replaced by the parts it was cut into, the
        power of a permutation on the far side of a bilinear form negated (attention keys)."""
        actions, seen = [], set()

        def add(a: Action) -> None:
            if (a.perm is not None or a.scale is not None) and a not in seen:
                seen.add(a)
                actions.append(a)

        for param, axis, p, s, power, groups, offset, start, inner in self.raw:
            ps, ss = self._pieces(self.perm_uf, p), self._pieces(self.scale_uf, s)
            if groups != 1 and (len(ps) > 1 or len(ss) > 1):
                raise SymmetryError(f"the grouped weight {param!r} reads a label that was cut into parts")
            if len(ss) == 1 and ss[0][0] is None:
                ss = [(None, False, o, n) for _, _, o, n in ps]
            if len(ps) == 1 and ps[0][0] is None:
                ps = [(None, False, o, n) for _, _, o, n in ss]
            aligned = [(o, n) for _, _, o, n in ps] == [(o, n) for _, _, o, n in ss]
            for i, (pr, odd, o, _) in enumerate(ps):
                sr = ss[i][0] if aligned else None
                if odd and sr is not None:  # a flipped permutation cannot share the action of a scale
                    add(Action(param, axis, None, sr, power, groups, offset, start + o * inner, inner))
                    sr = None
                add(Action(param, axis, pr, sr, -power if odd else power, groups, offset,
                           start + o * inner, inner))
            if not aligned:
                for sr, _, o, _ in ss:
                    add(Action(param, axis, None, sr, power, groups, offset, start + o * inner, inner))
        return actions

    @staticmethod
    def _tied(actions: list[Action]) -> list[Action]:
        """A parameter read twice on one axis by one label (an embedding table reused as the classifier,
        once as rows, once as columns) is permuted once, and cannot scale both ways: its scales go."""
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

    def _aliases(self, actions: list[Action]) -> list[Action]:
        """The same actions on every other name of a tied parameter (a state dict lists a tied embedding
        and classifier under both names; the graph reads one), so both names stay equal."""
        names: dict[int, list[str]] = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            names.setdefault(id(v), []).append(k)
        twins = {k: [x for x in group if x != k] for group in names.values() if len(group) > 1 for k in group}
        self.aliases = {x: group[0] for group in names.values() if len(group) > 1 for x in group[1:]}
        out, acted = list(actions), {a.param for a in actions}
        for a in actions:
            out += [dataclasses.replace(a, param=t) for t in twins.get(a.param, ()) if t not in acted]
        self.weights.update(t for w in list(self.weights) for t in twins.get(w, ()))
        return out

    def spec(self, shapes) -> Spec:
        actions = self._aliases(self._tied(self._actions()))
        used_p = {a.perm for a in actions} - {None}
        used_s = {a.scale for a in actions} - {None}
        perms = {r: self.perm_uf.size[r] for r in sorted(used_p, key=self.perm_uf.position)}
        scales = {r: self.scale_uf.size[r] for r in sorted(used_s, key=self.scale_uf.position)}
        producers = [p for p in self.output_producers if p is not None]
        bias = f"{producers[-1]}.bias" if producers else None
        return Spec(
            shapes=shapes, perms=perms, scales=scales, actions=tuple(actions),
            weights=frozenset(self.weights), output_bias=bias if bias in shapes else None,
            no_scaling=dict(self.no_scaling), blocks=self._blocks(perms),
            continuous=self._continuous(perms, actions, shapes),
            aliases={k: v for k, v in getattr(self, "aliases", {}).items() if k in shapes},
        )

    def _continuous(self, perms, actions, shapes) -> dict[str, tuple[str, int]]:
        """Attention labels with their general linear groups, and the dimensions of their redundant biases:
        a key bias only shifts each query's scores by a constant, and a value bias passes through the
        attention (its weights sum to 1) into the output projection's bias."""
        out: dict[str, tuple[str, int]] = {}
        bad = {self.perm_uf.find(x) for x in self.perm_uf.conflicts}
        no_shift = {self.perm_uf.find(x) for x in self.no_bias_shift}
        for label, kind in self.kinds.items():
            leaves = self.perm_uf.leaves(label)
            if len(leaves) != 1 or leaves[0][0] not in perms or leaves[0][0] in bad:
                continue
            root = leaves[0][0]
            mine = [a for a in actions if a.perm == root]
            biases = [a for a in mine if a.param not in self.weights and len(shapes[a.param]) == 1]
            extra = 0
            if root not in no_shift and kind == "qk" and any(a.power < 0 for a in biases):
                extra = perms[root]
            if root not in no_shift and kind == "vo" and any(a.power > 0 for a in biases):
                outs = [a.param for a in mine if a.param in self.weights and a.power < 0]
                if outs and all(f"{p.rsplit('.', 1)[0]}.bias" in shapes for p in outs):
                    extra = perms[root]
            out[root] = (kind, extra)
        return {k: out[k] for k in perms if k in out}

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
                        f"channels {label!r} feed or leave grouped convolutions (or attention heads) with "
                        f"{groups[label]} and {g} groups; spec_of supports one group count per channel set"
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
