r"""The symmetry group acting on weights (book: chapter "A gentle example", paper §3.3-3.4).

A group element :class:`Element` holds one permutation per permutation label
and one positive vector per scaling label of a :class:`~symlib.symmetry.spec.Spec`. It
acts by scaling first, then permuting:

.. math:: T_{(P,\lambda)}(\theta) = P\big(\lambda \cdot \theta\big).

Every function is pure: it returns new tensors and never mutates its inputs.
Elements and parameters may carry matching leading batch dimensions, so one
call transforms a whole stack of networks.

Grouped convolutions (paper App. D.4.2): a weight ``W`` of shape
``(C_out, C_in/G, k, k)`` stands for the block-diagonal dense weight
``D[o, g*C_in/G + j] = W[o, j]`` for ``g`` the group of output ``o``
(:func:`dense_weight`). A permutation ``pi`` of the ``C_in`` input channels and
``rho`` of the outputs act as ``D' = D[rho][:, pi]``; this stays block-diagonal
only when both move whole groups the same way (``Spec.blocks``), and then
``W'[o, j] = W[rho[o], pi[g*C_in/G + j] mod C_in/G]``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch

from symlib.symmetry.spec import Params, Spec, SymmetryError


@dataclasses.dataclass(frozen=True)
class Element:
    """A group element: ``perms[label]`` index tensors ``(*batch, n)`` and ``scales[label]``
    positive tensors ``(*batch, n)``. A missing label means the identity on it."""

    perms: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    scales: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def _along(v: torch.Tensor, axis: int, ndim_param: int, target: torch.Tensor) -> torch.Tensor:
    """Reshape a ``(*batch, n)`` vector so it broadcasts along ``axis`` of ``target``."""
    batch = v.shape[:-1]
    n = v.shape[-1]
    shape = tuple(batch) + (1,) * axis + (n,) + (1,) * (ndim_param - axis - 1)
    return v.reshape(shape)


def block_perm(p: torch.Tensor, groups: int) -> torch.Tensor | None:
    """The permutation of blocks ``sigma`` (``(*batch, G)``) that ``p`` induces, or ``None``
    when ``p`` does not map every block of ``n / G`` consecutive entries onto one block."""
    n = p.shape[-1]
    k = n // groups
    blk = torch.div(p.reshape(*p.shape[:-1], groups, k), k, rounding_mode="floor")
    sigma = blk[..., 0]
    if not bool((blk == sigma[..., None]).all()):
        return None
    return sigma


def _check_blocks(perms: dict[str, torch.Tensor], spec: Spec) -> None:
    """Permutations of grouped labels keep the blocks and share one block permutation per tie."""
    for tie, labels in spec.tie_classes().items():
        seen = None
        for label in labels:
            groups = spec.blocks[label][0]
            if label in perms:
                sigma = block_perm(perms[label], groups)
                if sigma is None:
                    raise SymmetryError(
                        f"permutation {label!r} mixes the {groups} channel groups of a grouped "
                        "convolution; valid permutations permute within groups and move whole groups "
                        "(draw them with ops.random_element)"
                    )
            else:
                sigma = torch.arange(groups)
            sigma = sigma.cpu()
            if tie is None:  # untied blocks stay in place, each label on its own (their counts may differ)
                if not bool((sigma == torch.arange(groups)).all()):
                    raise SymmetryError(
                        f"permutation {label!r} moves whole groups, but its groups reach the network's "
                        "output: only permutations within groups are symmetries"
                    )
                continue
            if seen is not None and not bool((seen == sigma).all()):
                raise SymmetryError(
                    f"labels {labels} must move their groups together (a grouped convolution ties "
                    f"its input and output groups), but {label!r} moves them differently; pass all "
                    "of them in one element"
                )
            seen = sigma


def _check_element(g: Element, spec: Spec) -> None:
    for label, p in g.perms.items():
        if label not in spec.perms:
            raise SymmetryError(f"unknown permutation label {label!r}; the spec has {list(spec.perms)}")
        if p.shape[-1] != spec.perms[label]:
            raise SymmetryError(f"permutation {label!r} has size {p.shape[-1]}, expected {spec.perms[label]}")
    if spec.blocks and g.perms:
        _check_blocks(g.perms, spec)
    for label, s in g.scales.items():
        if label not in spec.scales:
            if spec.no_scaling:
                spec.require_scaling()
            raise SymmetryError(f"unknown scaling label {label!r}; the spec has {list(spec.scales)}")
        if s.shape[-1] != spec.scales[label]:
            raise SymmetryError(f"scaling {label!r} has size {s.shape[-1]}, expected {spec.scales[label]}")
        if not bool((s > 0).all()):
            raise SymmetryError(f"scaling {label!r} has non-positive entries: scalings must be > 0")


def _acting(spec: Spec, labels: Mapping[str, torch.Tensor], kind: str):
    """The actions of the ``kind`` labels in ``labels``, in the order of ``spec.actions`` (the order in
    which they are applied): one label's from the spec's index (canonical forms and min-mass act one label
    at a time), several by a scan of every action."""
    if len(labels) == 1:
        return spec.of_label(next(iter(labels)), kind)
    return [a for a in spec.actions if getattr(a, kind) in labels]


def _grouped(v: torch.Tensor, a, spec: Spec) -> torch.Tensor:
    """Spread a ``(*batch, C_in)`` vector over the ``(C_out, C_in/G)`` axes of a grouped weight:
    entry ``[o, j]`` is ``v[g(o) * C_in/G + j]``, shaped to broadcast against the weight."""
    shape = spec.shapes[a.param]
    c_out, k = shape[0], shape[1]
    rows = torch.arange(c_out, device=v.device) // (c_out // a.groups)
    blocks = v.reshape(*v.shape[:-1], a.groups, k)
    per_row = blocks[..., rows, :]
    return per_row.reshape(*per_row.shape, *(1,) * (len(shape) - 2))


def _on_slice(t: torch.Tensor, a, spec: Spec, fn) -> torch.Tensor:
    """``t`` with ``fn`` applied to the slice of the axis that action ``a`` acts on (``Action.start``)."""
    d = t.ndim - len(spec.shapes[a.param]) + a.axis
    start, stop = spec.span(a)
    if start == 0 and stop == t.shape[d]:
        return fn(t)
    rest = t.shape[d] - stop
    parts = (t.narrow(d, 0, start), fn(t.narrow(d, start, stop - start)), t.narrow(d, stop, rest))
    return torch.cat(parts, d)


def _entries(v: torch.Tensor, a) -> torch.Tensor:
    """A per-label ``(*batch, n)`` vector spread over the ``n * inner`` entries of the action's slice."""
    return v.repeat_interleave(a.inner, dim=-1) if a.inner != 1 else v


