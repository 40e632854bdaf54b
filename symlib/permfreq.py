r"""How often do neurons swap places while a network trains? (book: chapter "Permutations during
training"; paper §5.2, Fig. 4).

Removing permutation symmetries sorts the neurons of every hidden layer by a key of their
incoming weights (:func:`symlib.canonical.sort_perms`). If training moves a network from one
sorted order to another, the canonical form jumps: the network has *permuted*. The paper measures
this with Kendall's rank correlation between the sorting permutations of successive steps,

.. math:: \tau(r, s) = \frac{2}{n(n-1)} \sum_{i<j} \operatorname{sign}(r_i - r_j)\,
          \operatorname{sign}(s_i - s_j),

where ``r`` and ``s`` give the rank of every neuron in the two orders: :math:`\tau = 1` when no
two neurons changed their relative order, and :math:`(1 - \tau) / 2` is the fraction of neuron
pairs that swapped.

* :func:`kendall_tau` computes :math:`\tau` for any stack of rank vectors, vectorised over the
  leading axes (runs, steps, layers; layers of different widths are zero-padded and masked), with
  ``O(n^2)`` sign comparisons per layer and no Python loop over pairs.
* :class:`PermutationTracker` is the per-step hook of :func:`symlib.train.train_stacked`: it keeps
  only the previous step's ranks and weights and records, per step, run and layer, :math:`\tau` and
  the number of neurons that changed position, for several sorting keys at once (the paper's
  ``"max"`` key and the first-weight key of its App. C.2), with the size of every run's step and
  the learning rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from symlib import canonical
from symlib.spec import Params, Spec

KEYS = ("max", "first")


def kendall_tau(r: torch.Tensor, s: torch.Tensor, lengths: torch.Tensor | Sequence[int] | None = None
                ) -> torch.Tensor:
    r"""Kendall's :math:`\tau` between rank vectors along the last axis, for every leading index.

    Args:
        r, s: ``(..., n)`` tensors of the same shape (ranks, or any values without ties; with
            ties this is Kendall's :math:`\tau_a`).
        lengths: optional ``(...)`` (broadcastable) number of valid entries per vector: entries at
            positions ``>= lengths`` are padding and ignored (layers of different widths stacked
            into one tensor). Every length must be at least 2.

    Returns:
        ``(...)`` float64 tensor of :math:`\tau` in ``[-1, 1]``.
    """
    if r.shape != s.shape:
        raise ValueError(f"r and s must have the same shape, got {tuple(r.shape)} and {tuple(s.shape)}")
    n = r.shape[-1]
    # sign products of all ordered pairs (exact in float32: entries are -1, 0, 1); the matrix is
    # symmetric with a zero diagonal, so the sum over i < j is half the sum over all (i, j)
    r, s = r.to(torch.float32), s.to(torch.float32)
    prod = torch.sign(r.unsqueeze(-1) - r.unsqueeze(-2)).mul_(torch.sign(s.unsqueeze(-1) - s.unsqueeze(-2)))
    if lengths is None:
        return prod.sum((-1, -2), dtype=torch.float64) / 2 / (n * (n - 1) / 2)
    lengths = torch.as_tensor(lengths, device=r.device)
    if bool((lengths < 2).any()) or bool((lengths > n).any()):
        raise ValueError(f"lengths must lie in [2, {n}], got {lengths.tolist()}")
    valid = (torch.arange(n, device=r.device) < lengths.unsqueeze(-1)).to(torch.float32)  # (..., n)
    agree = (prod @ valid.unsqueeze(-1)).squeeze(-1).mul_(valid).sum(-1, dtype=torch.float64) / 2
    return agree / (lengths.to(torch.float64) * (lengths - 1) / 2)


def ranks(perms: torch.Tensor) -> torch.Tensor:
    """Rank of every neuron in a sorted order: the inverse of the sorting permutation ``(..., n)``."""
    return perms.argsort(dim=-1)


def sorting_ranks(theta: Params, spec: Spec, key: str = "max", width: int | None = None
                  ) -> torch.Tensor:
    """Ranks of the neurons of every hidden layer in the canonical order, padded into one tensor.

    Args:
        theta: stacked parameters ``{name: (M, ...)}``.
        spec: the architecture's symmetries (its permutation labels are the layers).
        key: ``"max"`` (largest incoming weight, paper §5.2) or ``"first"`` (App. C.2).
        width: pad to this many neurons (default: the widest layer).

    Returns:
        ``(M, L, width)`` long tensor; layer ``l`` uses its first ``spec.perms`` entries.
    """
    perms = canonical.sort_perms(theta, spec, key=key)
    width = max(spec.perms.values()) if width is None else width
    out = []
    for label, n in spec.perms.items():
        rk = ranks(perms[label])
        out.append(torch.nn.functional.pad(rk, (0, width - n)))
    return torch.stack(out, dim=-2)


@dataclasses.dataclass(frozen=True)
class PermFreq:
    """What :class:`PermutationTracker` recorded.

    Attributes:
        layers: the permutation labels (hidden layers), in order; sizes: their widths.
        steps: ``(S,)`` global step of each record (the step after which the weights were read).
        lr: ``(S,)`` learning rate used by that step (NaN if unknown).
        tau: key -> ``(S, M, L)`` Kendall's tau between the ranks after this step and before it.
        changed: key -> ``(S, M, L)`` number of neurons whose rank changed.
        motion: ``(S, M)`` Euclidean norm of each run's parameter change at this step (how violent
            the step was), NaN where the previous weights were not available.
    """

    layers: tuple[str, ...]
    sizes: tuple[int, ...]
    steps: torch.Tensor
    lr: torch.Tensor
    tau: dict[str, torch.Tensor]
    changed: dict[str, torch.Tensor]
    motion: torch.Tensor

    def mean_tau(self, key: str = "max") -> torch.Tensor:
        """``(S,)`` tau averaged over runs and layers (the curve of the paper's Figure 4)."""
        return self.tau[key].mean((1, 2))

    def flips(self, key: str = "max") -> torch.Tensor:
        """``(S, M, L)`` whether the order of a layer changed at all at this step."""
        return self.changed[key] > 0


class PermutationTracker:
    r"""Per-step hook recording how the sorting permutations move during training.

    Pass an instance as ``on_step`` to :func:`symlib.train.train_stacked`; it is called with the
    step index and the stacked parameters after the update. Only the previous ranks are kept, so
    memory does not grow with the weights, only with the ``(S, M, L)`` records.

    Args:
        spec: the architecture's symmetries (e.g. :func:`symlib.trace.spec_of` of an OptuNet).
        keys: sorting keys to track (``"max"``, ``"first"``).
        lr_at: optional ``step -> learning rate`` (e.g. from the recipe), recorded with every step.
        init: optional initial parameters: the first step is then compared with them.
    """

    def __init__(self, spec: Spec, keys: Sequence[str] = KEYS, lr_at: Callable[[int], float] | None = None,
                 init: Params | None = None):
        bad = [k for k in keys if k not in KEYS]
        if bad or not keys:
            raise ValueError(f"keys must be a non-empty subset of {KEYS}, got {list(keys)}")
        small = {k: n for k, n in spec.perms.items() if n < 2}
        if small:
            raise ValueError(f"layers {small} have fewer than two neurons: nothing can permute there")
        self.spec, self.keys, self.lr_at = spec, tuple(keys), lr_at
        self.lengths = torch.tensor(list(spec.perms.values()))
        self._prev: dict[str, torch.Tensor] | None = None
        self._prev_flat: torch.Tensor | None = None
        self._motion: list[torch.Tensor] = []
        self._steps: list[int] = []
        self._lr: list[float] = []
        self._tau: dict[str, list[torch.Tensor]] = {k: [] for k in self.keys}
        self._changed: dict[str, list[torch.Tensor]] = {k: [] for k in self.keys}
        if init is not None:
            self._prev = self._ranks(init)
            self._prev_flat = self._flat(init)

    @staticmethod
    def _flat(theta: Params) -> torch.Tensor:
        return torch.cat([v.detach().reshape(v.shape[0], -1) for v in theta.values()], 1).to(torch.float64)

    def _ranks(self, theta: Params) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {k: sorting_ranks(theta, self.spec, k) for k in self.keys}

    def __call__(self, step: int, theta: Params) -> None:
        cur = self._ranks(theta)
        flat = self._flat(theta)
        if self._prev is not None:
            lengths = self.lengths.to(next(iter(cur.values())).device)
            for k in self.keys:
                self._tau[k].append(kendall_tau(cur[k], self._prev[k], lengths).cpu())
                self._changed[k].append((cur[k] != self._prev[k]).sum(-1).cpu())
            self._steps.append(int(step))
            self._lr.append(float(self.lr_at(step)) if self.lr_at is not None else float("nan"))
            self._motion.append((flat - self._prev_flat).norm(dim=1).cpu())
        self._prev, self._prev_flat = cur, flat

    def result(self) -> PermFreq:
        """The records so far, as tensors."""
        if not self._steps:
            raise ValueError("no step recorded yet: train with on_step=tracker (and init=, or two steps)")
        return PermFreq(
            layers=tuple(self.spec.perms),
            sizes=tuple(self.spec.perms.values()),
            steps=torch.tensor(self._steps),
            lr=torch.tensor(self._lr, dtype=torch.float64),
            tau={k: torch.stack(v) for k, v in self._tau.items()},
            changed={k: torch.stack(v) for k, v in self._changed.items()},
            motion=torch.stack(self._motion),
        )


def lr_schedule(recipe, n_train: int) -> Callable[[int], float]:
    """``step -> learning rate`` of a :class:`symlib.train.Recipe` with ``n_train`` training images."""
    per_epoch = -(-n_train // recipe.batch_size)
    return lambda step: recipe.lr_at(step // per_epoch)


def phase_means(values: torch.Tensor, lr: torch.Tensor) -> dict[float, float]:
    """Mean of ``values (S,)`` over the steps of each learning-rate phase, keyed by the rate."""
    out = {}
    for rate in torch.unique(lr, sorted=True).flip(0).tolist():
        out[rate] = float(values[lr == rate].double().mean())
    return out
