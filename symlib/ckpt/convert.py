r"""Checkpoints as symlib folders: ``symlib import`` and ``symlib canonicalize`` (book: "symlib on your own
network").

:func:`write` stores a stacked set in the project's one on-disk format, through the store's format of
stacked sets (:mod:`symlib.store.sets`: safetensors chunks that carry the sha256 of their tensors, a
``manifest.json`` with the set's core fields, ``n_modes`` checkpoints of ``n_per_mode`` networks each,
``"kind": "posterior"`` on disk as for posterior sample sets), so that :func:`symlib.load`,
:func:`symlib.info` (``symlib zoo info --check``), ``symlib zoo export``, ``symlib compare`` and every
function of the chapters work on it. The manifest records the method (``"import"``, ``"canonical"``, ...),
the fields every reader of the kind reads (``READER_FIELDS``: empty, checkpoints have no run seed,
hyper-parameters, base models or training problem), and:

* ``"arch"`` and ``"model"``: a network of the registry by name, with its :mod:`symlib.models` class and
  keyword arguments (``symlib.models.build.model_spec``), else the recipe's name;
* ``"architecture"``: the :class:`~symlib.ckpt.recipe.Recipe` that rebuilds the network (checked to give
  exactly the set's tensors before anything is written), from which the spec is traced;
* ``"source"``: where the set came from: every file read with its size, kind and sha256, the state dict's
  key and the prefix removed (or the folder a canonical set was computed from);
* ``"sha256"`` in every chunk record: the sha256 of the chunk file's bytes.

The folder is assembled under a temporary name beside ``out`` and renamed at the end: if any file fails
to read or any check fails, nothing is written (the temporary folder a killed run left is removed by the
next run to ``out``: :func:`symlib.store.remove_leftovers`; a full disk is named with the folder).
:func:`import_checkpoints` reads checkpoint files (:func:`~symlib.ckpt.loader.read`) and writes them;
:func:`canonical` writes the canonical forms (:func:`symlib.canonicalize`) of any set; :func:`networks`
rebuilds the networks of an imported set, one ``nn.Module`` per checkpoint, from its recipe
(``symlib.models.build.networks``: what ``symlib.load(..., as_="models")`` does for the architectures of
:mod:`symlib.models`). Nothing here depends on :mod:`symlib.posteriors`: the format is the store's.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from symlib import store
from symlib.ckpt import loader
from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.recipe import Recipe
from symlib.ckpt.recipe import spec as recipe_spec
from symlib.ckpt.state import Reference
from symlib.errors import SymmetryError
from symlib.models import build, registry
from symlib.params import Params
from symlib.store import sets

__all__ = ["canonical", "check_out", "import_checkpoints", "networks", "write"]

CHUNK_BYTES = 64 << 20
#: The fields every reader of a stacked set of kind ``"posterior"`` reads (``symlib.info``, ``symlib zoo
#: export``), recorded empty: checkpoints have no run seed, hyper-parameters, base models, diagnostics or
#: training problem.
READER_FIELDS = {"seed": None, "hyper": {}, "base": {"seeds": []}, "diagnostics": {}, "setup": None}


def check_out(out: str | os.PathLike) -> Path:
    """Refuse, before any work, an ``out`` that exists (a file, or a folder that is not empty: nothing is
    ever overwritten) or lies where nothing can be written."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = " (an exported dataset: nothing writes into one)" if store.exported(out) else ""
        raise CheckpointError(f"{out}: already exists{what}; nothing is overwritten: choose another --to "
                              f"(a new or empty folder)")
    parent = out.parent if out.parent != Path("") else Path(".")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"{out}: cannot be created ({parent} is not a writable folder); choose another "
                              f"--to")
    return out


def _model_record(recipe: Recipe, shapes: dict[str, tuple[int, ...]]) -> tuple[str, dict[str, Any]]:
    """``(arch, model)`` of a sample set's manifest: a network of the registry (by name, or its factory
    ``symlib.models:OptuNet`` with the arguments its shapes give) keeps the records the rest of symlib
    knows; anything else is named by its recipe."""
    net = (registry.REGISTRY.get(recipe.target) if recipe.builder == "symlib"
           else registry.of_factory(recipe.target) if recipe.builder == "factory" else None)
    if net is not None:
        try:
            rec = build.model_spec(net.name, shapes)
        except (KeyError, IndexError):
            rec = None
        if rec and all(rec["kwargs"].get(k) == v for k, v in recipe.args.items()):
            return net.name, rec
    name = recipe.name
    return (name if name.lower() not in registry.REGISTRY else f"{name} ({recipe.builder})",
            {"class": None, "kwargs": {}})


