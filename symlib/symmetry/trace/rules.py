"""The rule table: what each operation of a traced graph does to the labels of its inputs (book: chapter
"Symmetries of real architectures"). See :mod:`symlib.symmetry.trace` for the rules themselves.

:data:`TABLE` maps an operation to its :class:`Rule`, and :func:`apply`, the one place where the table is
read, gives each node of the graph (but the input, parameter reads and the output, which the walker
keeps) the state of its result. An operation is named by

* its module class, for a ``call_module`` node (``nn.Linear``; a subclass finds its nearest listed base);
* its function, for a ``call_function`` node (``torch.relu``, ``operator.add``), or the function's
  ``module.name`` for those of other packages, not imported here (torchvision's Swin functions);
* ``".name"`` for a tensor method (``".view"``);
* an ATen operator (a graph from ``torch.export``) by the function or method with the same arguments
  (:data:`ATEN`, :data:`ATEN_METHODS`: ``aten.view`` is ``torch.reshape``), or else by its name
  (``"select"``, ``"embedding"``).

A rule is a function ``rule(walker, node, op) -> state``, ``op`` the node's target (ATen operators
translated) or, for a module, the module. A :class:`Rule` holds one per kind of input, since an operation
may do one thing to a tensor whose labels lie on one axis and another to features split into heads.
:func:`apply` reads the node in this order:

1. a layer with several outputs (``nn.MultiheadAttention``) takes the node whole;
2. a tensor computed from parameters alone is a view of a parameter (``Rule.params``) or opaque;
3. a result that is not a tensor: an item of a tuple that is not a tensor, a shape query, an operation on
   fixed inputs or at the end of the network is nothing; a split gives its pieces (``Rule.multi``);
4. an operation between the last layer with parameters and the output leaves its inputs' labels to reach
   the output (they are fixed there);
5. an item of a tuple (``Multi``) is that item's state;
6. on features split into heads or attention scores, ``Rule.grid`` or ``Rule.scores``;
7. otherwise ``Rule.tensor``.

An operation with no rule for its inputs is refused, naming the node, unless its inputs carry no label.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from symlib.symmetry.trace import attention, channelwise, heads, layers, views
from symlib.symmetry.trace.labels import UNLABELLED, Attr, Grid, Multi, Scores, State
from symlib.symmetry.trace.walker import name_of


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one operation does, by the kind of its input (``None``: no rule for that kind).

    Attributes:
        tensor: on tensors whose labels lie on one axis (:class:`~.labels.State`), or on unlabelled ones.
        grid: on features split into heads (:class:`~.labels.Grid`).
        scores: on attention scores or weights (:class:`~.labels.Scores`).
        params: on parameters alone: a view of a parameter (:class:`~.labels.Attr`); without it, the
            result is opaque.
        multi: when the result is not a tensor: a tuple of tensors (a split, an attention layer with its
            weights) or a number (a shape query).
    """

    tensor: Callable | None = None
    grid: Callable | None = None
    scores: Callable | None = None
    params: Callable | None = None
    multi: Callable | None = None


def _every(rule: Callable, **more) -> Rule:
    """A rule that reads every kind of input itself."""
    return Rule(tensor=rule, grid=rule, scores=rule, **more)


def _nothing(w, node, op=None) -> None:
    """A shape query, or an ATen check: no tensor, no label."""
    return None


_KEEP = {"grid": attention.keep, "scores": attention.keep}  # copies, dropout: heads and scores stay
_SCORES = {"scores": attention.keep}  # element-wise on attention scores: their heads stay
def _grid_arithmetic(w, node, op):
    """Arithmetic on features split into heads: the rotary cases of :func:`.heads.arithmetic`, else
    :func:`.attention.arithmetic`."""
    out = heads.arithmetic(w, node, op)
    return attention.arithmetic(w, node, op) if out is None else out


