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
  relative gap between neighbouring keys. In float32 the input is known to a
  relative 6e-8, and a wide layer (thousands of neurons) can have neighbours
  closer than that: their order, hence the canonical form of the tensors that
  label acts on, may differ between ``theta`` and ``g . theta``.
* :func:`fix_softmax_shift` removes the softmax additive symmetry.
* :class:`AmbiguousCanonicalForm`: the warning :func:`canonicalize` gives when some label's margin is
  below the input dtype's resolution.

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


def _reduce(theta: Params, spec: Spec, a: Action, nb: int, how: str) -> torch.Tensor:
    """``how`` (``"max"`` or ``"sum"``) of each row of :func:`_per_neuron`, ``(*batch, n)`` float64, without
    copying the parameter (sums accumulate in float64; a maximum is exact in any dtype)."""
    t = ops.dense_weight(theta, spec, a.param) if a.groups != 1 else theta[a.param]
    start, stop = spec.span(a)
    d = nb + a.axis
    t = t.narrow(d, start, stop - start)
    other = [i for i in range(nb, t.ndim) if i != d]
    if how == "max":
        r = (t.amax(dim=other) if other else t).to(torch.float64)
    else:
        r = t.sum(dim=other, dtype=torch.float64) if other else t.to(torch.float64)
    r = r.reshape(*r.shape[:nb], (stop - start) // a.inner, a.inner)
    return r.amax(-1) if how == "max" else r.sum(-1)


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
            a.scale for a in spec.actions
            if a.param in params and a.scale not in (None, label) and a.power < 0
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
            a.perm for a in spec.actions
            if acts and a.param == acts[0].param and a.axis != acts[0].axis and a.perm not in (None, label)
        }
    return _topological(labels, deps, "permutation", "sort with key='max'")


def neuron_norms(theta: Params, spec: Spec, label: str, p: float = 2.0) -> torch.Tensor:
    """p-norm of the incoming weights of each neuron of scaling label ``label``: ``(*batch, n)``, float64."""
    nb = len(spec.batch_shape(theta))
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
    for label in scale_order(spec):
        norms = neuron_norms(out, spec, label, p)
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
    acts = spec.incoming(label, "perm") if by == "incoming" else spec.outgoing(label, "perm")
    if not acts:
        raise SymmetryError(f"permutation label {label!r} has no {by} weights to sort by")
    if key not in KEYS:
        raise ValueError(f"key must be one of {KEYS}, got {key!r}")

    if key == "first":
        keys = [_per_neuron(theta, spec, acts[0], nb)[..., 0].to(torch.float64)]
    else:
        keys = [_reduce(theta, spec, acts[0], nb, key)]
    biases = [a for a in spec.actions if a.perm == label and a.power > 0 and a.param not in spec.weights
              and len(spec.shapes[a.param]) == 1]
    keys += [_reduce(theta, spec, a, nb, "sum") for a in biases]
    for side in (spec.incoming(label, "perm"), spec.outgoing(label, "perm")):
        if side:
            keys.append(sum(_reduce(theta, spec, a, nb, "sum") for a in side))
    return keys


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


