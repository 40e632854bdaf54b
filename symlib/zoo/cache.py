"""Loading, merging, caching and summarising zoos (book: "Checkpoint zoos")."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symlib import scales as _scales
from symlib import store
from symlib.params import Params
from symlib.store import MANIFEST, chunk_name
from symlib.zoo.chunks import (
    ZooError,
    check_data,
    check_manifest,
    check_records,
    config_of,
    read,
    read_manifest,
    write_manifest,
)
from symlib.zoo.config import ZooConfig


def _check_complete(path: Path, man: dict[str, Any], cfg: ZooConfig) -> None:
    chunks = [ch["chunk"] for ch in man["chunks"]]
    dup = sorted({c for c in chunks if chunks.count(c) > 1})
    missing = sorted(set(range(cfg.n_chunks)) - set(chunks))
    if dup:
        raise ZooError(f"{path / MANIFEST}: chunks {dup} listed twice")
    if missing:
        lost = [s for c in missing for s in cfg.seeds[slice(*cfg.chunk_range(c))]]
        merging = man.get("merging") or {}
        if merging.get("shards"):
            shards = " ".join(str(p) for p in merging["shards"])
            how = (
                f"a merge into this folder was interrupted: run it again (`symlib zoo merge {shards} --out "
                f"{path}`), or train the missing chunks with `symlib zoo repair {path}`"
            )
        elif man.get("shard"):
            k, n = man["shard"]
            how = f"this is shard {k}/{n}: merge all shards with `symlib zoo merge`"
        else:
            how = f"finish it with `symlib zoo repair {path}` (it trains exactly the missing chunks)"
        raise ZooError(
            f"{path / MANIFEST}: zoo is incomplete, missing {len(lost)} models (seeds {lost[:10]}"
            f"{'...' if len(lost) > 10 else ''}); {how}"
        )


def load(path: str | os.PathLike, as_: str = "stacked", device: str | torch.device = "cpu"):
    """Load a whole zoo in one call, checking every file.

    A posterior sample set has the same format but its own manifest: load it with :func:`symlib.load`
    (either kind) or :func:`symlib.posteriors.io.load`.

    Args:
        path: the zoo directory.
        as_: ``"stacked"``: a dict of tensors ``(n_models, ...)`` (the state dict of model ``i`` at index
            ``i``); ``"models"``: a list of ``nn.Module`` in eval mode.
        device: where to put the tensors.

    Returns:
        ``(params, manifest)`` or ``(models, manifest)``.

    Raises:
        ZooError: naming the file, for a missing/corrupt manifest or chunk, a chunk file at another
            chunk's name, a manifest whose architecture, seeds, metrics or data record differ from its
            configuration or chunks, another architecture, NaN weights, or missing models.
    """
    if as_ not in ("stacked", "models"):
        raise ValueError(f"as_ must be 'stacked' or 'models', got {as_!r}")
    path = Path(path)
    man = read_manifest(path)
    cfg = config_of(path, man)
    check_manifest(path, man, cfg)
    _check_complete(path, man, cfg)
    parts = []
    for c in range(cfg.n_chunks):
        got = read(path / chunk_name(c), cfg, c)
        check_records(path, man, cfg, c, got.records)
        check_data(path, man, chunk_name(c), got.data)
        parts.append(got.tensors)
    dev = _scales.check_device(device)
    stacked = {k: torch.cat([p[k] for p in parts]).to(dev) for k in parts[0]}
    if as_ == "stacked":
        return stacked, man
    return models_from_stacked(cfg, stacked), man


def models_from_stacked(cfg: ZooConfig, stacked: Params) -> list[torch.nn.Module]:
    """One eval-mode ``nn.Module`` per model of a stacked state dict."""
    n = next(iter(stacked.values())).shape[0]
    out = []
    dev = next(iter(stacked.values())).device
    for i in range(n):
        with torch.device("meta"):
            m = cfg.make_model()
        m = m.to_empty(device=dev)
        try:
            m.load_state_dict({k: v[i] for k, v in stacked.items()})
        except RuntimeError as e:
            raise ZooError(
                f"the stacked weights do not fit architecture {cfg.arch!r} of the zoo's config ({e}); pass "
                f"the config the weights were trained with"
            ) from None
        out.append(m.eval())
    return out


def repair(
    path: str | os.PathLike, device: str | torch.device = "cpu", progress: bool = True
) -> dict[str, Any]:
    """Repair (or finish) the zoo in ``path`` from its manifest's configuration: every chunk is checked in
    full and exactly the damaged or missing ones are retrained (the same seeds give the same weights, bit
    for bit); valid chunks are not touched (``symlib zoo repair``).

    Returns:
        The manifest.

    Raises:
        ZooError: the manifest is missing or damaged (then rerun ``symlib zoo train ... --repair`` with
            the arguments that trained the zoo), or a chunk belongs to another zoo.
    """
    import symlib.zoo as _zoo  # through the package, so that a patched ``zoo.train`` is seen

    path = Path(path)
    man = read_manifest(path)
    cfg = config_of(path, man)
    shard = tuple(man["shard"]) if man.get("shard") else None
    return _zoo.train(cfg, path, shard=shard, device=device, progress=progress, repair=True)


def merge(shard_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> dict[str, Any]:
    """Check shards of one zoo and combine them into ``out_dir``.

    Every shard must hold the same configuration and data; every chunk must be present exactly once
    and pass :func:`symlib.zoo.read_chunk`.

    The output folder is checked before any chunk is read; while the chunks are copied its manifest
    names the shards (an interrupted merge says how to finish it), and temporary files an interrupted
    merge left there are removed.

    Returns:
        The merged manifest.
    """
    dirs = [Path(p) for p in shard_dirs]
    if not dirs:
        raise ValueError("merge needs at least one shard directory")
    mans = []
    for p in dirs:
        if store.kind_of(p) == "posterior":
            raise ZooError(
                f"{p}: holds a posterior sample set, not a zoo shard; `symlib zoo merge` combines the shards "
                f"of one zoo (`symlib zoo train --shard K/N`): pass zoo folders only"
            )
        mans.append(read_manifest(p))
    cfg = config_of(dirs[0], mans[0])
    out = Path(out_dir)
    old, damaged = store.check_out(out, "zoo")  # before reading (and checking) every chunk
    if damaged or (old is not None and old.get("config_hash") != cfg.hash):
        raise ZooError(
            f"{out / MANIFEST}: holds {'a damaged manifest' if damaged else 'another zoo'}; choose another "
            f"output folder"
        )
    store.check_owners(out, "config_hash", cfg.hash, "zoo")
    owner: dict[int, Path] = {}
    records: dict[int, list] = {}
    for p, man in zip(dirs, mans, strict=True):
        if config_of(p, man).hash != cfg.hash:
            raise ZooError(
                f"{p / MANIFEST}: config {man['config_hash']} differs from {dirs[0]}'s {cfg.hash}: these are "
                f"not shards of one zoo; merge shards trained with the same --preset, --scale and --seed"
            )
        fp = (man.get("data") or {}).get("fingerprint")
        fp0 = (mans[0].get("data") or {}).get("fingerprint")
        if fp != fp0:
            raise ZooError(f"{p / MANIFEST}: trained on data {fp}, but {dirs[0]} on {fp0}")
        for ch in man["chunks"]:
            c = ch["chunk"]
            if c in owner:
                raise ZooError(
                    f"chunk {c} (seeds {list(cfg.seeds[slice(*cfg.chunk_range(c))])}) is in both "
                    f"{owner[c]} and {p}; each shard must train a disjoint slice"
                )
            owner[c] = p
            got = read(p / chunk_name(c), cfg, c)
            check_data(p, man, chunk_name(c), got.data)  # the data its shard records
            records[c] = got.records
    missing = sorted(set(range(cfg.n_chunks)) - set(owner))
    if missing:
        lost = [s for c in missing for s in cfg.seeds[slice(*cfg.chunk_range(c))]]
        raise ZooError(
            f"merging {len(dirs)} shards leaves {len(lost)} models missing (chunks {missing}, "
            f"seeds {lost[:10]}{'...' if len(lost) > 10 else ''}); train the missing shards first"
        )
    full = ("nothing written before is damaged (every file is written to a temporary name and renamed): "
            "free some space and run the same merge again")
    with store.no_space(out, full):
        out.mkdir(parents=True, exist_ok=True)
        store.remove_stale(out)  # left by an interrupted merge (one writer per folder at a time)
        if old is None:  # a new folder: say what is being written there until the merge is done
            write_manifest(out, cfg, [], {}, mans[0].get("data"), None, list(range(cfg.n_chunks)),
                           merging={"shards": [str(p) for p in dirs]})
        for c, p in sorted(owner.items()):
            src, dst = p / chunk_name(c), out / chunk_name(c)
            if src.resolve() != dst.resolve():
                store.atomic_write_bytes(dst, src.read_bytes())
        return write_manifest(
            out, cfg, sorted(owner), records, mans[0].get("data"), None, list(range(cfg.n_chunks))
        )


def cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The zoo cache: ``cache_dir``, else ``$SYMLIB_CACHE``, else ``~/.cache/symlib/zoos``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("SYMLIB_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "symlib" / "zoos"


def cache_path(cfg: ZooConfig, cache: str | os.PathLike | None = None) -> Path:
    """Where the cache keeps zoo ``cfg``: ``<cache>/<preset>-<scale>-<config hash>``."""
    return cache_dir(cache) / f"{cfg.preset}-{cfg.scale}-{cfg.hash}"


def load_or_train(
    cfg: ZooConfig,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    as_: str = "stacked",
    seed: int | None = None,
    progress: bool = True,
):
    """The zoo ``cfg`` from the cache, training (or finishing) it first if needed.

    Chapters share one zoo: the cache key is the preset, the scale and the config hash.

    Args:
        cfg: the zoo (:func:`~symlib.zoo.config.preset`).
        device: where to train and where to put the loaded tensors.
        cache_dir: overrides ``$SYMLIB_CACHE``.
        as_: ``"stacked"`` or ``"models"`` (see :func:`load`).
        seed: if given, replaces ``cfg.seed`` (another, independent zoo).
        progress: show a progress bar while training.

    Returns:
        ``(params, manifest)`` or ``(models, manifest)``, as :func:`load`.
    """
    if seed is not None:
        cfg = dataclasses.replace(cfg, seed=seed)
    import symlib.zoo as _zoo  # through the package, so that a patched ``zoo.train`` is seen

    path = cache_path(cfg, cache_dir)
    try:  # read only: a complete cache may be read-only (zoo.train checks the folder before writing)
        man, damaged = (read_manifest(path) if (path / MANIFEST).exists() else None), False
    except store.DamagedError:
        man, damaged = None, True
    if man is None or not man.get("complete"):
        store.check_folder(path, "zoo", "zoo cache (cache_dir, --cache or $SYMLIB_CACHE)")
        _zoo.train(cfg, path, device=device, progress=progress, repair=damaged)
    try:
        return load(path, as_=as_, device=device)
    except store.DamagedError as e:  # a cache repairs itself: retrain exactly the damaged chunks
        warnings.warn(f"{e.args[0].split('; ')[0]}; retraining exactly the damaged chunks", stacklevel=2)
        _zoo.train(cfg, path, device=device, progress=progress, repair=True)
    return load(path, as_=as_, device=device)


def info(path: str | os.PathLike) -> str:
    """A human-readable summary of a zoo directory (also of an incomplete one or a shard); :func:`symlib.info`
    also summarises posterior sample sets."""
    path = Path(path)
    man = read_manifest(path)
    cfg = config_of(path, man)
    check_manifest(path, man, cfg)
    n = len(man["models"])
    lines = [
        f"zoo {path}: {cfg.preset} at scale {cfg.scale} (config {cfg.hash})",
        f"  arch {cfg.arch}, {n}/{cfg.n_models} models in {len(man['chunks'])}/{cfg.n_chunks} chunks"
        + (f", shard {man['shard'][0]}/{man['shard'][1]}" if man.get("shard") else "")
        + (", complete" if man.get("complete") else ", incomplete"),
        f"  recipe {cfg.recipe}",
        f"  data {man.get('data')}",
    ]
    if n:
        acc = torch.tensor([m["test_acc"] for m in man["models"]])
        lines.append(f"  test accuracy: mean {acc.mean():.4f}, min {acc.min():.4f}, max {acc.max():.4f}")
    lines.append(f"  symlib {man['symlib_version']}, git {man['git_commit']}")
    return "\n".join(lines)
