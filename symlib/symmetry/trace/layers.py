r"""Rules for the layers that hold parameters, as modules or as functions of the model's parameters (book:
chapter "Symmetries of real architectures"; paper App. D.4). See :mod:`symlib.symmetry.trace`; the table
that picks these rules is :mod:`~symlib.symmetry.trace.rules`.

* ``Linear`` and convolutions: the input's labels act (power -1) on the weight's input axis, segment by
  segment (``Action.start``, and ``Action.inner`` after a flatten); the output opens a new label, acting
  (power +1) on the weight's output axis and the bias:

  .. math:: W \leftarrow P_\mathrm{out}\,\mathrm{diag}(\lambda_\mathrm{out})\,W\,
            \mathrm{diag}(\lambda_\mathrm{in})^{-1}P_\mathrm{in}^\top,
            \qquad b \leftarrow P_\mathrm{out}\,\mathrm{diag}(\lambda_\mathrm{out})\,b .

  ``F.linear``, ``x @ W`` and ``torch.addmm(b, x, W)`` (Hugging Face's ``Conv1D``) with a parameter ``W``
  (or a view of one) are linear layers too, and so are ``F.conv1d/2d/3d`` and ATen's ``conv2d`` and
  ``convolution`` with a parameter (graphs from ``torch.export``). A grouped convolution ties its input and
  output labels' blocks (``Spec.blocks``).
* BatchNorm (eval mode, paper D.4.3; the module, ``F.batch_norm``, ATen's ``batch_norm``): same permutation
  as its input; the input scale :math:`\lambda` is absorbed by the running statistics (mean: power 1,
  ``var + eps``: power 2), and ``weight``/``bias`` open a new scale :math:`\mu`:

  .. math:: \gamma\frac{\lambda z - \lambda m}{\sqrt{\lambda^2 (v + \epsilon)}} + \beta
            = \gamma\frac{z - m}{\sqrt{v + \epsilon}} + \beta.

* LayerNorm and RMSNorm over the channel axis (modules, ``F.layer_norm``, ``F.rms_norm``): the permutation
  passes (its ``weight``/``bias`` move with it); the input's per-channel scale does not (the
  normalisation mixes channels), and ``weight``/``bias`` open a new scale.
* embeddings (``nn.Embedding``, ``F.embedding``, ``aten.embedding``): the table's features open a label,
  like a layer's outputs.

Every rule is ``rule(walker, node, op) -> state``, ``op`` the module of a ``call_module`` node
(:mod:`~symlib.symmetry.trace.rules`).
"""

from __future__ import annotations

import torch.fx
from torch import nn
from torch.nn import functional as F

from symlib.symmetry.trace.labels import FIXED, Attr, Grid, Multi, Scores, Seg, State


# ------------------------------------------------------------------------------------------- shared
def open_label(w, layer: str, n: int, axis: int, *params: tuple[str, int]) -> State:
    """A new label of ``n`` entries for the outputs of ``layer``, on axis ``axis`` of its result, acting
    (power +1) on the given ``(parameter, axis)`` pairs (the weight's output axis, the bias)."""
    label = w.new(layer, n)
    for name, axis_of_param in params:
        w.act(name, axis_of_param, label, label, 1)
    return State(axis, (Seg(label, label, n),), layer)


def _dense(w, layer: str, n: int, axis: int, weight: str, cols: int, rows: int, segs, bias=()) -> State:
    """A weight whose input axis ``cols`` reads segments ``segs`` and whose output axis ``rows`` (and the
    ``(parameter, axis)`` of its bias, if any) opens a label of ``n`` entries."""
    w.weights.add(weight)
    w.act_on(weight, cols, segs, -1)
    return open_label(w, layer, n, axis, (weight, rows), *bias)


def layer_of(name: str) -> str:
    """The layer of a parameter name (``"blocks.0.fc1"`` for ``"blocks.0.fc1.weight"``)."""
    return name.rsplit(".", 1)[0]


def param(w, node, arg, what: str) -> Attr | None:
    """The parameter behind argument ``arg`` (a view of one), or ``None`` for ``None``; refused otherwise."""
    if arg is None:
        return None
    st = w.states.get(arg) if isinstance(arg, torch.fx.Node) else None
    if isinstance(st, Attr) and st.in_state_dict and not st.opaque:
        return st
    raise w.refuse(node, f"the {what} {arg!r}, which is not a parameter of the model (or a view of one)",
                   "pass the model's own parameters")