def _gaps(keys: list[torch.Tensor], first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Relative gap between neurons ``first`` and ``second`` (``(*batch, m)`` indices each) on the key that
    decides their order: the first key on which they differ, divided by that key's largest magnitude over
    the label; 0 where they tie on every key."""
    out = torch.zeros(first.shape, dtype=torch.float64, device=first.device)
    open_ = torch.ones(first.shape, dtype=torch.bool, device=first.device)
    for k in keys:
        q = _quantize(k)
        unit = k.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(k.dtype).tiny)
        gap = (torch.gather(k, -1, second) - torch.gather(k, -1, first)).abs() / unit
        differs = torch.gather(q, -1, second) != torch.gather(q, -1, first)
        out = torch.where(open_ & differs, gap, out)
        open_ = open_ & ~differs
    return out


def _margin(keys: list[torch.Tensor], step: torch.Tensor, blocks: int = 1) -> torch.Tensor:
    """Smallest :func:`_gaps` between neurons that ``step`` puts next to each other (inside a block),
    ``(*batch,)``; ``inf`` for a label of one neuron per block."""
    n = step.shape[-1]
    k = n // blocks
    pos = torch.arange(n - 1, device=step.device)
    pairs = pos[(pos % k) != k - 1]
    if not len(pairs):
        return torch.full(step.shape[:-1], float("inf"), dtype=torch.float64, device=step.device)
    return _gaps(keys, step[..., pairs], step[..., pairs + 1]).amin(-1)


def _sort_perms(theta, spec: Spec, key: str, by: str, margins: dict | None = None) -> dict[str, torch.Tensor]:
    """:func:`sort_perms`; with ``margins`` a dict, also fills it with :func:`margins` per label."""
    if by not in ("incoming", "outgoing"):
        raise ValueError(f"by must be 'incoming' or 'outgoing', got {by!r}")
    nb = len(_check.validate(theta, spec))
    perms: dict[str, torch.Tensor] = {}
    cur = dict(theta)
    ties = spec.tie_classes()
    decided: set[str] = set()
    group_margin: dict[str, torch.Tensor] = {}  # tie -> the margin of the order its decider gave the groups
    for label in perm_order(spec, by, key):
        raw = _keys(cur, spec, label, key, by, nb)
        if key != "first" and label in perms:  # moved with its tie's blocks: its keys move along
            raw = [torch.gather(k, -1, perms[label]) for k in raw]
        ranks = _lexicographic([_quantize(k) for k in raw]).argsort(dim=-1).to(torch.float64)
        groups = spec.blocks[label][0] if label in spec.blocks else 1
        if label not in spec.blocks:
            step = {label: ranks.argsort(dim=-1, stable=True)}
        else:
            step = _block_sort(ranks, spec, label, ties, decided)
        if margins is not None:
            margins[label] = _margin(raw, step[label], groups)
            tie = spec.blocks[label][1] if label in spec.blocks else None
            if "blocks" in step:  # the label ordered the blocks of its tie by their top neurons
                group_margin[tie] = _margin(raw, step.pop("blocks"))
                margins[label] = torch.minimum(margins[label], group_margin[tie])
            elif tie in group_margin:  # another label of the tie ordered this label's blocks
                margins[label] = torch.minimum(margins[label], group_margin[tie])
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
    """:func:`canonicalize` met labels whose neurons' sort keys are closer than the input dtype's resolution:
    their order, hence the canonical form of every tensor they act on, may differ between ``theta`` and
    ``act(g, theta)``. A ``UserWarning``: the form is still a valid member of the orbit."""


def _warn_ambiguous(margins: dict[str, torch.Tensor], theta: Params, key: str) -> None:
    """One :class:`AmbiguousCanonicalForm` naming the labels whose smallest margin (over the batch) is below
    the resolution of the coarsest floating dtype of ``theta``: its unit roundoff ``finfo.eps / 2``, the
    relative accuracy to which the input's weights are known."""
    floats = [v.dtype for v in theta.values() if v.is_floating_point()] or [torch.float64]
    dtype = max(floats, key=lambda d: torch.finfo(d).eps)
    res = torch.finfo(dtype).eps / 2
    low = {label: float(m.min()) for label, m in margins.items() if m.numel() and float(m.min()) < res}
    if low:
        names = list(low)
        shown = ", ".join(map(repr, names[:8])) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        warnings.warn(
            f"canonicalize: {len(names)} label(s) ({shown}) have neurons whose sort keys (key={key!r}) "
            f"differ by less than the resolution of {str(dtype)[6:]} ({res:.1e}; smallest relative margin "
            f"{min(low.values()):.1e}), so act(g, theta) may get another canonical form on the tensors they "
            f"act on. Fix: pass theta in float64 (params.cast(theta, torch.float64)), or use another key "
            f"(key={'sum' if key != 'sum' else 'max'!r}); canonical.margins(theta, spec) gives the margins.",
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
    because some label's keys tie within the input dtype's resolution.

    ``canonicalize(act(g, theta)) == canonicalize(theta)`` for every group
    element ``g`` unless two neurons of a layer tie on every sort key (primary
    key, bias, incoming and outgoing sums), as exact duplicates do. Norms,
    scalings and keys are computed in float64 from the input (the result is cast
    back to its dtype once). But the input itself is only known to its dtype's
    resolution (its unit roundoff: :math:`2^{-24} \approx 6 \times 10^{-8}` in float32,
    :math:`2^{-53} \approx 1.1 \times 10^{-16}` in float64): where two neurons' keys
    are closer than that, no procedure can tell which comes first, and ``g . theta``
    may sort them differently from ``theta``. The warning fires whenever a label's
    margin (:func:`margins`: the smallest relative gap between neighbouring keys) is
    below that resolution; its two fixes are float64 input, or another key (e.g.
    ``key="sum"``, whose sums of many weights average rounding out).

    Args:
        key: ``"max"``, ``"first"`` or ``"sum"`` (:func:`sort`).
        scaling: ``"normalize"`` (unit p-norm neurons), ``"minmass"`` (the
            lightest network of the scaling orbit, :mod:`symlib.symmetry.minmass`;
            BatchNorm networks must be folded first), or ``None`` to keep
            scales (e.g. for tanh networks, which only have permutations).
    """
    work = _scaled64(theta, spec, p, scaling)
    gaps: dict[str, torch.Tensor] = {}
    perms = _sort_perms(work, spec, key, by, margins=gaps)
    _warn_ambiguous(gaps, theta, key)
    out = _like(ops.permute(work, spec, perms), theta)
    return _finish(spec, theta, out, check, "canonicalize")


def margins(
    theta: Params,
    spec: Spec,
    p: float = 2.0,
    key: str = "max",
    by: str = "incoming",
    scaling: str | None = "normalize",
) -> dict[str, torch.Tensor]:
    r"""How unambiguous the canonical form is: per permutation label, the smallest relative gap between
    two neurons that :func:`canonicalize` (same arguments) puts next to each other.

    For neighbours :math:`i, j` in the sorted order, the gap is
    :math:`|k_i - k_j| / \max_l |k_l|` on the first key on which they differ
    (the primary key unless they tie on it); the margin is the smallest gap over
    the label (inside each group for a grouped label, and between the groups'
    top neurons where the label orders the groups). The labels of a tie
    (``spec.blocks``: e.g. a depthwise convolution's channels, which move with
    the channels feeding it) get the margin of the order of their groups too,
    whichever label of the tie decided it, since that order is theirs. Rounding the input to a
    relative :math:`\epsilon` (:math:`2^{-24} \approx 6 \times 10^{-8}` in float32)
    moves keys by about that much, so a label whose margin is not well above it
    (say below :math:`10^{-6}` in float32) may sort differently for ``theta`` and
    ``act(g, theta)``. A margin of 0 means two neurons tie on every key.

    Returns:
        ``label -> (*batch,)`` float64 margins (``inf`` for a label of one neuron per group).
    """
    out: dict[str, torch.Tensor] = {}
    _sort_perms(_scaled64(theta, spec, p, scaling), spec, key, by, margins=out)
    return {label: out[label] for label in spec.perms if label in out}


def fix_softmax_shift(theta: Params, spec: Spec, total: float = 1.0) -> Params:
    """Remove the softmax additive symmetry: shift the last bias so its entries sum to ``total``."""
    b = theta[spec.output_bias] if spec.output_bias else None
    if b is None:
        raise SymmetryError("this network has no output bias, so it has no softmax additive symmetry")
    c = (total - b.sum(-1)) / b.shape[-1]
    return ops.shift_logits(theta, spec, c)
