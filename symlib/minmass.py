r"""The min-mass problem: the lightest member of a network's scaling orbit (book: chapter "Min-mass";
paper §3.6, Def. 3.3, Prop. 2, App. C.7).

The *mass* of a network is its L2-regularisation term without the biases. A
positive rescaling ``lam`` of the hidden neurons leaves the function unchanged
but changes the mass; with ``u = log lam`` and ``Q = W**2`` summed over every axis
no scaling acts on (a convolution's kernel positions, for instance),

.. math:: M(u) = \sum_{W} \sum_{i,j} Q_W[i,j]\, e^{2 u_{\mathrm{out}(W),i} - 2 u_{\mathrm{in}(W),j}},

with ``u = 0`` on the input and output layers. ``M`` is a sum of exponentials of
linear functions of ``u``: convex, and strictly convex and coercive when no
neuron is degenerate, so it has a unique minimiser ``u*`` (paper Prop. 2). The
optimality condition reads, for every hidden neuron ``i``,

.. math:: \lambda_i^2 A_i = \lambda_i^{-2} B_i \iff \lambda_i^4 = B_i / A_i,

where ``A_i`` is the mass of the neuron's incoming weights and ``B_i`` that of its
outgoing weights, the other neurons held fixed: at the optimum every neuron's
incoming and outgoing masses are equal ("balanced").

Solver (:func:`solve`). A few Gauss-Seidel sweeps over the scaling labels, each
the closed-form update above for a whole layer at once, bring ``u`` near the
optimum; damped Newton steps in log space (dense Hessian, Cholesky, backtracking
line search) then converge quadratically. Everything is batched over a leading
axis of networks and runs in float64. Convergence is declared when every free
neuron is balanced to a relative ``tol``: ``|in_i - out_i| <= tol (in_i + out_i)``.

Degenerate neurons (paper Def. C.7). A neuron whose incoming or outgoing weights
are all zero (a dead ReLU unit), or more generally one that no path of non-zero
weights links to both the input and the output, has a scale direction along
which the mass never grows, so the problem has no minimiser over it. Such
neurons are detected by a reachability pass, their scale is held at 1 and they
are reported; the minimum is then over the remaining neurons, which is a
strictly convex problem with a unique solution.

BatchNorm. In eval mode ``BN(conv(x))`` is invariant to rescaling the conv's
output channels (up to the epsilon in the variance), so the conv's scale only
multiplies incoming mass and the infimum is reached at ``lam -> 0``: no minimiser.
We fold every BatchNorm into the conv before it (:func:`fold_batchnorm`), which
gives a network without BatchNorm that computes the same function, and solve
min-mass on the folded network; its masses are the ones reported. A spec with a
scaling label that has incoming weights but no outgoing ones is refused with a
pointer to :func:`fold_batchnorm`.

The reference (:func:`reference`) is the cvxpy formulation: a geometric program
(``gp=True``, the paper's) for small networks and the log-sum-exp convex form in
``u`` for larger ones.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import operator

import torch

from symlib import check as _check
from symlib import ops
from symlib.spec import Params, Spec, SymmetryError

# ----------------------------------------------------------------------------------------- the problem


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
                "conv's scale). Fold BatchNorm first: theta, model = symlib.minmass.fold_batchnorm(theta, "
                "model), then build the spec of the folded model."
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


@dataclasses.dataclass(frozen=True)
class Solution:
    """Output of :func:`solve`: ``u`` per label ``(B, n)``, iteration counts and convergence."""

    u: dict[str, torch.Tensor]
    sweeps: int
    newton_steps: int
    converged: torch.Tensor
    residual: torch.Tensor


def _residual(prob, u, free) -> torch.Tensor:
    """Largest relative imbalance ``|in - out| / (in + out)`` over the free neurons, ``(B,)``."""
    inc, outg = _in_out(prob, u)
    res = [
        torch.where(free[k], (inc[k] - outg[k]).abs() / (inc[k] + outg[k]), 0.0).amax(-1)
        for k in prob.labels
    ]
    return torch.stack(res, -1).amax(-1) if res else torch.zeros(1)


def _sweep(prob: Problem, u: dict, free: dict) -> dict:
    """One Gauss-Seidel pass: each label in turn gets its closed-form optimum ``u = log(B/A) / 4``."""
    u = dict(u)
    for k in prob.labels:
        A, Bm = 0.0, 0.0
        for t in prob.terms:
            if t.out == k:
                _, b = _factors(t, u)
                A = A + _mv(t.q, b)
            if t.inp == k:
                a, _ = _factors(t, u)
                Bm = Bm + _vm(a, t.q)
        f = free[k]
        A = torch.where(f, A, 1.0)
        Bm = torch.where(f, Bm, 1.0)
        u[k] = torch.where(f, 0.25 * (torch.log(Bm) - torch.log(A)), u[k])
    return u


def _grad_hess(prob: Problem, u: dict, free: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient ``(B, N)`` and Hessian ``(B, N, N)`` of ``M`` in ``u``, fixed entries pinned."""
    off = prob.offsets
    N = prob.size
    q0 = prob.terms[0].q
    B = q0.shape[0]
    g = torch.zeros(B, N, dtype=q0.dtype, device=q0.device)
    H = torch.zeros(B, N, N, dtype=q0.dtype, device=q0.device)
    diag = torch.zeros(B, N, dtype=q0.dtype, device=q0.device)
    for t in prob.terms:
        a, b = _factors(t, u)
        if t.out is not None:
            s = slice(off[t.out], off[t.out] + a.shape[1])
            m = a * _mv(t.q, b)
            g[:, s] += 2 * m
            diag[:, s] += 4 * m
        if t.inp is not None:
            s = slice(off[t.inp], off[t.inp] + b.shape[1])
            m = b * _vm(a, t.q)
            g[:, s] -= 2 * m
            diag[:, s] += 4 * m
        if t.out is not None and t.inp is not None:
            so = slice(off[t.out], off[t.out] + a.shape[1])
            si = slice(off[t.inp], off[t.inp] + b.shape[1])
            T = t.q * a.unsqueeze(2) * b.unsqueeze(1)
            H[:, so, si] -= 4 * T
            H[:, si, so] -= 4 * T.transpose(1, 2)
    H.diagonal(dim1=1, dim2=2).add_(diag)
    g = torch.where(free, g, 0.0)
    pin = free.unsqueeze(1) & free.unsqueeze(2)
    H = torch.where(pin, H, 0.0)
    H.diagonal(dim1=1, dim2=2).add_((~free).to(H.dtype))
    return g, H