_ARITH = {"grid": _grid_arithmetic, "scores": attention.arithmetic}
_PASS = Rule(channelwise.passthrough, **_SCORES)
_NONHOMOGENEOUS = Rule(channelwise.nonhomogeneous, **_SCORES)
_RESHAPE = _every(views.reshape, params=views.reshaped_param)
_MOVE = _every(views.move, params=views.moved_param)
_SPLIT = Rule(multi=views.pieces)
_SWIN = "torchvision.models.swin_transformer"

_ROWS: list[tuple[tuple, Rule]] = [
    # layers with parameters (layers.py) and attention layers (attention.py)
    ((nn.Linear,), Rule(layers.linear_module)),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d), Rule(layers.conv)),
    ((F.conv1d, F.conv2d, F.conv3d, "convolution"), Rule(layers.conv_function)),
    ((nn.modules.batchnorm._BatchNorm,), Rule(layers.batchnorm)),
    ((F.batch_norm, torch.batch_norm), Rule(layers.batchnorm_function)),
    ((nn.LayerNorm, nn.RMSNorm), Rule(layers.norm_module)),
    ((F.layer_norm, F.rms_norm), Rule(layers.norm_function)),
    ((nn.Embedding,), Rule(layers.embedding_module)),
    ((F.embedding,), _every(layers.embedding_function)),
    (("embedding",), _every(layers.embedding_aten)),
    ((F.linear,), _every(layers.linear_function)),
    ((torch.addmm,), _every(layers.addmm)),
    ((operator.matmul, torch.matmul, torch.bmm, torch.mm, ".matmul", ".bmm", ".mm", ".__matmul__"),
     _every(attention.matmul)),
    ((F.scaled_dot_product_attention,), _every(attention.sdpa)),
    ((nn.MultiheadAttention,), Rule(multi=attention.mha)),
    ((f"{_SWIN}.shifted_window_attention",), _every(attention.swin)),
    # element-wise, pooling, reductions, concatenation (channelwise.py)
    ((nn.ReLU, nn.LeakyReLU, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
      nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
      nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
      nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d), Rule(channelwise.passthrough)),
    ((nn.Dropout, nn.Identity), Rule(channelwise.passthrough, **_KEEP)),
    ((F.relu, torch.relu, torch.relu_, F.relu_, F.leaky_relu, F.max_pool1d, F.max_pool2d, F.max_pool3d,
      F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d, F.adaptive_avg_pool2d,
      F.adaptive_avg_pool3d, F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
      torch.max_pool1d, torch.max_pool2d, torch.max_pool3d, torch.avg_pool1d, torch.adaptive_avg_pool1d,
      ".relu", ".relu_"), _PASS),
    ((F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, "torchvision.ops.stochastic_depth.stochastic_depth"),
     Rule(channelwise.passthrough, **_KEEP)),
    ((".contiguous", ".clone", ".detach", ".float", ".double", ".to", ".alias"),
     Rule(channelwise.passthrough, **_KEEP, params=views.same_param)),
    ((nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Mish,
      nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.ReLU6, nn.Softsign, nn.Tanhshrink, nn.LogSigmoid),
     Rule(channelwise.nonhomogeneous)),
    ((nn.Softmax, nn.LogSoftmax), _NONHOMOGENEOUS),
    ((torch.tanh, F.tanh, torch.sigmoid, F.sigmoid, F.gelu, F.silu, F.elu, F.selu, F.celu, F.softplus,
      F.mish, F.hardswish, F.hardsigmoid, F.hardtanh, F.relu6, torch.exp, torch.pow, operator.pow,
      F.softmax, torch.softmax, F.log_softmax, torch.log_softmax, ".tanh", ".tanh_", ".sigmoid",
      ".sigmoid_", ".exp", ".pow", ".__pow__", ".softmax", ".log_softmax", ".masked_fill", ".masked_fill_"),
     _NONHOMOGENEOUS),
    ((".type_as",), Rule(channelwise.nonhomogeneous, **_KEEP, params=views.same_param)),
    ((operator.add, operator.iadd, torch.add, operator.sub, operator.isub, torch.sub, ".add", ".add_",
      ".__add__", ".__iadd__", ".__radd__", ".sub", ".sub_", ".__sub__", ".__isub__"),
     Rule(channelwise.add, **_ARITH)),
    ((operator.mul, operator.imul, torch.mul, ".mul", ".mul_", ".__mul__", ".__imul__", ".__rmul__"),
     Rule(channelwise.norm_mul, **_ARITH)),
    ((operator.truediv, operator.itruediv, torch.div, ".div", ".div_", ".__truediv__", ".__itruediv__"),
     Rule(channelwise.div, **_ARITH)),
    ((torch.where,), Rule(channelwise.where, grid=attention.where, scores=attention.where)),
    ((torch.mean, torch.amax, torch.sum, ".mean", ".amax", ".sum"), Rule(channelwise.norm_reduce)),
    ((torch.cat, torch.concat, torch.concatenate), Rule(channelwise.cat, grid=heads.cat)),
    ((F.pad, "constant_pad_nd", ".pad"), Rule(channelwise.pad)),
    ((torch.roll, "roll", ".roll"), Rule(channelwise.roll)),
    # views of tensors and of parameters (views.py)
    ((torch.flatten, torch.squeeze, torch.unsqueeze, torch.reshape, ".flatten", ".view", ".reshape",
      ".squeeze", ".unsqueeze"), _RESHAPE),
    ((nn.Flatten,), Rule(views.reshape)),
    ((torch.unflatten, "unflatten", ".unflatten"), Rule(params=views.reshaped_param)),
    ((torch.permute, torch.transpose, torch.t, torch.movedim, ".permute", ".transpose", ".t", ".movedim"),
     _MOVE),
    (("movedim",), Rule(params=views.moved_param)),
    ((operator.getitem,), _every(views.index, params=views.indexed_param)),
    ((torch.select, "select", "slice"), _every(views.index)),
    ((torch.chunk, torch.split, torch.tensor_split, torch.unbind, "chunk", "split", "tensor_split", "unbind",
      "split_with_sizes", ".chunk", ".split", ".tensor_split", ".unbind", ".split_with_sizes"), _SPLIT),
    ((f"{_SWIN}._patch_merging_pad",), _every(views.patch_merging)),
    ((torch.clone, torch.detach, ".half", ".lift_fresh_copy"), Rule(params=views.same_param)),
    ((torch.broadcast_to, ".expand", ".expand_as", ".broadcast_to"),
     Rule(grid=heads.expand, params=views.expanded_param)),
    ((f"{_SWIN}._get_relative_position_bias",), Rule(params=views.relative_position_bias)),
    # shape queries and ATen checks (no tensor, no label); .T and .mT of a parameter
    ((getattr,), Rule(params=views.moved_param, multi=_nothing)),
    ((torch.numel, ".size", ".dim", ".numel", ".ndimension", "_assert_tensor_metadata", "sym_size",
      "sym_stride", "sym_numel", "sym_storage_offset", "_assert_async", "_assert_scalar"),
     Rule(multi=_nothing)),
    # negation keeps features split into heads (rotate_half of rotary embeddings, heads.py)
    ((operator.neg, torch.neg, ".neg", ".__neg__"), Rule(channelwise.passthrough, grid=heads.neg, **_SCORES)),
]


