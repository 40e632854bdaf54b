r"""The coarse problem of the min-mass solver: one log-scale shift per label (book: chapter "Min-mass").
See :mod:`symlib.symmetry.minmass`.

Gauss-Seidel sweeps balance each neuron against its neighbours, which removes the local imbalances
quickly but the global ones slowly: shifting *every* neuron of a label by the same log-scale :math:`t`
changes only the terms that link it to other labels, and along a chain of labels (a ResNet-50
bottleneck, ``stream -> conv1 -> conv2 -> conv3 -> stream``, stacked sixteen times) the sweeps pass such a
shift on one label per sweep, like heat along a rod. The coarse problem finds the best shifts of all
labels at once. Writing :math:`m_T` for the mass of term :math:`T` at the current scales, split by which
sides of the term move (degenerate neurons stay put), the mass after the shifts :math:`t` is exactly

.. math:: M(t) = \sum_T m^{11}_T e^{2 t_{o(T)} - 2 t_{i(T)}} + m^{10}_T e^{2 t_{o(T)}}
          + m^{01}_T e^{-2 t_{i(T)}} + m^{00}_T,

a convex function of one variable per label: a few Newton steps on a matrix of the size of the number
of labels (about a hundred) minimise it, at the cost of one pass over the weights to get the
:math:`m_T`. Alternating this correction with the sweeps is a two-level method (the labels as the
coarse grid); on ResNet-50 it takes the solver from about 1,400 sweeps to a few dozen.
"""

from __future__ import annotations

import torch

from symlib.symmetry.minmass.terms import Problem, _factors, _mv


def _components(prob: Problem, u: dict, free: dict, masses=None) -> tuple[torch.Tensor, ...]:
    """Every term's mass split by which sides shift: ``(jo, ji, m)`` with label indices ``(C,)`` (``-1``:
    that side does not shift) and masses ``(B, C)``. ``masses``: the terms' masses at ``u`` when already
    known, used as they are when no neuron is degenerate."""
    index = {k: j for j, k in enumerate(prob.labels)}
    dev = prob.terms[0].q.device
    if masses is not None and all(bool(f.all()) for f in free.values()):
        jo = [index[t.out] if t.out is not None else -1 for t in prob.terms]
        ji = [index[t.inp] if t.inp is not None else -1 for t in prob.terms]
        return torch.tensor(jo, device=dev), torch.tensor(ji, device=dev), torch.stack(masses, -1)
    jo, ji, ms = [], [], []
    for t in prob.terms:
        a, b = _factors(t, u)
        a_parts, b_parts = _sides(t.out, a, free, index), _sides(t.inp, b, free, index)
        for i_side, bv in b_parts:
            qb = _mv(t.q, bv)
            for o_side, av in a_parts:
                jo.append(o_side)
                ji.append(i_side)
                ms.append((av * qb).sum(-1))
    return torch.tensor(jo, device=dev), torch.tensor(ji, device=dev), torch.stack(ms, -1)


def _sides(label, v, free, index) -> list[tuple[int, torch.Tensor]]:
    """``v`` split into the entries that shift with ``label`` (its free neurons) and those that do not."""
    if label is None:
        return [(-1, v)]
    f = free[label]
    if bool(f.all()):
        return [(index[label], v)]
    return [(index[label], v * f), (-1, v * ~f)]


def _value_grad_hess(t, jo, ji, m, with_hess=True):
    """``M(t)``, its gradient and Hessian for shifts ``t`` ``(B, L)`` (module docstring)."""
    B, L = t.shape
    pad = torch.cat([t, torch.zeros(B, 1, dtype=t.dtype, device=t.device)], -1)  # index -1: no shift
    e = m * torch.exp(2 * pad[:, jo] - 2 * pad[:, ji])
    f = e.sum(-1)
    so, si = jo.clamp_min(0), ji.clamp_min(0)
    eo, ei = torch.where(jo >= 0, e, 0.0), torch.where(ji >= 0, e, 0.0)
    g = torch.zeros(B, L, dtype=t.dtype, device=t.device)
    g.index_add_(1, so, 2 * eo).index_add_(1, si, -2 * ei)
    if not with_hess:
        return f, g, None
    H = torch.zeros(B, L * L, dtype=t.dtype, device=t.device)
    both = torch.where((jo >= 0) & (ji >= 0), e, 0.0)
    H.index_add_(1, so * L + so, 4 * eo).index_add_(1, si * L + si, 4 * ei)
    H.index_add_(1, so * L + si, -4 * both).index_add_(1, si * L + so, -4 * both)
    return f, g, H.reshape(B, L, L)


def correct(prob: Problem, u: dict, free: dict, masses=None, max_newton: int = 30) -> dict:
    """``u`` with the best shift of each label's free neurons added (the coarse problem, minimised).

    ``masses``: every term's mass at ``u`` (``(B,)`` each, in term order), when already computed."""
    jo, ji, m = _components(prob, u, free, masses)
    B = m.shape[0]
    L = len(prob.labels)
    movable = torch.stack([free[k].any(-1) for k in prob.labels], -1)  # (B, L)
    t = torch.zeros(B, L, dtype=m.dtype, device=m.device)
    f, g, H = _value_grad_hess(t, jo, ji, m)
    eye = torch.eye(L, dtype=m.dtype, device=m.device)
    for _ in range(max_newton):
        g = torch.where(movable, g, 0.0)
        H = torch.where(movable[:, :, None] & movable[:, None, :], H, 0.0) + eye * (~movable)[:, None, :]
        ridge = 1e-12 * H.diagonal(dim1=1, dim2=2).amax(-1).clamp_min(1e-300)[:, None, None]
        d = torch.linalg.solve(H + ridge * eye, -g.unsqueeze(-1)).squeeze(-1)
        slope = (g * d).sum(-1)
        if bool((-slope <= 1e-14 * f).all()):  # Newton decrement below rounding: converged
            break
        step = torch.ones(B, dtype=m.dtype, device=m.device)
        for _ in range(40):  # backtracking (Armijo) per network
            new, _, _ = _value_grad_hess(t + step[:, None] * d, jo, ji, m, with_hess=False)
            ok = new <= f + 1e-4 * step * slope
            if bool(ok.all()):
                break
            step = torch.where(ok, step, 0.5 * step)
        t = t + step[:, None] * d
        f, g, H = _value_grad_hess(t, jo, ji, m)
    return {k: torch.where(free[k], u[k] + t[:, j:j + 1], u[k]) for j, k in enumerate(prob.labels)}
