r"""What one symmetry does to a network's parameters: the records a :class:`~symlib.symmetry.spec.Spec` is
made of (book: chapter "A gentle example", paper §3.3-3.4, App. C, D.4).

* :class:`Action`: one permutation or scaling label acting on one axis of one parameter (or a slice of
  it, a block of entries per label entry, a grouped convolution's input channels);
* :class:`Rotary`: the continuous group of one attention's rotary query-key heads;
* :class:`BiasShift`: one redundant direction among biases.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Action:
    """One label acting on one axis of one parameter.

    Attributes:
        param: parameter name, as in ``module.named_parameters()`` / ``state_dict()``.
        axis: axis in the parameter's own shape (no batch dimensions).
        perm: permutation label acting on this axis, or ``None``.
        scale: scaling label acting on this axis, or ``None``.
        power: exponent of the scale on this axis: +1 on the outgoing side of a
            neuron (rows of its incoming weights, its bias), -1 on the incoming
            side of the next layer, +2 for a BatchNorm running variance.
        groups: ``G > 1`` when ``param`` is the weight ``(C_out, C_in/G, ...)``
            of a grouped convolution and this action is its input-channel axis
            (``axis == 1``): the label has size ``C_in = G * shape[axis]`` and
            acts on the block-diagonal dense weight (see
            :func:`symlib.symmetry.ops.dense_weight`); its permutations must respect the
            groups (``Spec.blocks``).
        offset: the scale acts on ``theta + offset`` rather than on ``theta``:
            ``theta' = lam ** power * (theta + offset) - offset``. A BatchNorm
            running variance uses ``offset = eps``, which makes the absorbed
            scaling exact: ``var + eps`` scales by ``lam ** 2``.
        start: the label acts on the slice of the axis that begins at ``start``
            (0: the axis begins with it). A concatenation ``torch.cat([a, b], 1)``
            gives ``b``'s label ``start = a.shape[1]`` on the next layer's input axis.
        inner: each entry of the label covers ``inner`` consecutive entries of the
            axis: entry ``i`` acts on ``start + i*inner ... start + (i+1)*inner - 1``.
            A ``C x H x W`` map flattened into a linear layer's ``C*H*W`` inputs
            gives the channel label ``inner = H*W`` on that layer's input axis.
            The slice ``start ... start + n*inner - 1`` (``n`` the label's size)
            must lie in the axis; an action alone on its axis with ``start = 0``
            and ``inner = 1`` covers it whole.
    """

    param: str
    axis: int
    perm: str | None = None
    scale: str | None = None
    power: int = 0
    groups: int = 1
    offset: float = 0.0
    start: int = 0
    inner: int = 1

    @property
    def plain(self) -> bool:
        """Whether the action covers its whole axis entry by entry (no slice, no blocks, no groups)."""
        return self.start == 0 and self.inner == 1 and self.groups == 1


@dataclasses.dataclass(frozen=True)
class Rotary:
    r"""The continuous group of one attention's rotary query-key heads (:mod:`symlib.symmetry.continuous`).

    Rotary embeddings turn the pair :math:`(i, i + d/2)` of a head of :math:`d` features at its own
    frequency, so a change of basis of a head that keeps every score is one rotation and one scale per
    pair, :math:`A_i = s_i R(\phi_i)`, i.e. a complex number :math:`z_i` acting on
    :math:`x_i + \mathrm{i}\,x_{i+d/2}`: :math:`z` on the query rows of every query head of a key-value
    group, :math:`1/\bar z` (that is :math:`A^{-\top}`) on the group's key rows. :math:`d` real dimensions
    per key-value head.

    Attributes:
        queries: ``(param, start, stop)``: rows ``start ... stop - 1`` (axis 0) of ``param`` produce the
            queries, ``heads * r`` heads of ``per_head`` features laid out head after head (a weight's rows
            and its bias alike); query head ``h`` reads key-value head ``h // r``.
        keys: ``(param, start, stop)``: the rows that produce the keys, ``heads`` heads of ``per_head``.
        heads: key-value heads.
        per_head: features per head (even).
    """

    queries: tuple[tuple[str, int, int], ...]
    keys: tuple[tuple[str, int, int], ...]
    heads: int
    per_head: int


@dataclasses.dataclass(frozen=True)
class BiasShift:
    r"""One redundant direction of :math:`d` dimensions among biases (:mod:`symlib.symmetry.biases`):
    :math:`\delta \in \mathbb{R}^d` added to some rows, subtracted from others, and, for readers, taken
    out of their biases through their weights, :math:`c_j \to c_j - W_j \delta`.

    Attributes:
        plus: ``(param, start, stop)``: rows ``start ... stop - 1`` of ``param`` viewed as ``(-1, d)`` move
            by :math:`+\delta`.
        minus: the same, moving by :math:`-\delta`.
        readers: ``(weight, bias, transposed)``: a layer reading the shifted vectors, whose bias moves by
            :math:`-W\delta` (``weight`` of shape ``(out, d)``, or ``(d, out)`` when ``transposed``).
        kind: what the direction is: ``"token"`` (a class or distillation token against its position
            embedding), ``"patch"`` (a patch embedding's bias against the patch tokens' position
            embeddings), ``"table"`` (two embedding tables summed), ``"sum"`` (two biased layers summed) or
            ``"norm"`` (a LayerNorm's bias against the biases of its readers).
    """

    plus: tuple[tuple[str, int, int], ...]
    minus: tuple[tuple[str, int, int], ...] = ()
    readers: tuple[tuple[str, str, bool], ...] = ()
    kind: str = "norm"
