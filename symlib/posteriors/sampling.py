r"""Producing posterior sample sets: the training problem, base models, seeds and resumable runs
(book: chapter "Table 1"; paper §4, App. B).

**Seeds.** The target posterior is a zoo whose model ``i`` has seed ``i`` (``0 .. N - 1``, ``N = 1000`` at
the paper scale). Everything a posterior method trains uses seeds far away from that range, so that no
method ever sees a target checkpoint:

* base models (the starting points of SWAG, Laplace, SGHMC and HMC, the members of deep ensembles and the
  networks that MC dropout trains) of run ``seed``: ``BASE_SEED0 + SEED_STRIDE * seed + i``
  (``i < SEED_STRIDE``), i.e. 1,000,000,000 + 100,000 * seed + i (:func:`base_seeds`);
* a method's own random streams (SWAG's continued data order, SGHMC's noise and data order, dropout
  masks): :func:`stream_seeds`, ``>= 2**40``, derived from (seed, method, mode).

So the one-mode set uses base model ``i = 0`` and the multi-mode set base models ``0 .. 9`` of the same
run seed (the first is shared), and a deep ensemble of 100 members is ``0 .. 99``.

**Runs.** :func:`run` produces a method's samples into a directory: the base models come from the zoo
cache (a zoo of ``n_modes`` models with the preset's recipe, trained once, stacked for OptuNet, and found
again by every later run and method), the samples are written chunk by chunk (atomic files), a finished
set is loaded instead of recomputed, and a rerun after an interruption keeps the chunks already written.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from symlib import scales as _scales
from symlib import train as _train
from symlib.posteriors.base import Params, SampleSet, Setup

BASE_SEED0 = 1_000_000_000
SEED_STRIDE = 100_000
STREAM_SEED0 = 2**40

# Which methods start from trained base models (True: required, "optional": used when given).
USES_BASE: dict[str, bool | str] = {
    "ensemble": False,
    "dropout": False,
    "vi": False,
    "swag": True,
    "laplace": True,
    "sghmc": "optional",
    "hmc": "optional",
}


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


def setup_for(preset: str, scale: str = "cpu", device: str | torch.device = "cpu") -> Setup:
    """The training problem of a zoo preset (:func:`symlib.zoo.preset`): its architecture, recipe and
    training data on ``device``."""
    from symlib import zoo

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


def check_positive(**values: float) -> None:
    """Raise a ``ValueError`` naming every hyper-parameter that is not a finite positive number."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite positive number, got {v!r}")


def check_sizes(n_modes: int, n_per_mode: int) -> None:
    _scales.check_int("n_modes", n_modes, 1)
    _scales.check_int("n_per_mode", n_per_mode, 1)


def reference_state(setup: Setup) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one model's state dict (built on the meta device)."""
    with torch.device("meta"):
        model = setup.make_model()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_base(setup: Setup, base: Params | None, n_modes: int, method: str) -> Params:
    """Validate stacked base models ``(n_modes, ...)`` against the setup's architecture; return them on
    the setup's device."""
    if base is None:
        raise ValueError(
            f"{method} starts from trained base models; it needs trained networks: pass base=<stacked "
            f"state dicts (n_modes, ...)>, e.g. from symlib.posteriors.sampling.base_models(setup, n_modes, "
            f"seed) or a checkpoint zoo of the same preset (symlib.zoo.load_or_train), or use "
            f"sampling.run(...)"
        )
    ref = reference_state(setup)
    if set(base) != set(ref):
        missing, extra = sorted(set(ref) - set(base)), sorted(set(base) - set(ref))
        raise ValueError(
            f"{method}: the base models are not {setup.arch!r} networks of this setup (missing tensors "
            f"{missing[:5]}, unexpected {extra[:5]}): a base zoo of another architecture? Pass base models "
            f"trained for this setup"
        )
    for k, v in base.items():
        if tuple(v.shape) != (n_modes, *ref[k]):
            raise ValueError(
                f"{method}: base tensor {k!r} has shape {tuple(v.shape)}, expected {(n_modes, *ref[k])} "
                f"({n_modes} stacked {setup.arch!r} models; another width or number of classes?)"
            )
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ValueError(f"{method}: base tensor {k!r} holds NaN or infinite values")
    return {k: v.detach().to(setup.device) for k, v in base.items()}


def forbid_base(base: Params | None, method: str) -> None:
    if base is not None:
        raise ValueError(f"{method} trains its own networks from scratch; do not pass base models")


def check_finite_loss(loss: torch.Tensor, step: int, seeds: Sequence[int], what: str) -> None:
    """Stop with an error naming the step and the models whose loss is NaN or infinite."""
    bad = ~torch.isfinite(loss.detach().reshape(-1))
    if bad.any():
        which = [int(seeds[i]) for i in bad.nonzero().flatten().tolist()]
        raise FloatingPointError(
            f"{what}: non-finite loss at step {step} for the model(s) with seed(s) {which}; the run diverged "
            f"(lower the learning rate or check the data)"
        )