def _flat(prob: Problem, u: dict) -> torch.Tensor:
    return torch.cat([u[k] for k in prob.labels], -1)


def _unflat(prob: Problem, x: torch.Tensor) -> dict:
    return {k: x[:, o : o + prob.labels[k]] for k, o in prob.offsets.items()}


def solve(
    prob: Problem,
    u0: dict[str, torch.Tensor] | None = None,
    fixed: dict[str, torch.Tensor] | None = None,
    tol: float = 1e-10,
    sweeps: int = 16,
    max_newton: int = 100,
    max_dense: int = 8192,
    max_sweeps: int = 20000,
) -> Solution:
    r"""Minimise ``M(u)`` for every network of the batch (see the module docstring).

    Args:
        prob: the problem, from :func:`problem`.
        u0: starting log-scales per label ``(B, n)``; zeros (the given network) by default.
        fixed: neurons whose log-scale stays at ``u0`` (default: :func:`degenerate`).
        tol: convergence when every free neuron has ``|in - out| <= tol (in + out)``.
        sweeps: closed-form Gauss-Seidel sweeps before Newton.
        max_newton: most Newton steps.
        max_dense: networks with more scale variables than this skip the dense
            Newton steps and run Gauss-Seidel sweeps only (up to ``max_sweeps``).

    Returns:
        A :class:`Solution`; ``converged`` is per network.
    """
    if not prob.terms or not prob.labels:
        B = prob.terms[0].q.shape[0] if prob.terms else 1
        return Solution({}, 0, 0, torch.ones(B, dtype=torch.bool), torch.zeros(B, dtype=torch.float64))
    q0 = prob.terms[0].q
    B = q0.shape[0]
    fixed = degenerate(prob) if fixed is None else fixed
    free = {k: ~fixed[k] for k in prob.labels}
    u = {k: torch.zeros(B, n, dtype=q0.dtype, device=q0.device) for k, n in prob.labels.items()}
    if u0 is not None:
        u = {k: u0[k].to(q0).reshape(B, -1) if k in u0 else u[k] for k in prob.labels}
    n_sweeps = 0
    dense = prob.size <= max_dense
    for _ in range(sweeps if dense else max_sweeps):
        u = _sweep(prob, u, free)
        n_sweeps += 1
        if not dense and bool((_residual(prob, u, free) <= tol).all()):
            break
    res = _residual(prob, u, free)
    steps = 0
    if dense:
        freeflat = torch.cat([free[k] for k in prob.labels], -1)
        x = _flat(prob, u)
        mass = objective(prob, u)
        while steps < max_newton and not bool((res <= tol).all()):
            g, H = _grad_hess(prob, _unflat(prob, x), freeflat)
            L, info = torch.linalg.cholesky_ex(H)
            if bool((info > 0).any()):  # numerically singular: regularise lightly
                eye = torch.eye(H.shape[-1], dtype=H.dtype, device=H.device)
                ridge = 1e-12 * H.diagonal(dim1=1, dim2=2).amax(-1)[:, None, None]
                L, _ = torch.linalg.cholesky_ex(H + ridge * eye)
            y = torch.linalg.solve_triangular(L, -g.unsqueeze(-1), upper=False)
            d = torch.linalg.solve_triangular(L.mT, y, upper=True).squeeze(-1)
            d = torch.where((res > tol).unsqueeze(-1), d, 0.0)
            slope = (g * d).sum(-1)
            t = torch.ones(B, dtype=x.dtype, device=x.device)
            for _ in range(60):  # backtracking (Armijo) per network
                new = objective(prob, _unflat(prob, x + t.unsqueeze(-1) * d))
                ok = new <= mass + 1e-4 * t * slope + 1e-15 * mass
                if bool(ok.all()):
                    break
                t = torch.where(ok, t, 0.5 * t)
            x = x + t.unsqueeze(-1) * d
            mass = objective(prob, _unflat(prob, x))
            steps += 1
            res = _residual(prob, _unflat(prob, x), free)
        u = _unflat(prob, x)
    return Solution(u, n_sweeps, steps, res <= tol, res)


