"""The error of reading checkpoint files (book: "symlib on your own network")."""

from __future__ import annotations

from symlib.errors import CheckpointError

__all__ = ["CheckpointError"]


