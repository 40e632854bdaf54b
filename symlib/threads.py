"""Torch's intra-op threads around small operations (one concept: the thread count, saved and restored).

Many small operators (a tiny network's step, a loop over networks, dense LAPACK on a few hundred rows)
gain nothing from intra-op threads, and on a shared CPU the threads spin while waiting for each other:
measured 4-30x slower under one competing process. :func:`single` runs a block on one intra-op thread and
restores the previous count, also when the block raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["single"]


@contextlib.contextmanager
def single() -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(1)``; restore the previous count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
