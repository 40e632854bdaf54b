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
attention); :mod:`~symlib.symmetry.trace.inputs` says what the dummy input must be,
:mod:`~symlib.symmetry.trace.plain` traces through PyTorch's own transformer layers,
:mod:`~symlib.symmetry.trace.build` builds the :class:`~symlib.symmetry.spec.Spec` from the walk's
records, and :mod:`~symlib.symmetry.trace.biases` finds the redundant bias directions. Here:
:func:`spec_of` (trace, propagate shapes, walk, build).
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
from symlib.symmetry.spec import Spec, SymmetryError, with_scalings
from symlib.symmetry.trace import inputs, plain
from symlib.symmetry.trace.build import assemble
from symlib.symmetry.trace.labels import FIXED

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
    from symlib.symmetry.trace import biases, rules
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
    spec = dataclasses.replace(spec, shifts=_valid_shifts(spec, biases.find(gm, model)))
    _warn_if_small(records, spec, model)
    if vocab is not None:
        inputs.check_vocab(gm, int(vocab))
        spec = dataclasses.replace(spec, vocab=int(vocab))
    return spec.with_forward(_eval_forward(model), input_shape)


def _valid_shifts(spec: Spec, found: tuple) -> tuple:
    """The bias directions found (``trace.biases``) that the spec accepts, each checked on its own: one
    the graph pass got wrong is left out (the spec is then smaller than the group, never wrong) instead of
    failing the whole trace."""
    keep = []
    for shift in found:
        try:
            dataclasses.replace(spec, shifts=(shift,))
        except SymmetryError:
            continue
        keep.append(shift)
    return tuple(keep)


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
        return plain.symbolic_trace(model)  # torch.fx, through PyTorch's own transformer layers
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
