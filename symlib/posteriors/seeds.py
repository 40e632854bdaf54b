r"""Seeds of everything a posterior method trains, disjoint from the target zoo's (book: chapter "Table 1").

The target posterior is a zoo whose model ``i`` has seed ``i`` (``0 .. N - 1``, ``N = 1000`` at the paper
scale). Everything a posterior method trains uses seeds far away from that range, so that no method ever
sees a target checkpoint:

* base models (the starting points of SWAG, Laplace, SGHMC and HMC, the members of deep ensembles and the
  networks that MC dropout trains) of run ``seed``: ``BASE_SEED0 + SEED_STRIDE * seed + i``
  (``i < SEED_STRIDE``), i.e. 1,000,000,000 + 100,000 * seed + i (:func:`base_seeds`);
* a method's own random streams (SWAG's continued data order, SGHMC's noise and data order, dropout
  masks): :func:`stream_seeds`, ``>= 2**40``, derived from (seed, method, mode).

So the one-mode set uses base model ``i = 0`` and the multi-mode set base models ``0 .. 9`` of the same
run seed (the first is shared), and a deep ensemble of 100 members is ``0 .. 99``.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

from symlib import scales as _scales

BASE_SEED0 = 1_000_000_000
SEED_STRIDE = 100_000
STREAM_SEED0 = 2**40

__all__ = ["BASE_SEED0", "SEED_STRIDE", "STREAM_SEED0", "base_seeds", "generator", "stream_seeds"]


def base_seeds(n: int, seed: int = 0) -> list[int]:
    """Seeds of the first ``n`` base models of run ``seed``: ``BASE_SEED0 + SEED_STRIDE * seed + i``."""
    _scales.check_int("seed", seed, 0)
    _scales.check_int("number of base models", n, 1)
    if n > SEED_STRIDE:
        raise ValueError(f"at most {SEED_STRIDE} base models per run seed, got {n}")
    return [BASE_SEED0 + SEED_STRIDE * seed + i for i in range(n)]


def stream_seeds(n: int, seed: int, salt: str) -> list[int]:
    """``n`` seeds (>= 2**40, so never a zoo or base-model seed) for a method's own random streams."""
    ss = np.random.SeedSequence([int(seed), zlib.crc32(salt.encode())])
    return [STREAM_SEED0 + int(v >> np.uint64(25)) for v in ss.generate_state(n, dtype=np.uint64)]


def generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(int(seed) % (2**63))