def scale(theta: Params, spec: Spec, scales: dict[str, torch.Tensor]) -> Params:
    r"""Apply positive scalings: ``theta[param] <- lam ** power * (theta + offset) - offset``
    along each action's axis (``offset`` is 0 except for BatchNorm running variances)."""
    _check_element(Element(scales=scales), spec)
    out = dict(theta)
    merged: dict[tuple[str, int], list] = {}  # plain multiplications, one factor vector per axis
    for a in _acting(spec, scales, "scale"):
        if a.power == 0:
            continue
        if a.groups == 1 and not a.offset:
            merged.setdefault((a.param, a.axis), []).append(a)
            continue
        t = out[a.param]
        lam = scales[a.scale].to(t.dtype)
        if a.groups != 1:
            factor = _grouped(lam, a, spec) ** a.power
        else:
            factor = _along(_entries(lam, a), a.axis, len(spec.shapes[a.param]), t) ** a.power

        def apply(x, factor=factor, offset=a.offset):
            return (x + offset) * factor - offset if offset else x * factor

        out[a.param] = apply(t) if a.groups != 1 else _on_slice(t, a, spec, apply)
    for (param, axis), acts in merged.items():
        t = out[param]
        nb = t.ndim - len(spec.shapes[param])
        factor = torch.ones(*t.shape[:nb], t.shape[nb + axis], dtype=t.dtype, device=t.device)
        for a in acts:
            start, stop = spec.span(a)
            factor[..., start:stop] = factor[..., start:stop] * _entries(
                scales[a.scale].to(device=t.device, dtype=t.dtype), a) ** a.power
        out[param] = t * _along(factor, axis, len(spec.shapes[param]), t)
    return out


