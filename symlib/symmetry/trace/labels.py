"""The labels of one traced tensor and the union-find that merges them (book: chapter "Symmetries of real
architectures"). See :mod:`symlib.symmetry.trace`.

A traced tensor carries its labels on one axis (the channel, or feature, axis) as a list of
:class:`Seg` segments laid end to end: one segment for the output of a layer, several for a
concatenation. A segment's label entry ``i`` covers ``inner`` consecutive entries of the axis
(``inner = H*W`` after a ``C x H x W`` map is flattened). Attention spreads features over several axes
(:class:`Grid`: heads and the features inside a head), and its scores carry only the heads
(:class:`Scores`); an operation returning several tensors gives a :class:`Multi`.

The union-find (:class:`UnionFind`) merges labels that must move together; it also records, per merge,
whether the two labels act on opposite sides of a bilinear form (a parity: the keys of attention pair
with its queries), and splits a label into consecutive parts when a tensor is cut into pieces (the
fused query-key-value output of a layer, cut into queries, keys and values).
"""

from __future__ import annotations

import dataclasses
import itertools

FIXED = "<fixed>"
"""The class of the labels that no symmetry acts on: the network's input, its outputs, and everything
merged with them."""


@dataclasses.dataclass(frozen=True)
class Seg:
    """``n`` entries of one permutation label and one scaling label, each covering ``inner`` entries."""

    perm: str
    scale: str
    n: int
    inner: int = 1

    @property
    def size(self) -> int:
        return self.n * self.inner


@dataclasses.dataclass(frozen=True)
class State:
    """Labels of axis ``axis`` of one traced tensor: its segments, in order (none: no label at all)."""

    axis: int
    segs: tuple[Seg, ...] = ()
    producer: str | None = None

    def starts(self) -> list[int]:
        """Where each segment begins on the axis."""
        return list(itertools.accumulate((s.size for s in self.segs[:-1]), initial=0))

    def moved(self, axis: int) -> State:
        return dataclasses.replace(self, axis=axis)


UNLABELLED = State(1)


@dataclasses.dataclass(frozen=True)
class Grid:
    """Labelled features spread over several axes: axis ``axes[i]`` holds ``sizes[i]`` entries, the features
    in row-major order of ``axes`` (``axes[0]`` the slowest), carrying ``segs`` laid end to end. A reshape
    of a ``(..., h * k)`` tensor to ``(..., h, k)`` gives the grid of ``h`` heads of ``k`` features."""

    axes: tuple[int, ...]
    sizes: tuple[int, ...]
    segs: tuple[Seg, ...]
    producer: str | None = None


@dataclasses.dataclass(frozen=True)
class Scores:
    """Attention scores or weights of ``heads`` heads on axis ``axis``: the heads move with the blocks of
    permutation label ``follows`` (the query-key label), and nothing else is labelled."""

    axis: int
    heads: int
    follows: str


@dataclasses.dataclass(frozen=True)
class Multi:
    """The states of the tensors of a tuple (``torch.split``, ``unbind``, ``nn.MultiheadAttention``)."""

    items: tuple


@dataclasses.dataclass(frozen=True)
class Attr:
    """A parameter, buffer or constant read with ``get_attr`` (e.g. a layer-scale vector), or a view of one
    (``expand``, ``unsqueeze``, ``permute``, ...): axis ``i`` of the tensor is axis ``axes[i]`` of the
    parameter (``None``: an axis of size 1 or a broadcast); ``axes=None`` is the parameter itself. A tensor
    computed from parameters by anything else has ``opaque=True``: no label may act on it."""

    name: str
    shape: tuple[int, ...]
    in_state_dict: bool
    axes: tuple[int | None, ...] | None = None
    opaque: bool = False

    def param_axis(self, axis: int) -> int | None:
        """The parameter's axis behind the tensor's axis ``axis`` (``None`` when there is none)."""
        if self.opaque:
            return None
        return axis if self.axes is None else self.axes[axis]