def _check_recipe(recipe: Recipe, params: Params) -> None:
    if recipe.builder == "factory" and recipe.target.split(":")[0] in ("__main__", "builtins"):
        raise CheckpointError(
            f"{recipe.target}: a network defined in a notebook or script (__main__) cannot be rebuilt by "
            f"another process; put it in a module and pass model='module:Factory' (--model)"
        )
    ref = Reference.of_recipe(recipe)
    have = {k: tuple(v.shape[1:]) for k, v in params.items()}
    if have != ref.shapes:
        k = next((k for k in ref.shapes if have.get(k) != ref.shapes[k]), None) or next(
            k for k in have if k not in ref.shapes)
        raise CheckpointError(
            f"{recipe.describe()} does not rebuild these checkpoints: tensor {k!r} has shape {have.get(k)} "
            f"in the set and {ref.shapes.get(k)} in the architecture; pass the factory and arguments that "
            f"built them (--model, --model-args)"
        )


def write(
    params: Params,
    out: str | os.PathLike,
    recipe: Recipe,
    *,
    method: str = "import",
    n_modes: int | None = None,
    n_per_mode: int = 1,
    source: dict[str, Any] | None = None,
    chunk: int | None = None,
) -> dict[str, Any]:
    """Write a stacked set as a symlib folder (module docstring).

    Args:
        params: ``{name: (n, ...)}``.
        out: the folder to create (it must not exist, or be empty).
        recipe: the architecture; it must rebuild exactly these tensors and be importable (a class of
            ``__main__`` is not: put it in a module).
        method: recorded as the set's method (``"import"``, ``"canonical"``, ``"laplace-torch"``, ...).
        n_modes, n_per_mode: the set's structure (default: ``n`` modes of 1, independent checkpoints).
        source: where the set comes from (recorded).
        chunk: networks per chunk file (default: about 64 MiB per file).

    Returns:
        The manifest.

    Raises:
        CheckpointError: ``out`` exists, the recipe does not rebuild the tensors, or a weight is not
            finite; nothing is written then.
    """
    out = check_out(out)
    if not params:
        raise CheckpointError("no tensors to write")
    n = int(next(iter(params.values())).shape[0])
    for k, v in params.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"tensor {k!r} holds NaN or infinite weights; nothing was written")
    _check_recipe(recipe, params)
    n_modes = n // n_per_mode if n_modes is None else n_modes
    params = {k: v.detach().cpu().contiguous() for k, v in params.items()}
    per_net = sum(v[0].numel() * v.dtype.itemsize for v in params.values()) or 1
    chunk = chunk or max(1, min(n, CHUNK_BYTES // per_net))
    architecture = recipe.record(out)  # hashes a factory file: once
    ident = {"method": method, "tensors": store.tensor_digest(params), "architecture": architecture}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    full = (f"nothing was left at {out} (the set is assembled under a temporary name): free some space and "
            f"run the same command again")
    with store.assemble(out, method, full) as tmp:  # a killed run's leftovers removed first
        arch, model = _model_record(recipe, {k: tuple(v.shape[1:]) for k, v in params.items()})
        fields = {**READER_FIELDS, "arch": arch, "data": None, "model": model, "architecture": architecture}
        man = sets.write(params, tmp, method=method, set_hash=key, n_modes=n_modes, n_per_mode=n_per_mode,
                         chunk=chunk, fields=fields)
        for ch in man["chunks"]:
            ch["sha256"] = store.file_sha256(tmp / ch["file"])
        man["source"] = store.jsonable(source or {})
        store.write_manifest(tmp, man)
    return man


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def import_checkpoints(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    model: Any = None,
    prefix: str | None = None,
    scalings: str = "auto",
    vocab: int | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Read checkpoint files (:func:`~symlib.ckpt.loader.read`, same arguments) and write them as a symlib
    folder ``out`` (``symlib import SRC --to OUT``). With an input shape, the network is first traced on it
    (``scalings``, ``vocab``: as :func:`symlib.ckpt.recipe.spec`), so that a set whose network does not run
    on the shape it records is never written.

    Returns:
        The manifest (``"source"`` lists every file with its sha256).

    Raises:
        CheckpointError: ``out`` exists, a file fails to read, the architecture is unknown; nothing is
            written.
    """
    check_out(out)
    got = loader.read(sources, model, prefix, hashes=True, **kwargs)
    if got.manifest is not None:
        raise CheckpointError(f"{got.sources[0]}: already a symlib folder; read it with symlib.load, or "
                              f"export it with `symlib zoo export`")
    if got.recipe is None:
        raise CheckpointError(
            "the architecture of these checkpoints is unknown: pass it (--model MODULE:CALLABLE, with "
            "--model-args JSON and --input-shape C,H,W; model= in Python), or keep the Hugging Face or timm "
            "config.json beside the weights"
        )
    counts = set(got.counts)
    per = counts.pop() if len(counts) == 1 else 1
    source = {"from": [str(s) for s in ([sources] if isinstance(sources, str | os.PathLike) else sources)],
              "checkpoints": got.sources, "networks_per_checkpoint": got.counts, "files": got.files,
              "key": got.key, "prefix": got.prefix, "imported": _now()}
    if got.recipe.input_shape is not None:  # the network must run on the shape the set will record
        try:
            recipe_spec(got.recipe, origin="--input-shape", scalings=scalings, vocab=vocab)
        except SymmetryError:  # it runs; its symmetries are not traceable (raw comparisons still work)
            pass
    return write(got.params, out, got.recipe, method="import", n_per_mode=per, source=source)


def canonical(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    out: str | os.PathLike,
    model: Any = None,
    prefix: str | None = None,
    scalings: str = "auto",
    vocab: int | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """The canonical forms (:func:`symlib.canonicalize`: unit-norm neurons, sorted) of any set, written as
    a symlib folder ``out`` (``symlib canonicalize SRC --to OUT``). The source is a symlib folder or
    checkpoint files (arguments of :func:`~symlib.ckpt.loader.read`); its architecture and input shape
    must be known. Every network's function is checked to be unchanged. ``scalings`` and ``vocab`` are
    those of the traced spec (:func:`symlib.ckpt.recipe.spec`; ``--scalings``, ``--vocab``).

    Returns:
        The manifest.
    """
    from symlib.symmetry.canonical import canonicalize

    check_out(out)
    got = loader.read(sources, model, prefix, hashes=True, **kwargs)
    if got.recipe is None:
        raise CheckpointError("the architecture is unknown: pass --model MODULE:CALLABLE and --input-shape")
    spec = recipe_spec(got.recipe, scalings=scalings, vocab=vocab)
    canon = canonicalize(got.params, spec)
    man = got.manifest or {}
    n_modes, per = man.get("n_modes"), man.get("n_per_mode", 1)
    if n_modes is None or n_modes * per != got.n:
        counts = set(got.counts)
        per = counts.pop() if len(counts) == 1 else 1
        n_modes = got.n // per
    source = {"from": [str(s) for s in ([sources] if isinstance(sources, str | os.PathLike) else sources)],
              "transform": "canonicalize (normalise-and-sort: unit-norm incoming weights, sorted)",
              "set": {k: man[k] for k in ("kind", "method", "set_hash", "config_hash", "arch") if k in man},
              "files": got.files, "computed": _now()}
    return write(canon, out, got.recipe.with_shape(spec.input_shape), method="canonical", n_modes=n_modes,
                 n_per_mode=per, source=source)


def networks(path: str | os.PathLike, device: str | torch.device = "cpu") -> list[torch.nn.Module]:
    """One eval-mode ``nn.Module`` per checkpoint of a symlib folder, built by the recipe its manifest
    records (:func:`symlib.store.architecture`: an imported set's architecture, your own factory included)
    and loaded with its weights, in the set's order: what ``symlib.load(path, as_="models")`` returns.

    Raises:
        CheckpointError: the folder records no architecture, or its factory cannot be imported here.
    """
    from symlib import checkpoints

    params, man = checkpoints.load(path, device=device)
    recipe = store.architecture(man, str(path))
    if recipe is None:
        raise CheckpointError(f"{path}: its manifest records no architecture to rebuild the networks from")
    return build.networks(params, recipe, str(path))