def permute(theta: Params, spec: Spec, perms: dict[str, torch.Tensor]) -> Params:
    r"""Apply permutations: ``theta'[..., i, ...] = theta[..., perm[i], ...]`` on each action's axis.

    Grouped-convolution input axes are permuted after the output axis, as
    ``W'[o, j] = W[rho[o], pi[g(o) * C_in/G + j] mod C_in/G]`` (module docstring).
    """
    _check_element(Element(perms=perms), spec)
    out = dict(theta)
    grouped = []
    merged: dict[tuple[str, int], list] = {}  # one element for every network: one index per axis
    for a in _acting(spec, perms, "perm"):
        if a.groups != 1:
            grouped.append(a)
            continue
        if perms[a.perm].ndim == 1:
            merged.setdefault((a.param, a.axis), []).append(a)
            continue
        t = out[a.param]
        nb = t.ndim - len(spec.shapes[a.param])
        p = perms[a.perm]
        if a.inner != 1:  # label entry i moves the block of entries i*inner ... (i+1)*inner - 1
            p = (p[..., :, None] * a.inner + torch.arange(a.inner, device=p.device)).flatten(-2)
        idx = _along(p, a.axis, len(spec.shapes[a.param]), t)

        def gather(x, idx=idx, d=nb + a.axis):
            return torch.gather(x, d, idx.to(x.device).expand(x.shape))

        out[a.param] = _on_slice(t, a, spec, gather)
    for (param, axis), acts in merged.items():
        t = out[param]
        d = t.ndim - len(spec.shapes[param]) + axis
        idx = torch.arange(t.shape[d], device=t.device)
        for a in acts:
            p = perms[a.perm].to(t.device)
            if a.inner != 1:  # label entry i moves the block of entries i*inner ... (i+1)*inner - 1
                p = (p[:, None] * a.inner + torch.arange(a.inner, device=t.device)).flatten()
            start, stop = spec.span(a)
            idx[start:stop] = p + start
        out[param] = t.index_select(d, idx)  # a plain index_select (much faster than gather)
    for a in grouped:
        t = out[a.param]
        nb = t.ndim - len(spec.shapes[a.param])
        k = spec.shapes[a.param][1]
        idx = torch.remainder(_grouped(perms[a.perm], a, spec), k)
        out[a.param] = torch.gather(t, nb + 1, idx.expand(t.shape))
    return out


def dense_weight(theta: Params, spec: Spec, param: str) -> torch.Tensor:
    r"""The weight ``param`` as a dense tensor: block-diagonal ``(*batch, C_out, C_in, ...)`` for a
    grouped convolution, the tensor itself otherwise.

    A convolution with ``G`` groups stores ``W`` of shape ``(C_out, C_in/G, k, k)``;
    output channel ``o`` of group ``g = o // (C_out/G)`` reads input channels
    ``g*C_in/G ... (g+1)*C_in/G - 1``. The dense weight is

    .. math:: D[o, g\,C_{in}/G + j] = W[o, j], \qquad D[o, c] = 0 \text{ elsewhere},

    so a grouped convolution equals an ordinary one with weight ``D``. Every
    symmetry of the spec acts on ``D`` as on an ordinary weight (rows and
    columns), e.g. the min-mass objective sums ``D[o, c]**2`` over kernel
    positions exactly as for a dense convolution.

    Args:
        theta: parameters, optionally with leading batch dims.
        spec: the architecture's symmetries (it records the groups).
        param: parameter name, e.g. ``"conv2.weight"``.

    Returns:
        A new tensor (the input tensor itself when ``param`` is not grouped).
    """
    groups = spec.groups_of(param)
    t = theta[param]
    if groups == 1:
        return t
    shape = spec.shapes[param]
    nb = t.ndim - len(shape)
    c_out, k = shape[0], shape[1]
    dense = t.new_zeros(*t.shape[:nb], c_out, groups * k, *shape[2:])
    per = c_out // groups
    for g in range(groups):
        dense[(slice(None),) * nb + (slice(g * per, (g + 1) * per), slice(g * k, (g + 1) * k))] = (
            t[(slice(None),) * nb + (slice(g * per, (g + 1) * per),)]
        )
    return dense


def act(g: Element, theta: Params, spec: Spec) -> Params:
    """Apply the group element ``g`` to ``theta``: scale, then permute."""
    return permute(scale(theta, spec, g.scales), spec, g.perms)


def identity(spec: Spec, batch: tuple[int, ...] = (), dtype=torch.float64, device=None) -> Element:
    """The identity element, with every label present."""
    perms = {k: torch.arange(n, device=device).expand(*batch, n).clone() for k, n in spec.perms.items()}
    scales = {k: torch.ones(*batch, n, dtype=dtype, device=device) for k, n in spec.scales.items()}
    return Element(perms, scales)


