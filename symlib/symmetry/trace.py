r"""Derive a :class:`~symlib.symmetry.spec.Spec` from a model by tracing it (book: chapter "Symmetries of real
architectures"; paper App. D.4).

:func:`spec_of` traces ``model`` with ``torch.fx``, propagates shapes on one
dummy input, and walks the graph once. Every channel (feature) axis produced
by a ``Linear`` or a convolution gets a fresh permutation label and a fresh
scaling label; the other nodes move, tie or drop these labels:

* ReLU, LeakyReLU, max / average pooling, dropout, identity: pass both labels
  (they are permutation-equivariant and positively homogeneous,
  :math:`\mathrm{relu}(\lambda z) = \lambda\,\mathrm{relu}(z)` for :math:`\lambda > 0`).
* tanh, GELU, sigmoid, ...: pass the permutation, fix the scale (recorded in
  ``Spec.no_scaling``).
* flatten / view / mean: pass the labels when the channel axis stays the
  feature axis (e.g. after a global pool); a flatten of a spatial map is
  refused.
* BatchNorm (eval mode, paper D.4.3): same permutation as its input; the input
  scale :math:`\lambda` acts on the running mean (power 1) and on
  ``running_var + eps`` (power 2), so the normalisation absorbs it exactly;
  ``weight``/``bias`` open a new scale :math:`\mu` (power 1), undone by the next
  layer (power -1):

  .. math:: \gamma\frac{\lambda z - \lambda m}{\sqrt{\lambda^2 (v + \epsilon)}} + \beta
            = \gamma\frac{z - m}{\sqrt{v + \epsilon}} + \beta.

* residual ``add`` (paper D.4.4): the summed tensors must carry the same
  permutation and the same scale, so their labels are merged (union-find). A
  1x1 shortcut convolution is an ordinary convolution: it reads the block's
  input label and opens a label that the add then ties.
* grouped convolutions (paper D.4.2): the input label and the output label
  get a block structure and move their groups together (``Spec.blocks``).

The network's input and every tensor that reaches the output are fixed: their
labels merge into one "fixed" class that no symmetry acts on. Anything else
(concatenation, attention, a parameter used outside a layer, an unknown
module or function on a labelled tensor) raises :class:`~symlib.symmetry.spec.SymmetryError`
naming the node.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata
from torch.nn import functional as F

from symlib.symmetry.spec import Action, Spec, SymmetryError

FIXED = "<fixed>"

_PASS_MODULES = (
    nn.ReLU, nn.LeakyReLU, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
    nn.AlphaDropout, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
_NONHOMOGENEOUS_MODULES = (
    nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.ReLU6, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid,
)
_PASS_FUNCTIONS = {
    F.relu, torch.relu, torch.relu_, F.relu_, F.leaky_relu, F.dropout, F.dropout1d, F.dropout2d,
    F.dropout3d, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
    F.adaptive_max_pool2d, F.adaptive_max_pool3d,
}
_PASS_METHODS = {"relu", "relu_", "contiguous", "clone", "detach", "float", "double", "to"}
_NONHOMOGENEOUS_FUNCTIONS = {
    torch.tanh, F.tanh, torch.sigmoid, F.sigmoid, F.gelu, F.silu, F.elu, F.selu, F.celu, F.softplus,
    F.mish, F.hardswish, F.hardsigmoid, F.hardtanh, F.relu6, torch.exp,
}
_NONHOMOGENEOUS_METHODS = {"tanh", "tanh_", "sigmoid", "sigmoid_", "exp"}
_ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_", "__add__", "__iadd__"}
_RESHAPE_FUNCTIONS = {torch.flatten, torch.squeeze, torch.reshape, torch.mean, torch.amax}
_RESHAPE_METHODS = {"flatten", "view", "reshape", "squeeze", "mean", "amax"}


@dataclasses.dataclass(frozen=True)
class _State:
    """Labels of the channel axis ``axis`` of one traced tensor."""

    perm: str
    scale: str
    axis: int
    producer: str | None = None


class _UnionFind:
    """Union-find over label ids; the root of a class is its oldest member, or FIXED."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {FIXED: FIXED}
        self.order: dict[str, int] = {FIXED: -1}

    def add(self, x: str) -> None:
        self.parent[x] = x
        self.order[x] = len(self.order)

    def find(self, x: str) -> str:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> str:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            keep, drop = sorted((ra, rb), key=lambda r: self.order[r])
            self.parent[drop] = keep
            ra = keep
        return ra


