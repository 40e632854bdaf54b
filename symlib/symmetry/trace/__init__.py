r"""Derive a :class:`~symlib.symmetry.spec.Spec` from a model by tracing it (book: chapters "Symmetries of
real architectures" and "Transformers: permutations without scalings"; paper App. D.4; the architectures
supported: page "Architectures").

:func:`spec_of` traces ``model`` with ``torch.fx`` (in eval mode; models that ``torch.fx`` cannot trace,
such as Hugging Face ``transformers`` models, are exported with ``torch.export`` and their ATen graph is
walked by the same rules), propagates shapes on one dummy input (fake tensors: no arithmetic), and walks
the graph once. Every channel (feature) axis produced by a ``Linear`` or a convolution gets a
fresh permutation label and a fresh scaling label; the other nodes move, tie or drop these labels. A
tensor carries its labels on one axis as segments laid end to end (one per concatenated part), each
label entry covering a block of entries after a flatten:

* ReLU, LeakyReLU, max / average pooling, dropout, identity: pass both labels
  (they are permutation-equivariant and positively homogeneous,
  :math:`\mathrm{relu}(\lambda z) = \lambda\,\mathrm{relu}(z)` for :math:`\lambda > 0`).
* tanh, GELU, SiLU, ReLU6, Hardswish, sigmoid, ...: pass the permutation, fix the scale (recorded in
  ``Spec.no_scaling``; ``scalings="partial"`` keeps the scalings that hold elsewhere, ``"none"``
  drops them all).
* flatten / view (paper D.4.1's flattened convolutions, git-re-basin's VGG): a channel label acts on
  blocks of ``H*W`` inputs of the next linear layer (``Action.inner``).
* mean / sum over positions, permute, transpose: keep the labels on the moved axis.
* ``torch.cat`` along channels (SqueezeNet, DenseNet, Inception, GoogLeNet): the result carries the
  product of its parts' permutations, each part's labels on its own slice (``Action.start``).
* BatchNorm (eval mode, paper D.4.3): same permutation as its input; the input scale :math:`\lambda`
  acts on the running mean (power 1) and on ``running_var + eps`` (power 2), so the normalisation
  absorbs it exactly; ``weight``/``bias`` open a new scale :math:`\mu` (power 1), undone by the next
  layer (power -1):

  .. math:: \gamma\frac{\lambda z - \lambda m}{\sqrt{\lambda^2 (v + \epsilon)}} + \beta
            = \gamma\frac{z - m}{\sqrt{v + \epsilon}} + \beta.

* residual ``add`` (paper D.4.4): the summed tensors must carry the same permutation and the same
  scale, so their labels are merged (union-find). A 1x1 shortcut convolution is an ordinary
  convolution: it reads the block's input label and opens a label that the add then ties.
* products ``x * gate`` (squeeze-and-excitation in EfficientNet, MobileNet-V3, RegNet-Y): the factors'
  permutations merge; the product keeps the scale of ``x`` (the gate's, after a sigmoid, is fixed).
* grouped and depthwise convolutions (paper D.4.2): the input label and the output label get a block
  structure and move their groups together (``Spec.blocks``).
* LayerNorm and RMSNorm over the features (a transformer's residual stream): the permutation passes, so
  one label acts on every tensor that reads or writes the stream (embeddings, position embeddings, class
  tokens, every norm, the inputs of every projection, the outputs of every output projection); the norm
  fixes the stream's scale, and its affine weight opens a scale undone by the next layer's columns.
  Written out (Hugging Face's ``weight * (x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))``,
  :mod:`~symlib.symmetry.trace.channelwise`): a reduction over the features is a statistic no permutation
  changes (no label, the input's scales fixed), and a parameter vector times features whose scales are
  fixed opens a scale.
* splitting features: ``split``, ``chunk``, ``unbind`` and indexing along the labelled axis cut its label
  into parts (a fused query-key-value layer; SwiGLU's gate and value, whose product pairs them); a
  reshape ``(..., h * k) -> (..., h, k)`` spreads features over heads and its converse merges them back;
  interleaving parts (a channel shuffle) is refused.
* attention (:mod:`~symlib.symmetry.trace.attention`): ``q @ k.T`` and ``scaled_dot_product_attention``
  merge the query and key labels (keys on the far side of the bilinear form, ``Action.power`` -1), the
  attention weights carry the heads to the values, whose label then reaches the output projection; the
  heads are blocks of these labels, tied (``Spec.blocks``), with a label of their own for per-head
  parameters (Swin's relative position bias tables); the continuous group per head (:math:`GL(d_k)`,
  :math:`GL(d_v)`) and the redundant key and value biases are recorded in ``Spec.continuous``.
  ``nn.MultiheadAttention`` and torchvision's ``shifted_window_attention`` are rules of their own;
  ``F.linear``, ``x @ W``, ``torch.addmm`` with a parameter, and embeddings act as layers.
* rotary position embeddings and grouped-query attention (:mod:`~symlib.symmetry.trace.heads`): a product
  with a tensor that varies along a head's features (``cos``, ``sin``), a slice of every head or a repeat
  of the heads (``repeat_kv``, ``enable_gqa``) leaves only whole heads movable: a label of one entry per
  head, acting in blocks of the head's width; query heads form blocks of the key-value groups.
* views of a parameter (``expand``, ``unsqueeze``, ``permute``, ``.T``) stay that parameter: a class token
  concatenated to the patch embeddings, a position embedding added to them, move with their labels.

The network's input and every tensor that reaches the output are fixed: their labels merge into one
"fixed" class (:data:`FIXED`) that no symmetry acts on. Anything else (other matrix products, a cut
through a flattened channel, a parameter computed into something else before it meets labelled tensors,
an unknown module or function on a labelled tensor or on features split into heads) raises
:class:`~symlib.symmetry.spec.SymmetryError` naming the node and, when it was traced inside a submodule,
the module's path and class (``in module 'model.layers.0.self_attn' (LlamaAttention)``). A layer with
parameters but no rule that reads only unlabelled tensors (the input) gets no label, and an empty spec of a
network whose layers have hidden units is suspect: both issue a :class:`SmallSpecWarning` (the spec is
valid, but smaller than the group).

Layout: :mod:`~symlib.symmetry.trace.labels` (the labels of a tensor: segments, grids, scores, and the
union-find with parities and parts), :mod:`~symlib.symmetry.trace.walker` (the walk, the bookkeeping the
rules share, and the records it yields), :mod:`~symlib.symmetry.trace.rules` (the rule table: which rule
an operation gets, looked up in one place), and the rules: :mod:`~symlib.symmetry.trace.layers` (layers
with parameters, as modules or functions), :mod:`~symlib.symmetry.trace.channelwise` (activations,
arithmetic, reductions, concatenation, normalisations written out), :mod:`~symlib.symmetry.trace.views`
(reshapes, axis moves, indexing and splits, views of parameters), :mod:`~symlib.symmetry.trace.attention`
(attention: its products, heads and scores, and whole attention layers),
:mod:`~symlib.symmetry.trace.heads` (heads that move only whole: rotary embeddings, grouped-query
attention); :mod:`~symlib.symmetry.trace.inputs` says what the dummy input must be. Here: :func:`spec_of`
(trace, with ``PlainTracer`` through PyTorch's own transformer layers, propagate shapes, walk) and
``assemble``, which builds the :class:`~symlib.symmetry.spec.Spec` from the walk's records
(each recorded action on the final label classes, cut labels replaced by their parts, tied parameters
and their aliases, blocks of grouped convolutions and heads, the continuous groups of attention).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.shape_prop import ShapeProp, _extract_tensor_metadata

from symlib.errors import InputShapeError
from symlib.symmetry.spec import Action, Spec, SymmetryError, with_scalings
from symlib.symmetry.trace import inputs
from symlib.symmetry.trace.labels import FIXED, UnionFind

if TYPE_CHECKING:
    from symlib.symmetry.trace.walker import Records

__all__ = ["FIXED", "SmallSpecWarning", "spec_of"]


class SmallSpecWarning(UserWarning):
    """A traced spec that is likely smaller than the model's symmetry group: a layer with parameters that no
    rule knows read the network's input (its outputs carry no label), or the spec is empty although some
    ``Linear``, convolution or embedding has hidden units (outputs of more than one entry that do not reach
    the network's output). The spec is still valid (every element it lists keeps the function); it misses
    symmetries. The message names the model's class, the layers and what to check."""


def spec_of(model: nn.Module, input_shape, device=None, dtype=None, scalings: str = "auto",
            vocab: int | None = None, tracer: str = "auto") -> Spec:
    """The symmetries of ``model``, derived by tracing it with ``torch.fx`` (module docstring).

    Args:
        model: a PyTorch module whose ``forward`` ``torch.fx`` can trace (no
            data-dependent control flow); when ``torch.fx.symbolic_trace`` fails
            (Hugging Face ``transformers`` models do), the model is exported with
            ``torch.export`` instead and the same rules walk its ATen graph. It
            is traced in eval mode and not modified (its train/eval flags are
            restored).
        input_shape: shape of one input sample, without the batch dimension,
            e.g. ``(1, 28, 28)``, or ``(tokens,)`` for a language model.
        device, dtype: of the dummy input used to propagate shapes (default:
            those of the model's first parameter).
        vocab: for a network that reads token ids (integers in ``[0, vocab)``):
            the vocabulary size; the dummy input is then integer, and the spec's
            functional checks draw random tokens (``Spec.vocab``).
        scalings: ``"auto"`` (default): every scaling symmetry the layers allow;
            when some activation is not positively homogeneous (tanh, SiLU,
            ReLU6, ...) the spec lists it in ``Spec.no_scaling`` and scaling
            operations refuse it, with a message saying what to do.
            ``"partial"``: the same labels, and scaling operations act on the
            layers where scalings hold. ``"none"``: permutations only (valid for
            every element-wise activation).
        tracer: ``"auto"`` (default): ``torch.fx``, else ``torch.export``;
            ``"fx"`` or ``"export"``: that one only (both give the same spec
            where both trace the model).

    Returns:
        The spec, with ``forward`` (evaluating the model functionally, in eval
        mode; of a model returning a tuple or a dict, its first tensor, e.g. the
        logits of a Hugging Face model) and ``input_shape`` set. Labels are named after the layer that
        opens them: a convolution ``"layer1.0.conv1"`` opens a permutation and
        a scale of that name, a BatchNorm ``"bn1"`` a scale; merged labels keep
        the name of their first layer.

    Raises:
        SymmetryError: naming the node or layer whose symmetries are unknown.
    """
    from symlib.symmetry.trace import rules
    from symlib.symmetry.trace.walker import Walker

    if not isinstance(model, nn.Module):
        raise SymmetryError(f"spec_of takes an nn.Module, got {type(model).__name__}")
    if scalings not in ("auto", "partial", "none"):
        raise ValueError(f"scalings must be 'auto', 'partial' or 'none', got {scalings!r}")
    if tracer not in ("auto", "fx", "export"):
        raise ValueError(f"tracer must be 'auto', 'fx' or 'export', got {tracer!r}")
    input_shape = tuple(int(d) for d in input_shape)
    ref = next(iter(model.parameters()), None)
    dtype = dtype or (ref.dtype if ref is not None else torch.float32)
    device = device or (ref.device if ref is not None else None)
    modes = {m: m.training for m in model.modules()}
    config = getattr(model, "config", None)  # a Hugging Face model: its key/value cache only hides the graph
    cache = getattr(config, "use_cache", None)
    dummy = (torch.zeros(2, *input_shape, dtype=torch.long, device=device) if vocab is not None
             else torch.zeros(2, *input_shape, dtype=dtype, device=device))
    try:
        model.eval()  # the spec is of the eval-mode function (``if self.training`` branches traced so)
        if cache:
            config.use_cache = False
        gm = _trace(model, dummy, tracer)
        try:
            _propagate(gm, dummy)
        except Exception as err:
            raise InputShapeError(
                f"{type(model).__name__} fails on an input of shape (batch, *{input_shape}): {err}"
            ) from err
    finally:
        for m, t in modes.items():
            m.train(t)
        if cache:
            config.use_cache = cache
    records = Walker(model, gm, rules.apply).walk()
    spec = with_scalings(assemble(records, model), scalings)
    _warn_if_small(records, spec, model)
    if vocab is not None:
        inputs.check_vocab(gm, int(vocab))
        spec = dataclasses.replace(spec, vocab=int(vocab))
    return spec.with_forward(_eval_forward(model), input_shape)


def _warn_if_small(records: Records, spec: Spec, model: nn.Module) -> None:
    """Warn (:class:`SmallSpecWarning`) when layers without a rule read the input, or when the spec is
    empty although a ``Linear``, convolution or embedding has hidden units (more than one output entry,
    and its outputs do not reach the network's output: a lone classifier's spec is empty rightly)."""
    name = type(model).__name__
    check = ("check that symlib knows these layers (compare spec_of(..., tracer='fx') with tracer='export'; "
             "supported: Linear, Conv1d/2d/3d, BatchNorm, LayerNorm, embeddings, attention), or write the "
             "Spec by hand (symlib.symmetry.spec.Spec)")
    if records.opaque:
        warnings.warn(SmallSpecWarning(
            f"spec_of({name}): no rule for {', '.join(records.opaque)}, which read parameters of the model "
            f"and unlabelled tensors (the network's input): their outputs carry no label, so the spec misses "
            f"their symmetries; {check}"), stacklevel=3)
        return
    if spec.perms:
        return
    producers = set(records.output_producers)
    hidden = [k or type(m).__name__ for k, m in model.named_modules()  # (a layer's label is named after
              if isinstance(m, _LAYERS) and _units(m) > 1  # its weight's module: "weight" for the root)
              and f"{k}.weight".lstrip(".").rsplit(".", 1)[0] not in producers]
    if hidden:
        warnings.warn(SmallSpecWarning(
            f"spec_of({name}) found no symmetry although the layers {', '.join(map(repr, hidden[:4]))}"
            f"{' ...' if len(hidden) > 4 else ''} have hidden units (outputs of more than one entry that do "
            f"not reach the network's output); {check}"), stacklevel=3)


_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)