def _table(rows) -> dict:
    table: dict = {}
    for keys, rule in rows:
        for key in keys:
            if table.setdefault(key, rule) is not rule:  # (F.relu_ is torch.relu_: listed twice, one rule)
                raise ValueError(f"{key!r} has two rules")
    return table


TABLE: dict[object, Rule] = _table(_ROWS)
"""Operation (module class, function, ``".method"``, ATen name) -> :class:`Rule` (module docstring)."""

_NO_RULE = Rule()

# ATen operators (graphs from torch.export) as the function or method with the same arguments.
ATEN = {
    "add": operator.add, "sub": operator.sub, "rsub": operator.sub, "mul": operator.mul,
    "div": operator.truediv, "neg": operator.neg, "relu": torch.relu, "gelu": F.gelu, "silu": F.silu,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "exp": torch.exp, "pow": torch.pow,
    "view": torch.reshape, "reshape": torch.reshape, "_unsafe_view": torch.reshape,
    "unsqueeze": torch.unsqueeze, "squeeze": torch.squeeze, "flatten": torch.flatten,
    "permute": torch.permute, "transpose": torch.transpose, "t": torch.t, "mean": torch.mean,
    "sum": torch.sum, "amax": torch.amax, "cat": torch.cat, "layer_norm": F.layer_norm,
    "rms_norm": F.rms_norm, "dropout": F.dropout, "linear": F.linear, "addmm": torch.addmm,
    "matmul": torch.matmul, "bmm": torch.bmm, "mm": torch.mm, "softmax": torch.softmax,
    "_softmax": torch.softmax, "log_softmax": torch.log_softmax,
    "scaled_dot_product_attention": F.scaled_dot_product_attention,
    "conv1d": F.conv1d, "conv2d": F.conv2d, "conv3d": F.conv3d, "batch_norm": torch.batch_norm,
    "add_": operator.iadd, "sub_": operator.isub, "mul_": operator.imul, "div_": operator.itruediv,
    "relu_": torch.relu_, "leaky_relu": F.leaky_relu, "hardtanh": F.hardtanh, "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid, "elu": F.elu, "mish": F.mish, "softplus": F.softplus,
    "max_pool1d": F.max_pool1d, "max_pool2d": F.max_pool2d, "max_pool3d": F.max_pool3d,
    "avg_pool1d": F.avg_pool1d, "avg_pool2d": F.avg_pool2d, "avg_pool3d": F.avg_pool3d,
    "adaptive_avg_pool1d": F.adaptive_avg_pool1d, "adaptive_avg_pool2d": F.adaptive_avg_pool2d,
    "adaptive_avg_pool3d": F.adaptive_avg_pool3d, "where": torch.where,
}
ATEN_METHODS = {"clone", "alias", "contiguous", "detach", "lift_fresh_copy", "masked_fill", "expand"}


