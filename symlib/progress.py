"""Progress bars for long work: plain-text tqdm that honours ``TQDM_DISABLE`` (set under papermill/nbval)."""

from __future__ import annotations

import os

from tqdm import tqdm

__all__ = ["bar"]


def bar(total: int | None = None, desc: str | None = None, enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar, off when ``enabled`` is false or the environment sets ``TQDM_DISABLE=1``."""
    off = not enabled or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")
    return tqdm(total=total, desc=desc, disable=off, **kwargs)