def _units(m: nn.Module) -> int:
    """The number of output units of a ``Linear``, a convolution or an embedding."""
    return int(getattr(m, "out_features", None) or getattr(m, "out_channels", None) or m.embedding_dim)


def _trace(model: nn.Module, dummy: torch.Tensor, tracer: str = "auto") -> torch.fx.GraphModule:
    """The graph of ``model``: by ``torch.fx.symbolic_trace``, else by ``torch.export`` (an ATen graph whose
    parameters are read by ``get_attr``, under their state-dict names); ``tracer`` forces one of them."""
    try:
        if tracer == "export":
            raise SymmetryError("tracer='export' was asked for")
        return _symbolic_trace(model)  # torch.fx, through PyTorch's own transformer layers
    except Exception as fx_err:  # torch.fx raises many kinds of errors
        if tracer == "fx":
            raise SymmetryError(f"torch.fx could not trace {type(model).__name__} ({fx_err}); pass "
                                "tracer='auto' to export it with torch.export instead") from fx_err
        try:
            with torch.no_grad():
                return torch.export.export(model, (dummy,), strict=False).module()
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else ""
            raise SymmetryError(
                f"torch.fx could not trace {type(model).__name__} ({fx_err}), and torch.export could not "
                f"export it either ({type(err).__name__}: {first}). {inputs.advice(model, dummy, first)}"
            ) from err


