r"""The fast min-mass solver: closed-form Gauss-Seidel sweeps, then damped Newton steps in log space,
batched over networks (book: chapter "Min-mass"; paper Prop. 2). See :mod:`symlib.symmetry.minmass`."""

from __future__ import annotations

import dataclasses

import torch

from symlib.symmetry import check as _check
from symlib.symmetry import ops
from symlib.symmetry.minmass import coarse as _coarse
from symlib.symmetry.minmass.terms import (
    Problem,
    _factors,
    _in_out,
    _mv,
    _vm,
    degenerate,
    objective,
    problem,
)
from symlib.symmetry.spec import Params, Spec


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
    """One Gauss-Seidel pass: each label in turn gets its closed-form optimum ``u = log(B/A) / 4``.

    The factors ``exp(+-2 u)`` of each label are computed once and refreshed when the label moves."""
    u = dict(u)
    q0 = prob.terms[0].q
    one = torch.ones(q0.shape[0], 1, dtype=q0.dtype, device=q0.device)
    up = {k: torch.exp(2 * v) for k, v in u.items()}
    down = {k: torch.exp(-2 * v) for k, v in u.items()}
    into, out_of = {k: [] for k in prob.labels}, {k: [] for k in prob.labels}
    for t in prob.terms:
        if t.out is not None:
            into[t.out].append(t)
        if t.inp is not None:
            out_of[t.inp].append(t)
    for k in prob.labels:
        A, Bm = 0.0, 0.0
        for t in into[k]:
            A = A + _mv(t.q, down[t.inp] if t.inp is not None else one)
        for t in out_of[k]:
            Bm = Bm + _vm(up[t.out] if t.out is not None else one, t.q)
        f = free[k]
        A = torch.where(f, A, 1.0)
        Bm = torch.where(f, Bm, 1.0)
        u[k] = torch.where(f, 0.25 * (torch.log(Bm) - torch.log(A)), u[k])
        up[k], down[k] = torch.exp(2 * u[k]), torch.exp(-2 * u[k])
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


def _state(prob: Problem, u: dict, free: dict) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """In one pass over the weights: the largest relative imbalance (as :func:`_residual`), the mass
    (as :func:`~symlib.symmetry.minmass.terms.objective`) and every term's mass, each ``(B,)``."""
    inc = {k: 0.0 for k in prob.labels}
    outg = {k: 0.0 for k in prob.labels}
    masses = []
    for t in prob.terms:
        a, b = _factors(t, u)
        incoming = a * _mv(t.q, b)
        masses.append(incoming.sum(-1))
        if t.out is not None:
            inc[t.out] = inc[t.out] + incoming
        if t.inp is not None:
            outg[t.inp] = outg[t.inp] + b * _vm(a, t.q)
    res = [
        torch.where(free[k], (inc[k] - outg[k]).abs() / (inc[k] + outg[k]), 0.0).amax(-1)
        for k in prob.labels
    ]
    total = masses[0]
    for m in masses[1:]:
        total = total + m
    return torch.stack(res, -1).amax(-1), total, masses


def _large(prob: Problem, u: dict, free: dict, tol: float, max_sweeps: int, coarse: bool, anderson: int
           ) -> tuple[dict, int]:
    r"""The iteration for networks too large for dense Newton; returns ``u`` and the iteration count.

    One iteration maps ``x`` (the flat log-scales) to ``G(x)``: a coarse correction, then a sweep. Both
    lower the mass, but ``G`` contracts slowly on deep networks; Anderson acceleration (type II, over the
    last ``anderson`` steps) replaces ``G(x)`` by the combination of past iterates whose residuals
    ``f = G(x) - x`` cancel best, :math:`x + f - (\Delta X + \Delta F)\gamma` with
    :math:`\gamma = \arg\min \lVert f - \Delta F \gamma \rVert`. A combination heavier than ``x``
    is dropped for ``G(x)`` (and the history restarted), so the mass decreases at every iteration.
    """
    x = _flat(prob, u)
    X: list[torch.Tensor] = []
    F: list[torch.Tensor] = []
    n = 0
    res, mass, masses = _state(prob, u, free)
    while n < max_sweeps and not bool((res <= tol).all()):
        v = _unflat(prob, x)
        if coarse:  # the slow, label-wide modes of the sweeps, solved exactly
            v = _coarse.correct(prob, v, free, masses)
        gx = _flat(prob, _sweep(prob, v, free))
        n += 1
        new = gx
        if anderson:
            f = gx - x
            X.append(x)
            F.append(f)
            del X[: -(anderson + 1)], F[: -(anderson + 1)]
            if len(X) > 1:
                dx = torch.stack([b - a for a, b in zip(X, X[1:], strict=False)], -1)
                df = torch.stack([b - a for a, b in zip(F, F[1:], strict=False)], -1)
                gamma = torch.linalg.lstsq(df, f.unsqueeze(-1)).solution
                new = x + f - ((dx + df) @ gamma).squeeze(-1)
        done = (res <= tol).unsqueeze(-1)  # converged networks stay where they are
        state = _state(prob, _unflat(prob, torch.where(done, x, new)), free)
        downhill = state[1] <= mass * (1 + 1e-14)  # (to rounding: near the optimum both are equal)
        if new is not gx and not bool(downhill.all()):  # the extrapolation went uphill somewhere
            X, F = [], []
            new = torch.where(downhill.unsqueeze(-1), new, gx)
            state = _state(prob, _unflat(prob, torch.where(done, x, new)), free)
        x = torch.where(done, x, new)
        res, mass, masses = state
    return _unflat(prob, x), n


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
    coarse: bool = True,
    anderson: int = 6,
) -> Solution:
    r"""Minimise ``M(u)`` for every network of the batch (see the module docstring).

    Args:
        prob: the problem, from :func:`problem`.
        u0: starting log-scales per label ``(B, n)``; zeros (the given network) by default.
        fixed: neurons whose log-scale stays at ``u0`` (default: :func:`degenerate`).
        tol: convergence when every free neuron has ``|in - out| <= tol (in + out)``.
        sweeps: closed-form Gauss-Seidel sweeps before Newton.
        max_newton: most Newton steps.
        max_dense: networks with more scale variables than this (ResNet-50 has
            11,456) skip the dense Newton steps, whose Cholesky factorisation grows
            as the cube of that number, and iterate (up to ``max_sweeps`` times) a
            coarse correction (:mod:`~symlib.symmetry.minmass.coarse`) followed by a
            Gauss-Seidel sweep, extrapolated by Anderson acceleration.
        coarse: whether those iterations start with a coarse correction.
        anderson: how many past iterations the extrapolation combines (0: none).
            With ``coarse=False, anderson=0`` the large networks get plain sweeps,
            the solver's former method (1,415 sweeps on ResNet-50, against 21).

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
    if dense:
        for _ in range(sweeps):
            u = _sweep(prob, u, free)
            n_sweeps += 1
    else:
        u, n_sweeps = _large(prob, u, free, tol, max_sweeps, coarse, anderson)
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
    must be folded first (:func:`~symlib.symmetry.minmass.fold_batchnorm`).

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