class _Walker:
    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule):
        self.model = model
        self.gm = gm
        self.modules = dict(gm.named_modules())
        self.perm_uf, self.scale_uf = _UnionFind(), _UnionFind()
        self.sizes: dict[str, int] = {}
        self.raw: list[tuple] = []
        self.weights: set[str] = set()
        self.no_scaling: dict[str, str] = {}
        self.grouped: list[tuple[str, str, int]] = []
        self.states: dict[torch.fx.Node, _State | None] = {}
        self.output_producers: list[str | None] = []

    # ----------------------------------------------------------------- labels
    def _new(self, name: str, size: int) -> tuple[str, str]:
        label = name
        i = 1
        while label in self.perm_uf.parent or label in self.scale_uf.parent:
            label = f"{name}#{i}"
            i += 1
        self.perm_uf.add(label)
        self.scale_uf.add(label)
        self.sizes[label] = size
        return label, label

    def _act(self, param, axis, perm, scale, power, groups=1, offset=0.0) -> None:
        self.raw.append((param, axis, perm, scale, power, groups, offset))

    # ------------------------------------------------------------------ nodes
    @staticmethod
    def _shape(node) -> tuple[int, ...] | None:
        meta = node.meta.get("tensor_meta") if isinstance(node, torch.fx.Node) else None
        return tuple(meta.shape) if isinstance(meta, TensorMetadata) else None

    def _tensor_args(self, node) -> list[torch.fx.Node]:
        """Tensor-valued inputs of ``node``, including those inside lists and tuples."""
        nodes = self._nested_nodes((node.args, node.kwargs))
        return [a for a in nodes if self._shape(a) is not None]

    def _input(self, node) -> _State:
        args = self._tensor_args(node)
        if not args:
            raise SymmetryError(f"node {node.name!r} ({node.target}) has no tensor input")
        return self.states[args[0]]

    def _refuse(self, node, what: str, fix: str) -> SymmetryError:
        return SymmetryError(
            f"spec_of cannot handle {what} at node {node.name!r} (target {node.target!r}): {fix}"
        )

    def _fixed_inputs(self, node) -> bool:
        return all(
            self.states[a] is None or self.perm_uf.find(self.states[a].perm) == FIXED
            and self.scale_uf.find(self.states[a].scale) == FIXED
            for a in self._tensor_args(node)
        )

    def _fix_inputs(self, node) -> _State:
        """An operation between the last layer and the output: its inputs reach the output anyway."""
        for a in self._tensor_args(node):
            st = self.states[a]
            if st is not None:
                self.perm_uf.union(st.perm, FIXED)
                self.scale_uf.union(st.scale, FIXED)
                self.output_producers.append(st.producer)
        return _State(FIXED, FIXED, 1)

    def _tail(self) -> set[torch.fx.Node]:
        """Nodes from which every path reaches the output without passing through a layer with
        parameters (e.g. a final softmax): operations there cannot break a symmetry."""
        tail: set[torch.fx.Node] = set()
        for node in reversed(self.gm.graph.nodes):
            if node.op == "output":
                continue
            users = list(node.users)
            if users and all(
                u.op == "output" or (u in tail and not self._has_parameters(u)) for u in users
            ):
                tail.add(node)
        return tail

    def _has_parameters(self, node) -> bool:
        return node.op == "call_module" and any(True for _ in self.modules[node.target].parameters())

    def walk(self) -> None:
        self.tail = self._tail()
        for node in self.gm.graph.nodes:
            self.states[node] = self._visit(node)

    def _visit(self, node) -> _State | None:
        shape = self._shape(node)
        if node.op == "placeholder":
            return _State(FIXED, FIXED, 1) if shape is not None else None
        if node.op == "output":
            for a in self._tensor_args(node) + self._nested_nodes(node.args):
                st = self.states.get(a)
                if st is not None:
                    self.perm_uf.union(st.perm, FIXED)
                    self.scale_uf.union(st.scale, FIXED)
                    self.output_producers.append(st.producer)
            return None
        if node.op == "get_attr":
            raise self._refuse(
                node, f"the parameter or buffer {node.target!r} used outside a layer",
                "use it through an nn.Module layer (nn.Linear, nn.Conv2d, ...) so the spec knows its axes",
            )
        if shape is None:
            return None  # sizes, shapes and other non-tensor values
        if node.op == "call_module":
            return self._module(node, self.modules[node.target])
        if node.op == "call_function":
            return self._function(node, node.target, is_method=False)
        if node.op == "call_method":
            return self._function(node, node.target, is_method=True)
        raise self._refuse(node, f"the graph node kind {node.op!r}", "this is unexpected; report it")

    @staticmethod
    def _nested_nodes(args) -> list[torch.fx.Node]:
        out: list[torch.fx.Node] = []
        torch.fx.node.map_arg(args, lambda n: out.append(n))
        return out

    # ---------------------------------------------------------------- modules
    def _module(self, node, mod: nn.Module) -> _State | None:
        name = node.target
        if isinstance(mod, nn.Linear):
            return self._linear(node, name, mod)
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return self._conv(node, name, mod)
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            return self._batchnorm(node, name, mod)
        if isinstance(mod, _PASS_MODULES):
            return self._pass(node)
        if isinstance(mod, _NONHOMOGENEOUS_MODULES):
            return self._nonhomogeneous(node, name, type(mod).__name__)
        if isinstance(mod, nn.Flatten):
            return self._reshape(node)
        if self._fixed_inputs(node):  # e.g. an embedding of the input: nothing to act on yet
            return _State(FIXED, FIXED, 1)
        if node in self.tail:  # e.g. a final LayerNorm: the labels would reach the output anyway
            return self._fix_inputs(node)
        raise self._refuse(
            node, f"the module {name!r} of type {type(mod).__name__}",
            "its symmetries are unknown to symlib; supported: Linear, Conv1d/2d/3d (grouped too), "
            "BatchNorm, ReLU/LeakyReLU, element-wise activations, pooling, dropout, flatten after a "
            "global pool and residual additions. Write its Spec by hand (symlib.symmetry.spec.Spec) instead",
        )

    def _in_label(self, node, want_axis: str) -> _State:
        st = self._input(node)
        shape = self._shape(self._tensor_args(node)[0])
        axis = len(shape) - 1 if want_axis == "last" else 1
        if self.perm_uf.find(st.perm) != FIXED or self.scale_uf.find(st.scale) != FIXED:
            if st.axis != axis and not (st.axis == 1 and len(shape) == 2):
                raise self._refuse(
                    node, f"a layer reading axis {axis} of a tensor whose channels are on axis {st.axis}",
                    "apply Linear layers to (batch, features) tensors, e.g. after a global pool",
                )
        return st

    def _linear(self, node, name, mod) -> _State:
        st = self._in_label(node, "last")
        self.weights.add(f"{name}.weight")
        self._act(f"{name}.weight", 1, st.perm, st.scale, -1)
        p, s = self._new(name, mod.out_features)
        self._act(f"{name}.weight", 0, p, s, 1)
        if mod.bias is not None:
            self._act(f"{name}.bias", 0, p, s, 1)
        return _State(p, s, len(self._shape(node)) - 1, name)

    def _conv(self, node, name, mod) -> _State:
        st = self._in_label(node, "channel")
        self.weights.add(f"{name}.weight")
        g = mod.groups
        self._act(f"{name}.weight", 1, st.perm, st.scale, -1, groups=g)
        p, s = self._new(name, mod.out_channels)
        self._act(f"{name}.weight", 0, p, s, 1)
        if mod.bias is not None:
            self._act(f"{name}.bias", 0, p, s, 1)
        if g > 1:
            self.grouped.append((st.perm, p, g))
        return _State(p, s, 1, name)

    def _batchnorm(self, node, name, mod) -> _State:
        st = self._in_label(node, "channel")
        if not mod.track_running_stats:
            raise self._refuse(
                node, f"the BatchNorm {name!r} without running statistics",
                "in eval mode it normalises with batch statistics, which couples samples; build it with "
                "track_running_stats=True",
            )
        self._act(f"{name}.running_mean", 0, st.perm, st.scale, 1)
        self._act(f"{name}.running_var", 0, st.perm, st.scale, 2, offset=float(mod.eps))
        if not mod.affine:
            return _State(st.perm, FIXED, st.axis, st.producer)
        _, s = self._new(name, mod.num_features)
        self.perm_uf.union(s, FIXED)  # only its scale is new
        self.weights.add(f"{name}.weight")
        self._act(f"{name}.weight", 0, st.perm, s, 1)
        self._act(f"{name}.bias", 0, st.perm, s, 1)
        return _State(st.perm, s, st.axis, st.producer)

    # ------------------------------------------------------------- functions
    def _pass(self, node) -> _State:
        return self._input(node)

    def _nonhomogeneous(self, node, layer: str, what: str) -> _State:
        st = self._input(node)
        if self.scale_uf.find(st.scale) != FIXED:
            self.no_scaling[layer] = f"uses {what}, which is not positively homogeneous"
            self.scale_uf.union(st.scale, FIXED)
        return _State(st.perm, FIXED, st.axis, st.producer)

    def _reshape(self, node) -> _State:
        st = self._input(node)
        src = self._tensor_args(node)[0]
        in_shape, out_shape = self._shape(src), self._shape(node)
        if self.perm_uf.find(st.perm) == FIXED and self.scale_uf.find(st.scale) == FIXED:
            return _State(FIXED, FIXED, 1)
        c = in_shape[st.axis]
        rest = in_shape[st.axis + 1:]
        keeps = (
            st.axis == 1 and len(out_shape) >= 2 and out_shape[0] == in_shape[0] and out_shape[1] == c
            and all(d == 1 for d in out_shape[2:])
        )
        if node.target in ("mean", "amax", torch.mean, torch.amax):
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
            dims = {d % len(in_shape) for d in dims}
            if keeps and dims and not dims & {0, st.axis}:
                return _State(st.perm, st.scale, 1, st.producer)  # pooling over positions
        elif keeps and all(d == 1 for d in rest):
            return _State(st.perm, st.scale, 1, st.producer)
        if tuple(in_shape) == tuple(out_shape):
            return st
        raise self._refuse(
            node, f"a reshape of a labelled tensor from {tuple(in_shape)} to {tuple(out_shape)}",
            "flattening a spatial map mixes channels with positions; pool globally first "
            "(nn.AdaptiveAvgPool2d(1)) so that flatten keeps the channels as features",
        )

    def _add(self, node) -> _State:
        args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        tensors = self._tensor_args(node)
        st = self.states[tensors[0]]
        if len(tensors) < 2 or len(args) != len(node.args):
            self.no_scaling[node.name] = "adds a constant, which breaks positive homogeneity"
            self.scale_uf.union(st.scale, FIXED)
            return _State(st.perm, FIXED, st.axis, st.producer)
        shapes = {self._shape(t) for t in tensors}
        if len(shapes) != 1:
            raise self._refuse(node, f"a broadcasting add of shapes {sorted(shapes)}",
                               "residual additions must sum tensors of one shape")
        for other in tensors[1:]:
            o = self.states[other]
            if o.axis != st.axis:
                raise self._refuse(node, "an add of tensors whose channels lie on different axes",
                                   "sum tensors with the same layout")
            self.perm_uf.union(st.perm, o.perm)
            self.scale_uf.union(st.scale, o.scale)
        return st

    def _function(self, node, target, is_method: bool) -> _State | None:
        if (target in _ADD_METHODS) if is_method else (target in _ADD_FUNCTIONS):
            return self._add(node)
        if (target in _PASS_METHODS) if is_method else (target in _PASS_FUNCTIONS):
            return self._pass(node)
        if (target in _NONHOMOGENEOUS_METHODS) if is_method else (target in _NONHOMOGENEOUS_FUNCTIONS):
            name = target if is_method else getattr(target, "__name__", str(target))
            return self._nonhomogeneous(node, node.name, name)
        if (target in _RESHAPE_METHODS) if is_method else (target in _RESHAPE_FUNCTIONS):
            return self._reshape(node)
        if self._fixed_inputs(node):
            return _State(FIXED, FIXED, 1)
        if node in self.tail:
            return self._fix_inputs(node)
        fname = getattr(target, "__name__", target)
        what = f"the method .{target}()" if is_method else f"the function {fname}"
        raise self._refuse(
            node, what + " on a labelled tensor",
            "its symmetries are unknown to symlib (concatenation, products and attention are not "
            "supported); write the Spec by hand or express the layer with supported modules",
        )

    # ----------------------------------------------------------------- result
    def spec(self, shapes) -> Spec:
        pf, sf = self.perm_uf.find, self.scale_uf.find
        perms = {r: self.sizes[r] for r in self.sizes if pf(r) == r and r != FIXED}
        scales = {r: self.sizes[r] for r in self.sizes if sf(r) == r and r != FIXED}
        actions, seen = [], set()
        for param, axis, p, s, power, groups, offset in self.raw:
            p = pf(p)
            s = sf(s)
            p = None if p == FIXED else p
            s = None if s == FIXED else s
            if p is None and s is None:
                continue
            a = Action(param, axis, p, s, power, groups, offset)
            if a not in seen:
                seen.add(a)
                actions.append(a)
        used_p = {a.perm for a in actions}
        used_s = {a.scale for a in actions}
        perms = {k: v for k, v in perms.items() if k in used_p}
        scales = {k: v for k, v in scales.items() if k in used_s}
        blocks = self._blocks(perms)
        producers = [p for p in self.output_producers if p is not None]
        bias = f"{producers[-1]}.bias" if producers else None
        return Spec(
            shapes=shapes, perms=perms, scales=scales, actions=tuple(actions),
            weights=frozenset(self.weights), output_bias=bias if bias in shapes else None,
            no_scaling=dict(self.no_scaling), blocks=blocks,
        )

    def _blocks(self, perms) -> dict[str, tuple[int, str | None]]:
        pf = self.perm_uf.find
        groups: dict[str, int] = {}
        tie = _UnionFind()
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


