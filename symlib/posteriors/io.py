r"""Posterior sample sets on disk, in the zoo format (book: chapter "Table 1").

A sample set is stored in the format of checkpoint zoos (:mod:`symlib.store`), so that
``symlib.load(path)`` returns ``(params, manifest)`` for a posterior as for a zoo:

* ``chunk-00000.safetensors``, ...: ``chunk`` consecutive samples per file, every tensor stacked along
  a new first axis (mode-major: samples ``i * n_per_mode ...`` come from mode ``i``), the file's metadata
  holding the format, the set's identity hash, the chunk index, the (mode, index) of every sample and the
  sha256 of its tensors (:func:`symlib.store.tensor_digest`);
* ``manifest.json``: ``"kind": "posterior"``, the method and its hyper-parameters, the base models it
  started from (seeds, and the folder they are cached in), ``n_modes``, ``n_per_mode``, the diagnostics,
  the training problem (preset, scale, architecture, recipe, prior precision, data fingerprint), the
  tensor names and shapes of one sample, the chunks, and whether the set is complete.

Every file is written to a temporary name and renamed, so an interrupted write leaves complete files
only, and :func:`save` skips the chunks that are already on disk and valid (resuming).
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
from symlib import scales as _scales
from symlib import store
from symlib.params import Params
from symlib.posteriors.base import SampleSet, Setup
from symlib.store import FORMAT, MANIFEST, StoreError, chunk_name, jsonable

KIND = "posterior"
REPAIR = (
    "rerun `symlib posterior sample` with the same arguments (`--out` this folder): it rewrites exactly "
    "the damaged chunks"
)

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


def model_spec(arch: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The :mod:`symlib.models` class and its keyword arguments that rebuild a network of the registered
    architecture ``arch`` with these state-dict ``shapes`` (:mod:`symlib.models.registry`); ``{"class":
    None}`` for an architecture outside the registry."""
    net = _models.REGISTRY.get(arch)
    if net is None:
        return {"class": None, "kwargs": {}}
    return {"class": net.factory.__name__, "kwargs": net.args_of(shapes)}


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
    (:class:`symlib.store.StoreError` naming the field otherwise)."""
    man = store.read_manifest(path, KIND, f"produce the set with `symlib posterior sample --out {path}`")
    _check_fields(Path(path) / MANIFEST, man)
    return man


#: The fields of a sample set's manifest that readers use, and the type of each.
FIELDS = {"method": str, "set_hash": str, "n_modes": int, "n_per_mode": int, "n_samples": int, "chunk": int,
          "chunks": list}


def _check_fields(file: Path, man: dict[str, Any]) -> None:
    fix = ("the manifest was edited or damaged: restore it, or rerun the command that wrote the set with "
           "the same arguments to rewrite it")
    for key, kind in FIELDS.items():
        value = man.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            got = "missing" if key not in man else f"{type(value).__name__} {value!r}"[:80]
            raise StoreError(f"{file}: field {key!r} should be a {kind.__name__}, is {got}; {fix}")
    if man["chunk"] < 1 or man["n_samples"] < 1:
        raise StoreError(f"{file}: 'chunk' and 'n_samples' must be positive, are {man['chunk']} and "
                         f"{man['n_samples']}; {fix}")
    for ch in man["chunks"]:
        good = isinstance(ch, dict) and isinstance(ch.get("chunk"), int) and isinstance(ch.get("file"), str)
        if not good:
            raise StoreError(f"{file}: a record of 'chunks' is {str(ch)[:80]}, not {{'chunk': int, 'file': "
                             f"str, ...}}; {fix}")


def _chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _manifest(
    samples: SampleSet,
    set_hash: str,
    chunk: int,
    done: list[int],
    shapes: dict[str, list[int]],
    dtypes: dict[str, str],
    setup: dict[str, Any] | None,
    base: dict[str, Any] | None,
    seed: int | None,
) -> dict[str, Any]:
    ranges = _chunks(samples.n_samples, chunk)
    arch = (setup or {}).get("arch")
    return {
        "format": FORMAT,
        "kind": KIND,
        "method": samples.method,
        "set_hash": set_hash,
        "n_modes": samples.n_modes,
        "n_per_mode": samples.n_per_mode,
        "n_samples": samples.n_samples,
        "seed": seed,
        "hyper": jsonable(samples.hyper),
        "base": jsonable({"seeds": list(samples.base_seeds), **(base or {})}),
        "diagnostics": jsonable(samples.diagnostics),
        "setup": setup,
        "arch": arch,
        "data": (setup or {}).get("data"),
        "model": model_spec(arch, {k: tuple(v) for k, v in shapes.items()}) if arch else None,
        "architecture": _record(architecture(arch, {k: tuple(v) for k, v in shapes.items()}, setup)),
        "shapes": shapes,
        "dtypes": dtypes,
        "chunk": chunk,
        "chunks": [
            {"chunk": c, "file": chunk_name(c), "start": s, "stop": e}
            for c, (s, e) in enumerate(ranges)
            if c in done
        ],
        "complete": sorted(done) == list(range(len(ranges))),
        **store.provenance(),
    }


def _record(recipe: _models.Recipe | None) -> dict[str, Any] | None:
    return recipe.record() if recipe is not None else None


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
    """Write a sample set into ``out_dir`` (created if needed), resuming a partial write.

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
    out = Path(out_dir)
    for k, v in samples.params.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            bad = (~torch.isfinite(v)).reshape(v.shape[0], -1).any(1).nonzero().flatten().tolist()
            raise ValueError(
                f"sample set {samples.method}: tensor {k!r} holds NaN or infinite values (samples "
                f"{bad[:10]}{'...' if len(bad) > 10 else ''}); not saved, nothing written: the method "
                f"diverged, lower its step size or learning rate"
            )
    chunk = samples.n_per_mode if chunk is None else _scales.check_int("chunk", chunk, 1)
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
    check_out(out, set_hash, samples.method, samples.n_modes, samples.n_per_mode)
    out.mkdir(parents=True, exist_ok=True)
    store.remove_stale(out)
    shapes = {k: list(v.shape[1:]) for k, v in samples.params.items()}
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in samples.params.items()}
    ranges = _chunks(samples.n_samples, chunk)
    done: list[int] = []
    for c, (s, e) in enumerate(ranges):
        file = out / chunk_name(c)
        if file.exists():
            try:
                _read_chunk_file(file, set_hash, shapes, s, e)
                done.append(c)
                continue
            except StoreError:
                pass  # damaged, or of this set but chunked otherwise (check_out refused other sets'): rewrite

    def write() -> None:
        store.write_manifest(out, _manifest(samples, set_hash, chunk, done, shapes, dtypes, srec, base, seed))

    write()
    modes = samples.modes
    for c, (s, e) in enumerate(ranges):
        if c in done:
            continue
        recs = [{"index": i, "mode": int(modes[i])} for i in range(s, e)]
        meta = {
            "format": FORMAT,
            "kind": KIND,
            "set_hash": set_hash,
            "chunk": str(c),
            "samples": json.dumps(recs),
        }
        store.atomic_save({k: v[s:e] for k, v in samples.params.items()}, out / chunk_name(c), meta)
        done.append(c)
        write()
    return read_manifest(out)


