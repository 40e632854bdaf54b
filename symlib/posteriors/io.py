r"""Posterior sample sets on disk (book: chapter "Table 1").

A sample set is a stacked set (:mod:`symlib.store.sets`: chunk files of ``n_modes * n_per_mode`` samples
stacked along a new first axis, mode-major, and a ``manifest.json`` with the set's core fields, written
atomically and resumed), so that ``symlib.load(path)`` returns ``(params, manifest)`` for a posterior as
for a zoo. This module adds what is particular to posteriors:

* the manifest's fields of a posterior: the method's hyper-parameters (``"hyper"``), the base models it
  started from (``"base"``: seeds, and the folder they are cached in), the diagnostics, the run's seed, the
  training problem (``"setup"``: preset, scale, architecture, recipe, prior precision, data fingerprint;
  :func:`setup_record`) and the network it implies (``"arch"``, ``"model"``, ``"architecture"``);
* the set's identity (:func:`identity`: the sha256 of what determines the samples), so that :func:`save`
  resumes a partial write of the same set and refuses another;
* the checks of a manifest's architecture against its tensors and training problem (:func:`check_model`)
  and the summary :func:`info`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from symlib import models as _models
from symlib import store
from symlib.models.build import model_spec, networks
from symlib.params import Params
from symlib.posteriors.base import SampleSet, Setup
from symlib.store import MANIFEST, StoreError, jsonable
from symlib.store import sets as _sets
from symlib.store.sets import KIND

REPAIR = (
    "rerun `symlib posterior sample` with the same arguments (`--out` this folder): it rewrites exactly "
    "the damaged chunks"
)
_FINISH = "rerunning `symlib posterior sample` with the same arguments"

__all__ = [
    "KIND",
    "architecture",
    "check_model",
    "check_out",
    "identity",
    "info",
    "is_posterior",
    "load",
    "load_params",
    "model_spec",
    "models",
    "read_chunk",
    "read_manifest",
    "save",
    "setup_record",
]


def architecture(arch: str | None, shapes: dict[str, tuple[int, ...]],
                 setup: dict[str, Any] | None) -> _models.Recipe | None:
    """The recipe a sample set's manifest records (``"architecture"``): the registered network ``arch``
    with the arguments its ``shapes`` give, and the input shape of the set's zoo preset (``setup``), else
    the registry's; ``None`` for an architecture outside the registry."""
    from symlib import zoo

    net = _models.REGISTRY.get(arch) if arch else None
    if net is None:
        return None
    args = net.args_of(shapes)
    shape = net.input_shape(args)
    if (setup or {}).get("name") in zoo.PRESETS:
        cfg = zoo.preset(setup["name"], setup.get("scale") or "cpu")
        shape = (cfg.channels, cfg.image_size, cfg.image_size)
    return _models.Recipe("symlib", net.name, args, shape)


def setup_record(setup: Setup) -> dict[str, Any]:
    """What a manifest records of the training problem."""
    return jsonable(
        {
            "name": setup.name,
            "scale": setup.scale,
            "arch": setup.arch,
            "num_classes": setup.num_classes,
            "n_train": setup.n_train,
            "recipe": dataclasses.asdict(setup.recipe),
            "prior_precision": setup.prior_precision,
            "data": setup.data_info,
        }
    )


