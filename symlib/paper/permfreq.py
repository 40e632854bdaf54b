r"""How often do neurons swap places while a network trains? (book: chapter "Do networks
permute while they train?"; paper §5.2, Fig. 4).

Removing permutation symmetries sorts the neurons of every hidden layer by a key of their
incoming weights (:func:`symlib.symmetry.canonical.sort_perms`). If training moves a network from one
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
* :class:`PermutationTracker` is the per-step hook of :func:`symlib.training.stacked.train_stacked`: it keeps
  only the previous step's ranks and weights and records, per step, run and layer, :math:`\tau` and
  the number of neurons that changed position, for several sorting keys at once (the paper's
  ``"max"`` key and the first-weight key of its App. C.2), with the size of every run's step and
  the learning rate. It is also the ``on_step`` hook of the plain trainer
  :func:`symlib.training.plain.train_plain`, which passes one network's state with a leading axis of 1.
* :func:`track_plain` and :func:`track_zoo_recipe` train ResNets (paper Fig. 4 right: ResNet-18 on
  CIFAR-100) one run at a time with that hook and join the runs (:func:`concat_runs`);
  :func:`milestone_steps` gives the steps at which the learning rate decays, to mark them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from symlib.symmetry import canonical
from symlib.symmetry import check as _check
from symlib.symmetry.keys import _key
from symlib.symmetry.spec import Params, Spec

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

    With the ``"max"`` key and no grouped layer (MLPs, ResNets), every layer's ranks are read off the
    weights directly, without permuting the network label after label as
    :func:`symlib.symmetry.canonical.sort_perms` does: the largest incoming weight of a neuron does not
    depend on how the other layers are ordered, so the ranks are the same (tested), for a fraction of the cost
    (this runs after every training step).
    """
    width = max(spec.perms.values()) if width is None else width
    if key == "max" and not spec.blocks:
        rk = _max_ranks(theta, spec)
    else:
        perms = canonical.sort_perms(theta, spec, key=key)
        rk = {label: ranks(perms[label]) for label in spec.perms}
    out = [torch.nn.functional.pad(rk[label], (0, width - n)) for label, n in spec.perms.items()]
    return torch.stack(out, dim=-2)


def _max_ranks(theta: Params, spec: Spec) -> dict[str, torch.Tensor]:
    """Ranks of every layer's neurons by their largest incoming weight (ties broken as
    :func:`symlib.symmetry.canonical.sort_perms` breaks them), on the unpermuted weights."""
    nb = len(spec.batch_shape(theta))
    finite = torch.stack([torch.isfinite(theta[n]).all() for n in sorted(spec.weights)])
    if not bool(finite.all()):  # one synchronisation, not one per tensor
        _check.validate(theta, spec)  # names the tensor
    return {label: _key(theta, spec, label, "max", "incoming", nb).long() for label in spec.perms}


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

    Pass an instance as ``on_step`` to :func:`symlib.training.stacked.train_stacked`; it is called with the
    step index and the stacked parameters after the update. Only the previous ranks are kept, so
    memory does not grow with the weights, only with the ``(S, M, L)`` records.

    Args:
        spec: the architecture's symmetries (e.g. :func:`symlib.symmetry.trace.spec_of` of an OptuNet).
        keys: sorting keys to track (``"max"``, ``"first"``).
        lr_at: optional ``step -> learning rate`` (e.g. from the recipe), recorded with every step.
        init: optional initial parameters: the first step is then compared with them.
        motion_keys: names of the tensors whose change counts in the step size ``motion`` (default:
            every tensor passed; a network with BatchNorm passes its parameters' names, so that the
            running statistics, which are buffers, do not count).

    A ResNet's residual stream is one permutation label of its spec (every convolution writing into
    the stream, the shortcuts and the BatchNorms of the stream permute their channels together), so
    its channels are ranked once per stream, with one permutation, and count as one layer.
    """

    def __init__(self, spec: Spec, keys: Sequence[str] = KEYS, lr_at: Callable[[int], float] | None = None,
                 init: Params | None = None, motion_keys: Sequence[str] | None = None):
        bad = [k for k in keys if k not in KEYS]
        if bad or not keys:
            raise ValueError(f"keys must be a non-empty subset of {KEYS}, got {list(keys)}")
        small = {k: n for k, n in spec.perms.items() if n < 2}
        if small:
            raise ValueError(f"layers {small} have fewer than two neurons: nothing can permute there")
        unknown = sorted(set(motion_keys or ()) - set(spec.shapes))
        if unknown:
            raise ValueError(f"motion_keys {unknown[:5]} are not tensors of the spec's architecture; "
                             "pass names of its state_dict, e.g. [n for n, _ in model.named_parameters()]")
        self.motion_keys = None if motion_keys is None else tuple(motion_keys)
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

    def _flat(self, theta: Params) -> torch.Tensor:
        names = theta if self.motion_keys is None else self.motion_keys
        return torch.cat([theta[k].detach().reshape(theta[k].shape[0], -1).to(torch.float64) for k in names],
                         1)

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
    """``step -> learning rate`` of a :class:`~symlib.training.recipe.Recipe` with ``n_train`` training
    images."""
    per_epoch = -(-n_train // recipe.batch_size)
    return lambda step: recipe.lr_at(step // per_epoch)


def phase_means(values: torch.Tensor, lr: torch.Tensor) -> dict[float, float]:
    """Mean of ``values (S,)`` over the steps of each learning-rate phase, keyed by the rate."""
    out = {}
    for rate in torch.unique(lr, sorted=True).flip(0).tolist():
        out[rate] = float(values[lr == rate].double().mean())
    return out


def milestone_steps(recipe, n_train: int) -> list[int]:
    """The first step of every learning-rate phase after the first: ``m * steps_per_epoch`` for every
    milestone ``m`` of a step schedule that falls inside training (paper Fig. 4 right: epochs 25 and 50
    of the ResNet-18 recipe). A cosine schedule has no milestones (empty list)."""
    if recipe.schedule != "step":
        return []
    per_epoch = -(-n_train // recipe.batch_size)
    return [m * per_epoch for m in sorted(set(recipe.milestones)) if 0 < m < recipe.epochs]


def concat_runs(results: Sequence[PermFreq]) -> PermFreq:
    """Records of separate runs (each ``M_i`` runs, same steps and layers) as one record of all runs."""
    if not results:
        raise ValueError("concat_runs needs at least one PermFreq")
    first = results[0]
    for i, r in enumerate(results[1:], 1):
        if r.layers != first.layers or not torch.equal(r.steps, first.steps):
            raise ValueError(
                f"run {i} has other layers or steps than run 0 ({len(r.steps)} vs {len(first.steps)} steps): "
                "train every run with the same recipe, data size and number of epochs"
            )
    return PermFreq(
        layers=first.layers,
        sizes=first.sizes,
        steps=first.steps,
        lr=first.lr,
        tau={k: torch.cat([r.tau[k] for r in results], 1) for k in first.tau},
        changed={k: torch.cat([r.changed[k] for r in results], 1) for k in first.changed},
        motion=torch.cat([r.motion for r in results], 1),
    )


def stacked_state(model: torch.nn.Module) -> Params:
    """A module's ``state_dict`` (parameters and buffers), detached, with a leading axis of size 1."""
    return {k: v.detach().unsqueeze(0) for k, v in model.state_dict().items()}


