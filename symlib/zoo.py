r"""Checkpoint zoos: train, store, resume, shard, merge, load and cache networks (book: "Checkpoint zoos").

The paper estimates the target posterior with many independently trained
checkpoints (1,000 OptuNets on MNIST, paper §4). A *zoo* is a directory:

* ``chunk-00000.safetensors``, ``chunk-00001.safetensors``, ...: the state of
  ``ZooConfig.chunk`` consecutive models per file, every tensor stacked along a
  new first axis, with the chunk's seeds and per-model metrics in the file's metadata;
* ``manifest.json``: the configuration (architecture, recipe, seeds), the data
  fingerprint, the final train/test accuracy and loss of every model, the chunks,
  the symlib version and the git commit.

Every file is written to a temporary name in the same folder and renamed
(:func:`os.replace`), so a killed run leaves only complete files; restarting it
skips the chunks already on disk. ``shard=(k, n)`` trains chunks ``k, k + n,
k + 2n, ...`` only, so ``n`` machines (or a SLURM array) split a zoo;
:func:`merge` checks the shards and combines them. :func:`load_or_train`
caches zoos under ``$SYMLIB_CACHE`` (default ``~/.cache/symlib/zoos``), keyed
by preset, scale and a hash of the configuration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from symlib import models as _models
from symlib import scales as _scales
from symlib import train as _train

FORMAT = "symlib-zoo/1"
MANIFEST = "manifest.json"
Params = dict[str, torch.Tensor]


class ZooError(ValueError):
    """A zoo directory or file that is corrupt, incomplete or does not match its configuration."""


@dataclasses.dataclass(frozen=True)
class ZooConfig:
    """Everything that determines a zoo (two equal configs give the same zoo).

    Attributes:
        preset: preset name (see :func:`preset`).
        scale: ``"tiny"``, ``"cpu"`` or ``"paper"``.
        arch: ``"optunet"``, ``"resnet18"`` or ``"resnet20"``.
        dataset: a :mod:`symlib.data` dataset name.
        source: ``"embedded"``, ``"torchvision"`` or ``"synthetic"`` (random images of the right shape).
        recipe: the training recipe.
        n_models: checkpoints in the zoo; model ``i`` has seed ``seed + i``.
        seed: seed of the first model.
        n_train: training images used (the first ``n_train`` of the split; ``None``: all).
        n_test: test images used for the reported test metrics (``None``: all).
        chunk: models per file (the unit of resuming and sharding).
        width: first-stage width of ResNets (``None``: the architecture's default).
        num_classes: outputs of the network.
        image_size: side of the input images; channels: their channels.
    """

    preset: str
    scale: str
    arch: str
    dataset: str
    source: str
    recipe: _train.Recipe
    n_models: int
    seed: int = 0
    n_train: int | None = None
    n_test: int | None = None
    chunk: int = 32
    width: int | None = None
    num_classes: int = 10
    image_size: int = 28
    channels: int = 1

    def __post_init__(self):
        _scales.check_scale(self.scale)
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {sorted(ARCHS)}")
        if self.source not in ("embedded", "torchvision", "synthetic"):
            raise ValueError(
                f"unknown source {self.source!r}; choose 'embedded', 'torchvision' or 'synthetic'"
            )
        _scales.check_int("n_models", self.n_models, 1)
        _scales.check_int("seed", self.seed, 0)
        _scales.check_int("chunk", self.chunk, 1)

    @property
    def seeds(self) -> tuple[int, ...]:
        """The seed of every model, in zoo order."""
        return tuple(range(self.seed, self.seed + self.n_models))

    @property
    def n_chunks(self) -> int:
        return -(-self.n_models // self.chunk)

    def chunk_range(self, c: int) -> tuple[int, int]:
        """Model indices ``[start, stop)`` held by chunk ``c``."""
        return c * self.chunk, min((c + 1) * self.chunk, self.n_models)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def hash(self) -> str:
        """First 12 hex digits of the sha256 of the configuration (JSON, sorted keys)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    def make_model(self) -> torch.nn.Module:
        """A freshly initialised network of this zoo's architecture (global RNG)."""
        kwargs: dict[str, Any] = {"num_classes": self.num_classes}
        if self.arch != "optunet":
            kwargs["in_channels"] = self.channels
            if self.width is not None:
                kwargs["width"] = self.width
        return ARCHS[self.arch](**kwargs)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ZooConfig:
        d = dict(d)
        rec = dict(d.pop("recipe"))
        rec["milestones"] = tuple(rec.get("milestones", ()))
        return ZooConfig(recipe=_train.Recipe(**rec), **d)


def _arch(name: str):
    def make(**kw):
        if not hasattr(_models, name):
            raise ValueError(f"symlib.models has no {name}; update symlib")
        return getattr(_models, name)(**kw)

    return make


ARCHS = {"optunet": _arch("OptuNet"), "resnet18": _arch("ResNet18"), "resnet20": _arch("ResNet20")}


def _mnist_optunet(scale: str) -> ZooConfig:
    rec = _train.OPTUNET_MNIST
    return _scales.pick(
        scale,
        tiny=ZooConfig(
            "mnist-optunet",
            "tiny",
            "optunet",
            "mnist",
            "embedded",
            rec.scaled(2),
            n_models=8,
            n_train=512,
            n_test=256,
            chunk=2,
        ),
        cpu=ZooConfig(
            "mnist-optunet",
            "cpu",
            "optunet",
            "mnist",
            "embedded",
            dataclasses.replace(rec.scaled(CPU_EPOCHS), momentum=CPU_MOMENTUM),
            n_models=CPU_MODELS,
            chunk=32,
        ),
        paper=ZooConfig(
            "mnist-optunet", "paper", "optunet", "mnist", "torchvision", rec, n_models=1000, chunk=100
        ),
    )


# The cpu scale of "mnist-optunet" (the published book): 512 OptuNets, each trained for 20 epochs on the
# 4,000 embedded MNIST training digits with momentum 0.9 (paper: 1,000 for 60 epochs on 60,000, no
# momentum); see preset().
CPU_MODELS = 512
CPU_EPOCHS = 20
CPU_MOMENTUM = 0.9


def _resnet(name: str, dataset: str, rec: _train.Recipe, classes: int, size: int, scale: str) -> ZooConfig:
    common = dict(arch="resnet18", dataset=dataset, num_classes=classes, image_size=size, channels=3)
    return _scales.pick(
        scale,
        tiny=ZooConfig(
            name,
            "tiny",
            source="synthetic",
            recipe=rec.scaled(1),
            n_models=2,
            n_train=64,
            n_test=32,
            chunk=1,
            width=4,
            **common,
        ),
        cpu=ZooConfig(
            name,
            "cpu",
            source="synthetic",
            recipe=rec.scaled(2),
            n_models=2,
            n_train=256,
            n_test=128,
            chunk=1,
            width=8,
            **common,
        ),
        paper=ZooConfig(name, "paper", source="torchvision", recipe=rec, n_models=10, chunk=1, **common),
    )


PRESETS = {
    "mnist-optunet": _mnist_optunet,
    "cifar100-resnet18": lambda s: _resnet(
        "cifar100-resnet18", "cifar100", _train.RESNET18_CIFAR100, 100, 32, s
    ),
    "tinyimagenet-resnet18": lambda s: _resnet(
        "tinyimagenet-resnet18", "tinyimagenet", _train.RESNET18_TINYIMAGENET, 200, 64, s
    ),
}


def preset(name: str, scale: str = "cpu") -> ZooConfig:
    """The configuration of a named zoo at a scale.

    * ``mnist-optunet`` (the target posterior of the MNIST experiments, paper §4 and App. B.1: SGD lr
      0.04 halved at epochs 15 and 30, batch 64, weight decay 2e-4, random crop 28 with padding 4):

      - ``paper``: 1,000 OptuNets, 60 epochs, the full MNIST (60,000 / 10,000; ``source="torchvision"``).
      - ``cpu``: 512 OptuNets, 20 epochs (milestones scaled to epochs 5 and 10), the 4,000 / 1,000
        embedded MNIST digits, and **momentum 0.9** (the paper's recipe has none). This is less
        training than the paper's (1,260 steps instead of 56,000), chosen so that the zoo trains in
        about 5 minutes on 2 cores. With momentum, 20 epochs bring OptuNets to 71-87% test accuracy
        (mean 79.5% over 16 models, their ensemble 91.5%; 60 epochs: 85.7%, 10 epochs: 75%).
      - ``tiny``: 8 OptuNets, 2 epochs, 512 training digits, in files of 2 models (seconds).

    * ``cifar100-resnet18`` (75 epochs, batch 128, Nesterov SGD lr 0.1, momentum 0.9, weight decay 5e-4,
      lr / 10 at epochs 25 and 50, crop + flip) and ``tinyimagenet-resnet18`` (200 epochs, batch 128,
      lr 0.2, momentum 0.9, weight decay 5e-4, cosine): ``paper`` trains 10 ResNet-18 on the real data
      (a GPU and the datasets are needed); ``tiny`` and ``cpu`` are smoke runs of the same code on
      random images of the right shape (``source="synthetic"``) with narrow ResNet-18s.
    """
    if name not in PRESETS:
        raise ValueError(
            f"unknown preset {name!r}; choose one of {sorted(PRESETS)} (`symlib zoo list-presets`)"
        )
    return PRESETS[name](scale)


# ----------------------------------------------------------------------------- data


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


# ----------------------------------------------------------------------------- files


def _chunk_name(c: int) -> str:
    return f"chunk-{c:05d}.safetensors"


def _atomic_write_bytes(path: Path, payload: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tensor_digest(tensors: Params) -> str:
    """sha256 of named tensors (names, dtypes, shapes and bytes), recorded in every chunk file so that
    silently damaged weights are detected when the zoo is read."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        v = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.view(torch.uint8).numpy().tobytes() if v.numel() else b"")
    return h.hexdigest()


def _atomic_save(tensors: Params, path: Path, metadata: dict[str, str]) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    payload = safetensors_bytes(tensors, metadata={**metadata, "sha256": tensor_digest(tensors)})
    _atomic_write_bytes(path, payload)


def _reference_shapes(cfg: ZooConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = cfg.make_model()
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def read_chunk(path: str | os.PathLike, cfg: ZooConfig) -> tuple[Params, list[dict[str, Any]]]:
    """Read and check one chunk file of a zoo with configuration ``cfg``.

    Returns:
        The stacked tensors and the per-model records (seed and metrics).

    Raises:
        ZooError: naming the file, if it is unreadable, belongs to another configuration, has the wrong
            seeds, tensor names or shapes (another architecture), holds NaN/infinite weights, or its
            weights do not match the checksum written with them.
    """
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for damaged files
        raise ZooError(
            f"{path}: cannot read this zoo file ({type(e).__name__}: {e}); delete it and rerun "
            f"`symlib zoo train` to retrain its models"
        ) from None
    if meta.get("format") != FORMAT or "config_hash" not in meta:
        raise ZooError(f"{path}: not a {FORMAT} chunk (metadata {sorted(meta)})")
    if meta["config_hash"] != cfg.hash:
        raise ZooError(
            f"{path}: belongs to a zoo with config {meta['config_hash']}, not {cfg.hash} "
            f"({cfg.preset}/{cfg.scale}); do not mix zoos in one folder"
        )
    if meta.get("sha256") != tensor_digest(tensors):
        raise ZooError(
            f"{path}: its weights do not match the sha256 recorded when it was written, so the file is "
            f"corrupt (a damaged disk or an interrupted copy); delete it and rerun `symlib zoo train`"
        )
    c = int(meta["chunk"])
    start, stop = cfg.chunk_range(c)
    records = json.loads(meta["models"])
    seeds = [r["seed"] for r in records]
    if seeds != list(cfg.seeds[start:stop]):
        raise ZooError(f"{path}: holds seeds {seeds}, expected {list(cfg.seeds[start:stop])}")
    ref = _reference_shapes(cfg)
    if set(tensors) != set(ref):
        raise ZooError(
            f"{path}: tensors {sorted(tensors)} do not match architecture {cfg.arch!r} ({sorted(ref)})"
        )
    for k, v in tensors.items():
        if tuple(v.shape) != (stop - start, *ref[k]):
            raise ZooError(
                f"{path}: tensor {k!r} has shape {tuple(v.shape)}, expected "
                f"{(stop - start, *ref[k])} for {cfg.arch!r}"
            )
        if v.is_floating_point() and not torch.isfinite(v).all():
            bad = sorted(
                {seeds[i] for i in (~torch.isfinite(v)).flatten(1).any(1).nonzero().flatten().tolist()}
            )
            raise ZooError(
                f"{path}: tensor {k!r} holds NaN or infinite weights (seeds {bad}); delete the file "
                f"and rerun `symlib zoo train` to retrain these models"
            )
    return tensors, records


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


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


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not file.is_file():
        raise ZooError(f"{file}: no zoo manifest here; train one with `symlib zoo train --out {path}`")
    try:
        man = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ZooError(f"{file}: corrupt manifest ({e})") from None
    if man.get("format") != FORMAT:
        raise ZooError(f"{file}: format {man.get('format')!r}, expected {FORMAT!r}")
    return man


def _write_manifest(
    out: Path,
    cfg: ZooConfig,
    chunks: list[int],
    records: dict[int, list],
    data_info: dict | None,
    shard: tuple[int, int] | None,
    expected: list[int],
) -> dict[str, Any]:
    import symlib

    models = [r for c in sorted(records) for r in records[c]]
    man = {
        "format": FORMAT,
        "config": cfg.to_dict(),
        "config_hash": cfg.hash,
        "preset": cfg.preset,
        "scale": cfg.scale,
        "arch": cfg.arch,
        "recipe": dataclasses.asdict(cfg.recipe),
        "n_models": cfg.n_models,
        "seeds": [r["seed"] for r in models],
        "data": data_info,
        "models": models,
        "chunks": [
            {
                "chunk": c,
                "file": _chunk_name(c),
                "start": cfg.chunk_range(c)[0],
                "stop": cfg.chunk_range(c)[1],
            }
            for c in sorted(chunks)
        ],
        "shard": list(shard) if shard is not None else None,
        "complete": sorted(chunks) == sorted(expected),
        "symlib_version": symlib.__version__,
        "git_commit": _git_commit(),
    }
    _atomic_write_bytes(out / MANIFEST, json.dumps(man, indent=1).encode())
    return man


# ----------------------------------------------------------------------------- train


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
) -> dict[str, Any]:
    """Train the zoo ``cfg`` (or one shard of it) into ``out_dir``, resuming what is already there.

    Chunks already on disk are checked (:func:`read_chunk`) and skipped; each new chunk is written
    atomically as soon as it is trained, and the manifest is rewritten after every chunk. Temporary
    files left by a killed run are deleted, so only one run may write to a folder at a time (use
    ``shard`` and separate folders to train in parallel).

    Args:
        cfg: the zoo (:func:`preset`).
        out_dir: the zoo directory (created if needed).
        shard: ``(k, n)``: train only chunks ``c`` with ``c % n == k`` (``0 <= k < n``).
        device: ``"cpu"`` or ``"cuda"``.
        progress: show a tqdm bar of model-epochs (``TQDM_DISABLE=1`` hides it).

    Returns:
        The manifest (also in ``out_dir/manifest.json``).
    """
    from symlib.progress import bar as progress_bar

    dev = _scales.check_device(device)
    mine = _shard_chunks(cfg, shard)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        old = _read_manifest(out)
        if old["config_hash"] != cfg.hash:
            raise ZooError(
                f"{out / MANIFEST}: this folder holds zoo {old['preset']}/{old['scale']} "
                f"(config {old['config_hash']}), not {cfg.preset}/{cfg.scale} ({cfg.hash}); "
                f"choose another --out"
            )
    for stale in [*out.glob(".chunk-*.tmp"), *out.glob(f".{MANIFEST}.*.tmp")]:
        stale.unlink(missing_ok=True)  # left by a killed run (one run per folder at a time)
    records: dict[int, list] = {}
    for c in mine:
        if (out / _chunk_name(c)).exists():
            records[c] = read_chunk(out / _chunk_name(c), cfg)[1]
    todo = [c for c in mine if c not in records]
    data_info = None
    if (out / MANIFEST).exists():
        data_info = _read_manifest(out).get("data")
    if todo:
        d = load_data(cfg, dev)
        if data_info is not None and data_info.get("fingerprint") != d.info["fingerprint"]:
            raise ZooError(
                f"{out / MANIFEST}: was trained on data {data_info.get('fingerprint')}, but the data "
                f"now loads as {d.info['fingerprint']}; choose another --out"
            )
        data_info = d.info
    done = lambda: sorted(records)  # noqa: E731
    _write_manifest(out, cfg, done(), records, data_info, shard, mine)
    per_chunk = cfg.recipe.epochs
    total = sum(cfg.chunk_range(c)[1] - cfg.chunk_range(c)[0] for c in mine) * per_chunk
    initial = sum(len(records[c]) for c in records) * per_chunk
    with progress_bar(
        total,
        f"zoo {cfg.preset}/{cfg.scale}" + (f" shard {shard[0]}/{shard[1]}" if shard else ""),
        enabled=progress,
        initial=initial,
        unit="model-epoch",
    ) as bar:
        for c in todo:
            start, stop = cfg.chunk_range(c)
            theta, recs = _train_chunk(cfg, cfg.seeds[start:stop], d, dev, bar)
            meta = {
                "format": FORMAT,
                "config_hash": cfg.hash,
                "chunk": str(c),
                "arch": cfg.arch,
                "models": json.dumps(recs),
            }
            _atomic_save(theta, out / _chunk_name(c), meta)
            records[c] = recs
            _write_manifest(out, cfg, done(), records, data_info, shard, mine)
    return _read_manifest(out)


# ----------------------------------------------------------------------------- load, merge, cache


def _check_complete(path: Path, man: dict[str, Any], cfg: ZooConfig) -> None:
    chunks = [ch["chunk"] for ch in man["chunks"]]
    dup = sorted({c for c in chunks if chunks.count(c) > 1})
    missing = sorted(set(range(cfg.n_chunks)) - set(chunks))
    if dup:
        raise ZooError(f"{path / MANIFEST}: chunks {dup} listed twice")
    if missing:
        lost = [s for c in missing for s in cfg.seeds[slice(*cfg.chunk_range(c))]]
        raise ZooError(
            f"{path / MANIFEST}: zoo is incomplete, missing {len(lost)} models (seeds {lost[:10]}"
            f"{'...' if len(lost) > 10 else ''}); finish it with `symlib zoo train` (or merge all shards)"
        )


def load(path: str | os.PathLike, as_: str = "stacked", device: str | torch.device = "cpu"):
    """Load a whole zoo in one call, checking every file.

    Args:
        path: the zoo directory.
        as_: ``"stacked"``: a dict of tensors ``(n_models, ...)`` (the state dict of model ``i`` at index
            ``i``); ``"models"``: a list of ``nn.Module`` in eval mode.
        device: where to put the tensors.

    Returns:
        ``(params, manifest)`` or ``(models, manifest)``.

    Raises:
        ZooError: naming the file, for a missing/corrupt manifest or chunk, another architecture, NaN
            weights, or missing models.
    """
    if as_ not in ("stacked", "models"):
        raise ValueError(f"as_ must be 'stacked' or 'models', got {as_!r}")
    path = Path(path)
    man = _read_manifest(path)
    try:
        cfg = ZooConfig.from_dict(man["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ZooError(f"{path / MANIFEST}: bad config ({e})") from None
    if cfg.hash != man.get("config_hash"):
        raise ZooError(f"{path / MANIFEST}: config does not match its hash {man.get('config_hash')}")
    _check_complete(path, man, cfg)
    parts = []
    for c in range(cfg.n_chunks):
        tensors, recs = read_chunk(path / _chunk_name(c), cfg)
        parts.append(tensors)
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
        m.load_state_dict({k: v[i] for k, v in stacked.items()})
        out.append(m.eval())
    return out


def merge(shard_dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> dict[str, Any]:
    """Check shards of one zoo and combine them into ``out_dir``.

    Every shard must hold the same configuration and data; every chunk must be present exactly once
    and pass :func:`read_chunk`.

    Returns:
        The merged manifest.
    """
    dirs = [Path(p) for p in shard_dirs]
    if not dirs:
        raise ValueError("merge needs at least one shard directory")
    mans = [_read_manifest(p) for p in dirs]
    cfg = ZooConfig.from_dict(mans[0]["config"])
    owner: dict[int, Path] = {}
    records: dict[int, list] = {}
    for p, man in zip(dirs, mans, strict=True):
        if man["config_hash"] != cfg.hash:
            raise ZooError(f"{p / MANIFEST}: config {man['config_hash']} differs from {dirs[0]}'s {cfg.hash}")
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
            records[c] = read_chunk(p / _chunk_name(c), cfg)[1]
    missing = sorted(set(range(cfg.n_chunks)) - set(owner))
    if missing:
        lost = [s for c in missing for s in cfg.seeds[slice(*cfg.chunk_range(c))]]
        raise ZooError(
            f"merging {len(dirs)} shards leaves {len(lost)} models missing (chunks {missing}, "
            f"seeds {lost[:10]}{'...' if len(lost) > 10 else ''}); train the missing shards first"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists() and _read_manifest(out)["config_hash"] != cfg.hash:
        raise ZooError(f"{out / MANIFEST}: holds another zoo; choose another output folder")
    for c, p in sorted(owner.items()):
        src, dst = p / _chunk_name(c), out / _chunk_name(c)
        if src.resolve() != dst.resolve():
            _atomic_write_bytes(dst, src.read_bytes())
    return _write_manifest(
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
        cfg: the zoo (:func:`preset`).
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
    path = cache_path(cfg, cache_dir)
    man = _read_manifest(path) if (path / MANIFEST).exists() else None
    if man is None or not man.get("complete"):
        train(cfg, path, device=device, progress=progress)
    return load(path, as_=as_, device=device)


def info(path: str | os.PathLike) -> str:
    """A human-readable summary of a zoo directory (also of an incomplete one or a shard)."""
    path = Path(path)
    man = _read_manifest(path)
    cfg = ZooConfig.from_dict(man["config"])
    n = len(man["models"])
    lines = [
        f"zoo {path}: {man['preset']} at scale {man['scale']} (config {man['config_hash']})",
        f"  arch {man['arch']}, {n}/{cfg.n_models} models in {len(man['chunks'])}/{cfg.n_chunks} chunks"
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