def identity(
    method: str,
    n_modes: int,
    n_per_mode: int,
    hyper: dict[str, Any],
    setup: dict[str, Any] | None,
    base: dict[str, Any] | None,
    seed: int | None,
) -> str:
    """First 16 hex digits of the sha256 of what determines a sample set (two runs with the same identity
    produce the same samples): method, sizes, hyper-parameters, training problem, base models, seed."""
    key = jsonable(
        {
            "method": method,
            "n_modes": n_modes,
            "n_per_mode": n_per_mode,
            "hyper": hyper,
            "setup": setup,
            "base": (base or {}).get("seeds"),
            "seed": seed,
        }
    )
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a posterior sample set, checked to be one and to hold the fields every reader uses
    (``symlib.store.sets.read_manifest``: :class:`symlib.store.StoreError` naming the field otherwise)."""
    return _sets.read_manifest(path, f"produce the set with `symlib posterior sample --out {path}`")


def _fields(
    samples: SampleSet,
    shapes: dict[str, tuple[int, ...]],
    setup: dict[str, Any] | None,
    base: dict[str, Any] | None,
    seed: int | None,
) -> dict[str, Any]:
    """The fields a posterior adds to the manifest of its stacked set (module docstring)."""
    arch = (setup or {}).get("arch")
    recipe = architecture(arch, shapes, setup)
    return {
        "seed": seed,
        "hyper": jsonable(samples.hyper),
        "base": jsonable({"seeds": list(samples.base_seeds), **(base or {})}),
        "diagnostics": jsonable(samples.diagnostics),
        "setup": setup,
        "arch": arch,
        "data": (setup or {}).get("data"),
        "model": model_spec(arch, shapes) if arch else None,
        "architecture": recipe.record() if recipe is not None else None,
    }


def save(
    samples: SampleSet,
    out_dir: str | os.PathLike,
    *,
    setup: Setup | None = None,
    base: dict[str, Any] | None = None,
    seed: int | None = None,
    chunk: int | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """Write a sample set into ``out_dir`` (created if needed), resuming a partial write
    (``symlib.store.sets.write``).

    Chunks already on disk that belong to this set (same identity hash) and pass :func:`read_chunk` are
    kept; the others are written atomically, the manifest is rewritten after every chunk.

    Args:
        samples: the set.
        out_dir: its directory.
        setup: the training problem (recorded in the manifest).
        base: where the base models come from, e.g. ``{"path": "...", "preset": ...}`` (their seeds are
            ``samples.base_seeds``).
        seed: the run's seed (recorded; part of the identity).
        chunk: samples per file (default ``n_per_mode``: one mode per file).
        key: the set's identity hash (default :func:`identity` of the samples' method, sizes and
            hyper-parameters, the setup, the base seeds and ``seed``; :func:`symlib.posteriors.sampling.run`
            passes the hash of its request, so that a finished set is found before recomputing it).

    Returns:
        The manifest.

    Raises:
        StoreError: if ``out_dir`` is a file, lies under a file, is not writable, or holds another sample
            set, chunks of another set or a zoo (checked before anything is written).
        ValueError: the samples hold NaN or infinite weights (nothing is written, no folder created).
    """
    srec = setup_record(setup) if setup is not None else None
    set_hash = key or identity(
        samples.method,
        samples.n_modes,
        samples.n_per_mode,
        samples.hyper,
        srec,
        {"seeds": list(samples.base_seeds)},
        seed,
    )
    shapes = {k: tuple(v.shape[1:]) for k, v in samples.params.items()}
    return _sets.write(
        samples.params, out_dir, method=samples.method, set_hash=set_hash, n_modes=samples.n_modes,
        n_per_mode=samples.n_per_mode, chunk=chunk, fields=_fields(samples, shapes, srec, base, seed),
        fix="the method diverged, lower its step size or learning rate",
    )


def check_out(out: Path, set_hash: str, method: str, n_modes: int, n_per_mode: int) -> None:
    """Check, before any work, that ``out`` can receive the sample set ``set_hash``
    (``symlib.store.sets.check_out``): not a file, not under a file, writable, not holding a zoo, another
    sample set or chunks of one. A damaged manifest is accepted: every chunk is then checked and the
    manifest rewritten."""
    _sets.check_out(out, set_hash, method, n_modes, n_per_mode)


def read_chunk(path: str | os.PathLike, manifest: dict[str, Any], c: int) -> Params:
    """Read and check chunk ``c`` of the sample set described by ``manifest`` (format, identity hash,
    checksum, sample indices, tensor names and shapes, finiteness; ``symlib.store.sets.read_chunk``)."""
    return _sets.read_chunk(path, manifest, c, REPAIR)


def load_params(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Params, dict[str, Any]]:
    """The stacked samples ``{name: (S, ...)}`` of a complete set and its manifest (what
    ``symlib.zoo.load`` returns for a posterior set), its architecture checked first
    (:func:`check_model`)."""
    man = read_manifest(path)
    check_model(path, man)
    return _sets.load_params(path, device, manifest=man, fix=REPAIR, finish=_FINISH)


def load(path: str | os.PathLike, device: str | torch.device = "cpu") -> SampleSet:
    """A saved sample set as a :class:`SampleSet` (every file checked)."""
    params, man = load_params(path, device)
    return SampleSet(
        params=params,
        method=man["method"],
        n_modes=man["n_modes"],
        n_per_mode=man["n_per_mode"],
        hyper=man["hyper"],
        base_seeds=list(man["base"].get("seeds", [])),
        diagnostics=man["diagnostics"],
    )


def check_model(path: str | os.PathLike, man: dict[str, Any]) -> None:
    """Check that a manifest's architecture (``arch``, ``setup.arch`` and the ``model`` constructor) agrees
    with the tensor shapes it records, so that an edited or damaged manifest is named here rather than
    failing later in ``load_state_dict``, and that its data record is its training problem's."""
    file = Path(path) / MANIFEST
    fix = (
        "the manifest was edited or damaged: restore it, or rerun `symlib posterior sample` with the same "
        "arguments (`--out` this folder) to rewrite it"
    )
    arch, shapes, spec = man.get("arch"), man.get("shapes"), man.get("model")
    if not isinstance(shapes, dict):
        raise StoreError(f"{file}: no tensor shapes recorded; {fix}")
    st_arch = (man.get("setup") or {}).get("arch")
    if st_arch is not None and arch != st_arch:
        raise StoreError(f"{file}: records architecture {arch!r}, its training problem {st_arch!r}; {fix}")
    setup = man.get("setup") if isinstance(man.get("setup"), dict) else {}
    if "data" in setup and man.get("data") != setup["data"]:  # two copies, written together
        have, want = ((d or {}).get("fingerprint") if isinstance(d or {}, dict) else d
                      for d in (man.get("data"), setup["data"]))
        raise StoreError(f"{file}: records data fingerprint {have!r}, its training problem {want!r}; {fix}")
    if not arch:
        return
    try:
        expected = model_spec(arch, {k: tuple(v) for k, v in shapes.items()})
    except (KeyError, IndexError, TypeError) as e:
        raise StoreError(
            f"{file}: its tensors ({sorted(shapes)[:4]}...) are not those of architecture {arch!r} "
            f"(no {e}); {fix}"
        ) from None
    if spec != expected:
        raise StoreError(f"{file}: model {spec} does not match architecture {arch!r} ({expected}); {fix}")
    if not expected.get("class"):
        return
    try:
        with torch.device("meta"):
            net = _models.network(arch)(**expected["kwargs"])
    except (AttributeError, TypeError, ValueError) as e:
        raise StoreError(f"{file}: cannot build {expected} ({e}); {fix}") from None
    want = {k: list(v.shape) for k, v in net.state_dict().items()}
    have = {k: list(v) for k, v in shapes.items()}
    if want != have:
        diff = sorted(set(want) ^ set(have)) or [k for k in sorted(want) if want[k] != have[k]]
        k = diff[0]
        raise StoreError(
            f"{file}: architecture {arch!r} ({expected['class']}, {expected['kwargs']}) does not match the "
            f"tensors it records ({k!r}: {have.get(k)} recorded, {want.get(k)} expected); {fix}"
        )


