r"""One loader for the checkpoint files researchers have: ``symlib.load_checkpoints`` (book: "symlib on
your own network").

:func:`load_checkpoints` reads a set of checkpoints into the stacked form ``{name: (n, ...)}`` that
every symlib function takes (network ``i`` at index ``i``):

* ``torch.save`` files (``.pt``, ``.pth``, ``.bin``), Lightning ``.ckpt`` files, ``.safetensors`` files
  (:mod:`~symlib.ckpt.torchfile`, :mod:`~symlib.ckpt.safetensorsfile`), given as paths, a folder of them,
  or a glob (``"runs/*/last.ckpt"``);
* Hugging Face model folders (``save_pretrained``, timm's ``save_for_hf``; sharded too) and
  ``hf://owner/name`` model repositories (:mod:`~symlib.ckpt.hf`): one checkpoint per folder;
* a symlib folder (a zoo, a sample set, an imported set, an exported dataset): read by
  :func:`symlib.load`.

The sources are listed first (:func:`~symlib.ckpt.paths.expand`: every path looked at, none parsed yet).
Each file is then parsed (headers and pickles only, :mod:`~symlib.ckpt.lazy`), the network's tensors
found in it (:mod:`~symlib.ckpt.state`) and checked against the architecture, or against the first file:
the same names, the same shapes. Only then is the output allocated and every wanted tensor's bytes
copied straight into its row (large files are memory-mapped: only the wanted tensors' pages are read),
by several threads when the set is large and the machine has the cores (:data:`MAX_WORKERS`). Errors name
the file and the first tensor that differs; non-finite weights name the file; nothing is returned
half-done.

No network is stacked twice without being asked: a file named twice (symbolic links resolved, so a glob
through a link to its own folder counts once) and two files that hold the same network (the same content
hash, :func:`digests`: a Lightning ``last.ckpt`` beside the ``epoch=...ckpt`` it repeats, a
``.safetensors`` copy of a ``.pt``) are refused with the list of repeats, unless ``allow_duplicates=True``
(``--allow-duplicates``). The rows of a symlib folder are not checked: a posterior sample set may hold a
state twice by right (an MCMC chain that rejected a move repeats its state); :func:`symlib.compare`
checks that its two sets share no network (:func:`shared`). Symbolic-link loops and unreadable files or
folders are errors naming the path.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from symlib import scales as _scales
from symlib import store
from symlib.ckpt import hf, safetensorsfile, torchfile
from symlib.ckpt.errors import CheckpointError
from symlib.ckpt.lazy import Parsed, open_bytes
from symlib.ckpt.paths import EXTENSIONS, _identity, _path_error, expand
from symlib.ckpt.recipe import Recipe, from_config
from symlib.ckpt.state import Reference, Selection, candidates, select, shape_of
from symlib.params import Params

__all__ = ["EXTENSIONS", "MAX_WORKERS", "PARALLEL_ABOVE", "Loaded", "digests", "expand", "load_checkpoints",
           "read", "shared"]

#: Total bytes above which the tensors are copied by several threads (:data:`MAX_WORKERS` of them).
PARALLEL_ABOVE = 64 << 20
#: Threads that copy large sets: half the cores, at most 4 (why: docs/performance.md, "Benchmarks").
MAX_WORKERS = max(1, min(4, (os.cpu_count() or 1) // 2))
_KEEP = "allow_duplicates=True (--allow-duplicates on the command line)"


@dataclasses.dataclass
class Loaded:
    """Checkpoints read by :func:`read`.

    Attributes:
        params: the stacked tensors ``{name: (n, ...)}``.
        sources: one entry per checkpoint (a file, a Hugging Face folder, ``hf://...``), in order.
        counts: networks per source (1, or more for a file holding a stack).
        files: every file read: ``{"path", "bytes", "kind"}`` and, with ``hashes=True``, ``"sha256"``.
        recipe: the architecture, given or found beside the files (``None`` when unknown).
        key, prefix: where the state dict was in the (first) file and the prefix removed.
        manifest: the manifest when the source was a symlib folder.
        given: whether the architecture was given (``model=``) rather than found.
        row_digests: the content hash of every network once computed (:meth:`digests`), else ``None``.
    """

    params: Params
    sources: list[str]
    counts: list[int]
    files: list[dict[str, Any]]
    recipe: Recipe | None = None
    key: str = ""
    prefix: str = ""
    manifest: dict[str, Any] | None = None
    given: bool = False
    row_digests: list[bytes] | None = dataclasses.field(default=None, repr=False)

    @property
    def n(self) -> int:
        """Networks in all."""
        return sum(self.counts)

    def digests(self) -> list[bytes]:
        """The content hash of every network (:func:`digests`), computed once."""
        if self.row_digests is None:
            self.row_digests = digests(self.params)
        return self.row_digests

    def record(self) -> dict[str, Any]:
        """What a manifest says of this set: a symlib folder's manifest (with ``"architecture"`` when one
        was given), or for files their description (``"kind": "checkpoints"``, the architecture's name
        and recipe, the sources), as :func:`symlib.compare` reads them."""
        if self.manifest is not None:
            man = dict(self.manifest)
            if self.recipe is not None and (self.given or not man.get("architecture")):
                man["architecture"] = self.recipe.record()
            return man
        per = self.counts[0] if len(set(self.counts)) == 1 else 1
        return {"kind": "checkpoints", "method": "checkpoints", "n_modes": self.n // per, "n_per_mode": per,
                "arch": self.recipe.name if self.recipe else None, "sources": self.sources,
                "architecture": self.recipe.record() if self.recipe else None}



def _repeats(keys: Sequence, labels: Sequence[str]) -> list[list[str]]:
    """The labels grouped by equal keys, for the keys that occur more than once (in order)."""
    groups: dict[Any, list[str]] = {}
    for k, label in zip(keys, labels, strict=True):
        groups.setdefault(k, []).append(label)
    return [g for g in groups.values() if len(g) > 1]


def _few(items: Sequence[str], k: int = 3, sep: str = ", ") -> str:
    return sep.join(items[:k]) + (f"{sep}and {len(items) - k} more" if len(items) > k else "")


def _check_paths(items: list[tuple[str, str]]) -> None:
    """Refuse a checkpoint named twice (:func:`read`)."""
    groups = _repeats([_identity(p) for _, p in items], [p for _, p in items])
    if groups:
        said = [f"{_identity(g[0])} {len(g)} times (as {_few(sorted(g, key=len))})" for g in groups]
        raise CheckpointError(
            f"the same checkpoint is named more than once: {_few(said, sep='; ')}; its network would be "
            f"stacked once per name (a glob through a symbolic link to its own folder repeats files): name "
            f"each checkpoint once, or pass {_KEEP} to keep the repeats")


def _check_rows(hashes: list[bytes], labels: list[str]) -> None:
    """Refuse networks that repeat another of the set (:func:`read`)."""
    groups = _repeats(hashes, labels)
    if groups:
        said = [f"{_few(g[1:])} {'repeats' if len(g) == 2 else 'repeat'} {g[0]}" for g in groups]
        copies = sum(len(g) - 1 for g in groups)
        are = "is a copy" if copies == 1 else "are copies"
        raise CheckpointError(
            f"identical networks in the set: {_few(said, sep='; ')} ({copies} of {len(labels)} networks "
            f"{are} of another); a copy counts twice in every statistic of the set: leave the copies out (a "
            f"Lightning last.ckpt beside the epoch=...ckpt it repeats, a .safetensors copy of a .pt), or "
            f"pass {_KEEP} to keep them")


def digests(params: Params) -> list[bytes]:
    """The content hash of every network of a stack ``{name: (n, ...)}``: a 16-byte BLAKE2b digest of
    its tensors' names, dtypes, shapes and bytes, equal for two rows exactly when they hold the same
    network, bit for bit in the same dtypes. Each row's bytes are read once (by :data:`MAX_WORKERS`
    threads when the set is above :data:`PARALLEL_ABOVE` bytes); a thousand small networks take a few
    milliseconds."""
    if not params:
        return []
    n = int(next(iter(params.values())).shape[0])
    head = hashlib.blake2b(digest_size=16)
    rows = []
    for k in sorted(params):
        v = params[k].detach()
        head.update(f"{k}\0{v.dtype}\0{tuple(v.shape[1:])}\n".encode())
        if v.numel():
            v = torch.view_as_real(v.resolve_conj()) if v.is_complex() else v
            rows.append(v.cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy())

    def one(i: int) -> bytes:
        h = head.copy()
        for r in rows:
            h.update(r[i])
        return h.digest()

    if sum(r.nbytes for r in rows) > PARALLEL_ABOVE and n > 1 and MAX_WORKERS > 1:
        with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, n)) as ex:  # hashlib releases the GIL
            return list(ex.map(one, range(n)))
    return [one(i) for i in range(n)]


def shared(a: Loaded, b: Loaded) -> tuple[int, list[str]]:
    """What two sets have in common (:func:`symlib.compare` refuses sets that overlap: its two-sample
    test assumes independent sets): ``(n, paths)``, the number of distinct networks in both (the same
    content hash, :func:`digests`; each set's rows are hashed once) and the files or folders both read
    (symbolic links resolved)."""
    paths = sorted({_identity(s) for s in a.sources} & {_identity(s) for s in b.sources})
    return len(set(a.digests()) & set(b.digests())), paths


def _parse(kind: str, path: str, trust_pickle: bool) -> Parsed:
    if kind == "hf":
        folder = hf.resolve(path) if path.startswith(hf.HF_PREFIX) else Path(path)
        parsed = hf.read(folder, trust_pickle)
        parsed.path = path
        return parsed
    fb = open_bytes(path)
    if path.endswith(".safetensors"):
        return safetensorsfile.read(fb)
    return torchfile.read(fb, trust_pickle)


def _reference(model: Any, model_args: dict | None, input_shape) -> tuple[Recipe | None, Reference | None]:
    if model is None:
        return None, None
    if isinstance(model, torch.nn.Module):
        return Recipe.of(model, model_args, input_shape), Reference.of(model)
    recipe = Recipe.of(model, model_args, input_shape)
    if not isinstance(model, str | Recipe):  # a class or function: call it here
        built = model(**(model_args or {}))
        if not isinstance(built, torch.nn.Module):
            raise CheckpointError(f"model={model!r} returned a {type(built).__name__}, not an nn.Module")
        return recipe, Reference.of(built, recipe.describe())
    return recipe, Reference.of_recipe(recipe)


def _found_recipe(parsed: list[Parsed]) -> Recipe | None:
    found = None
    for p in parsed:
        if p.kind not in ("transformers", "timm"):
            continue
        rec = from_config(p.path, json.loads(p.metadata["config"]))
        if found is not None and rec.record() != found[1].record():
            a, b = found[1].args, rec.args
            diff = next((k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith("_")
                         and k != "transformers_version"), None)
            if diff is not None or rec.target != found[1].target:
                raise CheckpointError(f"{p.path}: another architecture than {found[0]} (config.json differs: "
                                      f"{diff or 'architectures'}); a set holds one architecture")
        elif found is None:
            found = (p.path, rec)
    return found[1] if found else None


def _from_set(path: str, model: Any, model_args, input_shape, device) -> Loaded:
    from symlib import checkpoints

    params, man = checkpoints.load(path, device=device)
    recipe = store.architecture(man, path) if model is None else None  # a given model overrides the record
    if model is not None:
        given, ref = _reference(model, model_args, input_shape)
        have = {k: tuple(v.shape[1:]) for k, v in params.items()}
        if have != ref.shapes:
            k = next((k for k in ref.shapes if have.get(k) != ref.shapes[k]), next(iter(have)))
            raise CheckpointError(f"{path}: tensor {k!r} has shape {have.get(k)} in this set, "
                                  f"{ref.shapes.get(k)} in {ref.what}: another architecture")
        recipe = given
    elif recipe is not None and input_shape is not None:
        recipe = recipe.with_shape(input_shape)
    n = next(iter(params.values())).shape[0]
    return Loaded(params, [path], [int(n)], [], recipe, manifest=man, given=model is not None)


def _copy(parsed: Parsed, sel: Selection, sd, out: Params, views: dict, row: int) -> None:
    n = sel.n
    for k, name in sel.names.items():
        dst = out[k][row:row + n] if n > 1 else out[k][row]
        raw = views.get(k)
        parsed.copy(sd[name], dst, None if raw is None else raw[row:row + n].reshape(-1))


def read(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    model: Any = None,
    prefix: str | None = None,
    *,
    key: str | None = None,
    model_args: dict[str, Any] | None = None,
    input_shape: Sequence[int] | str | None = None,
    trust_pickle: bool = False,
    device: str | torch.device = "cpu",
    hashes: bool = False,
    allow_duplicates: bool = False,
) -> Loaded:
    """Read checkpoints with everything known about them (:func:`load_checkpoints` returns the tensors).

    Args: as :func:`load_checkpoints`, and ``hashes``: record every file's sha256 (for a manifest).

    Returns:
        A :class:`Loaded`.
    """
    items = expand(sources)
    if not allow_duplicates:
        _check_paths(items)
    dev = _scales.check_device(device)
    if items[0][0] == "set":
        return _from_set(items[0][1], model, model_args, input_shape, dev)
    if len(items) == 1 and items[0][1].startswith(hf.HF_PREFIX):  # a symlib dataset, else a model repository
        try:
            return _from_set(items[0][1], model, model_args, input_shape, dev)
        except (store.StoreError, ImportError) as e:
            try:
                hf.resolve(items[0][1])
            except CheckpointError as e2:
                raise CheckpointError(f"{items[0][1]}: neither a symlib dataset ({e}) nor a model repository "
                                      f"({e2})") from None
    recipe, ref = _reference(model, model_args, input_shape)
    parsed = []
    for kind, path in items:
        try:
            parsed.append(_parse(kind, path, trust_pickle))
        except OSError as e:
            if not (isinstance(e, PermissionError) or e.errno == errno.ELOOP):
                raise
            raise _path_error(e, path) from None
    if recipe is None:
        recipe = _found_recipe(parsed)
        if recipe is not None:
            recipe = recipe.with_shape(input_shape)
            ref = Reference.of_recipe(recipe)
    memo: dict[Any, Selection] = {}
    sels = []
    for p in parsed:
        memo_key = (p.layout, p.kind) if p.layout is not None else None
        sel = memo.get(memo_key) if memo_key is not None else None
        if sel is None:
            sel = select(p, ref, prefix, key)
            if memo_key is not None:
                memo[memo_key] = sel
        sels.append(sel)
    first, sd0 = parsed[0], _state(parsed[0], sels[0])
    shapes = {k: shape_of(sd0[n])[1 if sels[0].n > 1 else 0:] for k, n in sels[0].names.items()}
    dtypes = {k: sd0[n].dtype for k, n in sels[0].names.items()}
    sds = [sd0]
    for p, sel in zip(parsed[1:], sels[1:], strict=True):
        if sel is sels[0] and p.obj is first.obj:  # the same layout: the same names, shapes and dtypes
            sds.append(sd0)
            continue
        sd = _state(p, sel)
        sds.append(sd)
        if sel.names.keys() != shapes.keys():
            only = sorted(set(sel.names) - set(shapes)) or sorted(set(shapes) - set(sel.names))
            k = only[0]
            where = p.path if k in sel.names else first.path
            raise CheckpointError(f"{p.path}: another architecture than {first.path}: tensor {k!r} is only "
                                  f"in {where}")
        for k, n in sel.names.items():
            have = shape_of(sd[n])[1 if sel.n > 1 else 0:]
            if have != shapes[k]:
                raise CheckpointError(f"{p.path}: tensor {k!r} has shape {have}, but {shapes[k]} in "
                                      f"{first.path}: another architecture or width")
            if sd[n].dtype != dtypes[k]:
                dtypes[k] = torch.promote_types(dtypes[k], sd[n].dtype)
    counts = [s.n for s in sels]
    total = sum(counts)
    out = {k: torch.empty((total, *shapes[k]), dtype=dtypes[k]) for k in shapes}
    views = {k: v.view(torch.uint8).reshape(total, -1).numpy() for k, v in out.items()
             if v.numel() and v.dtype.itemsize and not v.is_complex()}
    rows = [sum(counts[:i]) for i in range(len(counts))]
    size = sum(sum(p.sizes) for p in parsed)
    jobs = list(zip(parsed, sels, sds, rows, strict=True))
    if size > PARALLEL_ABOVE and len(jobs) > 1 and MAX_WORKERS > 1:
        with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(jobs))) as ex:
            list(ex.map(lambda j: _copy(j[0], j[1], j[2], out, views, j[3]), jobs))
    else:
        for p, sel, sd, row in jobs:
            _copy(p, sel, sd, out, views, row)
    _check_finite(out, parsed, rows, counts)
    row_digests = None
    if not allow_duplicates and total > 1:
        row_digests = digests(out)
        labels = [p if c == 1 else f"{p}[{j}]" for (_, p), c in zip(items, counts, strict=True)
                  for j in range(c)]
        _check_rows(row_digests, labels)
    files = []
    for p in parsed:
        for f, s in zip(p.files, p.sizes, strict=True):
            rec = {"path": f, "bytes": s, "kind": p.kind}
            if hashes:
                rec["sha256"] = store.file_sha256(f)
            files.append(rec)
    params = {k: v.to(dev) for k, v in out.items()}
    return Loaded(params, [path for _, path in items], counts, files, recipe, sels[0].key, sels[0].prefix,
                  given=model is not None, row_digests=row_digests)


def _state(p: Parsed, sel: Selection):
    return candidates(p.obj)[sel.key]


def _finite(v: torch.Tensor) -> bool:
    """Whether every entry is finite. A NaN or an infinity makes the sum non-finite, so a finite sum
    settles it in one fast pass; a non-finite sum (or one that overflowed) is checked entry by entry."""
    return bool(torch.isfinite(v.sum())) or bool(torch.isfinite(v).all())


def _check_finite(out: Params, parsed: list[Parsed], rows: list[int], counts: list[int]) -> None:
    for k, v in out.items():
        if v.is_floating_point() and not _finite(v):
            bad = (~torch.isfinite(v)).reshape(v.shape[0], -1).any(1).nonzero().flatten().tolist()
            files = []
            for r in bad:
                i = max(j for j, s in enumerate(rows) if s <= r)
                if parsed[i].path not in files:
                    files.append(parsed[i].path)
            more = "..." if len(files) > 5 else ""
            raise CheckpointError(f"{files[0]}: tensor {k!r} holds NaN or infinite weights (files with "
                                  f"non-finite weights: {files[:5]}{more}); a run that diverged cannot be "
                                  f"part of the set: leave these files out")


def load_checkpoints(
    paths_or_glob: str | os.PathLike | Sequence[str | os.PathLike],
    model: Any = None,
    prefix: str | None = None,
    *,
    key: str | None = None,
    model_args: dict[str, Any] | None = None,
    input_shape: Sequence[int] | str | None = None,
    trust_pickle: bool = False,
    device: str | torch.device = "cpu",
    allow_duplicates: bool = False,
) -> Params:
    r"""Read checkpoint files of one architecture as a stack ``{name: (n, ...)}``
    (``symlib.load_checkpoints``; module docstring).

    Args:
        paths_or_glob: files (``.pt``, ``.pth``, ``.ckpt``, ``.bin``, ``.safetensors``), folders of them,
            globs, Hugging Face model folders or ``hf://owner/name`` repositories, or one symlib folder.
        model: the architecture (optional; it finds the prefix and checks every tensor): an ``nn.Module``,
            a class or function returning one, a ``"module:callable"`` string or a
            :class:`~symlib.ckpt.recipe.Recipe`. A Hugging Face or timm ``config.json`` beside the weights
            serves when it is ``None``.
        prefix: the prefix to remove from the names (``"model."`` of a Lightning module); found when
            ``None``.
        key: where the state dict is inside the files (``"state_dict"``, ``"model"``); found when ``None``.
        model_args: keyword arguments of ``model`` when it is a class, function or string.
        input_shape: one input's shape (recorded with the recipe, for the spec).
        trust_pickle: read files that need code to be unpickled with ``torch.load(weights_only=False)``
            (it runs the code the file names: only for files you trust).
        device: where to put the tensors.
        allow_duplicates: keep networks that repeat (refused by default: no network is stacked twice
            silently): a file named twice (symbolic links resolved) and files holding the same network
            (the same names, dtypes, shapes and bytes: a Lightning ``last.ckpt`` saved by
            ``ModelCheckpoint(save_last=True)`` beside the ``epoch=...ckpt`` it repeats, a ``.pt`` and its
            ``.safetensors`` copy). The rows of a symlib folder are never checked: a posterior sample set
            may repeat a state by right (an MCMC chain that rejected a move); :func:`symlib.compare`
            checks that its two sets share no network.

    Returns:
        The stacked state dicts, network ``i`` (in the order given; globs and folders in natural order)
        at index ``i``.

    Raises:
        CheckpointError: naming the file: an empty glob, files of different architectures or shapes (the
            first tensor that differs), a missing or ambiguous prefix or state dict (the candidates),
            non-finite weights, a pickle that needs code, repeated checkpoints or networks (which repeat
            which, and ``allow_duplicates``), a symlink loop or an unreadable file or folder.
    """
    return read(paths_or_glob, model, prefix, key=key, model_args=model_args, input_shape=input_shape,
                trust_pickle=trust_pickle, device=device, allow_duplicates=allow_duplicates).params