# ------------------------------------------------------------------------------------------- the API


@dataclasses.dataclass(frozen=True)
class MinMassResult:
    """The min-mass member of the scaling orbit of a (stack of) network(s).

    Attributes:
        scales: optimal ``lam`` per scaling label, ``(*batch, n)`` float64, relative to the input.
        theta: the scaled network (same dtype as the input); same function.
        mass_before: mass of the input, ``(*batch,)`` float64.
        mass_after: mass of ``theta``, ``(*batch,)``.
        iterations: closed-form sweeps plus Newton steps used.
        converged: per network, whether every free neuron is balanced to ``tol``.
        residual: per network, the largest relative imbalance ``|in - out| / (in + out)``.
        degenerate: per label, the neurons held at scale 1 (see :func:`degenerate`).
    """

    scales: dict[str, torch.Tensor]
    theta: Params
    mass_before: torch.Tensor
    mass_after: torch.Tensor
    iterations: int
    converged: torch.Tensor
    residual: torch.Tensor
    degenerate: dict[str, torch.Tensor]

    @property
    def relative_saving(self) -> torch.Tensor:
        """``1 - mass_after / mass_before`` per network."""
        return 1.0 - self.mass_after / self.mass_before

    @property
    def n_degenerate(self) -> int:
        return int(sum(int(m.sum()) for m in self.degenerate.values()))


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