# ----------------------------------------------------------------------------- nn.Module helpers


def init_stacked(setup: Setup, seeds: Sequence[int]) -> Params:
    """The initial weights of one model per seed, stacked, on the setup's device and in its data's
    floating dtype (float64 problems train float64 networks)."""
    return {
        k: v.to(setup.device, setup.x.dtype) for k, v in _train.init_params(setup.make_model, seeds).items()
    }


def new_module(setup: Setup, state: Params | None = None, seed: int | None = None) -> torch.nn.Module:
    """A module of the setup's architecture on its device and in its data's dtype: ``seed``'s
    initialisation, or ``state``."""
    model = _train.init_model(setup.make_model, seed) if seed is not None else setup.make_model()
    model = model.to(setup.device, setup.x.dtype)
    if state is not None:
        model.load_state_dict(state)
    return model


def unstack(params: Params, i: int) -> Params:
    return {k: v[i] for k, v in params.items()}


def stack(states: Sequence[Params]) -> Params:
    return {k: torch.stack([s[k].detach() for s in states]) for k in states[0]}


def state_of(model: torch.nn.Module) -> Params:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def last_dropout(model: torch.nn.Module) -> torch.nn.Dropout:
    """The ``dropout`` layer before the last linear layer (``model.dropout``), or a clear error."""
    d = getattr(model, "dropout", None)
    if not isinstance(d, torch.nn.Dropout) or not isinstance(getattr(model, "fc", None), torch.nn.Linear):
        raise ValueError(
            f"{type(model).__name__} has no dropout layer before its last layer (expected attributes "
            f"'dropout' (nn.Dropout) and 'fc' (nn.Linear)); MC dropout needs one: use OptuNet or "
            f"ResNet18/ResNet20, which have it"
        )
    return d


