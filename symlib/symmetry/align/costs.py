r"""The alignment costs and their bilinear features (book: chapter "Aligning variational posteriors").

Every cost of :mod:`symlib.symmetry.align` is a sum of bilinear terms :math:`\langle F_k(t_0), P\,G_k(t_1)
\rangle` over the tensors a label touches (:class:`Cost`); :func:`w2_diag` and :func:`kl_diag` evaluate the
Wasserstein and KL divergences of two mean-field posteriors in closed form, :func:`interpolate` walks the
straight path between two aligned posteriors and :func:`barrier` measures the bump along it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from symlib.params import Params
from symlib.symmetry import ops
from symlib.symmetry.spec import Spec, SymmetryError

__all__ = ["COSTS", "Act", "Alignment", "Cost", "barrier", "interpolate", "kl_diag", "w2_diag"]

COSTS = ("weights", "wasserstein", "kl", "kl-mean")


@dataclasses.dataclass
class Alignment:
    """The result of :func:`~symlib.symmetry.align.align`.

    Attributes:
        perms: one permutation ``(n,)`` per label; ``ops.permute(mean1, spec, perms)`` is aligned.
        mean: the aligned means (side 1 permuted), every tensor of ``mean1``.
        std: the aligned standard deviations, or ``None`` when no ``std1`` was given.
        cost: the objective at the returned permutations (see ``costs``).
        costs: the objective before the first step and after every accepted step; it never increases.
            Over the aligned tensors only: the squared distance for ``"weights"``, :math:`W_2^2` for
            ``"wasserstein"``, the full KL for ``"kl"``, the mean term for ``"kl-mean"``.
        steps: the unit of every coordinate step, in order: a label, or ``"blocks:<tie>"`` for a
            step that moves whole blocks of grouped labels.
        rounds: rounds of coordinate descent run (the last one changed nothing when ``converged``).
        converged: whether a whole round left every permutation unchanged.
    """

    perms: dict[str, torch.Tensor]
    mean: Params
    std: Params | None
    cost: float
    costs: list[float]
    steps: list[str]
    rounds: int
    converged: bool


# ----------------------------------------------------------------------------- closed forms
def pairs(mean0, std0, mean1, std1):
    if isinstance(mean0, torch.Tensor):
        return [(mean0, std0, mean1, std1)]
    return [(mean0[k], std0[k], mean1[k], std1[k]) for k in mean0]


def w2_diag(mean0, std0, mean1, std1) -> torch.Tensor:
    r"""2-Wasserstein distance between diagonal Gaussians (book: chapter "Aligning variational posteriors").

    .. math:: W_2\big(\mathcal N(m_0, \mathrm{diag}\,s_0^2), \mathcal N(m_1, \mathrm{diag}\,s_1^2)\big)
              = \sqrt{\lVert m_0 - m_1\rVert^2 + \lVert s_0 - s_1\rVert^2},

    the general :math:`\lVert m_0 - m_1\rVert^2 + \mathrm{Tr}(\Sigma_0 + \Sigma_1
    - 2(\Sigma_0^{1/2}\Sigma_1\Sigma_0^{1/2})^{1/2})` for commuting (diagonal) covariances.

    Args:
        mean0, std0, mean1, std1: tensors, or state dicts with the keys of ``mean0`` (summed over).

    Returns:
        The distance (not squared), a 0-d tensor.
    """
    total = 0.0
    for m0, s0, m1, s1 in pairs(mean0, std0, mean1, std1):
        total = total + ((m0 - m1) ** 2).sum() + ((s0 - s1) ** 2).sum()
    return torch.as_tensor(total).sqrt()


def kl_diag(mean_p, std_p, mean_q, std_q) -> torch.Tensor:
    r""":math:`\mathrm{KL}[p \,\|\, q]` between diagonal Gaussians ``p = N(mean_p, std_p^2)``,
    ``q = N(mean_q, std_q^2)``.

    .. math:: \sum_i \log\frac{s_{q,i}}{s_{p,i}} + \frac{s_{p,i}^2 + (m_{p,i} - m_{q,i})^2}{2 s_{q,i}^2}
              - \frac12 .

    Args:
        mean_p, std_p, mean_q, std_q: tensors, or state dicts with the keys of ``mean_p``.
    """
    total = 0.0
    for mp, sp, mq, sq in pairs(mean_p, std_p, mean_q, std_q):
        total = total + (torch.log(sq / sp) + (sp**2 + (mp - mq) ** 2) / (2 * sq**2) - 0.5).sum()
    return torch.as_tensor(total)


def interpolate(mean0: Params, std0: Params | None, mean1: Params, std1: Params | None, t: float
                ) -> tuple[Params, Params | None]:
    r"""The posterior at ``t`` on the straight path from ``q_0`` (``t = 0``) to ``q_1`` (``t = 1``).

    Means and standard deviations move linearly: :math:`m_t = (1-t) m_0 + t m_1`,
    :math:`s_t = (1-t) s_0 + t s_1`. For diagonal Gaussians this is the 2-Wasserstein geodesic
    (:math:`W_2(q_0, q_t) = t\,W_2(q_0, q_1)`). Tensors that are not floating point (e.g. BatchNorm's
    ``num_batches_tracked``) are taken from side 0. Interpolate *aligned* posteriors
    (:func:`~symlib.symmetry.align.align`) to measure a loss barrier modulo permutations.

    Args:
        mean0, std0, mean1, std1: state dicts; the stds may be ``None`` (point estimates).
        t: position on the path, usually in [0, 1].

    Returns:
        ``(mean_t, std_t)``, new dicts (``std_t`` is ``None`` when either std is ``None``).
    """
    def lerp(a: Params, b: Params) -> Params:
        out = {}
        for k, v in a.items():
            if k not in b:
                raise KeyError(f"tensor {k!r} is missing from side 1; interpolate posteriors of one model")
            out[k] = (1 - t) * v + t * b[k] if v.is_floating_point() else v.clone()
        return out

    mean = lerp(mean0, mean1)
    std = lerp(std0, std1) if std0 is not None and std1 is not None else None
    return mean, std


# ----------------------------------------------------------------------------- the descent
@dataclasses.dataclass(frozen=True)
class Act:
    """One action of a label on a tensor the cost reads: entries ``start`` to ``start + n*inner - 1`` of axis
    ``axis`` of ``param`` permuted by ``label``, each label entry moving ``inner`` consecutive entries
    (:class:`~symlib.symmetry.actions.Action`; the whole axis for most layers)."""

    param: str
    axis: int
    label: str
    start: int = 0
    n: int = 0
    inner: int = 1

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as one row per label entry, ``(n, rest)`` (the slice the action covers)."""
        part = t.narrow(self.axis, self.start, self.n * self.inner).movedim(self.axis, 0)
        return part.reshape(self.n, -1)

    def blocks(self, t: torch.Tensor, groups: int) -> torch.Tensor:
        """``t`` as ``(groups, entries per group, rest)`` (the slice the action covers)."""
        return self.rows(t).reshape(groups, self.n // groups, -1)

    def permute(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """``t`` with the slice this action covers permuted by ``p`` (entry ``i`` takes entry ``p[i]``)."""
        idx = (p.to(t.device)[:, None] * self.inner + torch.arange(self.inner, device=t.device)).flatten()
        if self.start == 0 and self.n * self.inner == t.shape[self.axis]:
            return t.index_select(self.axis, idx)
        full = torch.arange(t.shape[self.axis], device=t.device)
        full[self.start:self.start + self.n * self.inner] = idx + self.start
        return t.index_select(self.axis, full)


def touched(spec: Spec, names) -> list[Act]:
    acts = [Act(a.param, a.axis, a.perm, a.start, spec.perms[a.perm], a.inner)
            for a in spec.actions if a.perm is not None and a.param in names]
    axes: dict[tuple[str, str], int] = {}
    for a in acts:
        if axes.setdefault((a.param, a.label), a.axis) != a.axis:
            raise SymmetryError(
                f"label {a.label!r} acts on two axes of {a.param!r}: its assignment is quadratic, not "
                "linear, and this alignment does not solve it; leave that tensor out with names="
            )
    return acts


def features(cost, mean0, std0, mean1, std1, names):
    """Feature tensors ``F_k`` (side 0) and ``G_k`` (side 1) with
    ``c(P) = const + sum_k <F_k, P G_k>`` (module docstring), per tensor name."""
    fa: dict[str, list[torch.Tensor]] = {}
    fb: dict[str, list[torch.Tensor]] = {}
    for k in names:
        m0 = mean0[k].to(torch.float64)
        m1 = mean1[k].to(torch.float64)
        s0 = std0[k].to(torch.float64) if k in std0 else torch.zeros_like(m0)
        s1 = std1[k].to(torch.float64) if k in std1 else torch.zeros_like(m1)
        if cost == "weights":
            fa[k], fb[k] = [m0], [-2 * m1]
        elif cost == "wasserstein":
            fa[k], fb[k] = [m0, s0], [-2 * m1, -2 * s1]
        else:
            w = 1.0 / s0**2
            second = m1**2 + s1**2 if cost == "kl" else m1**2
            fa[k], fb[k] = [w / 2, w * m0], [second, -m1]
    return fa, fb


class Cost:
    """The exact objective as a sum of per-tensor terms, recomputed only for the tensors whose labels
    changed (grouped weights as dense tensors, their off-block zeros masked out)."""

    def __init__(self, cost, spec: Spec, mean0, std0, mean1, std1, names, by_param):
        self.cost, self.by_param = cost, by_param
        self.by_label: dict[str, set[str]] = {}
        for param, acts in by_param.items():
            for a in acts:
                self.by_label.setdefault(a.label, set()).add(param)
        self.t = {}
        for k in names:
            m0, m1 = mean0[k].to(torch.float64), mean1[k].to(torch.float64)
            s0 = std0[k].to(torch.float64) if k in std0 else torch.zeros_like(m0)
            s1 = std1[k].to(torch.float64) if k in std1 else torch.zeros_like(m1)
            grouped = spec.groups_of(k) > 1
            mask = ops.dense_weight({k: torch.ones_like(m0)}, spec, k).bool() if grouped else None
            self.t[k] = tuple(ops.dense_weight({k: x}, spec, k) for x in (m0, s0, m1, s1)) + (mask,)
        self.terms = {k: self._term(k, {}) for k in self.t}

    def _term(self, k, perms) -> float:
        m0, s0, m1, s1, mask = self.t[k]
        for a in self.by_param.get(k, []):
            if a.label in perms:
                m1, s1 = a.permute(m1, perms[a.label]), a.permute(s1, perms[a.label])
        if mask is not None:
            m0, s0, m1, s1 = m0[mask], s0[mask], m1[mask], s1[mask]
        if self.cost == "weights":
            return float(((m0 - m1) ** 2).sum())
        if self.cost == "wasserstein":
            return float(((m0 - m1) ** 2).sum() + ((s0 - s1) ** 2).sum())
        if self.cost == "kl":
            return float(kl_diag(m1, s1, m0, s0))
        return float(((m0 - m1) ** 2 / (2 * s0**2)).sum())

    def value(self, perms, labels=None) -> tuple[float, dict[str, float]]:
        """The objective at ``perms``, recomputing the tensors of ``labels`` (all when ``None``)."""
        keys = self.t if labels is None else {k for q in labels for k in self.by_label.get(q, ())}
        terms = {**self.terms, **{k: self._term(k, perms) for k in keys}}
        return math.fsum(terms.values()), terms


def barrier(values) -> float:
    r"""Loss barrier along a path: :math:`\max_t \big(L(t) - [(1-t) L(0) + t L(1)]\big)` for losses
    ``values`` measured at evenly spaced ``t`` from 0 to 1 (Frankle et al. 2020)."""
    v = [float(x) for x in values]
    if len(v) < 2 or not all(math.isfinite(x) for x in v):
        raise ValueError("barrier needs at least two finite losses, the path's ends included")
    n = len(v) - 1
    return max(x - ((1 - i / n) * v[0] + (i / n) * v[-1]) for i, x in enumerate(v))
