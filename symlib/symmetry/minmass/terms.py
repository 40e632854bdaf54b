r"""The min-mass problem itself: the terms of the mass as a function of the log-scales, its value,
the neurons' incoming and outgoing masses, and the degenerate neurons (book: chapter "Min-mass";
paper §3.6, Def. 3.3, App. C.7). See :mod:`symlib.symmetry.minmass` for the mathematics."""

from __future__ import annotations

import dataclasses

import torch

from symlib.symmetry import check as _check
from symlib.symmetry import ops
from symlib.symmetry.spec import Params, Spec, SymmetryError


@dataclasses.dataclass(frozen=True)
class Term:
    """Mass of one weight tensor: ``sum_ij q[b, i, j] exp(2 u_out[b, i] - 2 u_in[b, j])``.

    Attributes:
        param: the weight's name.
        q: ``(B, n_out, n_in)`` float64 squares summed over the axes no scale acts on;
            a side with no scaling label has size 1 (its scale is fixed at 1).
        out: scaling label on the outgoing side (power +1), or ``None``.
        inp: scaling label on the incoming side (power -1), or ``None``.
    """

    param: str
    q: torch.Tensor
    out: str | None
    inp: str | None


@dataclasses.dataclass(frozen=True)
class Problem:
    """The min-mass problem of a stack of ``B`` networks, in log space.

    Attributes:
        labels: scaling labels, in spec order, with their sizes.
        terms: one :class:`Term` per weight tensor.
        batch: the batch shape of the original parameters (``B = prod(batch)``).
    """

    labels: dict[str, int]
    terms: tuple[Term, ...]
    batch: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of scale variables of one network."""
        return sum(self.labels.values())

    @property
    def offsets(self) -> dict[str, int]:
        out, o = {}, 0
        for k, n in self.labels.items():
            out[k] = o
            o += n
        return out


def _squares(theta: Params, spec: Spec, name: str, nb: int) -> tuple[torch.Tensor, str | None, str | None]:
    """``W**2`` of weight ``name`` in float64, reduced to ``(B, n_out, n_in)``, and its labels."""
    acts = [a for a in spec.actions if a.param == name and a.scale is not None and a.power != 0]
    w = ops.dense_weight(theta, spec, name).to(torch.float64)  # grouped conv: block-diagonal dense
    w = w.reshape(-1, *w.shape[nb:])
    q = w.square()
    out = [a for a in acts if a.power > 0]
    inp = [a for a in acts if a.power < 0]
    if len(out) > 1 or len(inp) > 1 or any(abs(a.power) != 1 for a in acts):
        raise SymmetryError(
            f"weight {name!r} carries scaling actions {acts}; min-mass handles weights with at most "
            "one outgoing (power +1) and one incoming (power -1) scaling label"
        )
    keep = [1 + a.axis for a in out + inp]
    other = [d for d in range(1, q.ndim) if d not in keep]
    q = q.sum(dim=other) if other else q
    if out and inp and out[0].axis > inp[0].axis:
        q = q.transpose(1, 2)
    if not out:
        q = q.unsqueeze(1)
    if not inp:
        q = q.unsqueeze(-1)
    if out and inp and out[0].scale == inp[0].scale:
        raise SymmetryError(f"weight {name!r} has the same scaling label on both sides; not supported")
    return q, (out[0].scale if out else None), (inp[0].scale if inp else None)


def problem(theta: Params, spec: Spec) -> Problem:
    """Build the log-space min-mass problem of ``theta`` (optionally a stack of networks).

    Raises:
        SymmetryError: non-homogeneous activations, non-finite weights, or a
            scaling label with incoming weights but no outgoing ones (a conv
            followed by BatchNorm: fold it first with :func:`fold_batchnorm`).
    """
    spec.require_scaling()
    batch = _check.validate(theta, spec)
    nb = len(batch)
    terms = []
    for name in spec.shapes:
        if name in spec.weights:
            q, out, inp = _squares(theta, spec, name, nb)
            terms.append(Term(name, q, out, inp))
    for label in spec.scales:
        has_in = any(t.out == label for t in terms)
        has_out = any(t.inp == label for t in terms)
        if has_in and not has_out:
            raise SymmetryError(
                f"scaling label {label!r} has incoming weights but no outgoing weights, so shrinking its "
                "scale lowers the mass forever (typically a conv followed by BatchNorm, which absorbs the "
                "conv's scale). Fold BatchNorm first: theta, model = "
                "symlib.symmetry.minmass.fold_batchnorm(theta, model), then build the spec of the folded "
                "model."
            )
    labels = {k: n for k, n in spec.scales.items() if any(k in (t.out, t.inp) for t in terms)}
    return Problem(labels, tuple(terms), tuple(batch))


def _factors(t: Term, u: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``a = exp(2 u_out)`` ``(B, n_out)`` and ``b = exp(-2 u_in)`` ``(B, n_in)``, ones on fixed sides."""
    B = t.q.shape[0]
    one = torch.ones(B, 1, dtype=t.q.dtype, device=t.q.device)
    a = torch.exp(2 * u[t.out]) if t.out is not None else one
    b = torch.exp(-2 * u[t.inp]) if t.inp is not None else one
    return a, b