# -------------------------------------------- PyTorch's transformer layers, traced through by torch.fx
def _encoder_layer(mod: nn.TransformerEncoderLayer, src, src_mask=None, src_key_padding_mask=None,
                   is_causal: bool = False):
    """``nn.TransformerEncoderLayer.forward`` without its fast path."""

    def attend(x):
        out = mod.self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                            need_weights=False, is_causal=is_causal)[0]
        return mod.dropout1(out)

    def feed_forward(x):
        return mod.dropout2(mod.linear2(mod.dropout(mod.activation(mod.linear1(x)))))

    x = src
    if mod.norm_first:
        x = x + attend(mod.norm1(x))
        return x + feed_forward(mod.norm2(x))
    x = mod.norm1(x + attend(x))
    return mod.norm2(x + feed_forward(x))


def _encoder(mod: nn.TransformerEncoder, src, mask=None, src_key_padding_mask=None, is_causal=None):
    """``nn.TransformerEncoder.forward`` without its fast path (no nested tensors)."""
    x = src
    for layer in mod.layers:
        x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
    return x if mod.norm is None else mod.norm(x)


_PLAIN = {nn.TransformerEncoderLayer: _encoder_layer, nn.TransformerEncoder: _encoder}
"""PyTorch's layers traced through by their plain forward (``PlainTracer``) instead of as one call."""


