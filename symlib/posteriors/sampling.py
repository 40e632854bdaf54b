r"""Producing posterior sample sets: the training problem of a preset, cached base models and resumable
runs (book: chapter "Table 1"; paper §4, App. B).

:func:`run` produces a method's samples into a directory: the base models come from the zoo cache (a zoo
of ``n_modes`` models with the preset's recipe and the seeds of :func:`~symlib.posteriors.seeds.base_seeds`,
trained once, stacked for OptuNet, and found again by every later run and method), the samples are
written chunk by chunk (atomic files), a finished set is loaded instead of recomputed, and a rerun after
an interruption keeps the chunks already written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from symlib import scales as _scales
from symlib import store, zoo
from symlib.params import Params
from symlib.posteriors.base import Method, SampleSet, Setup, check_sizes
from symlib.posteriors.seeds import base_seeds
from symlib.posteriors.sgd import train_models
from symlib.store import StoreError

__all__ = ["base_models", "base_zoo", "method", "run", "set_key", "setup_for"]


def setup_for(preset: str, scale: str = "cpu", device: str | torch.device = "cpu") -> Setup:
    """The training problem of a zoo preset (:func:`symlib.zoo.preset`): its architecture, recipe and
    training data on ``device``."""
    cfg = zoo.preset(preset, scale)
    d = zoo.load_data(cfg, _scales.check_device(device))
    return Setup(
        arch=cfg.arch,
        make_model=cfg.make_model,
        x=d.x,
        y=d.y,
        recipe=cfg.recipe,
        fill=tuple(d.fill),
        num_classes=cfg.num_classes,
        name=preset,
        scale=scale,
        data_info=d.info,
    )


def base_zoo(setup: Setup, n_modes: int, seed: int = 0) -> zoo.ZooConfig:
    """The zoo configuration of the ``n_modes`` base models of run ``seed`` (setup of a zoo preset): the
    preset with ``n_models = n_modes``, first seed ``BASE_SEED0 + SEED_STRIDE * seed``, OptuNets in one
    chunk, ResNets one per chunk. :func:`base_models` caches this zoo; a fan-out
    (:mod:`symlib.posteriors.fanout`) trains it."""
    seeds = base_seeds(n_modes, seed)
    cfg = zoo.preset(setup.name, setup.scale)
    if cfg.arch != setup.arch:
        raise ValueError(f"preset {setup.name!r} is {cfg.arch!r}, but the setup is {setup.arch!r}")
    return dataclasses.replace(
        cfg, seed=seeds[0], n_models=n_modes, chunk=n_modes if cfg.arch == "optunet" else 1
    )


def base_models(
    setup: Setup,
    n_modes: int,
    seed: int = 0,
    *,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    progress: bool = True,
) -> tuple[Params, list[int], str | None]:
    """``n_modes`` independently trained base models (seeds :func:`base_seeds`), stacked.

    When the setup is a zoo preset (``setup.name``) and ``use_cache``, the base models are a zoo of the
    preset with ``n_models = n_modes`` and first seed ``BASE_SEED0 + SEED_STRIDE * seed``, trained once
    into the zoo cache (:func:`symlib.zoo.load_or_train`, ``cache_dir`` or ``$SYMLIB_CACHE``; OptuNets
    stacked, ResNets one by one, resuming by chunk) and loaded by every later call. Otherwise they are
    trained in memory by :func:`train_models`.

    Returns:
        ``(params, seeds, zoo_path)`` (``zoo_path`` is ``None`` when not cached).
    """
    seeds = base_seeds(n_modes, seed)
    if use_cache and setup.name in zoo.PRESETS:
        cfg = base_zoo(setup, n_modes, seed)
        params, man = zoo.load_or_train(cfg, device=setup.device, cache_dir=cache_dir, progress=progress)
        if man.get("data", {}).get("fingerprint") != setup.data_info.get("fingerprint"):
            raise ValueError(
                f"cached base models {zoo.cache_path(cfg, cache_dir)} were trained on other data than the "
                f"setup's; use another cache_dir"
            )
        return params, seeds, str(zoo.cache_path(cfg, cache_dir))
    return train_models(setup, seeds, progress=progress, desc="base models"), seeds, None


# ----------------------------------------------------------------------------- runs


def set_key(name: str, setup: Setup, n_modes: int, n_per_mode: int, seed: int = 0, **hyper: Any) -> str:
    """The identity of the set that :func:`run` produces with these arguments (its manifest's ``set_hash``,
    :func:`symlib.posteriors.io.identity`): method, sizes, hyper-parameters, training problem, base seeds
    and run seed. Computed without sampling anything."""
    from symlib.posteriors import io

    uses = method(name).base in ("required", "optional")
    seeds = base_seeds(n_modes, seed) if uses else []
    return io.identity(name, n_modes, n_per_mode, hyper, io.setup_record(setup), {"seeds": seeds}, seed)


def method(name: str) -> Method:
    """The :class:`~symlib.posteriors.base.Method` of ``symlib.posteriors.<name>`` (a clear error if the
    name is unknown)."""
    from symlib.posteriors import METHODS

    if name not in METHODS:
        raise ValueError(f"unknown posterior method {name!r}; choose one of {list(METHODS)}")
    return importlib.import_module(f"symlib.posteriors.{name}").METHOD


def run(
    name: str,
    setup: Setup,
    n_modes: int,
    n_per_mode: int,
    seed: int = 0,
    out_dir: str | os.PathLike | None = None,
    *,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
    chunk: int | None = None,
    on_base: Callable[[Params], None] | None = None,
    **hyper: Any,
) -> SampleSet:
    """Produce ``n_modes x n_per_mode`` samples of method ``name`` into ``out_dir``, resuming.

    0. Before any work: the hyper-parameter names, the sizes and ``out_dir`` are checked (a file, a path
       under a file, a read-only folder, a folder holding a zoo, another set or chunks of one are refused,
       naming the fix; :func:`symlib.posteriors.io.check_out`).
    1. If ``out_dir`` holds this very set (same method, sizes, hyper-parameters, problem and seed)
       complete, it is loaded and returned: nothing is recomputed (temporary files a killed run left
       there are removed).
    2. Methods that start from trained models get ``n_modes`` base models from :func:`base_models`
       (cached: a rerun does not retrain them).
    3. ``symlib.posteriors.<name>.sample(setup, n_modes, n_per_mode, seed, base=..., **hyper)``.
    4. The set is written chunk by chunk (:func:`symlib.posteriors.io.save`, one mode per file by
       default); after an interruption, a rerun recomputes the samples (deterministic for a seed and a
       device) and writes only the missing chunks.

    Args:
        name: a method of :data:`symlib.posteriors.METHODS`.
        setup: the training problem (:func:`setup_for`).
        n_modes, n_per_mode: sizes (1 x 100: one-mode; 10 x 10: the paper's multi-mode).
        seed: the run's seed (base models :func:`~symlib.posteriors.seeds.base_seeds`, streams
            :func:`~symlib.posteriors.seeds.stream_seeds`).
        out_dir: where to write (``None``: compute only).
        progress: progress bars.
        cache_dir: the zoo cache for base models (default ``$SYMLIB_CACHE``).
        chunk: samples per file (default ``n_per_mode``).
        on_base: called with the base models (benchmarks).
        **hyper: the method's hyper-parameters.

    Returns:
        The :class:`SampleSet`.
    """
    from symlib.posteriors import io

    m = method(name)
    m.check_hyper(hyper)  # before any training: a typo costs nothing
    check_sizes(n_modes, n_per_mode)
    uses = m.base in ("required", "optional")
    seeds = base_seeds(n_modes, seed) if uses else []
    key = set_key(name, setup, n_modes, n_per_mode, seed, **hyper)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and io.is_posterior(out):
        man = io.read_manifest(out)
        if man.get("set_hash") == key and man.get("complete"):
            try:
                done = io.load(out, device=setup.device)
            except StoreError:
                pass  # a chunk was lost or damaged since: recompute, rewrite only what is missing
            else:
                with contextlib.suppress(OSError):  # a finished set may be read-only
                    store.remove_stale(out)  # left by a killed run (one writer per folder)
                return done
    if out is not None:
        io.check_out(out, key, name, n_modes, n_per_mode)  # before any work: nothing to lose, no time wasted
    base, base_path = None, None
    if uses:
        base, seeds, base_path = base_models(setup, n_modes, seed, cache_dir=cache_dir, progress=progress)
        if on_base is not None:
            on_base(base)
    samples = m.sample(setup, n_modes, n_per_mode, seed, base=base, progress=progress, **hyper)
    if uses and not samples.base_seeds:
        samples.base_seeds = list(seeds)
    if out is not None:
        io.save(
            samples,
            out,
            setup=setup,
            base={"zoo_path": base_path, "seed_rule": "BASE_SEED0 + SEED_STRIDE * seed + i"}
            if uses
            else None,
            seed=seed,
            chunk=chunk,
            key=key,
        )
    return samples
