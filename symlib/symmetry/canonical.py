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
* :class:`~symlib.symmetry.rounding.AmbiguousCanonicalForm`: the warning :func:`canonicalize` gives when
  some label's gap is below its bound; its docstring derives the bound from the input dtype's unit
  roundoff.

The sort keys and norms are :mod:`symlib.symmetry.keys`'s, the rounding bounds and gaps
:mod:`symlib.symmetry.rounding`'s; this module orders the labels and applies the group elements.

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
from symlib.symmetry.keys import KEYS, _keyed, _lexicographic, _neuron_norms, _quantize, neuron_norms
from symlib.symmetry.rounding import AmbiguousCanonicalForm, _Gap, _margin, _roundoff, _worse
from symlib.symmetry.spec import Params, Spec, SymmetryError

__all__ = ["AmbiguousCanonicalForm", "KEYS", "ambiguity", "canonicalize", "fix_softmax_shift", "margins",
           "neuron_norms", "normalize", "perm_order", "scale_order", "sort", "sort_perms"]


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


def _report(theta: Params, spec: Spec, p: float, key: str, by: str, scaling: str | None):
    """``(the canonical order's permutations, the float64 work, label -> _Gap)`` of :func:`canonicalize`."""
    work = _scaled64(theta, spec, p, scaling)
    report: dict[str, _Gap] = {}
    perms = _sort_perms(work, spec, key, by, report=report, roundoff=_roundoff(theta)[1],
                        scaled=scaling is not None)
    return perms, work, {label: report[label] for label in spec.perms if label in report}


def _warn_ambiguous(report: dict[str, _Gap], theta: Params, key: str) -> None:
    """One :class:`~symlib.symmetry.rounding.AmbiguousCanonicalForm` naming the labels some of whose
    decisions (over the batch) are below their rounding bound (:func:`ambiguity` below 1)."""
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
    (:class:`~symlib.symmetry.rounding.AmbiguousCanonicalForm`, once per call, naming the labels) when the
    form may not be canonical because some label's keys are closer than the input dtype's rounding can
    move them.

    ``canonicalize(act(g, theta)) == canonicalize(theta)`` for every group
    element ``g`` unless two neurons of a layer tie on every sort key (primary
    key, bias, incoming and outgoing sums), as exact duplicates do. Norms,
    scalings and keys are computed in float64 from the input (the result is cast
    back to its dtype once). But ``act(g, theta)`` is computed in the input's dtype,
    whose unit roundoff (:math:`2^{-24} \approx 6 \times 10^{-8}` in float32,
    :math:`2^{-53} \approx 1.1 \times 10^{-16}` in float64) moves each key by up to
    a few of its units (:class:`~symlib.symmetry.rounding.AmbiguousCanonicalForm` derives the bound):
    where two neighbours' keys are closer than that, no procedure can tell which comes first,
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
    layer (:class:`~symlib.symmetry.rounding.AmbiguousCanonicalForm` derives the bound): ``act(g, theta)``
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
    (:class:`~symlib.symmetry.rounding.AmbiguousCanonicalForm`). Below 1 the label's order may differ
    between ``theta`` and ``act(g, theta)``, and :func:`canonicalize` warns naming it; 0 for neurons tied
    on every key.

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