class PlainTracer(torch.fx.Tracer):
    """``torch.fx``'s tracer, which traces the modules of ``_PLAIN`` through their plain forward."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return type(m) not in _PLAIN and super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward, args, kwargs):
        plain = _PLAIN.get(type(m))
        if plain is not None:
            def forward(*a, **k):  # noqa: F811 (the plain forward replaces the module's own)
                return plain(m, *a, **k)
        return super().call_module(m, forward, args, kwargs)


def _symbolic_trace(model: nn.Module) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace`` with ``PlainTracer``."""
    tracer = PlainTracer()
    graph = tracer.trace(model)
    name = model.__class__.__name__ if isinstance(model, nn.Module) else model.__name__
    return torch.fx.GraphModule(tracer.root, graph, name)


def _propagate(gm: torch.fx.GraphModule, dummy: torch.Tensor) -> None:
    """The shape of every tensor of the graph (``node.meta["tensor_meta"]``), from fake tensors (no
    arithmetic: a ViT-B/16 takes a second, not five); by running the graph when fake tensors fail."""
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with torch.no_grad():
            FakeTensorProp(gm, mode).propagate(mode.from_tensor(dummy))
    except Exception:  # an operation without a fake kernel: run it for real
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints what it raises
            ShapeProp(gm).propagate(dummy)
        return

    def meta(v):
        if isinstance(v, torch.Tensor):
            return _extract_tensor_metadata(v)
        if isinstance(v, (tuple, list)):
            return tuple(meta(x) for x in v)
        return None

    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["tensor_meta"] = meta(node.meta["val"])