def attr_name(w, node, arg) -> str | None:
    """The state-dict name of a ``get_attr`` argument (a functional layer's weight), or ``None``."""
    if arg is None:
        return None
    st = w.states.get(arg)
    if isinstance(st, Attr) and st.in_state_dict:
        return st.name
    raise w.refuse(node, f"the argument {arg!r}", "pass the parameters of the model itself")


def last_axis(w, node, x, what: str, fix: str) -> tuple[Seg, ...]:
    """The segments on the last axis of ``x``, which a layer given as a function (or an attention) reads;
    refused (``what``, ``fix``) when labelled features lie on another axis, or in heads."""
    st = w.states.get(x)
    if isinstance(st, (Grid, Scores, Multi)) or (isinstance(st, State) and st.segs
                                                  and st.axis != len(w.shape(x)) - 1):
        raise w.refuse(node, what, fix)
    return w.segments(st if isinstance(st, State) else None, w.shape(x)[-1])


def _read(w, node, axis_kind: str) -> tuple[State, tuple[Seg, ...]]:
    """The input's state and segments on the axis the layer reads (last axis, or the channel axis 1)."""
    src = w.tensor_args(node)[0]
    st = w.input(node)
    shape = w.shape(src)
    axis = len(shape) - 1 if axis_kind == "last" else 1
    if not w.is_fixed(st) and st.axis != axis and not (st.axis == 1 and len(shape) == 2):
        raise w.refuse(
            node, f"a layer reading axis {axis} of a tensor whose channels are on axis {st.axis}",
            "apply Linear layers to (batch, features) tensors, e.g. after a global pool or a flatten",
        )
    return st, w.segments(st, shape[axis])


# ------------------------------------------------------------------------------------------- linear
def linear_module(w, node, mod: nn.Linear) -> State:
    """``nn.Linear`` on the last axis."""
    name = node.target
    _, segs = _read(w, node, "last")
    bias = [(f"{name}.bias", 0)] if mod.bias is not None else []
    return _dense(w, name, mod.out_features, len(w.shape(node)) - 1, f"{name}.weight", 1, 0, segs, bias)


def linear(w, node, x, weight, bias, transposed: bool = False) -> State:
    """``x @ W.T + b`` (``transposed``: ``b + x @ W``) with ``W`` a parameter: a linear layer."""
    wt = param(w, node, weight, "weight")
    b = param(w, node, bias, "bias")
    segs = last_axis(w, node, x, "a linear layer reading a tensor whose features are not on its last axis",
                     "apply it to (..., features) tensors, e.g. after merging the heads back")
    if len(wt.shape) != 2:
        raise w.refuse(node, f"the weight {wt.name!r} of shape {wt.shape}", "a linear weight is 2-D")
    rows, cols = (1, 0) if transposed else (0, 1)
    return _dense(w, layer_of(wt.name), wt.shape[rows], len(w.shape(node)) - 1, wt.name, wt.param_axis(cols),
                  wt.param_axis(rows), segs, [(b.name, b.param_axis(0))] if b is not None else [])


def linear_function(w, node, op=None) -> State:
    """``F.linear(x, weight, bias)``."""
    return linear(w, node, node.args[0], w.arg(node, 1, "weight"), w.arg(node, 2, "bias"))


def addmm(w, node, op=None) -> State:
    """``torch.addmm(bias, x, weight)``: ``bias + x @ weight``."""
    return linear(w, node, node.args[1], node.args[2], node.args[0], transposed=True)


# ---------------------------------------------------------------------------------------- convolutions
def conv(w, node, mod) -> State:
    """``nn.Conv1d/2d/3d``, grouped and depthwise too (paper D.4.2)."""
    name = node.target
    bias = f"{name}.bias" if mod.bias is not None else None
    return _conv(w, node, name, f"{name}.weight", bias, mod.out_channels, mod.in_channels, mod.groups)


def _conv(w, node, name: str, weight: str, bias: str | None, out_channels: int, in_channels: int,
          g: int) -> State:
    """A convolution of weight ``weight`` (``(out, in / g, *kernel)``) and ``g`` groups, from a module or a
    function."""
    _, segs = _read(w, node, "channel")
    if any(s.inner != 1 for s in segs):
        raise w.refuse(node, "a convolution over flattened channels", "convolve channel maps (N, C, ...)")
    labelled = [s for s in segs if not w.seg_fixed(s)]
    if g > 1 and labelled and len(segs) != 1:
        raise w.refuse(
            node, f"the grouped convolution {name!r} reading a concatenation",
            "grouped convolutions are supported on the output of one layer (or a residual stream)",
        )
    bias = [(bias, 0)] if bias is not None else []
    if g == 1:
        return _dense(w, name, out_channels, 1, weight, 1, 0, segs, bias)
    w.weights.add(weight)
    s = segs[0] if len(segs) == 1 else Seg(FIXED, FIXED, in_channels)
    w.act(weight, 1, s.perm, s.scale, -1, groups=g)
    out = open_label(w, name, out_channels, 1, (weight, 0), *bias)
    w.grouped.append((s.perm, out.segs[0].perm, g))
    return out