def check_out(out: Path, set_hash: str, method: str, n_modes: int, n_per_mode: int) -> None:
    """Check, before any work, that ``out`` can receive the sample set ``set_hash``
    (:func:`symlib.store.check_out`): not a file, not under a file, writable, not holding a zoo, another
    sample set or chunks of one. A damaged manifest is accepted: every chunk is then checked and the
    manifest rewritten."""
    old, _ = store.check_out(out, KIND)
    if old is not None and old.get("set_hash") != set_hash:
        raise StoreError(
            f"{out / MANIFEST}: this folder holds another sample set ({old.get('method')}, "
            f"{old.get('n_modes')} x {old.get('n_per_mode')}, hash {old.get('set_hash')}), "
            f"not this one ({method}, {n_modes} x {n_per_mode}, {set_hash}); choose another --out"
        )
    store.check_owners(out, "set_hash", set_hash, "sample set")


def _read_chunk_file(
    path: Path, set_hash: str, shapes: dict[str, list[int]], start: int, stop: int,
    n_per_mode: int | None = None,
) -> Params:
    expect = {"kind": KIND, "set_hash": set_hash}
    tensors, meta = store.read_chunk(path, expect, REPAIR, legacy=store.LEGACY[KIND])
    store.sample_records(path, meta, start, stop, n_per_mode, REPAIR)
    store.check_tensors(path, tensors, shapes, stop - start, "the manifest's tensors", fix=REPAIR)
    return tensors