def track_plain(make_model: Callable[[], torch.nn.Module], seeds: Sequence[int], x: torch.Tensor,
                y: torch.Tensor, recipe, spec: Spec, keys: Sequence[str] = KEYS,
                fill: float | Sequence[float] = 0.0, epochs: int | None = None,
                max_steps: int | None = None, progress: bool = False
                ) -> tuple[PermFreq, list[torch.nn.Module]]:
    """Train one network per seed with :func:`symlib.training.plain.train_plain` and track its sorting
    permutations at every step (paper §5.2, Fig. 4 right: ResNet-18 on CIFAR-100).

    Each run starts from :func:`symlib.training.plans.init_model` of its seed; its first step is compared with
    that initialisation. The step size ``motion`` counts the parameters only (not BatchNorm's running
    statistics).

    Args:
        make_model: builds the architecture (e.g. a zoo config's ``make_model``).
        seeds: one seed per run (initialisation, data order and crops, :func:`symlib.training.plans.streams`).
        x, y: training images and labels, on the device to train on.
        recipe: the :class:`symlib.training.recipe.Recipe`.
        spec: the architecture's symmetries (:func:`symlib.symmetry.trace.spec_of`).
        keys: sorting keys to track.
        fill, epochs, max_steps: as in :func:`symlib.training.plain.train_plain`.
        progress: a progress bar over the runs.

    Returns:
        ``(record, models)``: the :class:`PermFreq` of all runs (``M = len(seeds)``) and the trained
        networks.
    """
    from symlib import progress as _progress
    from symlib import training as _train

    if not seeds:
        raise ValueError("track_plain needs at least one seed (one run per seed)")
    lr_at = lr_schedule(recipe, x.shape[0])
    results, nets = [], []
    with _progress.bar(total=len(seeds), desc="tracked runs", enabled=progress) as pbar:
        for seed in seeds:
            model = _train.init_model(make_model, seed).to(x.device)
            tracker = PermutationTracker(spec, keys=keys, lr_at=lr_at, init=stacked_state(model),
                                         motion_keys=[n for n, _ in model.named_parameters()])
            nets.append(_train.train_plain(model, seed, x, y, recipe, fill=fill, epochs=epochs,
                                           max_steps=max_steps, on_step=tracker))
            results.append(tracker.result())
            pbar.update(1)
    return concat_runs(results), nets


@dataclasses.dataclass(frozen=True)
class TrackedTraining:
    """Permutation records of several runs of a zoo's recipe (:func:`track_zoo_recipe`).

    Attributes:
        record: the :class:`PermFreq` of all runs.
        epoch_steps: optimiser steps per epoch.
        milestones: steps at which the step schedule decays (:func:`milestone_steps`).
        test_acc: ``(M,)`` test accuracy of every run's final network.
        seconds: wall-clock time of training with tracking.
    """

    record: PermFreq
    epoch_steps: int
    milestones: list[int]
    test_acc: list[float]
    seconds: float


