"""The labels of one traced tensor and the union-find that merges them (book: chapter "Symmetries of real
architectures"). See :mod:`symlib.symmetry.trace`.

A traced tensor carries its labels on one axis (the channel, or feature, axis) as a list of
:class:`Seg` segments laid end to end: one segment for the output of a layer, several for a
concatenation. A segment's label entry ``i`` covers ``inner`` consecutive entries of the axis
(``inner = H*W`` after a ``C x H x W`` map is flattened).
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
class Attr:
    """A parameter, buffer or constant read with ``get_attr`` (e.g. a layer-scale vector)."""

    name: str
    shape: tuple[int, ...]
    in_state_dict: bool


class UnionFind:
    """Union-find over label ids; the root of a class is its oldest member, or FIXED."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {FIXED: FIXED}
        self.order: dict[str, int] = {FIXED: -1}

    def add(self, x: str) -> None:
        self.parent[x] = x
        self.order[x] = len(self.order)

    def find(self, x: str) -> str:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: str, b: str) -> str:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            keep, drop = sorted((ra, rb), key=lambda r: self.order[r])
            self.parent[drop] = keep
            ra = keep
        return ra