def _first_tensor(out):
    """The output of a model that returns a tuple or a dict (Hugging Face models): its first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    for x in items:
        if isinstance(x, torch.Tensor):
            return x
    return out


def _eval_forward(model: nn.Module):
    """``forward(theta, x)``: ``model`` evaluated in eval mode on parameters and buffers ``theta``
    (:func:`_first_tensor` of its output); the model's train/eval flags are restored after each call."""

    def forward(theta, x):
        modes = [(m, m.training) for m in model.modules()]
        model.eval()
        try:
            # tie_weights=False: a tied parameter (an embedding reused as the classifier) is read under
            # each of its names, whose values theta keeps equal
            return _first_tensor(torch.func.functional_call(model, theta, (x,), tie_weights=False))
        finally:
            for m, t in modes:
                m.train(t)

    return forward


# ------------------------------------------------------------------------------------------ assembly
def assemble(records: Records, model: nn.Module) -> Spec:
    """The :class:`~symlib.symmetry.spec.Spec` of ``model`` from what the walk of its graph recorded: the
    actions on the final labels, in the order of the labels' layers, with blocks, continuous groups and
    the aliases of tied parameters (module docstring)."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names: dict[int, list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        names.setdefault(id(v), []).append(k)
    groups = [group for group in names.values() if len(group) > 1]
    twins = {k: [x for x in group if x != k] for group in groups for k in group}
    actions = _with_twins(_tied(_actions(records)), twins)
    weights = records.weights | {t for w in records.weights for t in twins.get(w, ())}
    perm_uf, scale_uf = records.perm_uf, records.scale_uf
    used_p = {a.perm for a in actions} - {None}
    used_s = {a.scale for a in actions} - {None}
    perms = {r: perm_uf.size[r] for r in sorted(used_p, key=perm_uf.position)}
    scales = {r: scale_uf.size[r] for r in sorted(used_s, key=scale_uf.position)}
    producers = [p for p in records.output_producers if p is not None]
    bias = f"{producers[-1]}.bias" if producers else None
    return Spec(
        shapes=shapes, perms=perms, scales=scales, actions=tuple(actions), weights=frozenset(weights),
        output_bias=bias if bias in shapes else None, no_scaling=dict(records.no_scaling),
        blocks=_blocks(records, perms), continuous=_continuous(records, perms, actions, shapes, weights),
        aliases={x: group[0] for group in groups for x in group[1:] if x in shapes},
        norms={k: v for k, v in records.norms.items() if k in shapes},
    )


def _pieces(uf: UnionFind, label: str) -> list[tuple[str | None, bool, int, int]]:
    """``(root or None when fixed, parity, offset, size)`` of the parts of ``label``'s class."""
    out, pos = [], 0
    for root, odd, n in uf.leaves(label):
        out.append((None if root == FIXED else root, odd, pos, n))
        pos += n
    return out