def conv_function(w, node, op=None) -> State:
    """``F.conv1d/2d/3d(x, weight, bias, stride, padding, dilation, groups)`` (and ATen's ``conv2d``, ...;
    ATen's ``convolution``, whose groups come last, when not transposed) with parameters of the model."""
    aten_convolution = op == "convolution"
    if aten_convolution and node.args[6]:
        raise w.refuse(node, "a transposed convolution", "its symmetries are unknown to symlib; write the "
                       "Spec by hand")
    wt = _whole(w, node, w.arg(node, 1, "weight"), "convolution weight")
    b = _whole(w, node, w.arg(node, 2, "bias"), "convolution bias")
    g = int(node.args[8] if aten_convolution else w.arg(node, 6, "groups", 1))
    return _conv(w, node, layer_of(wt.name), wt.name, b.name if b is not None else None, wt.shape[0],
                 wt.shape[1] * g, g)


def _whole(w, node, arg, what: str) -> Attr | None:
    """The parameter behind ``arg``, read whole (not a view of it), or ``None``."""
    st = param(w, node, arg, what)
    if st is not None and st.axes is not None and st.axes != tuple(range(len(st.shape))):
        raise w.refuse(node, f"the {what} {st.name!r} read through a view", "pass the parameter itself")
    return st


# ------------------------------------------------------------------------------------- normalisations
def _open_scales(w, name, segs) -> tuple[Seg, ...]:
    """The segments with a new scale each (a normalisation's affine parameters open them)."""
    out = []
    for s in segs:
        new = w.new(name, s.n)
        w.perm_uf.union(new, FIXED)  # only its scale is new
        out.append(Seg(s.perm, new, s.n, s.inner))
    return tuple(out)


def batchnorm(w, node, mod) -> State:
    """BatchNorm in eval mode (module docstring)."""
    name = node.target
    if not mod.track_running_stats:
        raise _batch_statistics(w, node, name)
    affine = (f"{name}.weight", f"{name}.bias") if mod.affine else None
    return _batchnorm(w, node, name, f"{name}.running_mean", f"{name}.running_var", affine, float(mod.eps))


def _batch_statistics(w, node, name: str):
    return w.refuse(
        node, f"the BatchNorm {name!r} without running statistics",
        "in eval mode it normalises with batch statistics, which couples samples; build it with "
        "track_running_stats=True",
    )


def _batchnorm(w, node, name: str, mean: str, var: str, affine: tuple[str, str | None] | None,
               eps: float) -> State:
    """BatchNorm in eval mode on the running statistics ``mean``, ``var`` and the ``(weight, bias)`` of
    ``affine``, from a module or a function."""
    st, segs = _read(w, node, "channel")
    w.act_on(mean, 0, segs, 1)
    w.act_on(var, 0, segs, 2, offset=eps)
    if affine is None:
        return State(st.axis, tuple(Seg(s.perm, FIXED, s.n, s.inner) for s in segs), st.producer)
    w.weights.add(affine[0])
    out = _open_scales(w, name, segs)
    for p in affine:
        if p is not None:
            w.act_on(p, 0, out, 1)
    return State(st.axis, out, st.producer)


def batchnorm_function(w, node, op=None) -> State:
    """``F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)`` in eval mode,
    and ``torch.batch_norm`` / ATen's ``batch_norm(x, weight, bias, running_mean, running_var, training,
    momentum, eps, cudnn_enabled)``."""
    functional = op is F.batch_norm
    keys = ("running_mean", "running_var", "weight", "bias") if functional else (
        "weight", "bias", "running_mean", "running_var")
    args = {k: w.arg(node, i + 1, k) for i, k in enumerate(keys)}
    named = {k: _whole(w, node, a, f"BatchNorm {k}") for k, a in args.items()}
    layer = layer_of(next((p.name for p in named.values() if p is not None), node.name + "."))
    if named["running_mean"] is None or named["running_var"] is None or w.arg(node, 5, "training", False):
        raise _batch_statistics(w, node, layer)
    if named["weight"] is None and named["bias"] is not None:
        raise w.refuse(node, f"the BatchNorm {layer!r} with a bias but no weight", "give it both or neither")
    affine = None if named["weight"] is None else (
        named["weight"].name, named["bias"].name if named["bias"] is not None else None)
    eps = float(w.arg(node, 7, "eps", 1e-5))
    return _batchnorm(w, node, layer, named["running_mean"].name, named["running_var"].name, affine, eps)


