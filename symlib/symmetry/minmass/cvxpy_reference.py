r"""The cvxpy reference solver of the min-mass problem (the paper's approach; cvxpy is imported only
when it runs). See :mod:`symlib.symmetry.minmass`."""

from __future__ import annotations

import math
import operator

import torch

from symlib.symmetry.minmass.terms import degenerate, problem
from symlib.symmetry.spec import Params, Spec


def reference(
    theta: Params, spec: Spec, mode: str = "lse", solver: str = "CLARABEL", accurate: bool = True, **kw
) -> tuple[dict, float]:
    r"""The min-mass problem of ONE network solved by cvxpy (the paper's approach), as a reference.

    * ``mode="gp"``: the geometric program ``min sum_ij Q_ij lam_i^2 / lam_j^2`` over
      positive variables (``solve(gp=True)``); one monomial per non-zero weight,
      so only for small networks.
    * ``mode="lse"``: the equivalent convex program ``min log sum exp(2 u_i - 2 u_j + log Q_ij)``
      in ``u = log lam`` (one sparse affine map), which scales further.

    Degenerate neurons are held at scale 1, as in :func:`~symlib.symmetry.minmass.minmass`.

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
