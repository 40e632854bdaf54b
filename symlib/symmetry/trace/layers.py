r"""Rules for the layers that hold parameters, and the dispatch of ``call_module`` nodes (book: chapter
"Symmetries of real architectures"; paper App. D.4). See :mod:`symlib.symmetry.trace`.

* ``Linear`` / convolutions: the input's labels act (power -1) on the weight's input axis, segment by
  segment (``Action.start``, and ``Action.inner`` after a flatten); the output opens a new label.
  A grouped convolution ties its input and output labels' blocks (``Spec.blocks``).
* BatchNorm: same permutation as its input; the input's scale is absorbed by the running statistics
  (mean: power 1, ``var + eps``: power 2), and ``weight``/``bias`` open a new scale.
* LayerNorm (and RMSNorm) over the channel axis: the permutation passes (its ``weight``/``bias`` move
  with it); the input's per-channel scale does not (the normalisation mixes channels), and
  ``weight``/``bias`` open a new scale.
* ``nn.Embedding``: the table's features open a label (:func:`.attention.embedding_module`).
"""

from __future__ import annotations

from torch import nn

from symlib.symmetry.trace import rules
from symlib.symmetry.trace.labels import FIXED, Attr, Grid, Scores, Seg, State


def module(w, node, mod: nn.Module) -> State:
    name = node.target
    args = w.tensor_args(node)
    st = w.states.get(args[0]) if args else None
    if isinstance(st, (Grid, Scores)):  # features split into heads, or attention scores
        if isinstance(mod, (nn.Dropout, nn.Identity)) or (isinstance(st, Scores) and isinstance(
                mod, (nn.Softmax, nn.LogSoftmax))):
            return st
        raise w.refuse(node, f"the module {name!r} of type {type(mod).__name__} on "
                       + ("attention scores" if isinstance(st, Scores) else "features split into heads"),
                       "merge the heads back before other layers")
    if isinstance(mod, nn.Embedding):
        from symlib.symmetry.trace import attention

        return attention.embedding_module(w, node, mod)
    if isinstance(mod, nn.RMSNorm):
        return layernorm(w, node, tuple(mod.normalized_shape),
                         f"{name}.weight" if mod.weight is not None else None, None, name)
    if isinstance(mod, nn.Linear):
        return linear(w, node, name, mod)
    if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return conv(w, node, name, mod)
    if isinstance(mod, nn.modules.batchnorm._BatchNorm):
        return batchnorm(w, node, name, mod)
    if isinstance(mod, nn.LayerNorm):
        affine = mod.weight is not None
        return layernorm(w, node, tuple(mod.normalized_shape),
                         f"{name}.weight" if affine else None,
                         f"{name}.bias" if mod.bias is not None else None, name)
    if isinstance(mod, rules.PASS_MODULES):
        return w.input(node)
    if isinstance(mod, rules.NONHOMOGENEOUS_MODULES):
        return w.nonhomogeneous(node, name, type(mod).__name__)
    if isinstance(mod, nn.Flatten):
        return w.reshape(node)
    if w.fixed_inputs(node):  # e.g. an embedding of the input: nothing to act on yet
        return State(1)
    if node in w.tail:  # e.g. a final normalisation: the labels would reach the output anyway
        return w.fix_inputs(node)
    raise w.refuse(
        node, f"the module {name!r} of type {type(mod).__name__}",
        "its symmetries are unknown to symlib; supported: Linear, Conv1d/2d/3d (grouped and depthwise "
        "too), BatchNorm, LayerNorm over channels, element-wise activations, pooling, dropout, flatten, "
        "concatenation, residual additions and gating products. Write its Spec by hand "
        "(symlib.symmetry.spec.Spec) instead",
    )


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


def _act_segments(w, param, axis, segs, power, offset=0.0) -> None:
    pos = 0
    for s in segs:
        w.act(param, axis, s.perm, s.scale, power, offset=offset, start=pos, inner=s.inner)
        pos += s.size


