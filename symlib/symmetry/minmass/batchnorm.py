r"""Folding eval-mode BatchNorm into the layer before it, so that min-mass is well posed on BatchNorm
networks (book: chapter "Min-mass"). See :mod:`symlib.symmetry.minmass`."""

from __future__ import annotations

import copy
import dataclasses

import torch

from symlib.symmetry import check as _check
from symlib.symmetry.spec import Params, Spec, SymmetryError

_CONV = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)
_BN = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


@dataclasses.dataclass(frozen=True)
class Folded:
    """Output of :func:`fold_batchnorm`: parameters and model without BatchNorm, and what was folded.

    Attributes:
        theta: the folded parameters (stacked like the input).
        model: the folded module (BatchNorms replaced by identities, folded layers given biases).
        pairs: the ``(layer, BatchNorm)`` module names folded together.
        error: the relative output change measured by the functional check, or ``None``.
        spec: the symmetries of ``model`` (:func:`symlib.symmetry.trace.spec_of`) when ``input_shape``
            was given, else ``None``: ``symlib.minmass(folded.theta, folded.spec)`` is well posed.
    """

    theta: Params
    model: torch.nn.Module
    pairs: tuple[tuple[str, str], ...]
    error: float | None
    spec: Spec | None = None


def _bn_pairs(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(conv, bn) module names where the BN's only input is the conv and the conv feeds only the BN."""
    gm = torch.fx.symbolic_trace(model)
    mods = dict(model.named_modules())
    pairs = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(mods.get(node.target), _BN):
            src = node.args[0]
            if (
                isinstance(src, torch.fx.Node)
                and src.op == "call_module"
                and isinstance(mods.get(src.target), _CONV)
                and len(src.users) == 1
            ):
                pairs.append((src.target, node.target))
            else:
                raise SymmetryError(
                    f"BatchNorm {node.target!r} does not directly follow a conv/linear layer used only by "
                    "it; min-mass cannot fold it (see the chapter 'Min-mass' on BatchNorm)"
                )
    return pairs


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def fold_batchnorm(
    theta: Params, model: torch.nn.Module, input_shape: tuple[int, ...] | None = None, check: bool = True
) -> Folded:
    r"""Fold every eval-mode BatchNorm into the convolution (or linear layer) before it.

    .. math:: W' = \mathrm{diag}\Big(\frac{\gamma}{\sqrt{\sigma^2 + \epsilon}}\Big) W, \qquad
              b' = \frac{\gamma\,(b - \mu)}{\sqrt{\sigma^2 + \epsilon}} + \beta .

    The folded network computes exactly the eval-mode function of the original
    (up to rounding) and has no BatchNorm, so its min-mass problem is well posed
    (a conv followed by BatchNorm is invariant to the conv's output scale, which
    would let the mass shrink without bound). Masses reported for BatchNorm
    networks are those of the folded network.

    Args:
        theta: the model's ``state_dict``-like parameters (buffers included),
            optionally stacked along leading batch dimensions.
        model: the module ``theta`` belongs to (traced with ``torch.fx``).
        input_shape: shape of one input, for the functional check.
        check: compare outputs of the original and folded networks on random
            inputs (needs ``input_shape``).

    Returns:
        A :class:`Folded` with the new parameters, a new model (BatchNorms
        replaced by identities, folded layers given biases), the folded pairs,
        the functional error (``None`` without a check) and, when ``input_shape``
        is given, the folded model's spec. The new parameters and
        model keep the device and dtype of ``theta`` (a CUDA float32 network
        folds into a CUDA float32 network).

    Example (book: chapter "symlib on your own network")::

        folded = symlib.fold_batchnorm(theta, model, (1, 28, 28))
        light = symlib.minmass(folded.theta, folded.spec)
    """
    pairs = _bn_pairs(model)
    new_model = copy.deepcopy(model).eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    first = next(iter(shapes))
    nb = theta[first].ndim - len(shapes[first])
    out = dict(theta)
    for conv_name, bn_name in pairs:
        conv = model.get_submodule(conv_name)
        bn = model.get_submodule(bn_name)
        w = theta[f"{conv_name}.weight"]
        dt = w.dtype
        if bn.running_var is None:
            raise SymmetryError(f"BatchNorm {bn_name!r} tracks no running statistics; it cannot be folded")
        var = theta[f"{bn_name}.running_var"].to(torch.float64)
        mean = theta[f"{bn_name}.running_mean"].to(torch.float64)
        gamma = theta[f"{bn_name}.weight"].to(torch.float64) if bn.affine else torch.ones_like(var)
        beta = theta[f"{bn_name}.bias"].to(torch.float64) if bn.affine else torch.zeros_like(var)
        k = gamma / torch.sqrt(var + bn.eps)
        bias = theta.get(f"{conv_name}.bias")
        bias = bias.to(torch.float64) if bias is not None else torch.zeros_like(mean)
        wk = w.to(torch.float64) * k.reshape(*k.shape, *([1] * (w.ndim - nb - 1)))
        out[f"{conv_name}.weight"] = wk.to(dt)
        out[f"{conv_name}.bias"] = (k * (bias - mean) + beta).to(dt)
        for key in list(out):
            if key.startswith(bn_name + "."):
                del out[key]
        if conv.bias is None:
            where = {"device": conv.weight.device, "dtype": conv.weight.dtype}
            if isinstance(conv, torch.nn.Linear):
                nc = torch.nn.Linear(conv.in_features, conv.out_features, bias=True, **where)
            else:
                nc = type(conv)(
                    conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                    padding=conv.padding, dilation=conv.dilation, groups=conv.groups, bias=True,
                    padding_mode=conv.padding_mode, **where,
                )
            _set_module(new_model, conv_name, nc)
        _set_module(new_model, bn_name, torch.nn.Identity())
    # the folded model lives where (and in the precision) its parameters do
    like = next(v for v in theta.values() if v.is_floating_point())
    new_model = new_model.to(device=like.device, dtype=like.dtype).eval()
    err = None
    if check and pairs:
        if input_shape is None:
            raise ValueError("fold_batchnorm(check=True) needs input_shape, the shape of one input sample")
        err = _compare(model, theta, new_model, out, input_shape, nb)
        tol = _check.default_tol(next(iter(theta.values())).dtype)
        if not err <= tol:
            raise _check.FunctionalMismatch(
                f"folding BatchNorm changed the function: error {err:.3g} > {tol:g}"
            )
    spec = None
    if input_shape is not None:
        from symlib.symmetry.trace import spec_of

        spec = spec_of(new_model, input_shape)
    return Folded(out, new_model, tuple(pairs), err, spec)


def _compare(m1, t1, m2, t2, input_shape, nb) -> float:
    dtype = next(iter(t1.values())).dtype
    device = next(iter(t1.values())).device
    x = torch.randn(8, *input_shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.to(dtype=dtype, device=device)
    m1 = copy.deepcopy(m1).eval().to(device=device, dtype=dtype)

    def f(model, theta):
        if nb == 0:
            return torch.func.functional_call(model, theta, (x,))
        flat = {k: v.reshape(-1, *v.shape[nb:]) for k, v in theta.items()}
        return torch.func.vmap(lambda p: torch.func.functional_call(model, p, (x,)))(flat)

    with torch.no_grad():
        ya, yb = f(m1, t1), f(m2, t2)
    return float((ya - yb).abs().max() / ya.abs().max().clamp_min(1.0))