def read_chunk(path: str | os.PathLike, manifest: dict[str, Any], c: int) -> Params:
    """Read and check chunk ``c`` of the sample set described by ``manifest`` (format, identity hash,
    checksum, sample indices, tensor names and shapes, finiteness)."""
    start, stop = _chunks(manifest["n_samples"], manifest["chunk"])[c]
    return _read_chunk_file(
        Path(path) / chunk_name(c), manifest["set_hash"], manifest["shapes"], start, stop,
        manifest.get("n_per_mode"),
    )


def load_params(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Params, dict[str, Any]]:
    """The stacked samples ``{name: (S, ...)}`` of a complete set and its manifest (what
    ``symlib.zoo.load`` returns for a posterior set)."""
    path = Path(path)
    man = read_manifest(path)
    check_model(path, man)
    n_chunks = len(_chunks(man["n_samples"], man["chunk"]))
    have = sorted(ch["chunk"] for ch in man["chunks"])
    if not man.get("complete") or have != list(range(n_chunks)):
        missing = sorted(set(range(n_chunks)) - set(have))
        raise StoreError(
            f"{path / MANIFEST}: sample set is incomplete (chunks {missing} missing); finish it by rerunning "
            f"`symlib posterior sample` with the same arguments"
        )
    parts = [read_chunk(path, man, c) for c in range(n_chunks)]
    dev = _scales.check_device(device)
    return {k: torch.cat([p[k] for p in parts]).to(dev) for k in parts[0]}, man


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


def networks(params: Params, recipe: _models.Recipe, where: str = "") -> list[torch.nn.Module]:
    """One eval-mode ``nn.Module`` per network of a stacked set, built by ``recipe`` in the set's precision
    and device and loaded with its weights, in the set's order.

    Raises:
        StoreError: the weights do not fit the recipe's network (an edited or damaged manifest).
    """
    out = []
    n = next(iter(params.values())).shape[0]
    dev = next(iter(params.values())).device
    dtype = next(v.dtype for v in params.values() if v.is_floating_point())
    for i in range(n):
        m = recipe.build(meta=True)  # shapes only; built for real when a buffer is not in the set (the
        if any(k not in params for k, _ in m.named_buffers()):  # constructor computes it: position ids)
            m = recipe.build()
        real = not any(t.is_meta for t in m.state_dict().values())
        m = m.to(dev, dtype) if real else m.to_empty(device=dev).to(dtype)  # the set's precision
        missing, unexpected = m.load_state_dict({k: v[i] for k, v in params.items()}, strict=False)
        names = {k for k, _ in m.named_parameters()}
        gaps = [k for k in missing if not real or k in names]
        if gaps or unexpected:
            raise StoreError(
                f"{where}: network {i} does not fit the manifest's architecture {recipe.describe()} (missing "
                f"{gaps[:3]}, unexpected {unexpected[:3]}); the manifest was edited or damaged: "
                f"restore it, or rerun the command that wrote the folder"
            )
        out.append(m.eval())
    return out


def is_posterior(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a posterior sample set (its manifest says ``"kind": "posterior"``)."""
    return store.kind_of(path) == KIND


def info(path: str | os.PathLike) -> str:
    """A human-readable summary of a sample set directory (also of an incomplete one)."""
    path = Path(path)
    man = read_manifest(path)
    n_chunks = len(_chunks(man["n_samples"], man["chunk"]))
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
