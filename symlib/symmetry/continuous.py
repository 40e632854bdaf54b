r"""The continuous symmetries of attention (book: chapter "Transformers: permutations without scalings";
Tran et al. 2024 for the group of multi-head attention).

Head :math:`i` of an attention layer scores queries against keys with :math:`Q_i K_i^\top` and passes
its values to the output projection as :math:`W_{O,i} V_i`. Both products are unchanged by any invertible
change of basis of the head's features:

.. math:: Q_i \to A_i Q_i,\quad K_i \to A_i^{-\top} K_i \qquad (A_i \in GL(d_k)),
.. math:: V_i \to B_i V_i,\quad W_{O,i} \to W_{O,i} B_i^{-1} \qquad (B_i \in GL(d_v)),

where :math:`Q_i, K_i, V_i` stand for the rows of the projections (weights and biases) that produce the
head's features. Permutations of the features (the spec's permutation labels) and per-feature scalings
are the permutation and diagonal matrices of these groups. Two more directions are redundant biases:
a key bias :math:`b_K` adds :math:`q^\top b_K` to every score of a query, a constant the softmax removes,
so :math:`b_K` is free; and a value bias passes through attention unchanged (the weights of a query sum
to 1), so :math:`b_V \to b_V - \delta`, :math:`b_O \to b_O + W_O \delta` is a symmetry.

Rotary embeddings (Llama, Mistral, Qwen2) leave of a query-key head's :math:`GL(d)` one rotation and one
scale per pair :math:`(i, i + d/2)` of features (``symlib.symmetry.trace.heads`` derives it): a complex
number :math:`z_i` on :math:`x_i + \mathrm{i}\,x_{i+d/2}`, :math:`z` on the query rows of every query head
of a key-value group and :math:`1/\bar z` on the group's key rows, so that
:math:`\overline{z q}\,(k/\bar z) = \bar q k` and every score :math:`\mathrm{Re}\sum_i \bar q_i
e^{\mathrm{i}(n-m)\omega_i} k_i` is kept (multiplications by complex numbers commute). ``Spec.rotary``
records it (:class:`~symlib.symmetry.actions.Rotary`), :math:`d` dimensions per key-value head. It holds no
permutation of the heads (it acts inside each head), so the head permutations stay discrete.

A :class:`~symlib.symmetry.spec.Spec` records these groups in ``Spec.continuous`` (traced by
:func:`symlib.symmetry.trace.spec_of`): :func:`dims` counts them, :func:`act` and :func:`shift_biases`
apply them, :func:`random_element` draws one, and :func:`align_heads` moves one network towards another
by the orthogonal matrices of these groups (used by :func:`symlib.merge` with ``orthogonal=True``).
Canonical forms and min-mass act on the permutations (a subgroup) and leave the rest of these groups
alone.
"""

from __future__ import annotations

import math

import torch

from symlib.params import Params
from symlib.symmetry.spec import Action, Spec, SymmetryError

__all__ = ["act", "align_heads", "dims", "random_element", "random_shifts", "rotate", "shift_biases"]


def _blocks(spec: Spec, label: str) -> tuple[int, int]:
    groups = spec.blocks[label][0] if label in spec.blocks else 1
    return groups, spec.perms[label] // groups


def dims(spec: Spec) -> dict[str, int]:
    r"""Continuous dimensions per label: :math:`G k^2` for :math:`G` blocks (heads) of :math:`k` features
    of a label of ``Spec.continuous`` (:math:`GL(k)` per head), plus the label's redundant biases, plus, for
    the key heads label of a rotary group (``Spec.rotary``), :math:`d` per key-value head of :math:`d`
    features."""
    out = {}
    for label, (_, extra) in spec.continuous.items():
        g, k = _blocks(spec, label)
        out[label] = g * k * k + extra
    for label, r in spec.rotary.items():
        out[label] = out.get(label, 0) + r.heads * r.per_head
    return out