def spec_of(model: nn.Module, input_shape, device=None, dtype=None) -> Spec:
    """The symmetries of ``model``, derived by tracing it with ``torch.fx`` (module docstring).

    Args:
        model: a PyTorch module whose ``forward`` ``torch.fx`` can trace (no
            data-dependent control flow). It is not modified (its train/eval
            flags are restored).
        input_shape: shape of one input sample, without the batch dimension,
            e.g. ``(1, 28, 28)``.
        device, dtype: of the dummy input used to propagate shapes (default:
            those of the model's first parameter).

    Returns:
        The spec, with ``forward`` (evaluating the model functionally, in eval
        mode) and ``input_shape`` set. Labels are named after the layer that
        opens them: a convolution ``"layer1.0.conv1"`` opens a permutation and
        a scale of that name, a BatchNorm ``"bn1"`` a scale; merged labels keep
        the name of their first layer.

    Raises:
        SymmetryError: naming the node or layer whose symmetries are unknown.
    """
    if not isinstance(model, nn.Module):
        raise SymmetryError(f"spec_of takes an nn.Module, got {type(model).__name__}")
    input_shape = tuple(int(d) for d in input_shape)
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as err:  # torch.fx raises many kinds of errors
        raise SymmetryError(
            f"torch.fx could not trace {type(model).__name__}: {err}. Remove data-dependent control "
            "flow from forward, or write the Spec by hand"
        ) from err
    ref = next(iter(model.parameters()), None)
    dtype = dtype or (ref.dtype if ref is not None else torch.float32)
    device = device or (ref.device if ref is not None else None)
    modes = {m: m.training for m in model.modules()}
    try:
        gm.eval()
        with torch.no_grad():
            ShapeProp(gm).propagate(torch.zeros(2, *input_shape, dtype=dtype, device=device))
    except Exception as err:
        raise SymmetryError(
            f"{type(model).__name__} fails on an input of shape (batch, *{input_shape}): {err}"
        ) from err
    finally:
        for m, t in modes.items():
            m.train(t)
    walker = _Walker(model, gm)
    walker.walk()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    return walker.spec(shapes).with_forward(_eval_forward(model), input_shape)


def _eval_forward(model: nn.Module):
    """``forward(theta, x)``: ``model`` evaluated in eval mode on parameters and buffers ``theta``;
    the model's train/eval flags are restored after each call."""

    def forward(theta, x):
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            return torch.func.functional_call(model, theta, (x,))
        finally:
            for m, t in modes:
                m.train(t)

    return forward
