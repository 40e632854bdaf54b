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


def _segments(spec: Spec, acts, size: int) -> list[tuple[str | None, int, int, int]]:
    """``(label, start, n, inner)`` covering an axis of ``size`` entries: the labels' slices in order, and
    every stretch no label covers as one fixed entry (``label=None``, ``n=1``)."""
    out, pos = [], 0
    for a in sorted(acts, key=lambda a: a.start):
        lo, hi = spec.span(a)
        if lo > pos:
            out.append((None, pos, 1, lo - pos))
        out.append((a.scale, lo, (hi - lo) // a.inner, a.inner))
        pos = hi
    if pos < size or not out:
        out.append((None, pos, 1, size - pos))
    return out


def _squares(theta: Params, spec: Spec, name: str, nb: int
             ) -> list[tuple[torch.Tensor, str | None, str | None]]:
    """``W**2`` of weight ``name`` in float64, reduced to ``(B, n_out, n_in)``, and its labels: one
    ``(q, out, inp)`` per pair of slices when several labels share an axis (a concatenation, a flatten)."""
    acts = [a for a in spec.actions if a.param == name and a.scale is not None and a.power != 0]
    w = ops.dense_weight(theta, spec, name).to(torch.float64)  # grouped conv: block-diagonal dense
    w = w.reshape(-1, *w.shape[nb:])
    q = w.square()
    out = [a for a in acts if a.power > 0]
    inp = [a for a in acts if a.power < 0]
    axes_out, axes_in = {a.axis for a in out}, {a.axis for a in inp}
    if len(axes_out) > 1 or len(axes_in) > 1 or axes_out & axes_in or any(abs(a.power) != 1 for a in acts):
        raise SymmetryError(
            f"weight {name!r} carries scaling actions {acts}; min-mass handles weights whose outgoing "
            "(power +1) and incoming (power -1) scaling labels each lie on one axis"
        )
    keep = [1 + a for a in sorted(axes_out | axes_in)]
    other = [d for d in range(1, q.ndim) if d not in keep]
    q = q.sum(dim=other) if other else q
    if out and inp and out[0].axis > inp[0].axis:
        q = q.transpose(1, 2)
    if not out:
        q = q.unsqueeze(1)
    if not inp:
        q = q.unsqueeze(-1)
    if len(out) <= 1 and len(inp) <= 1 and all(a.start == 0 and a.inner == 1 for a in acts) and all(
        spec.span(a)[1] == q.shape[1 if a.power > 0 else 2] for a in acts
    ):  # one label (or none) on each side, covering it: the weight is one term
        if out and inp and out[0].scale == inp[0].scale:
            raise SymmetryError(f"weight {name!r} has the same scaling label on both sides; not supported")
        return [(q, out[0].scale if out else None, inp[0].scale if inp else None)]
    B = q.shape[0]
    terms = []
    for lab_o, lo_o, n_o, inner_o in _segments(spec, out, q.shape[1]):
        qo = q[:, lo_o:lo_o + n_o * inner_o].reshape(B, n_o, inner_o, -1).sum(2)
        for lab_i, lo_i, n_i, inner_i in _segments(spec, inp, q.shape[2]):
            if lab_o is not None and lab_o == lab_i:
                raise SymmetryError(f"weight {name!r} has the label {lab_o!r} on both sides; not supported")
            qi = qo[:, :, lo_i:lo_i + n_i * inner_i].reshape(B, n_o, n_i, inner_i).sum(3)
            terms.append((qi, lab_o, lab_i))
    return terms


def problem(theta: Params, spec: Spec) -> Problem:
    """Build the log-space min-mass problem of ``theta`` (optionally a stack of networks).

    Raises:
        SymmetryError: non-homogeneous activations, non-finite weights, or a
            scaling label with incoming weights but no outgoing ones (a conv
            followed by BatchNorm: fold it first with :func:`~symlib.symmetry.minmass.fold_batchnorm`).
    """
    spec.require_scaling()
    batch = _check.validate(theta, spec)
    nb = len(batch)
    terms = []
    for name in spec.shapes:
        if name in spec.weights:
            terms += [Term(name, q, out, inp) for q, out, inp in _squares(theta, spec, name, nb)]
    for label in spec.scales:
        has_in = any(t.out == label for t in terms)
        has_out = any(t.inp == label for t in terms)
        if has_in and not has_out:
            raise SymmetryError(
                f"scaling label {label!r} has incoming weights but no outgoing weights, so shrinking its "
                "scale lowers the mass forever (typically a conv followed by BatchNorm, which absorbs the "
                "conv's scale). Fold BatchNorm first: folded = symlib.fold_batchnorm(theta, model, "
                "input_shape), then symlib.minmass(folded.theta, folded.spec)."
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
    dt = prob.terms[0].q.dtype if prob.terms else torch.float64
    # Reachability as products with the non-negative squares: sum_j q_ij [j reached] > 0 exactly when
    # some non-zero weight links i to a reached neuron. Forward in term order, backward in reverse order,
    # so a feed-forward network settles in one pass each (one more confirms it).
    fwd = {k: torch.zeros(B, n, dtype=dt, device=dev) for k, n in prob.labels.items()}
    bwd = {k: torch.zeros(B, n, dtype=dt, device=dev) for k, n in prob.labels.items()}
    one = torch.ones(B, 1, dtype=dt, device=dev)
    changed = True
    while changed:
        changed = False
        for t in prob.terms:
            if t.out is not None:
                src = fwd[t.inp] if t.inp is not None else one
                new = torch.maximum(fwd[t.out], (_mv(t.q, src) > 0).to(dt))
                if not torch.equal(new, fwd[t.out]):
                    fwd[t.out], changed = new, True
        for t in reversed(prob.terms):
            if t.inp is not None:
                dst = bwd[t.out] if t.out is not None else one
                new = torch.maximum(bwd[t.inp], (_vm(dst, t.q) > 0).to(dt))
                if not torch.equal(new, bwd[t.inp]):
                    bwd[t.inp], changed = new, True
    fwd = {k: v > 0 for k, v in fwd.items()}
    bwd = {k: v > 0 for k, v in bwd.items()}
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