def random_element(spec: Spec, generator: torch.Generator | None = None, spread: float = 0.3,
                   dtype=torch.float64) -> dict[str, torch.Tensor]:
    r"""One random invertible matrix per head of every continuous label: :math:`\exp(s X / \sqrt{k})` with
    :math:`X` standard normal, ``(G, k, k)`` per label (a matrix exponential is always invertible); for a
    rotary group, one complex number per pair and key-value head, :math:`\exp(s a + 2\pi s b\,\mathrm{i})`
    with :math:`a, b` standard normal, ``(heads, d/2)`` complex (:func:`rotate`)."""
    out = {}
    for label in spec.continuous:
        g, k = _blocks(spec, label)
        x = torch.randn(g, k, k, generator=generator, dtype=torch.float64)
        out[label] = torch.linalg.matrix_exp(spread * x / math.sqrt(k)).to(dtype)
    for label, r in spec.rotary.items():  # z = exp(a + i b): scale exp(a), angle b
        x = torch.randn(2, r.heads, r.per_head // 2, generator=generator, dtype=torch.float64)
        out[label] = torch.exp(torch.complex(spread * x[0], 2 * math.pi * spread * x[1]))
    return out


def _along(t: torch.Tensor, a: Action, spec: Spec, fn) -> torch.Tensor:
    """``t`` with ``fn`` applied to the ``(..., G, k, ...)`` view of the slice that action ``a`` covers."""
    if a.inner != 1 or a.groups != 1:
        raise SymmetryError(f"the continuous label {a.perm!r} acts on blocks of {a.param!r}: not supported")
    d = t.ndim - len(spec.shapes[a.param]) + a.axis
    start, stop = spec.span(a)
    g, k = _blocks(spec, a.perm)
    part = t.narrow(d, start, stop - start)
    new = fn(part.unflatten(d, (g, k)), d).flatten(d, d + 1)
    return torch.cat((t.narrow(d, 0, start), new, t.narrow(d, stop, t.shape[d] - stop)), d)


def act(theta: Params, spec: Spec, mats: dict[str, torch.Tensor]) -> Params:
    r"""Apply one invertible matrix per head, ``mats[label]`` of shape ``(G, k, k)``: :math:`A` on the
    label's power +1 side, :math:`A^{-\top}` on its power -1 side (module docstring); for the label of a
    rotary group, complex numbers ``(heads, d/2)`` (:func:`rotate`). ``theta`` may carry leading batch
    dimensions (one matrix per head for all networks)."""
    out = dict(theta)
    rotary = {label: m for label, m in mats.items() if label in spec.rotary and m.is_complex()}
    if rotary:
        out = rotate(out, spec, rotary)
    for label, m in mats.items():
        if label in rotary:
            continue
        if label not in spec.continuous:
            raise SymmetryError(f"{label!r} carries no continuous group; those that do: "
                                f"{list(spec.continuous)}")
        inv_t = torch.linalg.inv(m).transpose(-1, -2)
        for a in spec.actions:
            if a.perm != label:
                continue
            mat = (m if a.power > 0 else inv_t).to(out[a.param].dtype)

            def apply(x, d, mat=mat):  # x[..., g, j, ...] -> sum_j mat[g, i, j] x[..., g, j, ...]
                y = torch.einsum("gij,...gj->...gi", mat, x.movedim((d, d + 1), (-2, -1)))
                return y.movedim((-2, -1), (d, d + 1))

            out[a.param] = _along(out[a.param], a, spec, apply)
    return out


def rotate(theta: Params, spec: Spec, zs: dict[str, torch.Tensor]) -> Params:
    r"""Apply rotary groups (``Spec.rotary``): ``zs[label]``, complex ``(heads, d/2)``, turns and scales the
    pair :math:`(x_i, x_{i+d/2})` of the query rows of every query head of key-value group ``j`` as
    :math:`x_i + \mathrm{i}\,x_{i+d/2} \to z_{j,i}(x_i + \mathrm{i}\,x_{i+d/2})`, and of the group's key
    rows by :math:`1/\bar z_{j,i}` (:math:`A^{-\top}` of :math:`A = s R(\phi)`; module docstring), on the
    weights' rows and the biases alike. ``theta`` may carry leading batch dimensions."""
    out = dict(theta)
    for label, z in zs.items():
        r = spec.rotary.get(label)
        if r is None:
            raise SymmetryError(f"{label!r} carries no rotary group; those that do: {list(spec.rotary)}")
        if tuple(z.shape) != (r.heads, r.per_head // 2) or not z.is_complex():
            raise SymmetryError(f"the rotary group of {label!r} takes complex numbers of shape "
                                f"({r.heads}, {r.per_head // 2}), got {tuple(z.shape)} {z.dtype}")
        for rows, factor in ((r.queries, z), (r.keys, 1 / z.conj())):
            for param, start, stop in rows:
                t = out[param]
                d = t.ndim - len(spec.shapes[param])
                per = (stop - start) // (r.heads * r.per_head)  # query heads per key-value head
                part = t.narrow(d, start, stop - start).movedim(d, -1)
                x = part.unflatten(-1, (r.heads, per, 2, r.per_head // 2))
                c = torch.complex(x[..., 0, :], x[..., 1, :]) * factor[:, None, :].to(
                    torch.complex128 if t.dtype == torch.float64 else torch.complex64)
                new = torch.stack((c.real, c.imag), -2).to(t.dtype).flatten(-4).movedim(-1, d)
                out[param] = torch.cat((t.narrow(d, 0, start), new, t.narrow(d, stop, t.shape[d] - stop)), d)
    return out


def _heads_view(t: torch.Tensor, a: Action, spec: Spec) -> torch.Tensor:
    """The slice of ``t`` that action ``a`` covers as ``(G, k, rest)``: one ``k x rest`` matrix per head."""
    d = a.axis
    start, stop = spec.span(a)
    g, k = _blocks(spec, a.perm)
    part = t.narrow(d, start, stop - start).unflatten(d, (g, k)).movedim((d, d + 1), (0, 1))
    return part.reshape(g, k, -1)


def align_heads(a: Params, b: Params, spec: Spec) -> Params:
    r"""``b`` moved towards ``a`` by one orthogonal matrix per head of every continuous label (orthogonal
    Procrustes, book: chapter "Transformers"): the orthogonal matrices of :math:`GL(d_k)` and
    :math:`GL(d_v)`, for which :math:`A^{-\top} = A`, so the queries' and the keys' rows (the values' rows
    and the output projection's columns) of head :math:`g` all turn by the same :math:`R_g`. The
    :math:`R_g` maximising :math:`\sum_t \langle X^a_{t,g}, R_g X^b_{t,g} \rangle` over the tensors
    :math:`t` the label acts on is :math:`U V^\top` for the SVD :math:`U S V^\top` of
    :math:`\sum_t X^a_{t,g} {X^b_{t,g}}^\top` (one ``k x k`` matrix per head). ``b``'s function is kept
    (:func:`act`). Labels acting on blocks of entries (rotary heads) are left alone. One network each,
    without batch dimensions."""
    mats = {}
    for label in spec.continuous:
        acts = [x for x in spec.actions if x.perm == label]
        if not acts or any(x.inner != 1 or x.groups != 1 for x in acts):
            continue
        cov = sum(_heads_view(a[x.param], x, spec).to(torch.float64)
                  @ _heads_view(b[x.param], x, spec).to(torch.float64).transpose(-1, -2) for x in acts)
        u, _, vh = torch.linalg.svd(cov)
        mats[label] = u @ vh
    return act(b, spec, mats) if mats else dict(b)


def _bias_actions(spec: Spec, label: str, sign: int) -> list[Action]:
    return [a for a in spec.actions if a.perm == label and a.param not in spec.weights
            and len(spec.shapes[a.param]) == 1 and a.power * sign > 0]


def random_shifts(spec: Spec, generator: torch.Generator | None = None, dtype=torch.float64
                  ) -> dict[str, torch.Tensor]:
    """A random shift ``(n,)`` for every continuous label with redundant biases."""
    return {label: torch.randn(spec.perms[label], generator=generator, dtype=torch.float64).to(dtype)
            for label, (_, extra) in spec.continuous.items() if extra}


def shift_biases(theta: Params, spec: Spec, shifts: dict[str, torch.Tensor]) -> Params:
    r"""Move along the redundant bias directions: for a query-key label, the key bias
    :math:`b_K \to b_K + \delta`; for a value label, :math:`b_V \to b_V - \delta` and
    :math:`b_O \to b_O + W_O \delta` (module docstring). Networks without batch dimensions."""
    out = dict(theta)
    for label, delta in shifts.items():
        kind, extra = spec.continuous.get(label, (None, 0))
        if not extra:
            raise SymmetryError(f"{label!r} has no redundant bias to shift")
        for a in _bias_actions(spec, label, -1 if kind == "qk" else 1):
            start, stop = spec.span(a)
            step = delta if kind == "qk" else -delta
            out[a.param] = out[a.param].index_add(0, torch.arange(start, stop), step.to(out[a.param].dtype))
        if kind == "vo":
            for a in spec.actions:
                if a.perm == label and a.param in spec.weights and a.power < 0:
                    w = out[a.param]
                    start, stop = spec.span(a)
                    part = w.narrow(a.axis, start, stop - start).movedim(a.axis, -1)
                    bias = f"{a.param.rsplit('.', 1)[0]}.bias"
                    out[bias] = out[bias] + (part @ delta.to(w.dtype)).reshape(out[bias].shape)
    return out
