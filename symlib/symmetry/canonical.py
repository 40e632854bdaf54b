r"""Removing symmetries a posteriori (book: chapter "A gentle example"; paper App. C.2, §5.2).

* :func:`normalize` removes scalings: every hidden neuron's incoming weights get
  unit p-norm, the factor being pushed into the next layer (Neyshabur et al.,
  2015). Layers are processed first to last, so each layer's norm includes the
  factor pushed from the layer before.
* :func:`sort` removes permutations: the neurons of each layer are ordered by a
  key of their incoming weights (``"first"``: the first weight, paper App. C.2;
  ``"max"``: the largest weight, the most stable key of paper §5.2), first layer
  first. ``by="outgoing"`` orders by outgoing weights, last layer first, as the
  paper's Figure 1 does for display.
* :func:`canonicalize` chains them: normalise, then sort.
* :func:`fix_softmax_shift` removes the softmax additive symmetry.

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

import torch

from symlib.symmetry import check as _check
from symlib.symmetry import ops
from symlib.symmetry.spec import Action, Params, Spec, SymmetryError


def _per_neuron(theta: Params, spec: Spec, a: Action, nb: int) -> torch.Tensor:
    """Parameter ``a.param`` with its acted axis moved right after the batch dims and the rest flattened
    (grouped convolution weights are made dense first, :func:`symlib.symmetry.ops.dense_weight`)."""
    t = ops.dense_weight(theta, spec, a.param) if a.groups != 1 else theta[a.param]
    t = t.movedim(nb + a.axis, nb)
    return t.reshape(*t.shape[: nb + 1], -1)


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

    Only the ``"first"`` key depends on that order; ``"max"`` is invariant to
    the other axes' permutations and keeps the forward (or backward) order.
    """
    labels = list(spec.perms) if by == "incoming" else list(reversed(spec.perms))
    if key == "max":
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
    """p-norm of the incoming weights of each neuron of scaling label ``label``: ``(*batch, n)``."""
    nb = len(spec.batch_shape(theta))
    acts = spec.incoming(label, "scale")
    if not acts:
        raise SymmetryError(f"scaling label {label!r} has no incoming weights in the spec")
    total = sum(_per_neuron(theta, spec, a, nb).abs().pow(p).sum(-1) for a in acts)
    return total.pow(1.0 / p)


def _finish(spec: Spec, before: Params, after: Params, check: bool, what: str) -> Params:
    if check and spec.forward is not None:
        _check.assert_same_function(spec, before, after, what=what)
    return after


