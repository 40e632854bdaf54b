r"""Table 1's HMC reference at the ``cpu`` scale, sampled once and committed with the ten base models its
chains start from (book: chapter "Table 1"; ``python -m symlib.paper.table1``).

The reference is the table's most expensive row (about 1,900 full-batch gradients of ten chains: two
minutes of ``make zoo`` on two cores), and the only one the other rows are measured against. Sampled once,
on one machine, and committed with the base models it starts from, every later build uses the same draws:

* :func:`commit` copies the HMC set and its base models from the zoo cache into
  ``symlib/paper/results/table1/<problem>-seed<seed>/`` with a record (the identities below, every file's
  sha256, the machine, the seconds it took, the command), assembled in a temporary folder and renamed.
* :func:`install` (``make zoo``, before Table 1's sets are produced) copies them into a cache that lacks
  them, once it has checked that the committed record is what this code would produce: the base zoo's
  configuration hash and the set's identity (:func:`symlib.posteriors.sampling.set_key`: method, sizes,
  the sampler's preset, the training problem and its data, base seeds, run seed) and every file's hash.
  A stale record (another preset or recipe, other data), a cache whose base models were trained here and
  differ from the committed ones, or a folder a killed run left half written is left alone: the reference
  is then sampled here, as before, and the reason printed.

The base models are committed with the reference because training is not bit-identical across instruction
sets (AVX2 and AVX-512 sum in other orders): trained with AVX2 code, the ten networks end up to a tenth of
their norm away from those trained with AVX-512 code, near but not at the points the reference's chains
started from. With both installed, the multi-mode rows start from exactly those points on every machine,
and every machine compares its approximations with the same reference.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from symlib import store

__all__ = ["COMMITTED", "FORMAT", "commit", "folder", "install", "origin", "record"]

COMMITTED = Path(__file__).parents[1] / "results" / "table1"
"""Where :func:`commit` writes, one folder per problem and run seed."""

FORMAT = "symlib-table1-reference/1"
"""The ``format`` of a committed record (``record.json``)."""

RECORD = "record.json"


def _hmc_entry(scale: str):
    from symlib.paper.table1.rows import plan

    (entry,) = [e for e in plan(scale, methods=()) if e.method == "hmc"]
    return entry


def _parts(setup, seed: int, cache_dir: str | os.PathLike | None) -> dict[str, Any]:
    """What the cache holds (or would hold) for the HMC row of ``setup`` and run ``seed``: the base zoo's
    config and folder, the set's folder and identity."""
    from symlib import zoo
    from symlib.paper.table1.rows import sets_dir
    from symlib.posteriors import sampling

    e = _hmc_entry(setup.scale)
    cfg = sampling.base_zoo(setup, e.n_modes, seed)
    sets = sets_dir(setup, seed, None if cache_dir is None else Path(cache_dir) / "posteriors")
    return {"entry": e, "base_cfg": cfg, "base": zoo.cache_path(cfg, cache_dir), "sets": sets,
            "set": sets / e.key,
            "set_hash": sampling.set_key(e.method, setup, e.n_modes, e.n_per_mode, seed, **dict(e.hyper))}


def folder(setup, seed: int = 0, root: str | os.PathLike | None = None) -> Path:
    """The committed folder of ``setup``'s HMC reference with run ``seed``: ``<root>/<the sets' folder
    name>`` (:func:`symlib.paper.table1.sets_dir`: preset, scale, a hash of the training problem, seed)."""
    from symlib.paper.table1.rows import sets_dir

    return Path(root if root is not None else COMMITTED) / sets_dir(setup, seed, "/").name


