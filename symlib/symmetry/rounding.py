r"""How far rounding moves a sort key, and how surely a canonical order is decided (book: chapter
"Symmetries of real architectures"; paper §5.2).

``act(g, theta)`` computed in the input's dtype moves each weight a canonical form sorts by: where two
neighbours' keys are closer than that motion, their order may differ between ``theta`` and
``act(g, theta)``.

* :class:`AmbiguousCanonicalForm`: the warning :func:`~symlib.symmetry.canonical.canonicalize` gives then;
  its docstring derives the bound from the input dtype's unit roundoff;
* the number of roundings that bound a key's error (``_Roundings``), and the gaps between neighbours
  that :func:`~symlib.symmetry.canonical.margins` and :func:`~symlib.symmetry.canonical.ambiguity`
  report (``_gaps``, ``_margin``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from symlib.symmetry.spec import Action, Params, Spec


class _Roundings:
    r"""How many roundings of the input's dtype (units of its unit roundoff ``u``) bound the error of a
    key's entries in the canonical form of ``act(g, theta)`` (:class:`AmbiguousCanonicalForm` derives it).

    :meth:`entry` counts those of one entry of ``act(g, theta)`` after the canonical form's scalings: the
    product along the action's own axis (1; the rounding of the factor itself is common to every entry of
    the neuron and cancels against the norm that divides it back out), a reciprocal or a square of the
    factor (power -1 or 2: 1), an offset added and taken away (a running variance's eps: 2), and per other
    scaled axis of the parameter its product, its reciprocal and the roundings of the norm that divides
    that axis's scale back out (:meth:`norm`). :meth:`norm` counts the roundings of a scaling label's norm,
    a weighted mean of its incoming weights' entry errors, so at most theirs, the norms inside those counted
    as one rounding each (exact where every chain of scalings ends at a BatchNorm's gamma, which has one
    product; in a chain of layers without normalisation the worst case would grow by three roundings a
    layer, but a norm averages the rounding of its whole fan-in). :meth:`key` adds the norm that
    normalises the action's own axis."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self._norms: dict[str, int] = {}

    @staticmethod
    def _extra(a: Action) -> int:
        return int(a.power < 0 or abs(a.power) >= 2) + 2 * int(bool(a.offset))

    def entry(self, a: Action, inner_norm=None) -> int:
        norm = inner_norm or self.norm
        other: dict[int, int] = {}
        for b in self.spec.on_param(a.param):
            if b.axis != a.axis and b.scale is not None and b.power != 0:
                other[b.axis] = max(other.get(b.axis, 0), 1 + self._extra(b) + norm(b.scale))
        own = 1 + (self._extra(a) if a.scale is not None and a.power != 0 else 0)
        return own + sum(other.values())

    def norm(self, scale: str | None) -> int:
        if scale is None:
            return 0
        if scale not in self._norms:
            acts = self.spec.incoming(scale, "scale")
            self._norms[scale] = max((self.entry(a, inner_norm=lambda s: int(s is not None)) for a in acts),
                                     default=1)
        return self._norms[scale]

    def key(self, a: Action) -> int:
        return self.entry(a) + (self.norm(a.scale) if a.power != 0 else 0)


class _Gap(NamedTuple):
    """How surely an order is decided, ``(*batch, ...)`` each: ``margin``, the smallest relative raw gap of a
    decision (:func:`~symlib.symmetry.canonical.margins`); ``ratio``, the smallest of the decisions'
    distances from changing over what rounding can move them
    (:func:`~symlib.symmetry.canonical.ambiguity`)."""

    margin: torch.Tensor
    ratio: torch.Tensor


def _gaps(keys: list[torch.Tensor], bounds: list[torch.Tensor], first: torch.Tensor,
          second: torch.Tensor) -> _Gap:
    """How surely neurons ``first`` and ``second`` (``(*batch, m)`` indices each) are ordered.

    Every key up to and including the one that decides their order (the first on which their quantized
    values differ) is a decision, unless they tie on it exactly (a raw gap of 0: duplicates, structural
    ties); its raw gap, relative to the key's largest magnitude over the label, counts for ``margin``.
    ``bounds`` (absolute, one tensor per key) say how far rounding can move each neuron's key. A deciding
    key keeps the order while the gap exceeds the two bounds plus one quantum (so that they cannot end in
    one quantum either): ``ratio`` is the gap over that. A key on which they tie after quantisation but not
    before keeps the tie only while neither key can cross a quantum boundary (the quanta are 1e-9 of the
    largest key, which moves too): ``ratio`` is the smaller of the two keys' distances to their nearest
    boundary over their motion, below 1 for every such tie in float32 (keys move by hundreds of quanta)
    and almost never in float64 (by 1e-6 of one). A deciding key also keeps the order while neither
    quantized key can change, whatever the gap. Neurons tied exactly on every key get margin and ratio 0."""
    inf = torch.full(first.shape, float("inf"), dtype=torch.float64, device=first.device)
    margin, ratio = inf, inf
    tiny = torch.finfo(torch.float64).tiny
    open_ = torch.ones(first.shape, dtype=torch.bool, device=first.device)
    for k, e in zip(keys, bounds, strict=True):
        top = k.abs().amax(-1, keepdim=True).clamp_min(tiny)
        quantum = top * 1e-9  # as in _quantize
        q = torch.round(k / quantum)
        slack = (0.5 - (k / quantum - q).abs()) * quantum  # distance to the nearest quantum boundary
        motion = e + k.abs() * e.amax(-1, keepdim=True) / top  # the key's, and the quanta's (top moves)
        stable = torch.where(motion > 0, slack / motion.clamp_min(tiny), torch.full_like(k, float("inf")))

        def pair(t):
            return torch.gather(t, -1, first), torch.gather(t, -1, second)

        (ka, kb), (ea, eb), (sa, sb), (qa, qb) = pair(k), pair(e), pair(stable), pair(q)
        gap = (kb - ka).abs()
        neither = torch.minimum(sa, sb)  # how far both quantized keys are from changing
        decides = open_ & (qa != qb)
        tie = open_ & (qa == qb) & (gap > 0)
        margin = torch.where(decides | tie, torch.minimum(margin, gap / top), margin)
        r = torch.where(decides, torch.maximum(gap / (ea + eb + quantum), neither), inf)
        r = torch.where(tie, neither, r)
        ratio = torch.minimum(ratio, r)
        open_ = open_ & ~decides
    tied = open_ & torch.isinf(margin)  # equal on every key
    zero = torch.zeros_like(margin)
    return _Gap(torch.where(tied, zero, margin), torch.where(tied, zero, ratio))


def _margin(keys: list[torch.Tensor], bounds: list[torch.Tensor], step: torch.Tensor,
            blocks: int = 1) -> _Gap:
    """The smallest :func:`_gaps` between neurons that ``step`` puts next to each other (inside a block),
    ``(*batch,)`` each; ``inf`` for a label of one neuron per block."""
    n = step.shape[-1]
    k = n // blocks
    pos = torch.arange(n - 1, device=step.device)
    pairs = pos[(pos % k) != k - 1]
    if not len(pairs):
        inf = torch.full(step.shape[:-1], float("inf"), dtype=torch.float64, device=step.device)
        return _Gap(inf, inf)
    g = _gaps(keys, bounds, step[..., pairs], step[..., pairs + 1])
    return _Gap(g.margin.amin(-1), g.ratio.amin(-1))


def _worse(a: _Gap, b: _Gap) -> _Gap:
    """The smaller margin and the smaller ratio of two :class:`_Gap`."""
    return _Gap(torch.minimum(a.margin, b.margin), torch.minimum(a.ratio, b.ratio))


class AmbiguousCanonicalForm(UserWarning):
    r""":func:`~symlib.symmetry.canonical.canonicalize` met labels whose neighbouring neurons' sort keys are
    closer than the rounding of the input's dtype can move them: their order, hence the canonical form of
    every tensor they act on, may differ between ``theta`` and ``act(g, theta)``. A ``UserWarning``: the form
    is still a valid member of the orbit.

    The bound (:func:`~symlib.symmetry.canonical.ambiguity`). ``act(g, theta)`` is computed in the input's
    dtype, of unit roundoff :math:`u = \mathrm{eps}/2` (:math:`2^{-24} \approx 6 \times 10^{-8}` in
    float32), and the canonical form divides the scalings back out in float64 (exactly, to float64
    rounding). So each weight it sorts by
    differs from the one ``theta`` gives by a relative :math:`r u` at most, :math:`r` counting the roundings
    of ``ops.scale`` that do not cancel: one for the product along the neuron's own axis (the factor's own
    rounding is common to the whole neuron and cancels in its normalisation), one more for a reciprocal or
    squared factor, two for a running variance's eps, and for each other scaled axis of the weight one for
    its product, one for its reciprocal factor and those of the norm that divides that scale back out (one
    for a BatchNorm's gamma). A norm :math:`\lVert w \rVert` is a weighted mean of its weights' relative
    errors, so it carries at most their :math:`r` too. A key then moves by at most :math:`e = c u A`, with
    :math:`c` the roundings of its weights plus those of the neuron's norm and

    * :math:`A = |k|` for a key that is one weight (``"max"``, ``"first"``: :math:`w_j / \lVert w \rVert`
      moves by :math:`2 r u` of itself, weight and norm);
    * :math:`A = \sum_i |w_i| / \lVert w \rVert \le \sqrt{n}` for a sum over a fan-in of :math:`n`
      (``"sum"``, and the tie-breaking sums of incoming and outgoing weights);
    * :math:`A = |b|` for a bias or running statistic (:math:`|b| + \epsilon` for a running variance).

    Two neighbours keep their order if, on the key that decides it, their gap exceeds
    :math:`e_i + e_j` (plus the 1e-9 quantum, so they cannot end in one quantum), and on each earlier key on
    which they tie after quantisation with a raw gap (below the quantum) neither key can cross a quantum
    boundary: in float32 keys move by hundreds of quanta, so such a tie is always ambiguous; in float64
    almost never. Exact ties (duplicates, structural ties) decide nothing. For example, a convolution after
    a BatchNorm (ResNet): :math:`r = 4` (own product; input axis: product, reciprocal, gamma), norm 4,
    :math:`c = 8`: a "max" gap is ambiguous below :math:`8 u (|k_i| + |k_j|) \approx 16 u |k| \approx
    10^{-6} |k|` in float32; the stem convolution, whose inputs no scaling touches: :math:`c = 2`, a gap of
    :math:`4 u |k|`; a "sum" key over 4,608 weights: :math:`8 u \cdot 0.8 \sqrt{4608} \approx 430 u`. With
    ``scaling=None`` no scale is divided out (a form without scalings is invariant to permutations only,
    which are exact): keys are known to the input's own rounding, :math:`e = u A`.

    The bound is first order and worst case: measured on ResNet-50, a "max" key of ``act(g, theta)`` moved
    by at most 2.9 u of itself (bound 8 u), and flips happened at gaps of at most 0.07 of the bound
    (``tools/canonical_ambiguity.py``). In chains of layers without normalisation (VGG, MLPs) it counts
    the norms inside a norm as one rounding each (their worst case grows by three roundings a layer, but a
    norm averages the rounding of its whole fan-in)."""


def _roundoff(theta: Params) -> tuple[torch.dtype, float]:
    """The coarsest floating dtype of ``theta`` and its unit roundoff ``finfo.eps / 2``."""
    floats = [v.dtype for v in theta.values() if v.is_floating_point()] or [torch.float64]
    dtype = max(floats, key=lambda d: torch.finfo(d).eps)
    return dtype, torch.finfo(dtype).eps / 2
