r"""The members of ``torch-uncertainty``'s ensembles as a stacked set (book: "symlib on your own network").

* A deep ensemble (``torch_uncertainty.models.deep_ensembles``) keeps its members as ``core_models``:
  :func:`members` stacks their ``state_dict`` s (the same names and shapes, checked).
* A packed ensemble (Laurent et al., 2023: ``PackedLinear`` and ``PackedConv{1,2,3}d`` layers, each a
  grouped layer holding the :math:`M` members side by side) is *unpacked*: member :math:`m` of every
  packed layer is its :math:`m`-th group (its :math:`m`-th block of output channels; the first layer's
  groups all read the whole input), of every BatchNorm its :math:`m`-th block of channels. The unpacked
  member is a copy of the network with plain layers of the member's width (:func:`member`), and
  :func:`members` checks, on random inputs of ``input_shape``, that member :math:`m` computes exactly the
  packed network's :math:`m`-th output (in float64). A network that is not a stack of such layers (a
  ``PackedLinear`` whose members are themselves grouped, ``gamma > 1``; attention or layer norms; a
  ``forward`` that mixes the members) cannot be unpacked exactly and is refused with the reason.

::

    theta = symlib.ckpt.from_torch_uncertainty.members(ensemble, input_shape=(1, 28, 28))
    spec = symlib.spec_of(symlib.ckpt.from_torch_uncertainty.member(ensemble), (1, 28, 28))
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from symlib.ckpt.errors import CheckpointError
from symlib.params import Params

__all__ = ["is_packed", "member", "members"]

_PACKED_CONV = ("PackedConv1d", "PackedConv2d", "PackedConv3d")
_CONV = {"PackedConv1d": nn.Conv1d, "PackedConv2d": nn.Conv2d, "PackedConv3d": nn.Conv3d}


def _kind(m: nn.Module) -> str:
    return type(m).__name__


def is_packed(model: nn.Module) -> bool:
    """Whether ``model`` holds packed layers (``PackedLinear``, ``PackedConv*d``)."""
    return any(_kind(m) in ("PackedLinear", *_PACKED_CONV) for m in model.modules())


def _estimators(model: nn.Module) -> int:
    ms = {m.num_estimators for m in model.modules() if _kind(m) in ("PackedLinear", *_PACKED_CONV)}
    if len(ms) != 1:
        raise CheckpointError(f"the packed layers disagree on the number of estimators ({sorted(ms)})")
    return ms.pop()


def _refuse(why: str) -> CheckpointError:
    return CheckpointError(f"this packed ensemble cannot be unpacked exactly: {why}; compare its outputs, or "
                           f"train a deep ensemble of the member architecture")


def _plain(layer: nn.Module, n: int) -> tuple[nn.Module, dict[str, Any]]:
    """The member layer of a packed layer and how to slice its tensors: ``{"out": rows per member}`` and,
    for a packed linear layer, ``"group"`` (its weight is ``(groups, out, in)``)."""
    kind = _kind(layer)
    if kind == "PackedLinear":
        if layer.implementation == "sparse":
            raise _refuse("PackedLinear with implementation='sparse'")
        groups, out_g, in_g = layer.weight.shape
        bias = layer.bias is not None
        if layer.first:
            if groups != 1 or out_g % n:
                raise _refuse(f"a first PackedLinear of {groups} groups and {out_g} outputs")
            return nn.Linear(in_g, out_g // n, bias=bias), {"out": out_g // n, "first": True}
        if groups != n:
            raise _refuse(f"a PackedLinear of {groups} groups for {n} estimators (gamma > 1: each member "
                          f"would be a block-diagonal linear layer)")
        return nn.Linear(in_g, out_g, bias=bias), {"out": out_g, "first": False}
    conv = layer.conv
    g = conv.groups
    first = getattr(layer, "first", False) or g == 1
    if (first and g != 1) or (not first and g % n) or conv.out_channels % n:
        raise _refuse(f"{kind} with {g} groups and {conv.out_channels} outputs for {n} estimators")
    in_m = conv.in_channels if first else conv.in_channels // n
    plain = _CONV[kind](in_m, conv.out_channels // n, conv.kernel_size, stride=conv.stride,
                        padding=conv.padding, dilation=conv.dilation, groups=1 if first else g // n,
                        bias=conv.bias is not None, padding_mode=conv.padding_mode)
    return plain, {"out": conv.out_channels // n, "first": first}


def _member_module(model: nn.Module, n: int) -> tuple[nn.Module, dict[str, tuple[str, dict[str, Any]]]]:
    """A copy of ``model`` with plain layers of one member's width, and for each replaced or sliced module
    path its kind and slicing."""
    twin = copy.deepcopy(model).cpu()
    plan: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, mod in list(twin.named_modules()):
        kind = _kind(mod)
        if kind in ("PackedLinear", *_PACKED_CONV):
            plain, how = _plain(mod, n)
            plan[name] = (kind, how)
        elif isinstance(mod, nn.modules.batchnorm._BatchNorm):
            if mod.num_features % n:
                raise _refuse(f"BatchNorm {name!r} of {mod.num_features} channels for {n} estimators")
            plain = type(mod)(mod.num_features // n, eps=mod.eps, momentum=mod.momentum, affine=mod.affine,
                              track_running_stats=mod.track_running_stats)
            plan[name] = ("batchnorm", {"out": mod.num_features // n})
        else:
            own = [k for k, _ in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]]
            inside = any(name.startswith(p + ".") or p == "" for p in plan if p != name)
            if own and not inside:
                raise _refuse(f"module {name!r} ({kind}) holds tensors {own} that are not a packed layer or "
                              f"a BatchNorm")
            continue
        parent, _, attr = name.rpartition(".")
        setattr(twin.get_submodule(parent) if parent else twin, attr, plain)
    return twin, plan


def _member_state(model: nn.Module, plan: dict, m: int) -> dict[str, torch.Tensor]:
    """Member ``m``'s tensors under the member module's names."""
    out = {}
    mods = dict(model.named_modules())
    for name, (kind, how) in plan.items():
        mod, pre = mods[name], f"{name}." if name else ""
        rows = slice(m * how["out"], (m + 1) * how["out"])
        if kind == "PackedLinear":
            w = mod.weight.detach()
            out[pre + "weight"] = w[0][rows] if how["first"] else w[m]
            if mod.bias is not None:
                out[pre + "bias"] = mod.bias.detach()[rows]
        elif kind in _PACKED_CONV:
            out[pre + "weight"] = mod.conv.weight.detach()[rows]
            if mod.conv.bias is not None:
                out[pre + "bias"] = mod.conv.bias.detach()[rows]
        else:
            for k, v in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]:
                out[pre + k] = v.detach() if v.ndim == 0 else v.detach()[rows]
    return out


def member(ensemble: nn.Module) -> nn.Module:
    """One member's architecture (with member 0's weights): a deep ensemble's first core model, or a
    packed ensemble's unpacked member (module docstring). Its spec is the set's
    (:func:`symlib.spec_of`)."""
    if hasattr(ensemble, "core_models"):
        return copy.deepcopy(ensemble.core_models[0])
    if not is_packed(ensemble):
        raise CheckpointError(f"{type(ensemble).__name__} is neither a deep ensemble (core_models) nor a "
                              f"packed ensemble (Packed* layers)")
    n = _estimators(ensemble)
    twin, plan = _member_module(ensemble, n)
    state = twin.state_dict()
    state.update(_member_state(ensemble, plan, 0))
    twin.load_state_dict(state)
    return twin.eval()


def _check(ensemble: nn.Module, n: int, params: Params, input_shape, twin: nn.Module) -> None:
    x = torch.randn(3, *input_shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    packed = copy.deepcopy(ensemble).cpu().double().eval()
    twin = twin.double().eval()
    try:
        with torch.no_grad():
            want = packed(x)
            if want.shape[0] != n * x.shape[0]:
                raise _refuse(f"its output has {want.shape[0]} rows for {x.shape[0]} inputs, not "
                              f"{n} x {x.shape[0]} (one block per member)")
            for m in range(n):
                twin.load_state_dict({k: v[m].double() if v.is_floating_point() else v[m]
                                      for k, v in params.items()})
                got = twin(x)
                ref = want[m * x.shape[0]:(m + 1) * x.shape[0]]
                err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
                if got.shape != ref.shape or err > 1e-9:
                    raise _refuse(f"member {m} does not reproduce the packed network's output {m} (relative "
                                  f"difference {err:.1e}): its forward mixes the members")
    except CheckpointError:
        raise
    except Exception as e:  # the unpacked member's forward failed
        raise _refuse(f"the unpacked member cannot run the network's forward ({type(e).__name__}: {e})") \
            from None


def members(ensemble: nn.Module, input_shape=None) -> Params:
    """The members of a ``torch-uncertainty`` ensemble as ``{name: (M, ...)}`` (module docstring).

    Args:
        ensemble: a deep ensemble (``core_models``) or a packed ensemble.
        input_shape: one input's shape, to check a packed ensemble's unpacking (required for one).

    Raises:
        CheckpointError: members of different architectures, or a packed ensemble that cannot be unpacked
            exactly (the reason named).
    """
    if hasattr(ensemble, "core_models"):
        states = [{k: v.detach().cpu() for k, v in mdl.state_dict().items()} for mdl in ensemble.core_models]
        first = states[0]
        for i, st in enumerate(states[1:], 1):
            diff = sorted(set(st) ^ set(first)) or [k for k in first if st[k].shape != first[k].shape]
            if diff:
                raise CheckpointError(f"deep ensemble member {i} differs from member 0 at tensor "
                                      f"{diff[0]!r}: the members are not of one architecture")
        return {k: torch.stack([st[k] for st in states]) for k in first}
    if not is_packed(ensemble):
        raise CheckpointError(f"{type(ensemble).__name__} is neither a deep ensemble (core_models) nor a "
                              f"packed ensemble (Packed* layers)")
    if input_shape is None:
        raise CheckpointError("pass input_shape= to unpack a packed ensemble: each member is checked against "
                              "the packed network's outputs on random inputs")
    n = _estimators(ensemble)
    twin, plan = _member_module(ensemble, n)
    base = {k: v.detach() for k, v in twin.state_dict().items()}
    states = []
    for m in range(n):
        st = dict(base)
        st.update(_member_state(ensemble, plan, m))
        states.append(st)
    params = {k: torch.stack([st[k].cpu() for st in states]) for k in base}
    _check(ensemble, n, params, tuple(input_shape), twin)
    return params