@torch.no_grad()
def bn_update(model: torch.nn.Module, setup: Setup, batch_size: int | None = None) -> torch.nn.Module:
    """Recompute BatchNorm running statistics over the training set (cumulative average, as SWAG's
    ``bn_update``), for weights that were not trained with these statistics. No-op without BatchNorm."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return model
    was = model.training
    model.train()
    moms = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    bs = batch_size or setup.recipe.batch_size
    for s in range(0, setup.n_train, bs):
        model(setup.x[s : s + bs])
    for m, mom in zip(bns, moms, strict=True):
        m.momentum = mom
    model.train(was)
    return model


# ----------------------------------------------------------------------------- training


def _dropout_mask(gen: torch.Generator, shape: tuple[int, ...], p: float, device, dtype) -> torch.Tensor:
    keep = torch.rand(shape, generator=gen, device=device) >= p
    return keep.to(dtype) / (1.0 - p)


def train_models(
    setup: Setup,
    seeds: Sequence[int],
    *,
    dropout: float = 0.0,
    recipe: _train.Recipe | None = None,
    progress: bool = True,
    desc: str = "train",
    mask_seed: int = 0,
) -> Params:
    """Train one network per seed with the setup's recipe; return their stacked state dicts.

    OptuNet: all models at once with the stacked trainer (:func:`symlib.train.minibatches`,
    :func:`~symlib.train.loss_and_grads`, :func:`~symlib.train.sgd_step`); with ``dropout = p > 0`` each
    model and image draws its own mask on the 10 features before the last layer (entries 0 or
    ``1 / (1 - p)``). Other architectures: one ``nn.Module`` after another with ``torch.optim.SGD`` on the
    same batches (the module's ``dropout`` layer set to ``p``).

    Raises:
        FloatingPointError: naming the step and seeds, if a loss becomes NaN or infinite.
    """
    from symlib.progress import bar

    rec = recipe or setup.recipe
    steps = rec.epochs * -(-setup.n_train // rec.batch_size)
    if setup.arch == "optunet":
        theta = init_stacked(setup, seeds)
        gen = generator(mask_seed, setup.device)
        bufs = None
        with bar(steps, f"{desc} ({len(seeds)} stacked)", enabled=progress, unit="step") as pb:
            for b in _train.minibatches(seeds, setup.x, setup.y, rec, setup.fill[0]):
                mask = None
                if dropout:
                    shape = (len(seeds), 10, b.x.shape[1])
                    mask = _dropout_mask(gen, shape, dropout, setup.device, b.x.dtype)
                loss, grads = _train.loss_and_grads(theta, b.x, b.y, "optunet", feat_mask=mask)
                check_finite_loss(loss, b.step, seeds, desc)
                theta, bufs = _train.sgd_step(theta, grads, bufs, b.lr, rec)
                pb.update(1)
        return theta
    # the dropout layers draw their masks from the global RNG: seed it, and restore it afterwards
    devices = [setup.device] if setup.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(mask_seed % (2**63))
        if devices:
            torch.cuda.manual_seed(mask_seed % (2**63))
        return _train_modules(setup, seeds, dropout, rec, steps, progress, desc)


def _train_modules(setup, seeds, dropout, rec, steps, progress, desc) -> Params:
    from symlib.progress import bar

    states = []
    with bar(steps * len(seeds), f"{desc} (one by one)", enabled=progress, unit="step") as pb:
        for s in seeds:
            model = new_module(setup, seed=s).train()
            if dropout:
                last_dropout(model).p = dropout
            opt = torch.optim.SGD(
                model.parameters(),
                lr=rec.lr,
                momentum=rec.momentum,
                weight_decay=rec.weight_decay,
                nesterov=rec.nesterov,
            )
            for b in _train.minibatches([s], setup.x, setup.y, rec, setup.fill):
                for g in opt.param_groups:
                    g["lr"] = b.lr
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(b.x[0]), b.y[0])
                check_finite_loss(loss, b.step, [s], desc)
                loss.backward()
                opt.step()
                pb.update(1)
            if dropout:
                last_dropout(model).p = 0.0
            states.append(state_of(model))
    return stack(states)


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
    from symlib import zoo

    seeds = base_seeds(n_modes, seed)
    if use_cache and setup.name in zoo.PRESETS:
        cfg = zoo.preset(setup.name, setup.scale)
        if cfg.arch != setup.arch:
            raise ValueError(f"preset {setup.name!r} is {cfg.arch!r}, but the setup is {setup.arch!r}")
        cfg = dataclasses.replace(
            cfg, seed=seeds[0], n_models=n_modes, chunk=n_modes if cfg.arch == "optunet" else 1
        )
        params, man = zoo.load_or_train(cfg, device=setup.device, cache_dir=cache_dir, progress=progress)
        if man.get("data", {}).get("fingerprint") != setup.data_info.get("fingerprint"):
            raise ValueError(
                f"cached base models {zoo.cache_path(cfg, cache_dir)} were trained on other data than the "
                f"setup's; use another cache_dir"
            )
        return params, seeds, str(zoo.cache_path(cfg, cache_dir))
    return train_models(setup, seeds, progress=progress, desc="base models"), seeds, None


# ----------------------------------------------------------------------------- runs


def method_module(method: str):
    """The module ``symlib.posteriors.<method>`` (a clear error if unknown or not installed)."""
    from symlib.posteriors import METHODS

    if method not in METHODS:
        raise ValueError(f"unknown posterior method {method!r}; choose one of {list(METHODS)}")
    try:
        return importlib.import_module(f"symlib.posteriors.{method}")
    except ModuleNotFoundError as e:
        if e.name == f"symlib.posteriors.{method}":
            raise ValueError(f"method {method!r} is not available in this version of symlib") from None
        raise


def run(
    method: str,
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
    """Produce ``n_modes x n_per_mode`` samples of ``method`` into ``out_dir``, resuming.

    1. If ``out_dir`` holds this very set (same method, sizes, hyper-parameters, problem and seed)
       complete, it is loaded and returned: nothing is recomputed.
    2. Methods that start from trained models get ``n_modes`` base models from :func:`base_models`
       (cached: a rerun does not retrain them).
    3. ``symlib.posteriors.<method>.sample(setup, n_modes, n_per_mode, seed, base=..., **hyper)``.
    4. The set is written chunk by chunk (:func:`symlib.posteriors.io.save`, one mode per file by
       default); after an interruption, a rerun recomputes the samples (deterministic for a seed and a
       device) and writes only the missing chunks.

    Args:
        method: a name of :data:`symlib.posteriors.METHODS`.
        setup: the training problem (:func:`setup_for`).
        n_modes, n_per_mode: sizes (1 x 100: one-mode; 10 x 10: the paper's multi-mode).
        seed: the run's seed (base models :func:`base_seeds`, streams :func:`stream_seeds`).
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
    from symlib.zoo import ZooError

    mod = method_module(method)
    check_sizes(n_modes, n_per_mode)
    uses = USES_BASE.get(method, getattr(mod, "USES_BASE", False))
    seeds = base_seeds(n_modes, seed) if uses else []
    key = io.identity(method, n_modes, n_per_mode, hyper, io.setup_record(setup), {"seeds": seeds}, seed)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None and io.is_posterior(out):
        man = io.read_manifest(out)
        if man.get("set_hash") == key and man.get("complete"):
            try:
                return io.load(out, device=setup.device)
            except ZooError:
                pass  # a chunk was lost or damaged since: recompute, rewrite only what is missing
    base, base_path = None, None
    if uses:
        base, seeds, base_path = base_models(setup, n_modes, seed, cache_dir=cache_dir, progress=progress)
        if on_base is not None:
            on_base(base)
    samples = mod.sample(setup, n_modes, n_per_mode, seed, base=base, progress=progress, **hyper)
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