def _actions(records: Records) -> list[Action]:
    """The recorded actions on the final labels: each label replaced by the parts it was cut into, the
    power of a permutation on the far side of a bilinear form negated (attention keys)."""
    actions, seen = [], set()

    def add(a: Action) -> None:
        if (a.perm is not None or a.scale is not None) and a not in seen:
            seen.add(a)
            actions.append(a)

    for r in records.actions:
        ps, ss = _pieces(records.perm_uf, r.perm), _pieces(records.scale_uf, r.scale)
        if r.groups != 1 and (len(ps) > 1 or len(ss) > 1):
            raise SymmetryError(f"the grouped weight {r.param!r} reads a label that was cut into parts")
        if len(ss) == 1 and ss[0][0] is None:
            ss = [(None, False, o, n) for _, _, o, n in ps]
        if len(ps) == 1 and ps[0][0] is None:
            ps = [(None, False, o, n) for _, _, o, n in ss]
        aligned = [(o, n) for _, _, o, n in ps] == [(o, n) for _, _, o, n in ss]
        for i, (pr, odd, o, _) in enumerate(ps):
            sr = ss[i][0] if aligned else None
            at = {"start": r.start + o * r.inner}
            if odd and sr is not None:  # a flipped permutation cannot share the action of a scale
                add(dataclasses.replace(r, perm=None, scale=sr, **at))
                sr = None
            add(dataclasses.replace(r, perm=pr, scale=sr, power=-r.power if odd else r.power, **at))
        if not aligned:
            for sr, _, o, _ in ss:
                add(dataclasses.replace(r, perm=None, scale=sr, start=r.start + o * r.inner))
    return actions


def _tied(actions: list[Action]) -> list[Action]:
    """A parameter read twice on one axis by one label (an embedding table reused as the classifier, once
    as rows, once as columns) is permuted once, and cannot scale both ways: its scales go."""
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


def _with_twins(actions: list[Action], twins: Mapping[str, list[str]]) -> list[Action]:
    """The same actions on every other name of a tied parameter (a state dict lists a tied embedding and
    classifier under both names; the graph reads one), so both names stay equal."""
    out, acted = list(actions), {a.param for a in actions}
    for a in actions:
        out += [dataclasses.replace(a, param=t) for t in twins.get(a.param, ()) if t not in acted]
    return out


def _continuous(records: Records, perms, actions, shapes, weights) -> dict[str, tuple[str, int]]:
    """Attention labels with their general linear groups, and the dimensions of their redundant biases:
    a key bias only shifts each query's scores by a constant, and a value bias passes through the
    attention (its weights sum to 1) into the output projection's bias."""
    uf = records.perm_uf
    out: dict[str, tuple[str, int]] = {}
    bad = {uf.find(x) for x in uf.conflicts}
    no_shift = {uf.find(x) for x in records.no_bias_shift}
    for label, kind in records.kinds.items():
        leaves = uf.leaves(label)
        if len(leaves) != 1 or leaves[0][0] not in perms or leaves[0][0] in bad:
            continue
        root = leaves[0][0]
        mine = [a for a in actions if a.perm == root]
        biases = [a for a in mine if a.param not in weights and len(shapes[a.param]) == 1]
        extra = 0
        if root not in no_shift and kind == "qk" and any(a.power < 0 for a in biases):
            extra = perms[root]
        if root not in no_shift and kind == "vo" and any(a.power > 0 for a in biases):
            outs = [a.param for a in mine if a.param in weights and a.power < 0]
            if outs and all(f"{p.rsplit('.', 1)[0]}.bias" in shapes for p in outs):
                extra = perms[root]
        out[root] = (kind, extra)
    return {k: out[k] for k in perms if k in out}


def _blocks(records: Records, perms) -> dict[str, tuple[int, str | None]]:
    """The permutation labels with blocks (groups of a convolution, heads), and the tie of each: labels
    tied together move their blocks alike; a tie with the fixed class keeps them in place (``None``)."""
    pf = records.perm_uf.find
    groups: dict[str, int] = {}
    tie = UnionFind()
    for p_in, p_out, g in records.grouped:
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