def random_element(
    spec: Spec,
    kind: str = "both",
    batch: tuple[int, ...] = (),
    log_range: float = math.log(4.0),
    generator: torch.Generator | None = None,
    dtype=torch.float64,
    device=None,
) -> Element:
    """Draw a random group element.

    Args:
        spec: the architecture's symmetries.
        kind: ``"perm"``, ``"scale"`` or ``"both"``.
        batch: leading batch shape (one element per network of a stack).
        log_range: scales are ``exp(U(-log_range, log_range))``.
        generator: torch random generator, for reproducibility.
        dtype, device: of the scales.

    Returns:
        A uniformly random permutation per permutation label and log-uniform
        scales per scaling label. Grouped labels (``spec.blocks``) get a
        uniform valid permutation: one random block permutation per tie,
        shared by its labels, and independent uniform permutations inside
        the blocks.
    """
    if kind not in ("perm", "scale", "both"):
        raise ValueError(f"kind must be 'perm', 'scale' or 'both', got {kind!r}")
    perms, scales = {}, {}
    if kind in ("perm", "both"):
        sigmas: dict[str, torch.Tensor] = {}
        for k, n in spec.perms.items():
            u = torch.rand(*batch, n, generator=generator, dtype=torch.float64)
            if k not in spec.blocks:
                perms[k] = u.argsort(dim=-1).to(device)
                continue
            groups, tie = spec.blocks[k]
            if tie is None:
                sigma = torch.arange(groups).expand(*batch, groups)
            else:
                if tie not in sigmas:
                    v = torch.rand(*batch, groups, generator=generator, dtype=torch.float64)
                    sigmas[tie] = v.argsort(dim=-1)
                sigma = sigmas[tie]
            inner = u.reshape(*batch, groups, n // groups).argsort(dim=-1)
            perms[k] = (sigma[..., None] * (n // groups) + inner).reshape(*batch, n).to(device)
    if kind in ("scale", "both"):
        spec.require_scaling()
        for k, n in spec.scales.items():
            u = torch.rand(*batch, n, generator=generator, dtype=torch.float64)
            scales[k] = torch.exp((2 * u - 1) * log_range).to(dtype=dtype, device=device)
    return Element(perms, scales)


def invert_perm(p: torch.Tensor) -> torch.Tensor:
    """Inverse of a batch of permutations ``(*batch, n)``."""
    return p.argsort(dim=-1)


def _full(g: Element, spec: Spec, batch, dtype, device) -> Element:
    e = identity(spec, batch, dtype=dtype, device=device)
    return Element({**e.perms, **g.perms}, {**e.scales, **g.scales})


def _ref(g: Element) -> tuple[tuple[int, ...], torch.dtype, torch.device | None]:
    for s in g.scales.values():
        return tuple(s.shape[:-1]), s.dtype, s.device
    for p in g.perms.values():
        return tuple(p.shape[:-1]), torch.float64, p.device
    return (), torch.float64, None


def compose(g2: Element, g1: Element, spec: Spec) -> Element:
    r"""The element ``g2 ∘ g1`` (apply ``g1`` first): ``act(compose(g2, g1), θ) = act(g2, act(g1, θ))``.

    With ``g = (p, λ)`` acting as ``θ'[i] = λ[p[i]] θ[p[i]]`` on an outgoing axis,
    the product is ``p = p1[p2]`` and ``λ = λ2[p1^{-1}] · λ1``.
    """
    batch, dtype, device = max((_ref(g2), _ref(g1)), key=lambda r: len(r[0]))
    g1 = _full(g1, spec, batch, dtype, device)
    g2 = _full(g2, spec, batch, dtype, device)
    perms = {k: torch.gather(g1.perms[k], -1, g2.perms[k]) for k in spec.perms}
    scales = {}
    for k in spec.scales:
        label = spec.perm_of_scale(k)  # None: channels that no permutation moves
        s2 = g2.scales[k] if label is None else torch.gather(g2.scales[k], -1, invert_perm(g1.perms[label]))
        scales[k] = s2 * g1.scales[k]
    return Element(perms, scales)


def inverse(g: Element, spec: Spec) -> Element:
    r"""The inverse element: ``p' = p^{-1}``, ``λ' = (1/λ)[p]``."""
    batch, dtype, device = _ref(g)
    g = _full(g, spec, batch, dtype, device)
    perms = {k: invert_perm(p) for k, p in g.perms.items()}
    scales = {}
    for k, s in g.scales.items():
        label = spec.perm_of_scale(k)
        scales[k] = 1.0 / s if label is None else torch.gather(1.0 / s, -1, g.perms[label])
    return Element(perms, scales)


def shift_logits(theta: Params, spec: Spec, c: float | torch.Tensor) -> Params:
    r"""The softmax additive symmetry (paper App. C.1.3): ``b_L <- b_L + c·1``.

    ``c`` is a number or a tensor of the batch shape. Softmax outputs are
    unchanged; raw logits shift by ``c``.
    """
    if spec.output_bias is None:
        raise SymmetryError("this network has no output bias, so it has no softmax additive symmetry")
    b = theta[spec.output_bias]
    c = torch.as_tensor(c, dtype=b.dtype, device=b.device)
    return {**theta, spec.output_bias: b + c[..., None]}
