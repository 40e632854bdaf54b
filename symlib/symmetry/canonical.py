r"""Removing symmetries a posteriori (book: chapter "A gentle example"; paper App. C.2, §5.2).

* :func:`normalize` removes scalings: every hidden neuron's incoming weights get
  unit p-norm, the factor being pushed into the next layer (Neyshabur et al.,
  2015). Layers are processed first to last, so each layer's norm includes the
  factor pushed from the layer before.
* :func:`sort` removes permutations: the neurons of each layer are ordered by a
  key of their incoming weights (``"first"``: the first weight, paper App. C.2;
  ``"max"``: the largest weight, the most stable key of paper §5.2; ``"sum"``:
  their sum), first layer first. ``by="outgoing"`` orders by outgoing weights,
  last layer first, as the paper's Figure 1 does for display.
* :func:`canonicalize` chains them: normalise, then sort. Norms, scalings and keys
  are computed in float64 whatever the input's dtype (cast back once at the end).
* :func:`margins` says how unambiguous the order is: per label, the smallest
  relative gap between neighbouring keys (on every key that decides their order).
  ``g . theta`` computed in float32 moves each key by up to a few times 6e-8 of
  its size, and a wide layer (thousands of neurons) can have neighbours closer
  than that: their order, hence the canonical form of the tensors that label acts
  on, may differ between ``theta`` and ``g . theta``. :func:`ambiguity` gives each
  gap over the bound of that rounding (below 1: ambiguous).
* :func:`fix_softmax_shift` removes the softmax additive symmetry.
* :class:`AmbiguousCanonicalForm`: the warning :func:`canonicalize` gives when some label's gap is
  below its bound; its docstring derives the bound from the input dtype's unit roundoff.

Real architectures (specs from :func:`symlib.symmetry.trace.spec_of`, paper App. D.4):

* labels are processed in dependency order (:func:`scale_order`,
  :func:`perm_order`): a label comes after the labels acting on the other axes
  of its incoming weights, so the result is exactly invariant;
* a BatchNorm opens a scale whose "incoming weights" are its ``weight``
  (gamma): normalising sets ``|gamma| = 1`` (one norm over every gamma of a
  residual stream, whose BatchNorms share one scale); the convolution before a
  BatchNorm is normalised on its own kernels, the BatchNorm's running
  statistics absorbing the factor;
* grouped labels (``spec.blocks``) are sorted inside each group, and the
  groups are ordered by their largest key; the label of a tie met first
  decides the order of the groups of every label of that tie.

Every function checks, when the spec has a forward function, that the network
computes the same function afterwards (:func:`symlib.symmetry.check.assert_same_function`).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from symlib.symmetry import check as _check
from symlib.symmetry import ops
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


def _float64(theta: Params) -> Params:
    """``theta`` with every floating tensor in float64 (the same tensors when they already are)."""
    return {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in theta.items()}


def _like(out: Params, theta: Params) -> Params:
    """``out`` cast back to the dtypes of ``theta``."""
    return {k: v.to(theta[k].dtype) if k in theta and v.dtype != theta[k].dtype else v
            for k, v in out.items()}


def _topological(labels: list[str], deps: dict[str, set[str]], what: str, fix: str) -> list[str]:
    """Order ``labels`` so each comes after its ``deps``, keeping the given order where free."""
    done: list[str] = []
    left = list(labels)
    while left:
        ready = next((x for x in left if deps[x] <= set(done)), None)
        if ready is None:
            raise SymmetryError(
                f"the {what} labels {left} depend on each other in a cycle (their keys read weights "
                f"that the others reorder or rescale): this canonical form is not defined; {fix}"
            )
        done.append(ready)
        left.remove(ready)
    return done


def scale_order(spec: Spec) -> list[str]:
    """Scaling labels, each after the labels that scale the columns of its incoming weights."""
    deps = {}
    for label in spec.scales:
        params = {a.param for a in spec.incoming(label, "scale")}
        deps[label] = {
            a.scale for p in params for a in spec.on_param(p) if a.scale not in (None, label) and a.power < 0
        }
    return _topological(
        list(spec.scales), deps, "scaling",
        "a residual branch without BatchNorm feeds back into its own stream; use min-mass "
        "(symlib.minmass)",
    )


def perm_order(spec: Spec, by: str = "incoming", key: str = "first") -> list[str]:
    """Permutation labels, each after the labels permuting the other axes of its sort key's weight.

    Only the ``"first"`` key depends on that order; ``"max"`` and ``"sum"`` are
    invariant to the other axes' permutations and keep the forward (or backward) order.
    """
    labels = list(spec.perms) if by == "incoming" else list(reversed(spec.perms))
    if key in ("max", "sum"):
        return labels
    deps = {}
    for label in labels:
        acts = spec.incoming(label, "perm") if by == "incoming" else spec.outgoing(label, "perm")
        deps[label] = {
            a.perm for a in (spec.on_param(acts[0].param) if acts else ())
            if a.axis != acts[0].axis and a.perm not in (None, label)
        }
    return _topological(labels, deps, "permutation", "sort with key='max'")


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


def _finish(spec: Spec, before: Params, after: Params, check: bool, what: str) -> Params:
    if check and spec.forward is not None:
        _check.assert_same_function(spec, before, after, what=what)
    return after


def normalize(theta: Params, spec: Spec, p: float = 2.0, check: bool = True) -> Params:
    r"""Remove scaling symmetries: give each hidden neuron unit p-norm incoming weights.

    .. math:: \lambda_{\ell,i} = \lVert W_\ell[i,:] \rVert_p^{-1}, \quad \ell = 1, \dots, L-1,

    computed layer after layer on the already rescaled network, in float64 (norms
    and scalings; the result is cast back to the input's dtype).

    Args:
        theta: parameters, optionally with leading batch dims.
        spec: the architecture's symmetries; its hidden activations must be
            positively homogeneous (ReLU).
        p: the norm (2 by default; the paper's Figure 1 uses 3).
        check: verify the function is unchanged.

    Raises:
        SymmetryError: non-ReLU activations, NaN weights, or a dead neuron whose
            incoming weights are all zero (no scale can normalise it).
    """
    out = _like(_normalize64(theta, spec, p), theta)
    return _finish(spec, theta, out, check, f"normalize(p={p})")


def _normalize64(theta: Params, spec: Spec, p: float) -> Params:
    """:func:`normalize` without the check, every floating tensor returned in float64."""
    spec.require_scaling()
    if not p > 0:
        raise ValueError(f"p must be positive, got {p}")
    _check.validate(theta, spec)
    out = _float64(theta)
    nb = len(spec.batch_shape(out))
    for label in scale_order(spec):
        norms = _neuron_norms(out, spec, label, p, nb)
        dead = norms == 0
        if bool(dead.any()):
            raise SymmetryError(
                f"{int(dead.sum())} neuron(s) of layer {label!r} have all-zero incoming weights (dead "
                "units): they have no unit-norm representative. Prune them, or use "
                "symlib.symmetry.minmass which fixes their scale explicitly."
            )
        out = ops.scale(out, spec, {label: 1.0 / norms})
    return out


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
    the number ``c`` of roundings that bound its error (:class:`_Roundings`): ``[(key, A, c), ...]``
    (``A`` and ``c`` are ``None`` without ``sizes``)."""
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


class _Gap(NamedTuple):
    """How surely an order is decided, ``(*batch, ...)`` each: ``margin``, the smallest relative raw gap of a
    decision (:func:`margins`); ``ratio``, the smallest of the decisions' distances from changing over what
    rounding can move them (:func:`ambiguity`)."""

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


def _sort_perms(theta, spec: Spec, key: str, by: str, report: dict | None = None,
                roundoff: float = 2.0**-53, scaled: bool = True) -> dict[str, torch.Tensor]:
    """:func:`sort_perms`; with ``report`` a dict, also fills it with a :class:`_Gap` per label, the
    rounding bounds of the keys being ``c * roundoff * A`` (:func:`_keyed`), or ``roundoff * A`` for
    keys that no scaling was divided out of (``scaled=False``: the input's own rounding)."""
    if by not in ("incoming", "outgoing"):
        raise ValueError(f"by must be 'incoming' or 'outgoing', got {by!r}")
    nb = len(_check.validate(theta, spec))
    perms: dict[str, torch.Tensor] = {}
    cur = dict(theta)
    ties = spec.tie_classes()
    decided: set[str] = set()
    group_gap: dict[str, _Gap] = {}  # tie -> how decided the order its decider gave the groups is
    for label in perm_order(spec, by, key):
        keyed = _keyed(cur, spec, label, key, by, nb, sizes=report is not None)
        raw = [k for k, _, _ in keyed]
        if report is not None:
            bounds = [size * (roundoff * c if scaled else roundoff) for _, size, c in keyed]
        if key != "first" and label in perms:  # moved with its tie's blocks: its keys move along
            raw = [torch.gather(k, -1, perms[label]) for k in raw]
            if report is not None:
                bounds = [torch.gather(e, -1, perms[label]) for e in bounds]
        ranks = _lexicographic([_quantize(k) for k in raw]).argsort(dim=-1).to(torch.float64)
        groups = spec.blocks[label][0] if label in spec.blocks else 1
        if label not in spec.blocks:
            step = {label: ranks.argsort(dim=-1, stable=True)}
        else:
            step = _block_sort(ranks, spec, label, ties, decided)
        if report is not None:
            report[label] = _margin(raw, bounds, step[label], groups)
            tie = spec.blocks[label][1] if label in spec.blocks else None
            if "blocks" in step:  # the label ordered the blocks of its tie by their top neurons
                group_gap[tie] = _margin(raw, bounds, step.pop("blocks"))
                report[label] = _worse(report[label], group_gap[tie])
            elif tie in group_gap:  # another label of the tie ordered this label's blocks
                report[label] = _worse(report[label], group_gap[tie])
        step.pop("blocks", None)
        if key == "first":  # ("max" and "sum" keys ignore the other axes' order; block moves are above)
            cur = ops.permute(cur, spec, step)
        for k, p in step.items():
            perms[k] = torch.gather(perms[k], -1, p) if k in perms else p
    return perms


def sort_perms(theta: Params, spec: Spec, key: str = "max", by: str = "incoming") -> dict[str, torch.Tensor]:
    """The permutations that :func:`sort` applies, one per label (``(*batch, n)`` each)."""
    return _sort_perms(theta, spec, key, by)


def _block_sort(keys, spec: Spec, label: str, ties, decided: set[str]) -> dict[str, torch.Tensor]:
    """Sort a grouped label inside its groups; order the groups too if its tie is not decided yet.

    Returns the step permutations: ``label``'s and, when it orders the groups,
    the block permutations of the other labels of its tie, and under ``"blocks"``
    the neurons that decided the order of the groups (each group's top neuron, in
    the new order of the groups).
    """
    groups, tie = spec.blocks[label]
    n = keys.shape[-1]
    k = n // groups
    blocks = keys.reshape(*keys.shape[:-1], groups, k)
    inner = blocks.argsort(dim=-1, stable=True)
    base = torch.arange(groups, device=keys.device)
    top = None
    if tie is None or tie in decided:
        sigma = base.expand(*keys.shape[:-1], groups)
    else:
        sigma = blocks.amax(-1).argsort(dim=-1, stable=True)
        decided.add(tie)
        top = torch.gather(inner[..., -1] + base * k, -1, sigma)
    src = torch.gather(inner, -2, sigma[..., None].expand(inner.shape))
    step = {label: (sigma[..., None] * k + src).reshape(keys.shape)}
    if tie is not None and not bool((sigma == base).all()):
        for other in ties[tie]:
            if other != label:
                m = spec.perms[other] // groups
                within = torch.arange(m, device=keys.device)
                step[other] = (sigma[..., None] * m + within).reshape(*keys.shape[:-1], groups * m)
    if top is not None:
        step["blocks"] = top
    return step


def sort(theta: Params, spec: Spec, key: str = "max", by: str = "incoming", check: bool = True) -> Params:
    """Remove permutation symmetries: order each layer's neurons by increasing key.

    Args:
        theta: parameters, optionally with leading batch dims.
        spec: the architecture's symmetries.
        key: ``"max"`` (largest incoming weight, paper §5.2), ``"first"`` (first
            incoming weight, paper App. C.2) or ``"sum"`` (sum of the incoming
            weights: an average of many weights, the most robust to rounding in
            float32 for wide layers; see :func:`margins`). Keys are computed in float64.
        by: ``"incoming"`` (layers first to last) or ``"outgoing"`` (last to
            first, the display order of the paper's Figure 1).
        check: verify the function is unchanged.
    """
    out = ops.permute(theta, spec, sort_perms(theta, spec, key=key, by=by))
    return _finish(spec, theta, out, check, f"sort(key={key!r}, by={by!r})")


def _scaled64(theta: Params, spec: Spec, p: float, scaling: str | None) -> Params:
    """The first step of :func:`canonicalize`: every floating tensor in float64, rescaled (``scaling=None``:
    the input's own tensors, since permutations are exact in any dtype)."""
    if scaling == "normalize":
        return _normalize64(theta, spec, p)
    if scaling == "minmass":
        from symlib.symmetry import minmass as _minmass  # the unique lightest member of the orbit, Prop. 2

        return _minmass.minmass(_float64(theta), spec, check=False).theta
    if scaling is not None:
        raise ValueError(f"scaling must be 'normalize', 'minmass' or None, got {scaling!r}")
    return dict(theta)  # permutations are exact in any dtype; keys are computed in float64


class AmbiguousCanonicalForm(UserWarning):
    r""":func:`canonicalize` met labels whose neighbouring neurons' sort keys are closer than the rounding of
    the input's dtype can move them: their order, hence the canonical form of every tensor they act on, may
    differ between ``theta`` and ``act(g, theta)``. A ``UserWarning``: the form is still a valid member of
    the orbit.

    The bound (:func:`ambiguity`). ``act(g, theta)`` is computed in the input's dtype, of unit roundoff
    :math:`u = \mathrm{eps}/2` (:math:`2^{-24} \approx 6 \times 10^{-8}` in float32), and the canonical form
    divides the scalings back out in float64 (exactly, to float64 rounding). So each weight it sorts by
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


def _report(theta: Params, spec: Spec, p: float, key: str, by: str, scaling: str | None):
    """``(the canonical order's permutations, the float64 work, label -> _Gap)`` of :func:`canonicalize`."""
    work = _scaled64(theta, spec, p, scaling)
    report: dict[str, _Gap] = {}
    perms = _sort_perms(work, spec, key, by, report=report, roundoff=_roundoff(theta)[1],
                        scaled=scaling is not None)
    return perms, work, {label: report[label] for label in spec.perms if label in report}


def _warn_ambiguous(report: dict[str, _Gap], theta: Params, key: str) -> None:
    """One :class:`AmbiguousCanonicalForm` naming the labels some of whose decisions (over the batch) are
    below their rounding bound (:func:`ambiguity` below 1)."""
    dtype = _roundoff(theta)[0]
    low = {label: g for label, g in report.items() if g.ratio.numel() and float(g.ratio.min()) < 1}
    if low:
        names = list(low)
        shown = ", ".join(map(repr, names[:8])) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        worst = min(names, key=lambda x: float(low[x].ratio.min()))
        warnings.warn(
            f"canonicalize: {len(names)} label(s) ({shown}) have neighbouring neurons whose sort keys "
            f"(key={key!r}) are closer than the rounding of {str(dtype)[6:]} can move them (worst: "
            f"{worst!r}, smallest gap {float(low[worst].margin.min()):.1e} of its largest key, "
            f"{float(low[worst].ratio.min()):.2g} of its bound), so act(g, theta) may get another "
            f"canonical form on the tensors they act on. Fix: pass theta in float64 (params.cast(theta, "
            f"torch.float64)), or try another key (key={'sum' if key != 'sum' else 'max'!r}); "
            f"canonical.ambiguity(theta, spec) gives each label's gaps over their bounds, "
            f"canonical.margins(theta, spec) the gaps.",
            AmbiguousCanonicalForm, stacklevel=3,
        )


def canonicalize(
    theta: Params,
    spec: Spec,
    p: float = 2.0,
    key: str = "max",
    by: str = "incoming",
    scaling: str | None = "normalize",
    check: bool = True,
) -> Params:
    r"""The canonical (identifiable) form: remove scalings, then permutations (paper Prop. 1); warns
    (:class:`AmbiguousCanonicalForm`, once per call, naming the labels) when the form may not be canonical
    because some label's keys are closer than the input dtype's rounding can move them.

    ``canonicalize(act(g, theta)) == canonicalize(theta)`` for every group
    element ``g`` unless two neurons of a layer tie on every sort key (primary
    key, bias, incoming and outgoing sums), as exact duplicates do. Norms,
    scalings and keys are computed in float64 from the input (the result is cast
    back to its dtype once). But ``act(g, theta)`` is computed in the input's dtype,
    whose unit roundoff (:math:`2^{-24} \approx 6 \times 10^{-8}` in float32,
    :math:`2^{-53} \approx 1.1 \times 10^{-16}` in float64) moves each key by up to
    a few of its units (:class:`AmbiguousCanonicalForm` derives the bound): where two
    neighbours' keys are closer than that, no procedure can tell which comes first,
    and ``g . theta`` may sort them differently from ``theta``. The warning fires
    whenever one of a label's decisions is below its bound (:func:`ambiguity` below
    1); its two fixes are float64 input, or another key.

    Args:
        key: ``"max"``, ``"first"`` or ``"sum"`` (:func:`sort`).
        scaling: ``"normalize"`` (unit p-norm neurons), ``"minmass"`` (the
            lightest network of the scaling orbit, :mod:`symlib.symmetry.minmass`;
            BatchNorm networks must be folded first), or ``None`` to keep
            scales (e.g. for tanh networks, which only have permutations).
    """
    perms, work, report = _report(theta, spec, p, key, by, scaling)
    _warn_ambiguous(report, theta, key)
    out = ops.permute(_like(work, theta), spec, perms)  # cast first: a permutation moves values exactly
    return _finish(spec, theta, out, check, "canonicalize")


def margins(
    theta: Params,
    spec: Spec,
    p: float = 2.0,
    key: str = "max",
    by: str = "incoming",
    scaling: str | None = "normalize",
) -> dict[str, torch.Tensor]:
    r"""How unambiguous the canonical form is: per permutation label, the smallest relative gap of a
    decision between two neurons that :func:`canonicalize` (same arguments) puts next to each other.

    For neighbours :math:`i, j` in the sorted order, every key up to and including
    the one that decides their order (the first on which they differ after keys are
    quantized to :math:`10^{-9}` of their largest magnitude) is a decision, with gap
    :math:`|k_i - k_j| / \max_l |k_l|` on the raw keys: a key on which they tie after
    quantisation but not before is decided by rounding (rounding can put the two on
    either side of a quantum boundary), so its raw gap counts; exact ties (raw gap 0:
    duplicates, structural ties) decide nothing. The margin is the smallest gap over
    the label (inside each group for a grouped label, and between the groups' top
    neurons where the label orders the groups). The labels of a tie (``spec.blocks``:
    e.g. a depthwise convolution's channels, which move with the channels feeding it)
    get the margin of the order of their groups too, whichever label of the tie
    decided it, since that order is theirs. A margin of 0 means two neurons tie on
    every key.

    Whether a margin is small enough to matter depends on the dtype, the key and the
    layer (:class:`AmbiguousCanonicalForm` derives the bound): ``act(g, theta)``
    computed in the input's dtype, of unit roundoff :math:`u = \mathrm{eps}/2`, moves
    a key by up to :math:`c u A`, :math:`c` counting the roundings its weights and
    the neuron's norm carry and :math:`A = |k|` for a key that is one weight,
    :math:`\sum_i |w_i| / \lVert w \rVert \le \sqrt{n}` for a sum over a fan-in of
    :math:`n`. Neighbours whose gap is below :math:`c u (A_i + A_j)` may sort
    differently for ``theta`` and ``act(g, theta)``: in float32, for the "max" key,
    a margin below about :math:`16 u \approx 10^{-6}` of the label's largest key
    behind a BatchNorm (:math:`c = 8`), :math:`4 u` for the stem (:math:`c = 2`).
    :func:`ambiguity` gives each label's smallest gap over its bound, the number the
    warning tests.

    Returns:
        ``label -> (*batch,)`` float64 margins (``inf`` for a label of one neuron per group).
    """
    return {label: g.margin for label, g in _report(theta, spec, p, key, by, scaling)[2].items()}


def ambiguity(
    theta: Params,
    spec: Spec,
    p: float = 2.0,
    key: str = "max",
    by: str = "incoming",
    scaling: str | None = "normalize",
) -> dict[str, torch.Tensor]:
    r"""Per permutation label, the smallest ratio, over the decisions of :func:`margins`, of the two
    neighbours' key gap to the bound that rounding ``act(g, theta)`` in the input's dtype can move it by
    (:class:`AmbiguousCanonicalForm`). Below 1 the label's order may differ between ``theta`` and
    ``act(g, theta)``, and :func:`canonicalize` warns naming it; 0 for neurons tied on every key.

    Returns:
        ``label -> (*batch,)`` float64 ratios (``inf`` for a label of one neuron per group).
    """
    return {label: g.ratio for label, g in _report(theta, spec, p, key, by, scaling)[2].items()}


def fix_softmax_shift(theta: Params, spec: Spec, total: float = 1.0) -> Params:
    """Remove the softmax additive symmetry: shift the last bias so its entries sum to ``total``."""
    b = theta[spec.output_bias] if spec.output_bias else None
    if b is None:
        raise SymmetryError("this network has no output bias, so it has no softmax additive symmetry")
    c = (total - b.sum(-1)) / b.shape[-1]
    return ops.shift_logits(theta, spec, c)
