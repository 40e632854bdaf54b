r"""Derive a :class:`~symlib.symmetry.spec.Spec` from a model by tracing it (book: chapter "Symmetries of real
architectures"; paper App. D.4; the architectures supported: page "Architectures").

:func:`spec_of` traces ``model`` with ``torch.fx`` (in eval mode), propagates shapes on one dummy input,
and walks the graph once. Every channel (feature) axis produced by a ``Linear`` or a convolution gets a
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

The network's input and every tensor that reaches the output are fixed: their labels merge into one
"fixed" class (:data:`FIXED`) that no symmetry acts on. Anything else (attention, matrix products,
splitting labelled channels, a parameter used outside a layer, an unknown module or function on a
labelled tensor) raises :class:`~symlib.symmetry.spec.SymmetryError` naming the node.

Layout: :mod:`~symlib.symmetry.trace.labels` (segments, union-find), :mod:`~symlib.symmetry.trace.rules`
(which operation does what), :mod:`~symlib.symmetry.trace.layers` (layers with parameters),
:mod:`~symlib.symmetry.trace.tensors` (shapes and arithmetic), :mod:`~symlib.symmetry.trace.walker`
(the walk and the spec it yields).
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from symlib.symmetry.spec import Spec, SymmetryError, with_scalings
from symlib.symmetry.trace.labels import FIXED

__all__ = ["FIXED", "spec_of"]


def spec_of(model: nn.Module, input_shape, device=None, dtype=None, scalings: str = "auto") -> Spec:
    """The symmetries of ``model``, derived by tracing it with ``torch.fx`` (module docstring).

    Args:
        model: a PyTorch module whose ``forward`` ``torch.fx`` can trace (no
            data-dependent control flow). It is traced in eval mode and not
            modified (its train/eval flags are restored).
        input_shape: shape of one input sample, without the batch dimension,
            e.g. ``(1, 28, 28)``.
        device, dtype: of the dummy input used to propagate shapes (default:
            those of the model's first parameter).
        scalings: ``"auto"`` (default): every scaling symmetry the layers allow;
            when some activation is not positively homogeneous (tanh, SiLU,
            ReLU6, ...) the spec lists it in ``Spec.no_scaling`` and scaling
            operations refuse it, with a message saying what to do.
            ``"partial"``: the same labels, and scaling operations act on the
            layers where scalings hold. ``"none"``: permutations only (valid for
            every element-wise activation).

    Returns:
        The spec, with ``forward`` (evaluating the model functionally, in eval
        mode) and ``input_shape`` set. Labels are named after the layer that
        opens them: a convolution ``"layer1.0.conv1"`` opens a permutation and
        a scale of that name, a BatchNorm ``"bn1"`` a scale; merged labels keep
        the name of their first layer.

    Raises:
        SymmetryError: naming the node or layer whose symmetries are unknown.
    """
    from symlib.symmetry.trace.walker import Walker

    if not isinstance(model, nn.Module):
        raise SymmetryError(f"spec_of takes an nn.Module, got {type(model).__name__}")
    if scalings not in ("auto", "partial", "none"):
        raise ValueError(f"scalings must be 'auto', 'partial' or 'none', got {scalings!r}")
    input_shape = tuple(int(d) for d in input_shape)
    ref = next(iter(model.parameters()), None)
    dtype = dtype or (ref.dtype if ref is not None else torch.float32)
    device = device or (ref.device if ref is not None else None)
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()  # the spec is of the eval-mode function (``if self.training`` branches traced so)
        try:
            gm = torch.fx.symbolic_trace(model)
        except Exception as err:  # torch.fx raises many kinds of errors
            raise SymmetryError(
                f"torch.fx could not trace {type(model).__name__}: {err}. Remove data-dependent control "
                "flow from forward, or write the Spec by hand"
            ) from err
        try:
            with torch.no_grad():
                ShapeProp(gm).propagate(torch.zeros(2, *input_shape, dtype=dtype, device=device))
        except Exception as err:
            raise SymmetryError(
                f"{type(model).__name__} fails on an input of shape (batch, *{input_shape}): {err}"
            ) from err
    finally:
        for m, t in modes.items():
            m.train(t)
    walker = Walker(model, gm)
    walker.walk()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    spec = with_scalings(walker.spec(shapes), scalings)
    return spec.with_forward(_eval_forward(model), input_shape)


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
