r"""Fan a posterior sample set out with submitit: its independently trained networks as a job array
(book: chapter "Table 1"; the zoo fan-out is :mod:`symlib.zoo.fanout`).

A method's modes are independent where each mode is a network trained on its own. Those trainings are
a zoo (same seeds, same weights, bit for bit), so they are fanned out as one
(:func:`symlib.zoo.fanout.submit`: shards of a job array, resubmitted when killed, merged), and the
rest runs where :func:`submit` runs:

* ``ensemble``: every member is a training run (seeds :func:`~symlib.posteriors.seeds.base_seeds`). The
  members are the fanned-out zoo; the set is assembled from them.
* ``swag``, ``laplace``, ``sghmc``, ``hmc``: the ``n_modes`` base models (a full training each: the cost
  at the paper's scale) are the base zoo of :func:`~symlib.posteriors.sampling.base_zoo`, fanned out into
  the zoo cache; the method then runs on them through :func:`~symlib.posteriors.sampling.run`, which finds
  them there. The method's own sampling draws every mode from one random stream, so it stays in one
  process.
* ``dropout`` and ``vi`` train their networks inside the method, all modes in one run (dropout draws
  every mode's masks from one stream): there is no per-mode job to fan out, and :func:`submit` says so.

Either way the set equals, bit for bit, what ``symlib posterior sample`` writes without an executor
(same identity hash, same tensors). The fan-out's work folder is ``OUT/fanout`` (``symlib zoo status
OUT`` or ``symlib posterior status OUT`` shows its shards).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from symlib import store, zoo
from symlib.posteriors import io, sampling
from symlib.posteriors.base import SampleSet, Setup, check_sizes
from symlib.posteriors.seeds import base_seeds
from symlib.zoo import fanout as _zfanout

FANNED = {"ensemble": "members", "swag": "base", "laplace": "base", "sghmc": "base", "hmc": "base"}

__all__ = ["FANNED", "independent_zoo", "submit"]


def independent_zoo(method: str, setup: Setup, n_modes: int, n_per_mode: int, seed: int = 0,
                    n_shards: int = 1) -> zoo.ZooConfig:
    """The zoo of the networks a method trains independently, one per mode (module docstring).

    Args:
        method: a method of :data:`FANNED`.
        setup: the training problem of a zoo preset (:func:`~symlib.posteriors.sampling.setup_for`).
        n_modes, n_per_mode, seed: the set's sizes and run seed.
        n_shards: for an ensemble, the members go in at least this many chunks (a shard is a chunk or more).

    Raises:
        ValueError: the method's modes are not independent trainings, or the setup is not a zoo preset.
    """
    if method not in FANNED:
        raise ValueError(
            f"{method}: its networks are trained inside the method, all modes in one run (dropout draws "
            f"every mode's masks from one random stream), so there is no per-mode job to fan out; run it "
            f"without --executor. Fanned out: {sorted(FANNED)}"
        )
    if setup.name not in zoo.PRESETS:
        raise ValueError(
            f"a fan-out needs the setup of a zoo preset ({sorted(zoo.PRESETS)}), got {setup.name!r}"
        )
    if FANNED[method] == "base":
        return sampling.base_zoo(setup, n_modes, seed)
    n = n_modes * n_per_mode
    cfg = zoo.preset(setup.name, setup.scale)
    chunk = max(1, min(cfg.chunk, math.ceil(n / max(1, n_shards))))
    return dataclasses.replace(cfg, seed=base_seeds(n, seed)[0], n_models=n, chunk=chunk)


def _ensemble(setup: Setup, params, n_modes: int, n_per_mode: int, seed: int) -> SampleSet:
    seeds = base_seeds(n_modes * n_per_mode, seed)
    return SampleSet(  # what symlib.posteriors.ensemble draws, from the same trainings
        params=params,
        method="ensemble",
        n_modes=n_modes,
        n_per_mode=n_per_mode,
        hyper={"recipe": dataclasses.asdict(setup.recipe), "member_seeds": seeds},
        base_seeds=seeds[:n_modes],
    )


def submit(
    method: str,
    preset: str,
    scale: str,
    n_modes: int,
    n_per_mode: int,
    out: str | os.PathLike,
    n_shards: int,
    executor: str = "local",
    *,
    seed: int = 0,
    hyper: dict[str, Any] | None = None,
    device: str = "cpu",
    cache_dir: str | os.PathLike | None = None,
    resources: _zfanout.Resources | None = None,
    max_retries: int = 2,
    poll_s: float = 10.0,
    timeout_s: float | None = None,
    chunk: int | None = None,
    progress: bool = True,
    on_poll: Callable[[_zfanout.Status], None] | None = None,
) -> SampleSet:
    """Produce the sample set of ``symlib posterior sample`` with its independent trainings fanned out as a
    submitit job array (module docstring); resumes like the zoo fan-out when run again.

    Args:
        method: ``ensemble``, ``swag``, ``laplace``, ``sghmc`` or ``hmc`` (:data:`FANNED`).
        preset, scale: the training problem (:func:`~symlib.posteriors.sampling.setup_for`).
        n_modes, n_per_mode: sizes (``--modes``, ``--samples / --modes``).
        out: the sample set's folder.
        n_shards: shards of the job array (capped at the zoo's chunks: the base models of OptuNets are
            one chunk, so one shard).
        executor: ``"slurm"`` or ``"local"`` (:mod:`symlib.zoo.fanout`).
        seed, hyper, device, cache_dir, chunk, progress: as :func:`~symlib.posteriors.sampling.run`.
        resources, max_retries, poll_s, timeout_s, on_poll: as :func:`symlib.zoo.fanout.submit`.

    Returns:
        The :class:`~symlib.posteriors.base.SampleSet`, also written to ``out``.
    """
    hyper = dict(hyper or {})
    m = sampling.method(method)
    m.check_hyper(hyper)
    check_sizes(n_modes, n_per_mode)
    setup = sampling.setup_for(preset, scale, device)
    cfg = independent_zoo(method, setup, n_modes, n_per_mode, seed, n_shards)
    out = Path(out)
    uses = m.base in ("required", "optional")
    key = io.identity(method, n_modes, n_per_mode, hyper, io.setup_record(setup),
                      {"seeds": base_seeds(n_modes, seed) if uses else []}, seed)
    io.check_out(out, key, method, n_modes, n_per_mode)  # before any work
    zpath = zoo.cache_path(cfg, cache_dir)
    man = store.read_manifest(zpath) if store.kind_of(zpath) == "zoo" else None
    if man is None or not man.get("complete"):
        store.check_folder(zpath, "zoo", "zoo cache (cache_dir, --cache or $SYMLIB_CACHE)")
        _zfanout.submit(cfg, zpath, min(n_shards, cfg.n_chunks), executor, resources=resources, device=device,
                        work=_zfanout.work_dir(out), max_retries=max_retries, poll_s=poll_s,
                        timeout_s=timeout_s, on_poll=on_poll)
    if FANNED[method] == "base":
        return sampling.run(method, setup, n_modes, n_per_mode, seed, out, progress=progress,
                            cache_dir=cache_dir, chunk=chunk, **hyper)
    params, _ = zoo.load(zpath, device=setup.device)
    samples = _ensemble(setup, params, n_modes, n_per_mode, seed)
    io.save(samples, out, setup=setup, base=None, seed=seed, chunk=chunk, key=key)
    return samples