def linear(w, node, name, mod) -> State:
    st, segs = _read(w, node, "last")
    w.weights.add(f"{name}.weight")
    _act_segments(w, f"{name}.weight", 1, segs, -1)
    label = w.new(name, mod.out_features)
    w.act(f"{name}.weight", 0, label, label, 1)
    if mod.bias is not None:
        w.act(f"{name}.bias", 0, label, label, 1)
    return State(len(w.shape(node)) - 1, (Seg(label, label, mod.out_features),), name)


def conv(w, node, name, mod) -> State:
    st, segs = _read(w, node, "channel")
    if any(s.inner != 1 for s in segs):
        raise w.refuse(node, "a convolution over flattened channels", "convolve channel maps (N, C, ...)")
    w.weights.add(f"{name}.weight")
    g = mod.groups
    labelled = [s for s in segs if not w.seg_fixed(s)]
    if g > 1 and labelled and len(segs) != 1:
        raise w.refuse(
            node, f"the grouped convolution {name!r} reading a concatenation",
            "grouped convolutions are supported on the output of one layer (or a residual stream)",
        )
    label = w.new(name, mod.out_channels)
    if g > 1:
        s = segs[0] if len(segs) == 1 else Seg(FIXED, FIXED, mod.in_channels)
        w.act(f"{name}.weight", 1, s.perm, s.scale, -1, groups=g)
        w.grouped.append((s.perm, label, g))
    else:
        _act_segments(w, f"{name}.weight", 1, segs, -1)
    w.act(f"{name}.weight", 0, label, label, 1)
    if mod.bias is not None:
        w.act(f"{name}.bias", 0, label, label, 1)
    return State(1, (Seg(label, label, mod.out_channels),), name)


def batchnorm(w, node, name, mod) -> State:
    st, segs = _read(w, node, "channel")
    if not mod.track_running_stats:
        raise w.refuse(
            node, f"the BatchNorm {name!r} without running statistics",
            "in eval mode it normalises with batch statistics, which couples samples; build it with "
            "track_running_stats=True",
        )
    _act_segments(w, f"{name}.running_mean", 0, segs, 1)
    _act_segments(w, f"{name}.running_var", 0, segs, 2, offset=float(mod.eps))
    if not mod.affine:
        return State(st.axis, tuple(Seg(s.perm, FIXED, s.n, s.inner) for s in segs), st.producer)
    w.weights.add(f"{name}.weight")
    out = _open_scales(w, name, segs)
    _act_segments(w, f"{name}.weight", 0, out, 1)
    _act_segments(w, f"{name}.bias", 0, out, 1)
    return State(st.axis, out, st.producer)


def _open_scales(w, name, segs) -> tuple[Seg, ...]:
    """The segments with a new scale each (a normalisation's affine parameters open them)."""
    out = []
    for s in segs:
        new = w.new(name, s.n)
        w.perm_uf.union(new, FIXED)  # only its scale is new
        out.append(Seg(s.perm, new, s.n, s.inner))
    return tuple(out)


def layernorm(w, node, normalized_shape, weight: str | None, bias: str | None, layer: str) -> State:
    """LayerNorm over the last axis (``normalized_shape = (C,)``), from a module or ``F.layer_norm``."""
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
    out = _open_scales(w, layer, segs)
    _act_segments(w, weight, 0, out, 1)
    if bias is not None:
        _act_segments(w, bias, 0, out, 1)
    return State(st.axis, out, st.producer)


def attr_name(w, node, arg) -> str | None:
    """The state-dict name of a ``get_attr`` argument (a functional layer's weight), or ``None``."""
    if arg is None:
        return None
    st = w.states.get(arg)
    if isinstance(st, Attr) and st.in_state_dict:
        return st.name
    raise w.refuse(node, f"the argument {arg!r}", "pass the parameters of the model itself")
