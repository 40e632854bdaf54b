r"""The rotations of a transformer's residual stream (book: chapter "Transformers: permutations without
scalings").

In a pre-norm transformer every layer that reads the residual stream :math:`x \in \mathbb{R}^d` reads it
through a LayerNorm (or RMSNorm) followed by a linear map, and every other layer only writes into it
(embeddings, position embeddings, class tokens, the patch embedding, the output projection of each
attention, the last layer of each MLP). Write a reader as :math:`y = W\,(g \odot z + \beta) + c` with
:math:`z = Cx / \sigma(x)`, :math:`C = I - \tfrac1d \mathbf{1}\mathbf{1}^\top` the centring and
:math:`\sigma(x) = (\lVert Cx\rVert^2/d + \epsilon)^{1/2}` (RMSNorm: :math:`C = I`, no :math:`\beta`).
An orthogonal :math:`Q` with :math:`Q\mathbf{1} = \mathbf{1}` commutes with :math:`C` and keeps norms, so
if every writer is rotated, :math:`x \to Qx`, every normalised stream rotates with it,
:math:`z \to Qz`, and the reader is unchanged when

.. math:: W \to W\,\mathrm{diag}(g)\,Q^\top \mathrm{diag}(g)^{-1}, \qquad
          \beta \to \mathrm{diag}(g)\,Q\,\mathrm{diag}(g)^{-1}\beta, \qquad g \to g, \qquad c \to c,

for then :math:`W'(g \odot Qz + \beta') = W\,\mathrm{diag}(g)\,Q^\top Q z + W\beta = W(g\odot z + \beta)`.
Writers map by :math:`Q` along the stream axis (rows of a weight, a bias, the features of an embedding).
In the folded coordinates :math:`\tilde W = W\,\mathrm{diag}(g)` (the reader with the norm's gain
absorbed) and :math:`\tilde\beta = \beta / g`, every tensor that touches the stream, stream axis first,
moves as :math:`X \to QX`.

The group is :math:`O(d-1)` (the rotations of :math:`\mathbf{1}^\perp`), of dimension :math:`(d-1)(d-2)/2`,
when a LayerNorm reads the stream; :math:`O(d)`, of dimension :math:`d(d-1)/2`, when only RMSNorms do.
The stream's permutations (its permutation label) are elements of it up to the norm's scalings: a
permutation moves the gains :math:`g` with the stream, a rotation leaves them in place. A stream that is
read without a norm, whose norm's output is itself the stream (a post-norm transformer such as BERT, the
embedding norm of Swin), or whose embedding is tied to the classifier has no such rotations (a tied
table would have to be both a writer and a reader).

:func:`stream_labels` finds the stream labels of a :class:`~symlib.symmetry.spec.Spec` (from its actions
and ``Spec.norms``), :func:`rotate` applies a rotation, :func:`dims` counts the dimensions,
:func:`procrustes` finds the rotation that brings one network's stream closest to another's,

.. math:: Q^\star = \arg\min_{Q} \sum_t \lVert Q X^b_t - X^a_t \rVert_F^2 = U V^\top,
          \qquad U S V^\top = \sum_t X^a_t X^{b\top}_t ,

(for LayerNorm in the basis of :math:`\mathbf{1}^\perp`), and :func:`align_stream` applies it. The
spec's actions cannot tell a positively homogeneous activation between a norm and its reader (it would
carry the norm's scaling label, but not its rotations); transformers have none, and
:func:`stream_labels` with ``params`` checks the function numerically.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from symlib.params import Params
from symlib.symmetry.spec import Action, Spec, SymmetryError

__all__ = ["align_stream", "dims", "procrustes", "random_orthogonal", "rotate", "stream_labels"]


@dataclasses.dataclass(frozen=True)
class _Stream:
    """What touches one stream label: writers (stream axis ``a.axis``), norms ``(weight, bias or None)``,
    readers ``(action, norm weight)``, and whether a LayerNorm centres it (``fix_ones``)."""

    label: str
    d: int
    fix_ones: bool
    writers: tuple[Action, ...]
    norms: tuple[tuple[str, str | None], ...]
    readers: tuple[tuple[Action, str], ...]


def _structure(spec: Spec, label: str) -> _Stream:
    """The stream ``label`` of ``spec``, or a :class:`SymmetryError` saying why it has no rotations."""
    if label not in spec.perms:
        raise SymmetryError(f"{label!r} is not a permutation label of this spec; its labels: "
                            f"{list(spec.perms)}")
    acts = [a for a in spec.actions if a.perm == label]
    norm_w = [a for a in acts if a.param in spec.norms]
    if not norm_w:
        raise SymmetryError(f"no LayerNorm or RMSNorm reads {label!r}: it is not a residual stream" + (
            "" if spec.norms else " (this spec records no norms, Spec.norms: a spec written by hand or saved "
            "before Spec.norms; trace the model with spec_of)"))
    for a in acts:
        if not a.plain:
            raise SymmetryError(f"{label!r} acts on a slice of {a.param!r} (start {a.start}, inner "
                                f"{a.inner}, groups {a.groups}): rotations of a stream that is concatenated "
                                "or split are not supported")
        if a.power not in (1, -1) or a.offset:
            raise SymmetryError(f"{label!r} acts on {a.param!r} with power {a.power}: not a residual stream")
    # a tensor under several names (Spec.aliases) rotates with the stream when every name writes it (T5's
    # shared input table); a table read both as the embedding and as the classifier leaves the final norm
    # without the scale labels that link it to its readers (the tie removed them), and is refused below
    tied = [a.param for a in acts if a.param in spec.aliases or a.param in spec.aliases.values()]
    scales: dict[str, tuple[str, str | None]] = {}
    for a in norm_w:
        if a.scale is None and tied and spec.scales:
            raise SymmetryError(f"{tied[0]!r} is tied to another tensor (Spec.aliases): a table read both as "
                                f"the embedding and as the classifier cannot rotate with {label!r}; untie it "
                                "(tie_word_embeddings=False) or leave the stream's rotations alone")
        if a.scale is None:
            why = ("the spec has no scaling labels, which link each norm to its readers: trace with "
                   "scalings='auto' or 'partial'") if not spec.scales else (
                "its output is not read by linear layers alone (in a post-norm transformer, or a norm after "
                "an embedding, it is the stream itself)")
            raise SymmetryError(f"the norm {a.param!r} of {label!r} keeps no rotation: {why}")
        carriers = [b for b in spec.actions if b.scale == a.scale]
        bias = [b.param for b in carriers if b.power > 0 and b.param != a.param]
        if len(bias) > 1 or any(b.perm != label for b in carriers) or (
                bias and len(spec.shapes[bias[0]]) != 1):
            raise SymmetryError(f"the scaling of the norm {a.param!r} also acts on "
                                f"{[b.param for b in carriers if b.param not in (a.param, *bias[:1])]}: "
                                f"{label!r} is not a stream that only norms read")
        scales[a.scale] = (a.param, bias[0] if bias else None)
    readers, writers = [], []
    norm_params = {p for pair in scales.values() for p in pair}
    for a in acts:
        if a.param in norm_params:
            continue
        if a.power > 0:
            writers.append(a)
        elif a.scale in scales and a.param in spec.weights:
            readers.append((a, scales[a.scale][0]))
        else:
            raise SymmetryError(f"{a.param!r} reads the stream {label!r} without a LayerNorm or RMSNorm in "
                                "between: the stream's rotations hold only when every reader normalises it "
                                "first (a pre-norm transformer whose head reads a final norm)")
    if not readers:
        raise SymmetryError(f"no linear layer reads {label!r} through a norm")
    return _Stream(label, spec.perms[label], any(spec.norms[w] == "layer" for w, _ in scales.values()),
                   tuple(writers), tuple(scales.values()), tuple(readers))


def stream_labels(spec: Spec, params: Params | None = None) -> list[str]:
    r"""The permutation labels of ``spec`` whose stream every reader reads through a LayerNorm or RMSNorm
    (module docstring), in the spec's order; ``[]`` for a network without one (a CNN, a post-norm
    transformer, a head that pools the stream without a norm).

    Args:
        spec: a traced spec (:func:`symlib.symmetry.trace.spec_of`, scalings ``"auto"`` or ``"partial"``).
        params: optional weights (one network) of the spec's model: each label found is then checked
            numerically, a random rotation keeping the function in float64
            (:func:`symlib.symmetry.check.function_error` below 1e-4, float32's tolerance: Hugging Face's
            RMSNorm computes in float32 whatever the model's dtype, while a stream that does not rotate
            moves the outputs by order one), and a failure raises a :class:`SymmetryError`.
    """
    out = []
    for label in spec.perms:
        try:
            _structure(spec, label)
        except SymmetryError:
            continue
        out.append(label)
    if params is not None and spec.forward is not None:
        from symlib.symmetry import check

        theta = {k: v.double() if v.is_floating_point() else v for k, v in params.items()}
        gen = torch.Generator().manual_seed(0)
        for label in out:
            st = _structure(spec, label)
            q = random_orthogonal(st.d, st.fix_ones, gen)
            err = float(check.function_error(spec, theta, _rotate(theta, spec, st, q)).max())
            if not err < 1e-4:
                raise SymmetryError(f"a rotation of the stream {label!r} changed the function by {err:.3g}: "
                                    "something between a norm and its reader is not linear; leave this "
                                    "stream's rotations alone")
    return out


def dims(spec: Spec) -> dict[str, int]:
    r"""Dimensions of the rotation group of every stream label: :math:`(d-1)(d-2)/2` (:math:`O(d-1)`) when
    a LayerNorm reads it, :math:`d(d-1)/2` (:math:`O(d)`) when only RMSNorms do."""
    out = {}
    for label in stream_labels(spec):
        st = _structure(spec, label)
        k = st.d - 1 if st.fix_ones else st.d
        out[label] = k * (k - 1) // 2
    return out


def _ones_basis(d: int, dtype=torch.float64, device=None) -> torch.Tensor:
    r"""An orthonormal basis ``(d, d-1)`` of :math:`\mathbf{1}^\perp`: the last ``d-1`` columns of the
    Householder reflection that swaps :math:`e_1` and :math:`\mathbf{1}/\sqrt d`."""
    v = torch.full((d,), 1 / math.sqrt(d), dtype=dtype, device=device)
    v[0] -= 1
    h = torch.eye(d, dtype=dtype, device=device) - 2 * torch.outer(v, v) / (v @ v)
    return h[:, 1:]


def _haar(n: int, generator: torch.Generator | None, dtype) -> torch.Tensor:
    x = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(x)
    return (q * torch.sign(torch.diagonal(r))).to(dtype)  # the signs make it Haar-distributed


def random_orthogonal(d: int, fix_ones: bool, generator: torch.Generator | None = None,
                      dtype=torch.float64) -> torch.Tensor:
    r"""A Haar-random orthogonal ``(d, d)`` matrix; with ``fix_ones``, one of :math:`O(d-1)`:
    :math:`Q = P R P^\top + \tfrac1d\mathbf{1}\mathbf{1}^\top` with :math:`R` Haar in :math:`O(d-1)` and
    :math:`P` an orthonormal basis of :math:`\mathbf{1}^\perp`, so :math:`Q\mathbf{1} = \mathbf{1}`."""
    if not fix_ones:
        return _haar(d, generator, dtype)
    p = _ones_basis(d)
    q = p @ _haar(d - 1, generator, torch.float64) @ p.T + torch.full((d, d), 1 / d, dtype=torch.float64)
    return q.to(dtype)


def _stream_last(t: torch.Tensor, spec: Spec, a: Action) -> tuple[torch.Tensor, torch.Size]:
    """``t`` as ``(*batch, m, d)``, its stream axis last, and the shape of the moved tensor."""
    nb = t.ndim - len(spec.shapes[a.param])
    u = t.movedim(nb + a.axis, -1)
    return u.reshape(*t.shape[:nb], -1, u.shape[-1]), u.shape


def _back(u: torch.Tensor, shape: torch.Size, t: torch.Tensor, spec: Spec, a: Action) -> torch.Tensor:
    nb = t.ndim - len(spec.shapes[a.param])
    return u.reshape(shape).movedim(-1, nb + a.axis).contiguous()


def _gain(theta: Params, weight: str) -> torch.Tensor:
    g = theta[weight]
    if not bool((g != 0).all()):
        raise SymmetryError(f"the norm weight {weight!r} has zero entries: its reader cannot absorb a "
                            "rotation (diag(g)^-1); perturb them or leave the stream's rotations alone")
    return g


def _rotate(theta: Params, spec: Spec, st: _Stream, q: torch.Tensor) -> Params:
    """:func:`rotate` without the checks of ``q`` (a tensor that both writes and reads the stream gets
    both maps, one after the other)."""
    out = dict(theta)
    for a in st.writers:  # X -> Q X along the stream axis: u -> u Q^T with the stream last
        t = out[a.param]
        u, shape = _stream_last(t, spec, a)
        out[a.param] = _back(u @ q.to(t).mT, shape, t, spec, a)
    for a, weight in st.readers:  # W -> W diag(g) Q^T diag(g)^-1
        t = out[a.param]
        g = _gain(theta, weight).unsqueeze(-2).to(t)
        u, shape = _stream_last(t, spec, a)
        out[a.param] = _back((u * g) @ q.to(t).mT / g, shape, t, spec, a)
    for weight, bias in st.norms:  # beta -> diag(g) Q diag(g)^-1 beta
        if bias is not None:
            g = _gain(theta, weight)
            b = theta[bias]
            out[bias] = (((b / g).unsqueeze(-2) @ q.to(b).mT).squeeze(-2) * g).to(b.dtype)
    return out


def rotate(params: Params, spec: Spec, label: str, q: torch.Tensor) -> Params:
    r"""Rotate the stream ``label`` by the orthogonal ``q`` (module docstring): writers :math:`X \to QX`
    along the stream axis, each norm's reader :math:`W \to W\,\mathrm{diag}(g)\,Q^\top\mathrm{diag}(g)^{-1}`
    and bias :math:`\beta \to \mathrm{diag}(g)\,Q\,\mathrm{diag}(g)^{-1}\beta`; the norms' gains and
    everything else unchanged. The network computes the same function.

    Args:
        params: one network, or a stack (leading batch dimensions).
        spec: its spec (:func:`symlib.symmetry.trace.spec_of`).
        label: a stream label (:func:`stream_labels`).
        q: ``(d, d)`` orthogonal (shared by a stack) or ``(*batch, d, d)``; with
            :math:`Q\mathbf{1} = \mathbf{1}` when a LayerNorm reads the stream (:func:`random_orthogonal`,
            :func:`procrustes`).

    Returns:
        New parameters (``params`` is not modified).
    """
    st = _structure(spec, label)
    spec.batch_shape(params)
    if q.shape[-2:] != (st.d, st.d):
        raise SymmetryError(f"the stream {label!r} has {st.d} features; got a rotation of shape "
                            f"{tuple(q.shape)}")
    q64 = q.double()
    eye = torch.eye(st.d, dtype=torch.float64, device=q.device)
    tol = (1e-9 if q.dtype == torch.float64 else 1e-4) * math.sqrt(st.d)
    if not float((q64.mT @ q64 - eye).abs().max()) < tol:
        raise SymmetryError(f"the rotation of {label!r} is not orthogonal (|Q^T Q - I| > {tol:.1g}); build "
                            "it with random_orthogonal or procrustes")
    if st.fix_ones and not float((q64.sum(-1) - 1).abs().max()) < tol:
        raise SymmetryError(f"a LayerNorm reads {label!r}: its rotations must fix the all-ones vector "
                            "(Q 1 = 1, which commutes with the centring); build Q with "
                            "random_orthogonal(d, fix_ones=True) or procrustes")
    return _rotate(params, spec, st, q)


def _folded(theta: Params, spec: Spec, st: _Stream) -> list[torch.Tensor]:
    r"""Every tensor of the stream as ``(*batch, d, m)``, stream axis first, readers and biases folded
    (:math:`\mathrm{diag}(g) W^\top`, :math:`\beta / g`): each moves as :math:`X \to QX`. A tensor that
    both writes and reads the stream (it would move as :math:`QXQ^\top`) is left out."""
    both = {a.param for a in st.writers} & {a.param for a, _ in st.readers}
    out = []
    for a in st.writers:
        if a.param not in both:
            out.append(_stream_last(theta[a.param], spec, a)[0].mT)
    for a, weight in st.readers:
        if a.param in both:
            continue
        g = _gain(theta, weight).to(theta[a.param])
        out.append((_stream_last(theta[a.param], spec, a)[0] * g.unsqueeze(-2)).mT)
    for weight, bias in st.norms:
        if bias is not None:
            out.append((theta[bias] / _gain(theta, weight)).unsqueeze(-1))
    return out


def _procrustes(theta_a: Params, theta_b: Params, spec: Spec, st: _Stream) -> torch.Tensor:
    m = None
    for xa, xb in zip(_folded(theta_a, spec, st), _folded(theta_b, spec, st), strict=True):
        dtype = torch.promote_types(xa.dtype, xb.dtype)
        part = (xa.to(dtype) @ xb.to(dtype).mT).double()  # one matmul per tensor: (*batch, d, d)
        m = part if m is None else m + part
    if st.fix_ones:  # Q = P R P^T + 11^T/d, R the Procrustes solution of P^T M P
        p = _ones_basis(st.d, device=m.device)
        u, _, vh = torch.linalg.svd(p.T @ m @ p)
        return p @ (u @ vh) @ p.T + torch.full((st.d, st.d), 1 / st.d, dtype=m.dtype, device=m.device)
    u, _, vh = torch.linalg.svd(m)
    return u @ vh


def procrustes(a: Params, b: Params, spec: Spec, label: str | None = None) -> dict[str, torch.Tensor]:
    r"""The rotation of each stream that brings ``b`` closest to ``a``: :math:`Q^\star = \arg\min_Q \sum_t
    \lVert QX^b_t - X^a_t\rVert_F^2` over the stream's group, summed over every tensor :math:`t` that touches
    the stream, stream axis first, readers and norm biases folded (module docstring), so that
    ``rotate(b, spec, label, Q)`` is the rotated ``b`` closest to ``a`` in these coordinates. One matrix
    product per tensor builds :math:`M = \sum_t X^a_t X^{b\top}_t` (in float64), one SVD of ``(d, d)``
    solves it. Each label is solved on ``b`` as given (:func:`align_stream` rotates between labels). A
    tensor that both reads the stream (through a norm) and writes it moves as :math:`QXQ^\top` and is left
    out of the sum (pre-norm transformers have none).

    Args:
        a, b: two networks of ``spec`` (batch dimensions broadcast: one ``a`` against a stack ``b``).
        spec: their spec.
        label: one stream label, or ``None`` for every label of :func:`stream_labels`.

    Returns:
        ``label -> Q`` (float64, ``(*batch, d, d)``, orthogonal, :math:`Q\mathbf{1} = \mathbf{1}` under a
        LayerNorm).
    """
    labels = stream_labels(spec) if label is None else [label]
    if not labels:
        raise SymmetryError("this spec has no residual stream that only LayerNorms or RMSNorms read "
                            "(stream_labels is empty); there is no rotation to find")
    spec.batch_shape(a), spec.batch_shape(b)
    return {k: _procrustes(a, b, spec, _structure(spec, k)) for k in labels}


def align_stream(a: Params, b: Params, spec: Spec) -> Params:
    r"""``b`` with every stream rotated onto ``a`` (:func:`procrustes`, then :func:`rotate`, one label
    after the other): the same function as ``b``, closer to ``a`` in the folded coordinates. A spec
    without a stream returns ``b`` unchanged (as a new dict)."""
    out = dict(b)
    for label in stream_labels(spec):
        st = _structure(spec, label)
        out = _rotate(out, spec, st, _procrustes(a, out, spec, st))
    return out
