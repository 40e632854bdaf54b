"""Training a zoo: data, stacked chunks, shards and resuming (book: "Checkpoint zoos")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symlib import scales as _scales
from symlib import store
from symlib import training as _train
from symlib.params import Params
from symlib.store import FORMAT, MANIFEST, chunk_name
from symlib.zoo.chunks import DATA, ZooError, data_entry, read, write_manifest
from symlib.zoo.config import ZooConfig


@dataclasses.dataclass(frozen=True)
class _Data:
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    fill: tuple[float, ...]
    info: dict[str, Any]


def _synthetic(cfg: ZooConfig, n: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + salt)
    x = torch.randn(n, cfg.channels, cfg.image_size, cfg.image_size, generator=g)
    return x, torch.randint(0, cfg.num_classes, (n,), generator=g)


def load_data(cfg: ZooConfig, device: str | torch.device = "cpu") -> _Data:
    """The training and test tensors of a zoo, on ``device``, with the data fingerprint."""
    if cfg.source == "synthetic":
        x, y = _synthetic(cfg, cfg.n_train or 256, 0)
        xt, yt = _synthetic(cfg, cfg.n_test or 128, 1)
        h = hashlib.sha256()
        for t in (x, y, xt, yt):
            h.update(t.numpy().tobytes())
        fill = (0.0,) * cfg.channels
        info = {"name": cfg.dataset, "source": "synthetic", "fingerprint": h.hexdigest()}
    else:
        from symlib import data

        tr = data.load(cfg.dataset, "train", source=cfg.source)
        te = data.load(cfg.dataset, "test", source=cfg.source)
        x, y = tr.x[: cfg.n_train], tr.y[: cfg.n_train]
        xt, yt = te.x[: cfg.n_test], te.y[: cfg.n_test]
        fill = tuple(float(v) for v in tr.black)
        info = {
            "name": tr.name,
            "source": tr.source,
            "fingerprint": tr.fingerprint,
            "test_fingerprint": te.fingerprint,
        }
    info.update(n_train=int(x.shape[0]), n_test=int(xt.shape[0]))
    dev = torch.device(device)
    return _Data(x.to(dev), y.to(dev), xt.to(dev), yt.to(dev), fill, info)


def _shard_chunks(cfg: ZooConfig, shard: tuple[int, int] | None) -> list[int]:
    if shard is None:
        return list(range(cfg.n_chunks))
    k, n = shard
    if not (isinstance(k, int) and isinstance(n, int) and n >= 1 and 0 <= k < n):
        raise ValueError(
            f"shard must be (k, n) with 0 <= k < n, got {shard!r} (k counts from 0, like "
            f"$SLURM_ARRAY_TASK_ID with --array=0-{max(n, 1) - 1})"
        )
    return list(range(k, cfg.n_chunks, n))


def _train_chunk(
    cfg: ZooConfig, seeds: Sequence[int], d: _Data, device: torch.device, bar
) -> tuple[Params, list]:
    rec = cfg.recipe
    if cfg.arch == "optunet":
        theta = _train.init_params(cfg.make_model, seeds)
        theta = _train.train_stacked(
            theta,
            seeds,
            d.x,
            d.y,
            rec,
            fill=d.fill[0],
            arch="optunet",
            on_epoch=lambda e: bar.update(len(seeds)),
        )
        tr_acc, tr_loss = _train.evaluate_stacked(theta, d.x, d.y)
        te_acc, te_loss = _train.evaluate_stacked(theta, d.x_test, d.y_test)
        metrics = [tr_acc.tolist(), tr_loss.tolist(), te_acc.tolist(), te_loss.tolist()]
    else:
        states, metrics_t = [], []
        for s in seeds:
            model = _train.train_plain(_train.init_model(cfg.make_model, s), s, d.x, d.y, rec, fill=d.fill)
            metrics_t.append(
                _train.evaluate_model(model, d.x, d.y) + _train.evaluate_model(model, d.x_test, d.y_test)
            )
            states.append(model.state_dict())
            bar.update(rec.epochs)
        theta = {k: torch.stack([st[k] for st in states]) for k in states[0]}
        metrics = [list(col) for col in zip(*metrics_t, strict=True)]
    records = [
        {
            "seed": int(s),
            "train_acc": metrics[0][i],
            "train_loss": metrics[1][i],
            "test_acc": metrics[2][i],
            "test_loss": metrics[3][i],
        }
        for i, s in enumerate(seeds)
    ]
    return theta, records


def train(
    cfg: ZooConfig,
    out_dir: str | os.PathLike,
    shard: tuple[int, int] | None = None,
    device: str | torch.device = "cpu",
    progress: bool = True,
    repair: bool = False,
) -> dict[str, Any]:
    """Train the zoo ``cfg`` (or one shard of it) into ``out_dir``, resuming what is already there.

    The folder is checked before any work (:func:`symlib.store.check_out`): a file, a path under a file,
    a read-only folder, an exported dataset, a folder holding files symlib did not write (``notes.txt``,
    ``.git/``), a sample set, another zoo or chunks of another zoo are refused and nothing is written.
    Chunks already on disk are checked in full (:func:`~symlib.zoo.chunks.read`: checksum, seeds, shapes)
    and skipped; each new chunk is written atomically as soon as it is trained (the same bytes for the
    same chunk: :func:`symlib.store.serialize`), and the manifest is rewritten after every chunk when it
    changes (a complete zoo is checked and nothing is written). Every chunk records the data it was
    trained on (the manifest's data record), which a manifest must then record. Temporary files left by
    a killed run are deleted, so only one run may write to a folder at a time (use ``shard`` and
    separate folders to train in parallel). A full disk is a :class:`~symlib.store.StoreError` naming the
    folder (nothing written before is damaged).

    A damaged chunk (unreadable, or its weights do not match their checksum) or a damaged manifest is
    refused unless ``repair``: then exactly the damaged chunks are retrained (the same seeds give the same
    weights, bit for bit) and the manifest is rebuilt from the chunks (``symlib zoo repair``,
    :func:`symlib.zoo.repair`).

    Args:
        cfg: the zoo (:func:`~symlib.zoo.config.preset`).
        out_dir: the zoo directory (created if needed).
        shard: ``(k, n)``: train only chunks ``c`` with ``c % n == k`` (``0 <= k < n``).
        device: ``"cpu"`` or ``"cuda"``.
        progress: show a tqdm bar of model-epochs (``TQDM_DISABLE=1`` hides it).
        repair: retrain damaged chunks and rebuild a damaged manifest instead of refusing them.

    Returns:
        The manifest (also in ``out_dir/manifest.json``).
    """
    from symlib.progress import bar as progress_bar

    dev = _scales.check_device(device)
    mine = _shard_chunks(cfg, shard)
    out = Path(out_dir)
    old = _check_out(out, cfg, repair)  # before any work: nothing is written if the folder is refused
    records, data_info = _existing(out, cfg, mine, old, repair)
    todo = [c for c in mine if c not in records]
    if todo or data_info is None:
        d = load_data(cfg, dev)
        data_info = _same_data(out, data_info, d.info)
    done = lambda: sorted(records)  # noqa: E731
    per_chunk = cfg.recipe.epochs
    total = sum(cfg.chunk_range(c)[1] - cfg.chunk_range(c)[0] for c in mine) * per_chunk
    initial = sum(len(records[c]) for c in records) * per_chunk
    full = ("nothing written before is damaged (every file is written to a temporary name and renamed): "
            "free some space, or choose another --out, and run the same command again: it resumes")
    with store.no_space(out, full), progress_bar(
        total,
        f"zoo {cfg.preset}/{cfg.scale}" + (f" shard {shard[0]}/{shard[1]}" if shard else ""),
        enabled=progress,
        initial=initial,
        unit="model-epoch",
    ) as bar:
        out.mkdir(parents=True, exist_ok=True)
        store.remove_stale(out)  # left by a killed run (one run per folder at a time)
        write_manifest(out, cfg, done(), records, data_info, shard, mine)
        for c in todo:
            start, stop = cfg.chunk_range(c)
            theta, recs = _train_chunk(cfg, cfg.seeds[start:stop], d, dev, bar)
            _check_finite(theta, recs, cfg)
            meta = {
                "format": FORMAT,
                "config_hash": cfg.hash,
                "chunk": str(c),
                "arch": cfg.arch,
                "models": json.dumps(recs),
                DATA: data_entry(data_info),
            }
            store.atomic_save(theta, out / chunk_name(c), meta)
            records[c] = recs
            write_manifest(out, cfg, done(), records, data_info, shard, mine)
    return store.read_manifest(out, "zoo")


def _check_out(out: Path, cfg: ZooConfig, repair: bool) -> dict[str, Any] | None:
    """Check, before any work, that the zoo ``cfg`` can be trained into ``out``
    (:func:`symlib.store.check_out`: not a file, writable, not an exported dataset, no files symlib did not
    write, no other set; and no chunks of another zoo); a damaged manifest only with ``repair``.

    Returns:
        The folder's manifest, or ``None``.
    """
    old, damaged = store.check_out(out, "zoo")
    if old is not None and old.get("config_hash") != cfg.hash:
        raise ZooError(
            f"{out / MANIFEST}: this folder holds zoo {old.get('preset')}/{old.get('scale')} "
            f"(config {old.get('config_hash')}), not {cfg.preset}/{cfg.scale} ({cfg.hash}); "
            f"choose another --out"
        )
    if damaged and not repair:
        raise ZooError(
            f"{out / MANIFEST}: corrupt manifest; the chunks beside it may still be valid: rerun this "
            f"command with --repair (`repair=True`): it checks every chunk, keeps the valid ones, retrains "
            f"the damaged ones and rewrites the manifest"
        )
    store.check_owners(out, "config_hash", cfg.hash, "zoo")
    return old


def _existing(
    out: Path, cfg: ZooConfig, mine: list[int], old: dict[str, Any] | None, repair: bool
) -> tuple[dict[int, list], dict[str, Any] | None]:
    """The chunks of ``mine`` already in ``out``, checked in full (their model records; a damaged one is
    refused unless ``repair``, then left out to be trained again), and the data record the zoo was trained
    on: the one its chunks carry (their header's sha256 vouches for it; a manifest's may have been
    edited), else the manifest's, else ``None``.

    Raises:
        ZooError: a damaged chunk without ``repair``, or chunks trained on different data.
    """
    records: dict[int, list] = {}
    held: dict[int, dict[str, Any]] = {}
    for c in mine:
        if (out / chunk_name(c)).exists():
            try:
                got = read(out / chunk_name(c), cfg, c)
            except store.DamagedError as e:
                if not repair:
                    raise ZooError(f"{e} (or rerun this command with --repair)") from None
                continue
            records[c] = got.records
            if got.data is not None:
                held[c] = got.data
    if not held:
        return records, (old.get("data") if old is not None else None)
    first, data = next(iter(held.items()))
    for c, other in held.items():
        if other != data:
            raise ZooError(
                f"{out / chunk_name(c)}: was trained on data {other.get('fingerprint')}, but "
                f"{chunk_name(first)} on {data.get('fingerprint')}: chunks of zoos trained on different data "
                f"are mixed in this folder; move the chunks of one of them out, or choose another --out"
            )
    return records, data


def _same_data(out: Path, recorded: dict[str, Any] | None, loaded: dict[str, Any]) -> dict[str, Any]:
    """The data record to train with: ``recorded`` (what the zoo in ``out`` was trained on), checked
    against the data as it loads now (``loaded``), or ``loaded`` for a new zoo.

    Raises:
        ZooError: the data loads otherwise now (another fingerprint): the zoo cannot be continued.
    """
    if recorded is None:
        return loaded
    for k in sorted(set(recorded) & set(loaded)):
        if recorded[k] != loaded[k]:
            raise ZooError(
                f"{out / MANIFEST}: was trained on data {recorded[k]} ({k}), but the data now loads as "
                f"{loaded[k]}; choose another --out"
            )
    return recorded


def _check_finite(theta: Params, recs: list, cfg: ZooConfig) -> None:
    """Refuse to write a chunk whose networks diverged (NaN or infinite weights), naming their seeds."""
    bad = set()
    for v in theta.values():
        if v.is_floating_point():
            bad |= set((~torch.isfinite(v)).flatten(1).any(1).nonzero().flatten().tolist())
    if bad:
        raise FloatingPointError(
            f"zoo {cfg.preset}/{cfg.scale}: the networks of seeds {sorted(recs[i]['seed'] for i in bad)} "
            f"diverged (NaN or infinite weights) with recipe lr={cfg.recipe.lr}; nothing was written for "
            f"this chunk: lower the learning rate (a new config, so a new --out)"
        )