def normalize(theta: Params, spec: Spec, p: float = 2.0, check: bool = True) -> Params:
    r"""Remove scaling symmetries: give each hidden neuron unit p-norm incoming weights.

    .. math:: \lambda_{\ell,i} = \lVert W_\ell[i,:] \rVert_p^{-1}, \quad \ell = 1, \dots, L-1,

    computed layer after layer on the already rescaled network.

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
    spec.require_scaling()
    if not p > 0:
        raise ValueError(f"p must be positive, got {p}")
    _check.validate(theta, spec)
    out = dict(theta)
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
    return _finish(spec, theta, out, check, f"normalize(p={p})")


def _quantize(k: torch.Tensor, rel: float = 1e-9) -> torch.Tensor:
    """``k`` rounded to ``rel`` times its largest magnitude along the last axis."""
    unit = k.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(k.dtype).tiny) * rel
    return torch.round(k / unit)


def _key(theta: Params, spec: Spec, label: str, key: str, by: str, nb: int) -> torch.Tensor:
    """Each neuron's rank in the sort order of ``label``: ``(*batch, n)``, a permutation of 0..n-1.

    The primary key is the first or the largest incoming (outgoing) weight. Ties,
    which occur in degenerate layers (e.g. after a width-1 layer every normalised
    incoming weight is +-1), are broken lexicographically by keys that are just
    as invariant: the neuron's bias, the sum of its incoming weights and the sum
    of its outgoing weights (sums over the axes other labels permute).
    """
    acts = spec.incoming(label, "perm") if by == "incoming" else spec.outgoing(label, "perm")
    if not acts:
        raise SymmetryError(f"permutation label {label!r} has no {by} weights to sort by")
    if key not in ("first", "max"):
        raise ValueError(f"key must be 'first' or 'max', got {key!r}")
    w = _per_neuron(theta, spec, acts[0], nb)
    keys = [w[..., 0] if key == "first" else w.amax(-1)]
    biases = [a for a in spec.actions if a.perm == label and a.power > 0 and a.param not in spec.weights
              and len(spec.shapes[a.param]) == 1]
    keys += [theta[a.param] for a in biases]
    for side in (spec.incoming(label, "perm"), spec.outgoing(label, "perm")):
        if side:
            keys.append(sum(_per_neuron(theta, spec, a, nb).sum(-1) for a in side))
    # Keys equal up to rounding (e.g. +-1 after normalisation) must tie, not be ordered by the noise.
    keys = [_quantize(k) for k in keys]
    order = keys[-1].argsort(dim=-1, stable=True)
    for k in reversed(keys[:-1]):
        order = torch.gather(order, -1, torch.gather(k, -1, order).argsort(dim=-1, stable=True))
    return order.argsort(dim=-1).to(w.dtype)


def sort_perms(theta: Params, spec: Spec, key: str = "max", by: str = "incoming") -> dict[str, torch.Tensor]:
    """The permutations that :func:`sort` applies, one per label (``(*batch, n)`` each)."""
    if by not in ("incoming", "outgoing"):
        raise ValueError(f"by must be 'incoming' or 'outgoing', got {by!r}")
    nb = len(_check.validate(theta, spec))
    perms: dict[str, torch.Tensor] = {}
    cur = dict(theta)
    ties = spec.tie_classes()
    decided: set[str] = set()
    for label in perm_order(spec, by, key):
        keys = _key(cur, spec, label, key, by, nb)
        if label not in spec.blocks:
            step = {label: keys.argsort(dim=-1, stable=True)}
        else:
            step = _block_sort(keys, spec, label, ties, decided)
        cur = ops.permute(cur, spec, step)
        for k, p in step.items():
            perms[k] = torch.gather(perms[k], -1, p) if k in perms else p
    return perms


def _block_sort(keys, spec: Spec, label: str, ties, decided: set[str]) -> dict[str, torch.Tensor]:
    """Sort a grouped label inside its groups; order the groups too if its tie is not decided yet.

    Returns the step permutations: ``label``'s and, when it orders the groups,
    the block permutations of the other labels of its tie.
    """
    groups, tie = spec.blocks[label]
    n = keys.shape[-1]
    k = n // groups
    blocks = keys.reshape(*keys.shape[:-1], groups, k)
    inner = blocks.argsort(dim=-1, stable=True)
    base = torch.arange(groups, device=keys.device)
    if tie is None or tie in decided:
        sigma = base.expand(*keys.shape[:-1], groups)
    else:
        sigma = blocks.amax(-1).argsort(dim=-1, stable=True)
        decided.add(tie)
    src = torch.gather(inner, -2, sigma[..., None].expand(inner.shape))
    step = {label: (sigma[..., None] * k + src).reshape(keys.shape)}
    if tie is not None and not bool((sigma == base).all()):
        for other in ties[tie]:
            if other != label:
                m = spec.perms[other] // groups
                within = torch.arange(m, device=keys.device)
                step[other] = (sigma[..., None] * m + within).reshape(*keys.shape[:-1], groups * m)
    return step


def sort(theta: Params, spec: Spec, key: str = "max", by: str = "incoming", check: bool = True) -> Params:
    """Remove permutation symmetries: order each layer's neurons by increasing key.

    Args:
        theta: parameters, optionally with leading batch dims.
        spec: the architecture's symmetries.
        key: ``"first"`` (first incoming weight, paper App. C.2) or ``"max"``
            (largest incoming weight, paper §5.2).
        by: ``"incoming"`` (layers first to last) or ``"outgoing"`` (last to
            first, the display order of the paper's Figure 1).
        check: verify the function is unchanged.
    """
    out = ops.permute(theta, spec, sort_perms(theta, spec, key=key, by=by))
    return _finish(spec, theta, out, check, f"sort(key={key!r}, by={by!r})")


def canonicalize(
    theta: Params,
    spec: Spec,
    p: float = 2.0,
    key: str = "max",
    by: str = "incoming",
    scaling: str | None = "normalize",
    check: bool = True,
) -> Params:
    """The canonical (identifiable) form: remove scalings, then permutations (paper Prop. 1).

    ``canonicalize(act(g, theta)) == canonicalize(theta)`` for every group
    element ``g`` unless two neurons of a layer tie on every sort key (primary
    key, bias, incoming and outgoing sums), as exact duplicates do.

    Args:
        scaling: ``"normalize"`` (unit p-norm neurons), ``"minmass"`` (the
            lightest network of the scaling orbit, :mod:`symlib.symmetry.minmass`;
            BatchNorm networks must be folded first), or ``None`` to keep
            scales (e.g. for tanh networks, which only have permutations).
    """
    out = theta
    if scaling == "normalize":
        out = normalize(out, spec, p=p, check=False)
    elif scaling == "minmass":
        from symlib.symmetry import (
            minmass as _minmass,  # the unique lightest member of the orbit paper Prop. 2,
        )

        out = _minmass.minmass(out, spec, check=False).theta
    elif scaling is not None:
        raise ValueError(f"scaling must be 'normalize', 'minmass' or None, got {scaling!r}")
    out = sort(out, spec, key=key, by=by, check=False)
    return _finish(spec, theta, out, check, "canonicalize")


def fix_softmax_shift(theta: Params, spec: Spec, total: float = 1.0) -> Params:
    """Remove the softmax additive symmetry: shift the last bias so its entries sum to ``total``."""
    b = theta[spec.output_bias] if spec.output_bias else None
    if b is None:
        raise SymmetryError("this network has no output bias, so it has no softmax additive symmetry")
    c = (total - b.sum(-1)) / b.shape[-1]
    return ops.shift_logits(theta, spec, c)