def record(setup, seed: int = 0, root: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The committed record of ``setup``'s HMC reference with run ``seed``, or ``None`` when none was
    committed (an unreadable record is an error naming the file)."""
    path = folder(setup, seed, root) / RECORD
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable record ({e}); restore it with `git checkout -- "
                         f"{path.parent}` or commit the reference again (`python -m symlib.paper.table1`)"
                         ) from None
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
    return doc


def _files(where: Path, suffix: str = "") -> dict[str, str]:
    """``{relative path: sha256}`` of the files under ``where`` ending in ``suffix`` (hidden ones and the
    record left out)."""
    found = sorted(where.rglob(f"*{suffix}"))
    return {str(p.relative_to(where)): store.files.file_sha256(p) for p in found
            if p.is_file() and p.name != RECORD
            and not any(q.startswith(".") for q in p.relative_to(where).parts)}


def _manifest(read, folder: Path) -> dict[str, Any]:
    """A zoo's or a set's manifest (``read``: its reader), or ``{}`` when the folder holds none or a
    damaged one (left to ``symlib.zoo.load_or_train`` and ``symlib.posteriors.sampling.run``, which
    repair)."""
    if not (folder / "manifest.json").is_file():
        return {}
    try:
        return read(folder)
    except store.StoreError:
        return {}


def _recorded(files: dict[str, str], part: str) -> dict[str, str]:
    """The sample files of ``part`` (``"base"`` or ``"hmc"``) in a record's ``files``, relative to it."""
    return {k[len(part) + 1:]: v for k, v in files.items()
            if k.startswith(f"{part}/") and k.endswith(".safetensors")}


def commit(setup, seed: int = 0, cache_dir: str | os.PathLike | None = None,
           root: str | os.PathLike | None = None, seconds: float | None = None,
           command: str | None = None) -> Path:
    """Copy the HMC reference of ``setup`` (run ``seed``) and its base models from the zoo cache into
    :func:`folder`, with a record of what identifies them, their files' sha256, the machine and ``seconds``
    (how long sampling took). The cache must hold both, complete, with the identities this code computes
    (:func:`symlib.paper.table1.produce` makes them). An existing committed folder is never replaced:
    remove it (``git rm -r``) to commit another. Returns the folder."""
    import torch

    from symlib.paper import frontier
    from symlib.posteriors import io
    from symlib.zoo import chunks

    parts = _parts(setup, seed, cache_dir)
    if not _manifest(chunks.read_manifest, parts["base"]).get("complete"):
        raise ValueError(f"no complete base models at {parts['base']}: produce Table 1's sets first "
                         f"(`make zoo`, or python -m symlib.paper.table1)")
    man = _manifest(io.read_manifest, parts["set"])
    if not man.get("complete") or man.get("set_hash") != parts["set_hash"]:
        raise ValueError(f"no complete HMC set of this code's identity {parts['set_hash']} at "
                         f"{parts['set']}: produce Table 1's sets first (`make zoo`, or python -m "
                         f"symlib.paper.table1)")
    io.load(parts["set"])  # every file checked before it is copied
    target = folder(setup, seed, root)
    if target.exists():
        raise FileExistsError(f"{target} already holds a committed reference; remove it (`git rm -r "
                              f"{target}`) to commit another")
    with store.files.assemble(target, "commit", "free some space and commit again") as tmp:
        shutil.copytree(parts["base"], tmp / "base", ignore=shutil.ignore_patterns(".*"))
        shutil.copytree(parts["set"], tmp / "hmc", ignore=shutil.ignore_patterns(".*"))
        doc = {"format": FORMAT, "preset": setup.name, "scale": setup.scale, "seed": seed,
               "base_config_hash": parts["base_cfg"].hash, "base_folder": parts["base"].name,
               "set_folder": parts["set"].name, "set_hash": parts["set_hash"],
               "sets_folder": parts["sets"].name, "files": _files(tmp),
               "machine": {**frontier.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability()},
               "seconds": None if seconds is None else round(float(seconds), 1),
               "command": command or "python -m symlib.paper.table1 " + " ".join(sys.argv[1:])}
        (tmp / RECORD).write_text(json.dumps(doc, indent=1) + "\n")
    return target


def install(setup, seed: int = 0, cache_dir: str | os.PathLike | None = None,
            root: str | os.PathLike | None = None) -> tuple[str, str]:
    """Copy the committed HMC reference of ``setup`` (run ``seed``) and its base models into the zoo cache
    (``cache_dir`` or ``$SYMLIB_CACHE``) when it lacks them and the record is this code's.

    Returns:
        ``(status, why)``: ``"installed"``; ``"cached"`` (the cache holds this very set already);
        ``"absent"`` (nothing committed for this problem and seed); ``"stale"`` (committed with other
        settings, data or files: sample it again here and commit it, ``python -m symlib.paper.table1``);
        ``"conflict"`` (the cache holds other base models, or a partly written set: the reference is
        sampled here). Only ``"installed"`` writes, and only into folders that did not exist.
    """
    from symlib.posteriors import io
    from symlib.zoo import chunks

    doc = record(setup, seed, root)
    if doc is None:
        return "absent", f"no committed reference in {folder(setup, seed, root)}"
    src = folder(setup, seed, root)
    parts = _parts(setup, seed, cache_dir)
    how = "sample it here and commit it again: python -m symlib.paper.table1"
    expected = {"base_config_hash": parts["base_cfg"].hash, "set_hash": parts["set_hash"],
                "set_folder": parts["set"].name, "sets_folder": parts["sets"].name}
    differ = [k for k, v in expected.items() if doc.get(k) != v]
    if differ:
        return "stale", (f"{src} was committed with other settings or data ({', '.join(differ)} differ); "
                         f"{how}")
    files = _files(src)
    if files != doc.get("files"):
        bad = sorted(set(files.items()) ^ set(doc.get("files", {}).items()))
        return "stale", (f"{src}: files differ from its record ({bad[0][0]}, ...); restore them with git "
                         f"or {how}")
    man = _manifest(io.read_manifest, parts["set"])
    if man.get("set_hash") == parts["set_hash"] and man.get("complete"):
        return "cached", f"{parts['set']} holds the reference already"
    if parts["set"].exists():
        return "conflict", f"{parts['set']} holds a partly written set (a killed run?); it is resumed here"
    if parts["base"].exists():
        if not _manifest(chunks.read_manifest, parts["base"]).get("complete") or \
                _files(parts["base"], ".safetensors") != _recorded(files, "base"):
            return "conflict", (f"the cache's base models {parts['base']} were trained here and differ from "
                                f"the committed ones; the reference is sampled here from them")
    else:
        with store.files.assemble(parts["base"], "install", "free some space and run make zoo again") as tmp:
            shutil.copytree(src / "base", tmp, dirs_exist_ok=True)
    with store.files.assemble(parts["set"], "install", "free some space and run make zoo again") as tmp:
        shutil.copytree(src / "hmc", tmp, dirs_exist_ok=True)
    io.load(parts["set"])  # checked as a produced set is
    took = doc.get("seconds")
    m = doc.get("machine", {})
    return "installed", (f"the committed reference ({m.get('cpu', '?')}, {m.get('cpu_capability', '?')}, "
                         f"{m.get('date', '?')}" + (f", sampled in {took:.0f} s" if took else "") + ")")


def origin(setup, seed: int = 0, cache_dir: str | os.PathLike | None = None,
           root: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """The committed record when the cache's HMC set of ``setup`` (run ``seed``) is the committed one (its
    sample files equal, byte for byte), else ``None`` (sampled here, or nothing committed)."""
    doc = record(setup, seed, root)
    if doc is None:
        return None
    here = _parts(setup, seed, cache_dir)["set"]
    if not here.is_dir():
        return None
    mine = _recorded(doc["files"], "hmc")
    return doc if mine and _files(here, ".safetensors") == mine else None


def main(argv=None) -> int:
    """``python -m symlib.paper.table1``: produce Table 1's HMC reference at the ``cpu`` scale (or load it
    from the cache) and commit it with its base models (:func:`commit`); returns the exit status."""
    import argparse

    from symlib.paper.table1.rows import produce
    from symlib.posteriors import sampling

    p = argparse.ArgumentParser(prog="python -m symlib.paper.table1",
                                description="Sample Table 1's HMC reference (cpu scale) and commit it with "
                                            "the base models its chains start from.")
    p.add_argument("--preset", default="mnist-optunet")
    p.add_argument("--scale", default="cpu", help="the scale (the book commits the cpu scale's)")
    p.add_argument("--seed", type=int, default=0, help="the chapter's run seed")
    p.add_argument("--root", default=None, help=f"where to commit (default {COMMITTED})")
    args = p.parse_args(argv)
    setup = sampling.setup_for(args.preset, args.scale)
    t0 = time.perf_counter()
    timings: dict = {}
    produce(setup, [_hmc_entry(args.scale)], args.seed, progress=True, timings=timings)
    took = sum(timings.values())
    path = commit(setup, args.seed, root=args.root, seconds=took,
                  command=f"python -m symlib.paper.table1 --preset {args.preset} --scale {args.scale} "
                          f"--seed {args.seed}")
    print(f"committed {path} (sampled in {took:.0f} s, {time.perf_counter() - t0:.0f} s in all)", flush=True)
    return 0