def minmass(
    theta: Params,
    spec: Spec,
    tol: float = 1e-10,
    check: bool = True,
    strict: bool = True,
    **solver,
) -> MinMassResult:
    r"""The minimum-mass network of the scaling orbit of ``theta`` (paper Def. 3.3).

    .. math:: \lambda^* = \arg\min_{\lambda > 0} \sum_\ell \big\lVert \mathrm{diag}(\lambda_\ell)\,
              W_\ell\,\mathrm{diag}(\lambda_{\ell-1})^{-1} \big\rVert_F^2, \qquad
              \lambda_0 = \lambda_L = 1,

    with convolution weights summed over kernel positions and biases excluded.
    Degenerate neurons keep scale 1 and are reported; networks with BatchNorm
    must be folded first (:func:`fold_batchnorm`).

    Args:
        theta: parameters, optionally stacked along leading batch dimensions.
        spec: the architecture's symmetries (ReLU activations).
        tol: balance tolerance of the solver.
        check: verify that the scaled network computes the same function.
        strict: raise if some network did not converge.
        **solver: passed to :func:`solve` (``sweeps``, ``max_newton``, ``max_dense``).

    Returns:
        A :class:`MinMassResult`.
    """
    prob = problem(theta, spec)
    dead = degenerate(prob)
    sol = solve(prob, fixed=dead, tol=tol, **solver)
    batch = prob.batch
    if strict and not bool(sol.converged.all()):
        bad = int((~sol.converged).sum())
        raise RuntimeError(
            f"min-mass did not converge for {bad} network(s) (largest imbalance "
            f"{float(sol.residual.max()):.3g} > tol {tol:g}); raise max_newton or loosen tol"
        )
    scales = {k: torch.exp(v).reshape(*batch, -1) for k, v in sol.u.items()}
    theta64 = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in theta.items()}
    scaled = ops.scale(theta64, spec, scales)
    out = {k: scaled[k].to(theta[k].dtype) if theta[k].is_floating_point() else scaled[k] for k in theta}
    if check and spec.forward is not None:
        _check.assert_same_function(spec, theta, out, what="minmass")
    return MinMassResult(
        scales=scales,
        theta=out,
        mass_before=objective(prob, {k: torch.zeros_like(v) for k, v in sol.u.items()}).reshape(batch),
        mass_after=objective(prob, sol.u).reshape(batch),
        iterations=sol.sweeps + sol.newton_steps,
        converged=sol.converged.reshape(batch),
        residual=sol.residual.reshape(batch),
        degenerate={k: v.reshape(*batch, -1) for k, v in dead.items()},
    )


# --------------------------------------------------------------------------------------- cvxpy reference