def track_zoo_recipe(cfg, seeds: Sequence[int], device: str | torch.device = "cpu",
                     keys: Sequence[str] = KEYS, epochs: int | None = None, progress: bool = True
                     ) -> TrackedTraining:
    """Train ``len(seeds)`` networks of a zoo configuration (architecture, data and recipe of
    :func:`symlib.zoo.preset`, e.g. ``"cifar100-resnet18"``) and track their sorting permutations.

    The data come from :func:`symlib.zoo.load_data`: the real dataset at the ``paper`` scale (missing
    files raise :mod:`symlib.data`'s ``FileNotFoundError`` saying how to get them), random images of
    the right shape for the synthetic smoke-test presets.

    Args:
        cfg: a :class:`symlib.zoo.ZooConfig` of a module architecture (ResNet).
        seeds: one seed per run; use seeds outside the zoo's to get runs independent of its checkpoints.
        device: where to train.
        keys: sorting keys to track.
        epochs: train for this many epochs of the recipe's schedule (default: all).
        progress: a progress bar over the runs.
    """
    import time

    from symlib import training as _train
    from symlib import zoo as _zoo
    from symlib.symmetry import trace as _trace

    if cfg.arch == "optunet":
        raise ValueError("track_zoo_recipe trains module architectures one by one; for OptuNet use "
                         "train.train_stacked(..., on_step=PermutationTracker(...)), as the chapter does")
    d = _zoo.load_data(cfg, device)
    template = cfg.make_model()
    spec = _trace.spec_of(template, tuple(d.x.shape[1:]))
    t0 = time.perf_counter()
    record, nets = track_plain(cfg.make_model, seeds, d.x, d.y, cfg.recipe, spec, keys=keys, fill=d.fill,
                               epochs=epochs, progress=progress)
    seconds = time.perf_counter() - t0
    acc = [_train.evaluate_model(net, d.x_test, d.y_test)[0] for net in nets]
    n = d.x.shape[0]
    return TrackedTraining(record=record, epoch_steps=-(-n // cfg.recipe.batch_size),
                           milestones=milestone_steps(cfg.recipe, n), test_acc=acc, seconds=seconds)


def key_gaps(theta: Params, names: Sequence[str], key: str = "max") -> float:
    """Median gap between adjacent sorted keys of the neurons of a layer, over the layers and the runs:
    how close, typically, two neurons are to swapping places in the sorted order.

    Args:
        theta: stacked parameters ``{name: (M, n_out, ...)}``.
        names: the weight tensors whose output neurons are sorted (e.g. ``["conv1.weight", "conv2.weight"]``).
        key: ``"max"`` (a neuron's largest incoming weight) or ``"first"`` (its first incoming weight: the
            top-left kernel weight of the first input channel for a convolution).

    Returns:
        The median, over every layer, run and pair of neighbours in the sorted order, of the difference
        between their keys.
    """
    if key not in KEYS:
        raise ValueError(f"key must be one of {KEYS}, got {key!r}")
    gaps = []
    for name in names:
        w = theta[name].flatten(2)
        k = w.amax(-1) if key == "max" else w[..., 0]
        gaps.append(k.sort(-1).values.diff(dim=-1).flatten())
    return float(torch.cat(gaps).median())


def noise_flips(theta: Params, spec: Spec, sigmas: Sequence[float], keys: Sequence[str] = KEYS,
                repeats: int = 20, seed: int = 0):
    r"""How often a small random push changes the sorted order: the share of (repeat, run, layer) triples
    whose sorting permutation changes when Gaussian noise of standard deviation :math:`\sigma` is added to
    every weight tensor of ``spec`` (biases unchanged).

    Training moves every key at every step; isotropic noise of the size of a step separates how far a key
    moves from how close the keys are, for each key alike.

    Args:
        theta: stacked parameters ``{name: (M, ...)}`` of ``M`` networks.
        spec: their symmetries (its permutation labels are the layers).
        sigmas: noise levels, in the units of the weights.
        keys: sorting keys (:data:`KEYS`).
        repeats: noise draws per level.
        seed: of the noise.

    Returns:
        A DataFrame indexed by :math:`\sigma` with one column per key.
    """
    import pandas as pd

    gen = torch.Generator().manual_seed(seed)
    base = {k: sorting_ranks(theta, spec, k) for k in keys}
    rows = {}
    with torch.no_grad():
        for sigma in sigmas:
            flips = dict.fromkeys(keys, 0.0)
            for _ in range(repeats):
                noisy = {n: v + sigma * torch.randn(v.shape, generator=gen, dtype=v.dtype).to(v.device)
                         if n in spec.weights else v for n, v in theta.items()}
                for k in keys:
                    flips[k] += float((sorting_ranks(noisy, spec, k) != base[k]).any(-1).double().mean())
            rows[float(sigma)] = {k: v / repeats for k, v in flips.items()}
    frame = pd.DataFrame.from_dict(rows, orient="index")
    frame.index.name = "sigma"
    return frame