class UnionFind:
    """Union-find over label ids; the root of a class is its oldest member, or FIXED.

    Each id has a size. ``union(a, b, odd=True)`` records that ``a`` and ``b`` permute together but sit on
    opposite sides of a bilinear form (:meth:`parity`); a class whose parities contradict each other is
    listed in ``conflicts``. :meth:`cut` splits a class into consecutive parts (``parts`` of its root), and
    a union refines both classes to their common parts first.
    """

    def __init__(self) -> None:
        self.parent: dict[str, str] = {FIXED: FIXED}
        self.order: dict[str, int] = {FIXED: -1}
        self.odd: dict[str, bool] = {FIXED: False}
        self.size: dict[str, int] = {FIXED: 0}
        self.parts: dict[str, list[str]] = {}
        self.conflicts: set[str] = set()
        self.origin: dict[str, tuple[str, int]] = {}  # id -> (the id it was cut from first, offset in it)

    def add(self, x: str, size: int = 0) -> None:
        self.parent[x] = x
        self.order[x] = len(self.order)
        self.odd[x] = False
        self.size[x] = size

    def find(self, x: str) -> str:
        path = []
        while self.parent[x] != x:
            path.append(x)
            x = self.parent[x]
        acc = False
        for y in reversed(path):  # path compression, keeping each id's parity to the root
            acc ^= self.odd[y]
            self.odd[y], self.parent[y] = acc, x
        return x

    def parity(self, x: str) -> bool:
        """Whether ``x`` sits on the opposite side of its class's root (after ``find``)."""
        self.find(x)
        return False if self.parent[x] == x else self.odd[x]

    def union(self, a: str, b: str, odd: bool = False) -> str:
        ra, rb = self.find(a), self.find(b)
        pa, pb = self.parity(a), self.parity(b)
        if ra == rb:
            if (pa ^ pb) != odd and ra != FIXED:
                self.conflicts.add(ra)
            return ra
        if ra in self.parts or rb in self.parts:
            if FIXED in (ra, rb):
                for leaf, _, _ in self.leaves(ra if rb == FIXED else rb):
                    self.union(leaf, FIXED)
            else:
                la, lb = self._common(ra, rb)
                for (x, px, _), (y, py, _) in zip(la, lb, strict=True):
                    self.union(x, y, odd ^ pa ^ pb ^ px ^ py)
            ra, rb = self.find(ra), self.find(rb)
            if ra == rb:
                return ra
        keep, drop = sorted((ra, rb), key=lambda r: self.order[r])
        self.parent[drop] = keep
        self.odd[drop] = pa ^ pb ^ odd
        if drop in self.conflicts:
            self.conflicts.add(keep)
        return keep

    # ------------------------------------------------------------------ parts
    def leaves(self, x: str, size: int | None = None) -> list[tuple[str, bool, int]]:
        """The finest parts of ``x``'s class, in order, as ``(root, parity relative to x, size)`` (the class
        root itself when the class was never cut; a part merged with FIXED keeps its own size)."""
        r = self.find(x)
        px = self.parity(x)
        n = self.size[x] if size is None else size
        if r not in self.parts:
            return [(r, px, n)]
        return [(leaf, p ^ px, m) for part in self.parts[r] for leaf, p, m in self.leaves(part)]

    def cuts(self, x: str) -> list[int]:
        """Offsets where the parts of ``x``'s class begin, 0 excluded."""
        out, pos = [], 0
        for _, _, n in self.leaves(x)[:-1]:
            pos += n
            out.append(pos)
        return out

    def cut(self, x: str, offset: int) -> None:
        """Split ``x``'s class at ``offset`` (a no-op at a boundary of its parts or for FIXED)."""
        r = self.find(x)
        if r == FIXED or offset <= 0 or offset >= self.size[r]:
            return
        if r in self.parts:
            pos = 0
            for p in self.parts[r]:
                n = self.size[p]
                if pos < offset < pos + n:
                    self.cut(p, offset - pos)
                pos += n
            return
        base, at = self.origin.get(r, (r, 0))
        subs = []
        for lo, hi in ((0, offset), (offset, self.size[r])):
            sub = f"{base}[{at + lo}:{at + hi}]"
            self.add(sub, hi - lo)
            self.origin[sub] = (base, at + lo)
            subs.append(sub)
        self.parts[r] = subs

    def _common(self, ra: str, rb: str) -> tuple[list[tuple[str, bool, int]], list[tuple[str, bool, int]]]:
        """Cut both classes at each other's part boundaries; their leaves, now of equal sizes."""
        if self.size[ra] != self.size[rb]:
            raise ValueError(f"labels {ra!r} and {rb!r} have sizes {self.size[ra]} and {self.size[rb]}")
        for c in self.cuts(rb):
            self.cut(ra, c)
        for c in self.cuts(ra):
            self.cut(rb, c)
        return self.leaves(ra), self.leaves(rb)

    def position(self, x: str) -> tuple[int, int]:
        """Where ``x`` was opened: the creation order of the id it was cut from, and its offset there."""
        base, at = self.origin.get(x, (x, 0))
        return self.order[base], at
