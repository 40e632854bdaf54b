"""The error of reading checkpoint files (book: "symlib on your own network")."""

from __future__ import annotations

from symlib.store import StoreError

__all__ = ["CheckpointError"]


class CheckpointError(StoreError):
    """Checkpoint files that cannot be read as asked: a missing file or empty glob, a file of another
    kind, another architecture or shape, a missing or ambiguous prefix, non-finite weights, or a pickle
    that needs code. The message names the file and, where there is one, the fix. Nothing is written
    when it is raised (it is a :class:`symlib.store.StoreError`, so the ``symlib`` command reports it)."""