def normalize(target, is_method: bool):
    """``(target, is_method)`` with an ATen operator replaced by its function or method equivalent."""
    if not isinstance(target, torch._ops.OpOverload):
        return target, is_method
    name = name_of(target)
    if name in ATEN:
        return ATEN[name], False
    if name in ("_to_copy", "to"):
        return "to", True
    if name in ATEN_METHODS:
        return name, True
    return name, False


def lookup(w, node) -> tuple[object, bool, Rule]:
    """``(op, is_method, rule)`` of a ``call_module``, ``call_function`` or ``call_method`` node: its target
    (ATen operators translated; the module itself for a module), whether it is a tensor method, and its
    row of :data:`TABLE` (a rule of ``None`` everywhere when it has none)."""
    if node.op == "call_module":
        mod = w.modules[node.target]
        rule = next((TABLE[c] for c in type(mod).__mro__ if c in TABLE), _NO_RULE)
        return mod, False, rule
    op, is_method = normalize(node.target, node.op == "call_method")
    if is_method:
        return op, True, TABLE.get(f".{op}", _NO_RULE)
    rule = TABLE.get(op)
    if rule is None:  # a function of another package, by its module and name
        rule = TABLE.get(f"{getattr(op, '__module__', None)}.{getattr(op, '__name__', None)}", _NO_RULE)
    return op, False, rule


