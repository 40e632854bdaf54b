r"""The sort keys of a layer's neurons, the numbers a canonical form orders them by (book: chapter "A gentle
example"; paper App. C.2, §5.2).

* :func:`neuron_norms`: the p-norm of each neuron's incoming weights, which normalisation divides out;
* the sort keys of a permutation label (``"max"``, ``"first"`` or ``"sum"`` of the incoming or outgoing
  weights, :data:`KEYS`), with the tie-breaking keys after them (the neuron's bias, the sums of its
  incoming and outgoing weights), each key's size and the roundings that bound its error
  (:class:`~symlib.symmetry.rounding.AmbiguousCanonicalForm` derives the bound);
* their quantisation to 1e-9 of the largest key and the stable lexicographic order of the neurons.

Keys and norms are computed in float64. The keys that reduce a row (its maximum, its sums) read the
stored parameters without copying them, a grouped convolution's input channels included (from its
stored weight, not the dense one); the ``"first"`` key and the norms read rows of the parameter, made
dense for a grouped convolution. :mod:`symlib.symmetry.canonical` sorts by these keys.
"""

from __future__ import annotations

import torch

from symlib.symmetry import ops
from symlib.symmetry.rounding import _Roundings
from symlib.symmetry.spec import Action, Params, Spec, SymmetryError


def _per_neuron(theta: Params, spec: Spec, a: Action, nb: int) -> torch.Tensor:
    """Parameter ``a.param`` as one row per entry of the label, ``(*batch, n, rest)``: the slice of the axis
    the action covers, its ``inner`` entries per label entry and every other axis flattened into the row
    (grouped convolution weights are made dense first, :func:`symlib.symmetry.ops.dense_weight`)."""
    t = ops.dense_weight(theta, spec, a.param) if a.groups != 1 else theta[a.param]
    start, stop = spec.span(a)
    t = t.narrow(nb + a.axis, start, stop - start).movedim(nb + a.axis, nb)
    n = (stop - start) // a.inner
    return t.reshape(*t.shape[:nb], n, -1)