def _mv(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.bmm(q, v.unsqueeze(-1)).squeeze(-1)


def _vm(v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.bmm(v.unsqueeze(1), q).squeeze(1)


def objective(prob: Problem, u: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mass ``M(u)`` of every network, ``(B,)``."""
    total = 0.0
    for t in prob.terms:
        a, b = _factors(t, u)
        total = total + (a * _mv(t.q, b)).sum(-1)
    return total


def _in_out(prob: Problem, u: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Per neuron: incoming mass ``in`` and outgoing mass ``out`` at ``u`` (``(B, n)`` each)."""
    inc = {k: 0.0 for k in prob.labels}
    outg = {k: 0.0 for k in prob.labels}
    for t in prob.terms:
        a, b = _factors(t, u)
        if t.out is not None:
            inc[t.out] = inc[t.out] + a * _mv(t.q, b)
        if t.inp is not None:
            outg[t.inp] = outg[t.inp] + b * _vm(a, t.q)
    return inc, outg


# ------------------------------------------------------------------------------------ degenerate neurons


def degenerate(prob: Problem) -> dict[str, torch.Tensor]:
    """Neurons with no non-zero-weight path from the input or none to the output, ``(B, n)`` bool.

    Dead ReLU units (all-zero incoming or outgoing weights) are among them. On
    the other neurons the problem is strictly convex and coercive (every scale
    direction makes some term grow), so its minimiser exists and is unique.
    """
    B = prob.terms[0].q.shape[0] if prob.terms else 1
    dev = prob.terms[0].q.device if prob.terms else None
    fwd = {k: torch.zeros(B, n, dtype=torch.bool, device=dev) for k, n in prob.labels.items()}
    bwd = {k: torch.zeros(B, n, dtype=torch.bool, device=dev) for k, n in prob.labels.items()}
    pos = [(t, t.q > 0) for t in prob.terms]
    true = torch.ones(B, 1, dtype=torch.bool, device=dev)
    changed = True
    while changed:
        changed = False
        for t, p in pos:
            if t.out is not None:
                src = fwd[t.inp] if t.inp is not None else true
                new = fwd[t.out] | (p & src.unsqueeze(1)).any(-1)
                if not torch.equal(new, fwd[t.out]):
                    fwd[t.out], changed = new, True
            if t.inp is not None:
                dst = bwd[t.out] if t.out is not None else true
                new = bwd[t.inp] | (p & dst.unsqueeze(2)).any(1)
                if not torch.equal(new, bwd[t.inp]):
                    bwd[t.inp], changed = new, True
    return {k: ~(fwd[k] & bwd[k]) for k in prob.labels}


# -------------------------------------------------------------------------------------------- solver


def neuron_masses(theta: Params, spec: Spec) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Incoming and outgoing mass of every hidden neuron: two dicts label -> ``(*batch, n)``.

    At the min-mass optimum they are equal for every non-degenerate neuron.
    """
    prob = problem(theta, spec)
    B = prob.terms[0].q.shape[0]
    dev = prob.terms[0].q.device
    zero = {k: torch.zeros(B, n, dtype=torch.float64, device=dev) for k, n in prob.labels.items()}
    inc, out = _in_out(prob, zero)
    shape = lambda v: v.reshape(*prob.batch, -1)  # noqa: E731
    return {k: shape(v) for k, v in inc.items()}, {k: shape(v) for k, v in out.items()}


def mass(theta: Params, spec: Spec) -> torch.Tensor:
    """The mass: sum of squared weights, biases and buffers excluded, ``(*batch,)`` float64."""
    batch = _check.validate(theta, spec)
    nb = len(batch)
    total = 0.0
    for name in spec.weights:
        w = theta[name].to(torch.float64)
        total = total + w.square().sum(dim=tuple(range(nb, w.ndim)))
    return torch.as_tensor(total, dtype=torch.float64)