def reference(
    theta: Params, spec: Spec, mode: str = "lse", solver: str = "CLARABEL", accurate: bool = True, **kw
) -> tuple[dict, float]:
    r"""The min-mass problem of ONE network solved by cvxpy (the paper's approach), as a reference.

    * ``mode="gp"``: the geometric program ``min sum_ij Q_ij lam_i^2 / lam_j^2`` over
      positive variables (``solve(gp=True)``); one monomial per non-zero weight,
      so only for small networks.
    * ``mode="lse"``: the equivalent convex program ``min log sum exp(2 u_i - 2 u_j + log Q_ij)``
      in ``u = log lam`` (one sparse affine map), which scales further.

    Degenerate neurons are held at scale 1, as in :func:`minmass`.

    Args:
        theta: parameters of one network (no batch dimensions).
        spec: its symmetries.
        mode: ``"gp"`` or ``"lse"``.
        solver: a cvxpy solver name (clarabel by default; ``"SCS"`` also works, less accurately).
        accurate: with clarabel, tighten its tolerances to 1e-10 (the defaults give the optimal
            mass to about 1e-8 relative but the scales only to about 1e-4).
        **kw: passed to ``Problem.solve``.

    Returns:
        ``(scales, mass)``: ``lam`` per label (float64 tensors) and the optimal mass.
    """
    import cvxpy as cp
    import numpy as np
    import scipy.sparse as sp

    if solver == "CLARABEL" and accurate:  # tight tolerances, for scales accurate to ~1e-9
        kw = {"tol_gap_abs": 1e-10, "tol_gap_rel": 1e-10, "tol_feas": 1e-10, "tol_ktratio": 1e-8, **kw}
    prob = problem(theta, spec)
    if prob.batch:
        raise ValueError("reference() solves one network; pass theta without batch dimensions")
    fixed = degenerate(prob)
    off, N = prob.offsets, prob.size
    free = np.concatenate([(~fixed[k][0]).cpu().numpy() for k in prob.labels] or [np.zeros(0, bool)])
    idx = -np.ones(N, dtype=np.int64)
    idx[free] = np.arange(int(free.sum()))
    nv = int(free.sum())
    rows, cols, vals, logq, const = [], [], [], [], 0.0
    r = 0
    for t in prob.terms:
        q = t.q[0].cpu().numpy()
        ii, jj = np.nonzero(q > 0)
        if t.out is None and t.inp is None:
            const += float(q.sum())
            continue
        for side, lab, sign in ((ii, t.out, 2.0), (jj, t.inp, -2.0)):
            if lab is None:
                continue
            var = idx[off[lab] + side]
            keep = var >= 0
            rows.append(r + np.nonzero(keep)[0])
            cols.append(var[keep])
            vals.append(np.full(int(keep.sum()), sign))
        logq.append(np.log(q[ii, jj]))
        r += len(ii)
    A = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r, max(nv, 1))
    )
    c = np.concatenate(logq)
    if mode == "lse":
        u = cp.Variable(max(nv, 1))
        terms = A @ u + c
        if const > 0:
            terms = cp.hstack([terms, np.array([math.log(const)])])
        pr = cp.Problem(cp.Minimize(cp.log_sum_exp(terms)))
        pr.solve(solver=solver, **kw)
        uval = np.asarray(u.value, dtype=np.float64)
        value = math.exp(pr.value)
    elif mode == "gp":
        lam = cp.Variable(max(nv, 1), pos=True)
        A = A.tocsr()
        monos = []
        for k in range(r):
            lo, hi = A.indptr[k], A.indptr[k + 1]
            m = math.exp(c[k])
            for col, v in zip(A.indices[lo:hi], A.data[lo:hi], strict=True):
                m = m * lam[col] ** float(v)
            monos.append(m)
        obj = _balanced_sum(monos) + const
        pr = cp.Problem(cp.Minimize(obj))
        pr.solve(gp=True, solver=solver, **kw)
        uval = np.log(np.asarray(lam.value, dtype=np.float64))
        value = float(pr.value)
    else:
        raise ValueError(f"mode must be 'lse' or 'gp', got {mode!r}")
    if pr.status not in ("optimal", "optimal_inaccurate"):
        raise RuntimeError(f"cvxpy returned status {pr.status!r}")
    full = np.zeros(N)
    full[free] = uval[:nv]
    scales = {k: torch.from_numpy(np.exp(full[o : o + prob.labels[k]])) for k, o in off.items()}
    return scales, value