def _reduce(theta: Params, spec: Spec, a: Action, nb: int, how: str | tuple[str, ...]):
    """``how`` (``"max"``, ``"sum"`` or ``"abs"``: the sum of magnitudes) of each row of :func:`_per_neuron`,
    ``(*batch, n)`` float64, without copying the parameter (sums accumulate in float64; a maximum is exact
    in any dtype); a tuple of them for a tuple ``how``."""
    if a.groups != 1:
        return _reduce_grouped(theta, spec, a, nb, how)
    t = theta[a.param]
    start, stop = spec.span(a)
    d = nb + a.axis
    t = t.narrow(d, start, stop - start)
    out = []
    for h, r in _reductions(t, [i for i in range(nb, t.ndim) if i != d], how):
        r = r.reshape(*r.shape[:nb], (stop - start) // a.inner, a.inner)
        out.append(r.amax(-1) if h == "max" else r.sum(-1))
    return out[0] if isinstance(how, str) else tuple(out)


def _reductions(t: torch.Tensor, other: list[int], how: str | tuple[str, ...]):
    """``[(h, r), ...]``: for each ``h`` of ``how``, ``t``'s maximum, sum of magnitudes (``"abs"``) or sum
    over the dimensions ``other`` (``t`` itself, made non-negative for ``"abs"``, where there are none), in
    float64 (sums accumulate in float64; a maximum is exact in any dtype)."""
    out = []
    for h in (how,) if isinstance(how, str) else how:
        if h == "max":
            r = (t.amax(dim=other) if other else t).to(torch.float64)
        elif h == "abs":
            r = (torch.linalg.vector_norm(t, ord=1, dim=other, dtype=torch.float64) if other
                 else t.abs().to(torch.float64))
        else:
            r = t.sum(dim=other, dtype=torch.float64) if other else t.to(torch.float64)
        out.append((h, r))
    return out


def _reduce_grouped(theta: Params, spec: Spec, a: Action, nb: int, how: str | tuple[str, ...]):
    """:func:`_reduce` of a grouped convolution's input-channel action, from the stored weight: the row of
    input channel ``g * C_in/G + j`` in the dense weight (:func:`symlib.symmetry.ops.dense_weight`) holds
    ``W[o, j]`` for the outputs ``o`` of group ``g`` and zeros elsewhere, so its sums are those of the
    stored entries and its maximum is theirs or zero (a depthwise layer's dense weight, ``C`` times the
    stored one, is never built)."""
    t = theta[a.param]
    shape = spec.shapes[a.param]
    t = t.reshape(*t.shape[:nb], a.groups, shape[0] // a.groups, *shape[1:])  # (*batch, G, C_out/G, k, ...)
    out = []
    for h, r in _reductions(t, [nb + 1, *range(nb + 3, t.ndim)], how):
        r = r.clamp_min(0.0) if h == "max" else r  # a maximum with the zeros of the other groups' rows
        out.append(r.flatten(-2))  # (*batch, G * k) = (*batch, C_in)
    return out[0] if isinstance(how, str) else tuple(out)


def neuron_norms(theta: Params, spec: Spec, label: str, p: float = 2.0) -> torch.Tensor:
    """p-norm of the incoming weights of each neuron of scaling label ``label``: ``(*batch, n)``, float64."""
    return _neuron_norms(theta, spec, label, p, len(spec.batch_shape(theta)))


def _neuron_norms(theta: Params, spec: Spec, label: str, p: float, nb: int) -> torch.Tensor:
    """:func:`neuron_norms` of a ``theta`` with ``nb`` batch dimensions, already checked against ``spec``."""
    acts = spec.incoming(label, "scale")
    if not acts:
        raise SymmetryError(f"scaling label {label!r} has no incoming weights in the spec")
    def power(x):  # |x|^p; for p = 2 one pass (the same numbers as abs().pow(2))
        return x.square() if p == 2 else x.abs().pow(p)

    total = sum(power(_per_neuron(theta, spec, a, nb).to(torch.float64)).sum(-1) for a in acts)
    return total.pow(1.0 / p)


KEYS = ("max", "first", "sum")


def _quantize(k: torch.Tensor, rel: float = 1e-9) -> torch.Tensor:
    """``k`` rounded to ``rel`` times its largest magnitude along the last axis."""
    unit = k.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(k.dtype).tiny) * rel
    return torch.round(k / unit)


def _keys(theta: Params, spec: Spec, label: str, key: str, by: str, nb: int) -> list[torch.Tensor]:
    """The sort keys of ``label``'s neurons, primary first, ``(*batch, n)`` float64 each (:func:`_key`)."""
    return [k for k, _, _ in _keyed(theta, spec, label, key, by, nb, sizes=False)]


def _keyed(theta: Params, spec: Spec, label: str, key: str, by: str, nb: int, sizes: bool = True):
    """:func:`_keys` with, per key, its size ``A`` (``(*batch, n)``: ``|k|`` for a key that is one weight,
    the sum of the magnitudes of its terms for a sum, plus the offset of each running-variance entry) and
    the number ``c`` of roundings that bound its error (:class:`~symlib.symmetry.rounding._Roundings`):
    ``[(key, A, c), ...]`` (``A`` and ``c`` are ``None`` without ``sizes``)."""
    acts = spec.incoming(label, "perm") if by == "incoming" else spec.outgoing(label, "perm")
    if not acts:
        raise SymmetryError(f"permutation label {label!r} has no {by} weights to sort by")
    if key not in KEYS:
        raise ValueError(f"key must be one of {KEYS}, got {key!r}")
    rounds = _Roundings(spec) if sizes else None

    def total(side):  # one sum key over the actions of one side, its size and its roundings
        if not sizes:
            return sum(_reduce(theta, spec, a, nb, "sum") for a in side), None, None
        parts = [_reduce(theta, spec, a, nb, ("sum", "abs")) for a in side]
        size = sum(m + a.offset * a.inner for a, (_, m) in zip(side, parts, strict=True))
        return sum(k for k, _ in parts), size, max(rounds.key(a) for a in side)

    if key == "sum":
        out = [total(acts[:1])]
    else:
        k = (_per_neuron(theta, spec, acts[0], nb)[..., 0].to(torch.float64) if key == "first"
             else _reduce(theta, spec, acts[0], nb, "max"))
        out = [(k, k.abs() if sizes else None, rounds.key(acts[0]) if sizes else None)]
    biases = [a for a in spec.of_label(label, "perm") if a.power > 0 and a.param not in spec.weights
              and len(spec.shapes[a.param]) == 1]
    out += [total([a]) for a in biases]
    for side in (spec.incoming(label, "perm"), spec.outgoing(label, "perm")):
        if side:
            out.append(total(side))
    return out


def _lexicographic(keys: list[torch.Tensor]) -> torch.Tensor:
    """The stable lexicographic order of the quantized ``keys`` (primary first): ``(*batch, n)`` indices."""
    order = keys[-1].argsort(dim=-1, stable=True)
    for k in reversed(keys[:-1]):
        order = torch.gather(order, -1, torch.gather(k, -1, order).argsort(dim=-1, stable=True))
    return order


def _key(theta: Params, spec: Spec, label: str, key: str, by: str, nb: int) -> torch.Tensor:
    """Each neuron's rank in the sort order of ``label``: ``(*batch, n)``, a permutation of 0..n-1.

    The primary key is the largest (``"max"``), the first (``"first"``) or the sum
    (``"sum"``) of the incoming (outgoing) weights, computed in float64. Ties, which
    occur in degenerate layers (e.g. after a width-1 layer every normalised
    incoming weight is +-1), are broken lexicographically by keys that are just
    as invariant: the neuron's bias, the sum of its incoming weights and the sum
    of its outgoing weights (sums over the axes other labels permute). Keys equal
    to 1e-9 of their largest magnitude tie; neurons equal on every key keep
    their order (a stable sort), which is deterministic for a given input.
    """
    keys = [_quantize(k) for k in _keys(theta, spec, label, key, by, nb)]
    return _lexicographic(keys).argsort(dim=-1).to(torch.float64)