def apply(w, node):
    """The state of the result of ``node`` (module docstring: the order in which a node is read)."""
    op, is_method, rule = lookup(w, node)
    module = node.op == "call_module"
    if module and rule.multi is not None:
        return rule.multi(w, node, op)
    if not module and node in w.from_params:
        return (rule.params or views.opaque_param)(w, node, op)
    src = node.args[0] if node.args else None
    item = op is operator.getitem and isinstance(src, torch.fx.Node) and isinstance(w.states.get(src), Multi)
    if w.shape(node) is None:
        if item or w.fixed_inputs(node) or node in w.tail:
            return None
        if rule.multi is not None:
            return rule.multi(w, node, op)
        raise w.refuse(node, f"{name_of(node.target)} on a labelled tensor, which does not return a tensor",
                       "its symmetries are unknown to symlib; write the Spec by hand")
    if node in w.tail and not w.has_parameters(node):  # e.g. a softmax: the labels of its inputs reach
        return w.fix_inputs(node)  # the output anyway (no spurious no_scaling)
    if item:
        return w.states[src].items[node.args[1]]
    args = w.tensor_args(node)
    first = w.states.get(args[0]) if args else None
    heads = isinstance(first, (Grid, Scores)) or (not module and any(
        isinstance(w.states.get(a), (Grid, Scores)) for a in args))
    if heads:
        on_heads = rule.scores if isinstance(first, Scores) else rule.grid
        if on_heads is None:
            raise _refuse_on_heads(w, node, op, is_method, first)
        return on_heads(w, node, op)
    if rule.tensor is not None:
        return rule.tensor(w, node, op)
    return _unknown(w, node, op, is_method)


def _refuse_on_heads(w, node, op, is_method: bool, first):
    kind = "attention scores" if isinstance(first, Scores) else "features split into heads"
    if node.op == "call_module":
        return w.refuse(node, f"the module {node.target!r} of type {type(op).__name__} on {kind}",
                        "merge the heads back before other layers")
    name = name_of(op)
    return w.refuse(node, f"{'.' + name + '()' if is_method else name} on {kind}",
                    "only reshapes, permutes, scaling by numbers, masks, softmax and the attention products "
                    "are known on them")


def _layer(w, node, op) -> str:
    """``"up (ConvTranspose2d)"``: the layer of a node with parameters (a module, or the module of the first
    parameter a function reads) and its kind."""
    if node.op == "call_module":
        return f"{node.target} ({type(op).__name__})"
    attrs = [w.states[a] for a in w.nested_nodes((node.args, node.kwargs))
             if isinstance(w.states.get(a), Attr)]
    return f"{attrs[0].name.rsplit('.', 1)[0] if attrs else node.name} ({name_of(op)})"


def _unknown(w, node, op, is_method: bool) -> State:
    """An operation without a rule: nothing to do on inputs without labels, else refused."""
    if w.fixed_inputs(node):  # e.g. an embedding of the input: nothing to act on yet
        if w.has_parameters(node):  # a layer without a rule: its outputs' symmetries are missed
            w.opaque.append(_layer(w, node, op))
        return UNLABELLED
    if node.op == "call_module":
        if node in w.tail:  # e.g. a final normalisation: the labels would reach the output anyway
            return w.fix_inputs(node)
        raise w.refuse(
            node, f"the module {node.target!r} of type {type(op).__name__}",
            "its symmetries are unknown to symlib; supported: Linear, Conv1d/2d/3d (grouped and depthwise "
            "too), BatchNorm, LayerNorm and RMSNorm over channels, Embedding, MultiheadAttention, "
            "TransformerEncoder(Layer), element-wise activations, pooling, dropout, flatten, concatenation, "
            "residual additions and gating products (page 'Architectures'). Write its Spec by hand "
            "(symlib.symmetry.spec.Spec) instead",
        )
    what = f"the method .{op}()" if is_method else f"the function {name_of(op)}"
    param = w.parameter_note(node)
    raise w.refuse(
        node, what + " on a labelled tensor" + param,
        ("use the parameter through an nn.Module layer (nn.Linear, nn.Conv2d, ...) so the spec knows its "
         "axes; " if param else "") + "its symmetries are unknown to symlib (matrix products "
        "are supported as attention, queries times keys and weights times values); write the Spec by hand "
        "or express the layer with supported modules",
    )