def _balanced_sum(xs):
    """Balanced sum of cvxpy expressions (a left fold nests too deeply for large GPs)."""
    xs = list(xs)
    while len(xs) > 1:
        xs = [operator.add(*xs[i : i + 2]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


# -------------------------------------------------------------------------------------------- BatchNorm

_CONV = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)
_BN = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


@dataclasses.dataclass(frozen=True)
class Folded:
    """Output of :func:`fold_batchnorm`: parameters and model without BatchNorm, and what was folded."""

    theta: Params
    model: torch.nn.Module
    pairs: tuple[tuple[str, str], ...]
    error: float | None


def _bn_pairs(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(conv, bn) module names where the BN's only input is the conv and the conv feeds only the BN."""
    gm = torch.fx.symbolic_trace(model)
    mods = dict(model.named_modules())
    pairs = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(mods.get(node.target), _BN):
            src = node.args[0]
            if (
                isinstance(src, torch.fx.Node)
                and src.op == "call_module"
                and isinstance(mods.get(src.target), _CONV)
                and len(src.users) == 1
            ):
                pairs.append((src.target, node.target))
            else:
                raise SymmetryError(
                    f"BatchNorm {node.target!r} does not directly follow a conv/linear layer used only by "
                    "it; min-mass cannot fold it (see the chapter 'Min-mass' on BatchNorm)"
                )
    return pairs


def _set_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def fold_batchnorm(
    theta: Params, model: torch.nn.Module, input_shape: tuple[int, ...] | None = None, check: bool = True
) -> Folded:
    r"""Fold every eval-mode BatchNorm into the convolution (or linear layer) before it.

    .. math:: W' = \mathrm{diag}\Big(\frac{\gamma}{\sqrt{\sigma^2 + \epsilon}}\Big) W, \qquad
              b' = \frac{\gamma\,(b - \mu)}{\sqrt{\sigma^2 + \epsilon}} + \beta .

    The folded network computes exactly the eval-mode function of the original
    (up to rounding) and has no BatchNorm, so its min-mass problem is well posed
    (a conv followed by BatchNorm is invariant to the conv's output scale, which
    would let the mass shrink without bound). Masses reported for BatchNorm
    networks are those of the folded network.

    Args:
        theta: the model's ``state_dict``-like parameters (buffers included),
            optionally stacked along leading batch dimensions.
        model: the module ``theta`` belongs to (traced with ``torch.fx``).
        input_shape: shape of one input, for the functional check.
        check: compare outputs of the original and folded networks on random
            inputs (needs ``input_shape``).

    Returns:
        A :class:`Folded` with the new parameters, a new model (BatchNorms
        replaced by identities, folded layers given biases), the folded pairs and
        the functional error (``None`` without a check).
    """
    pairs = _bn_pairs(model)
    new_model = copy.deepcopy(model).eval()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    first = next(iter(shapes))
    nb = theta[first].ndim - len(shapes[first])
    out = dict(theta)
    for conv_name, bn_name in pairs:
        conv = model.get_submodule(conv_name)
        bn = model.get_submodule(bn_name)
        w = theta[f"{conv_name}.weight"]
        dt = w.dtype
        if bn.running_var is None:
            raise SymmetryError(f"BatchNorm {bn_name!r} tracks no running statistics; it cannot be folded")
        var = theta[f"{bn_name}.running_var"].to(torch.float64)
        mean = theta[f"{bn_name}.running_mean"].to(torch.float64)
        gamma = theta[f"{bn_name}.weight"].to(torch.float64) if bn.affine else torch.ones_like(var)
        beta = theta[f"{bn_name}.bias"].to(torch.float64) if bn.affine else torch.zeros_like(var)
        k = gamma / torch.sqrt(var + bn.eps)
        bias = theta.get(f"{conv_name}.bias")
        bias = bias.to(torch.float64) if bias is not None else torch.zeros_like(mean)
        wk = w.to(torch.float64) * k.reshape(*k.shape, *([1] * (w.ndim - nb - 1)))
        out[f"{conv_name}.weight"] = wk.to(dt)
        out[f"{conv_name}.bias"] = (k * (bias - mean) + beta).to(dt)
        for key in list(out):
            if key.startswith(bn_name + "."):
                del out[key]
        if conv.bias is None:
            if isinstance(conv, torch.nn.Linear):
                nc = torch.nn.Linear(conv.in_features, conv.out_features, bias=True)
            else:
                nc = type(conv)(
                    conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                    padding=conv.padding, dilation=conv.dilation, groups=conv.groups, bias=True,
                    padding_mode=conv.padding_mode,
                )
            _set_module(new_model, conv_name, nc)
        _set_module(new_model, bn_name, torch.nn.Identity())
    new_model = new_model.to(dtype=next(iter(theta.values())).dtype).eval()
    err = None
    if check and pairs:
        if input_shape is None:
            raise ValueError("fold_batchnorm(check=True) needs input_shape, the shape of one input sample")
        err = _compare(model, theta, new_model, out, input_shape, nb)
        tol = _check.default_tol(next(iter(theta.values())).dtype)
        if not err <= tol:
            raise _check.FunctionalMismatch(
                f"folding BatchNorm changed the function: error {err:.3g} > {tol:g}"
            )
    return Folded(out, new_model, tuple(pairs), err)


def _compare(m1, t1, m2, t2, input_shape, nb) -> float:
    dtype = next(iter(t1.values())).dtype
    device = next(iter(t1.values())).device
    x = torch.randn(8, *input_shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.to(dtype=dtype, device=device)
    m1 = copy.deepcopy(m1).eval().to(dtype)

    def f(model, theta):
        if nb == 0:
            return torch.func.functional_call(model, theta, (x,))
        flat = {k: v.reshape(-1, *v.shape[nb:]) for k, v in theta.items()}
        return torch.func.vmap(lambda p: torch.func.functional_call(model, p, (x,)))(flat)

    with torch.no_grad():
        ya, yb = f(m1, t1), f(m2, t2)
    return float((ya - yb).abs().max() / ya.abs().max().clamp_min(1.0))