def layernorm(w, node, normalized_shape, weight: str | None, bias: str | None, layer: str,
              kind: str = "layer") -> State:
    """LayerNorm (``kind="layer"``) or RMSNorm (``"rms"``) over the last axis (``normalized_shape =
    (C,)``), from a module, ``F.layer_norm`` or ``F.rms_norm``."""
    src = w.tensor_args(node)[0]
    st = w.input(node)
    shape = w.shape(src)
    if w.is_fixed(st):
        return State(len(shape) - 1)
    if node in w.tail:  # a final normalisation: its input's labels reach the output anyway
        return w.fix_inputs(node)
    if len(normalized_shape) != 1 or st.axis != len(shape) - 1:
        raise w.refuse(
            node, f"the LayerNorm {layer!r} over {tuple(normalized_shape)} of a tensor whose channels are on "
            f"axis {st.axis}", "only a LayerNorm over the channel axis alone (the last axis) keeps channel "
            "permutations",
        )
    w.fix_scales(st, layer, "is a LayerNorm, which normalises across channels (no per-channel scaling)")
    segs = tuple(Seg(s.perm, FIXED, s.n, s.inner) for s in st.segs)
    if weight is None:
        return State(st.axis, segs, st.producer)
    w.weights.add(weight)
    w.norms[weight] = kind
    out = _open_scales(w, layer, segs)
    w.act_on(weight, 0, out, 1)
    if bias is not None:
        w.act_on(bias, 0, out, 1)
    return State(st.axis, out, st.producer)


def norm_module(w, node, mod) -> State:
    """``nn.LayerNorm`` and ``nn.RMSNorm`` (which has no bias)."""
    name = node.target
    weight, bias = mod.weight, getattr(mod, "bias", None)
    return layernorm(w, node, tuple(mod.normalized_shape), f"{name}.weight" if weight is not None else None,
                     f"{name}.bias" if bias is not None else None, name,
                     "rms" if isinstance(mod, nn.RMSNorm) else "layer")


def norm_function(w, node, op) -> State:
    """``F.layer_norm(x, shape, weight, bias)`` and ``F.rms_norm(x, shape, weight)``."""
    shape = w.arg(node, 1, "normalized_shape")
    weight = attr_name(w, node, w.arg(node, 2, "weight"))
    bias = attr_name(w, node, w.arg(node, 3, "bias")) if op is F.layer_norm else None
    return layernorm(w, node, tuple(shape), weight, bias, weight.rsplit(".", 1)[0] if weight else node.name,
                     "rms" if op is F.rms_norm else "layer")


# ------------------------------------------------------------------------------------------ embeddings
def _table(w, wt: Attr, layer: str, axis: int) -> State:
    """A lookup in a ``(vocabulary, d)`` table: its ``d`` features open a label."""
    w.weights.add(wt.name)
    return open_label(w, layer, wt.shape[1], axis, (wt.name, wt.param_axis(1)))


def embedding(w, node, weight) -> State:
    """A lookup of the network's input tokens in the table ``weight`` (a parameter)."""
    wt = param(w, node, weight, "embedding table")
    ids = [a for a in w.tensor_args(node) if a is not weight]
    if ids and not w.is_fixed(w.states.get(ids[0])):
        raise w.refuse(node, "an embedding of labelled indices", "embed the network's input tokens")
    return _table(w, wt, layer_of(wt.name), len(w.shape(node)) - 1)


def embedding_function(w, node, op=None) -> State:
    """``F.embedding(ids, weight)``."""
    return embedding(w, node, w.arg(node, 1, "weight"))


def embedding_aten(w, node, op=None) -> State:
    """``aten.embedding(weight, ids)`` (graphs from ``torch.export``)."""
    return embedding(w, node, node.args[0])


def embedding_module(w, node, mod: nn.Embedding) -> State:
    """``nn.Embedding``."""
    if not w.fixed_inputs(node):
        raise w.refuse(node, f"the embedding {node.target!r} of labelled indices", "embed the input tokens")
    wt = Attr(f"{node.target}.weight", tuple(mod.weight.shape), True)
    return _table(w, wt, node.target, len(w.shape(node)) - 1)