def models(params: Params, manifest: dict[str, Any], where: str | os.PathLike = "") -> list[torch.nn.Module]:
    """One eval-mode ``nn.Module`` per sample (for ``symlib.load(path, as_="models")``), built by the
    recipe the manifest of the folder ``where`` records (:func:`symlib.store.architecture`)."""
    recipe = store.architecture(manifest, str(where))
    if recipe is None:
        raise StoreError(
            f"sample set of architecture {manifest.get('arch')!r}: its manifest records no network to rebuild"
        )
    return networks(params, recipe, str(where))


def is_posterior(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a posterior sample set (its manifest says ``"kind": "posterior"``)."""
    return store.kind_of(path) == KIND


def info(path: str | os.PathLike) -> str:
    """A human-readable summary of a sample set directory (also of an incomplete one)."""
    path = Path(path)
    man = read_manifest(path)
    n_chunks = len(_sets.ranges(man["n_samples"], man["chunk"]))
    st = man.get("setup") or {}
    lines = [
        f"posterior {path}: {man['method']} on {st.get('name') or '?'} at scale {st.get('scale')} "
        f"(set {man['set_hash']})",
        f"  {man['n_modes']} modes x {man['n_per_mode']} samples = {man['n_samples']} samples in "
        f"{len(man['chunks'])}/{n_chunks} chunks" + (", complete" if man.get("complete") else ", incomplete"),
        f"  arch {man.get('arch')}, prior precision {st.get('prior_precision')}, seed {man.get('seed')}",
        f"  hyper {json.dumps(man['hyper'], sort_keys=True)}",
        f"  base {json.dumps(man['base'], sort_keys=True)}",
    ]
    if man.get("diagnostics"):
        lines.append(f"  diagnostics {json.dumps(man['diagnostics'], sort_keys=True)}")
    if "source" in man:  # a set written by symlib.ckpt.convert (symlib import)
        src, rec = man.get("source") or {}, man.get("architecture") or {}
        lines[0] = f"checkpoints {path}: {man['method']} (set {man['set_hash']})"
        args, n_files = json.dumps(rec.get("args") or {}, sort_keys=True), len(src.get("files") or [])
        lines[2:5] = [f"  arch {man.get('arch')}: {rec.get('builder')} {rec.get('target')} {args}, "
                      f"input shape {rec.get('input_shape')}",
                      f"  from {src.get('from')} ({n_files} files, sha256 in the manifest)"]
    lines.append(f"  symlib {man['symlib_version']}, git {man['git_commit']}")
    return "\n".join(lines)
