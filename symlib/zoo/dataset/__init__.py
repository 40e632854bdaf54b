r"""Checkpoint sets as published datasets: export a zoo (or a posterior sample set) to a folder in the
layout the Hugging Face Hub expects, check such a folder, and resolve ``hf://`` addresses through the
Hub's cache (book: "Checkpoint zoos").

:func:`export` writes a *dataset folder*:

* ``chunk-00000.safetensors``, ...: the set's chunks, byte for byte (every file still carries the
  sha256 of its header and of its tensors, :mod:`symlib.store`);
* ``manifest.json``: the set's manifest, plus an ``"export"`` record naming the files below;
* ``checkpoints.csv`` (:data:`~symlib.zoo.dataset.table.TABLE`, :mod:`~symlib.zoo.dataset.table`): the
  *manifest table*, one row per checkpoint: its index, seed, chunk file and row, preset, scale,
  architecture, recipe and configuration hash, training metrics, test accuracy and the **sha256 of its
  chunk file** (the hash the Hub's LFS stores too);
* ``README.md`` (:data:`~symlib.zoo.dataset.card.CARD`, :mod:`~symlib.zoo.dataset.card`): the dataset
  card, YAML metadata first (license, task, size, tags, the table as the dataset viewer's data), then how
  the set was trained, how to load it and how to cite the paper;
* ``croissant.json`` (:data:`~symlib.zoo.dataset.croissant.CROISSANT`,
  :mod:`~symlib.zoo.dataset.croissant`): a Croissant 1.0 JSON-LD description (every file with its sha256,
  the table as a record set), validated with ``mlcroissant`` when it is installed.

The folder is still a checkpoint folder: ``symlib.load(folder)`` reads it, after :func:`verify` has
checked that every chunk matches the table's sha256 and that every cell of the table is what the
manifest and the chunks record. ``symlib.load("hf://owner/name")`` first resolves the address with
``huggingface_hub`` (:func:`~symlib.zoo.dataset.hub.resolve`: the Hub's cache, ``HF_HUB_OFFLINE=1``
honoured). Uploading is one command of the Hub's own client (not run by symlib)::

    hf upload owner/name OUT . --repo-type dataset   # huggingface_hub >= 1.0; older: huggingface-cli upload
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import json
import os
import shutil
from pathlib import Path

from symlib import store
from symlib.store import MANIFEST, StoreError, file_sha256
from symlib.zoo.dataset.card import CARD, CITATION, URLS, card, check_license
from symlib.zoo.dataset.croissant import CROISSANT, description, validate_croissant
from symlib.zoo.dataset.hub import HF_PREFIX, resolve
from symlib.zoo.dataset.table import TABLE, check_table, encode, read_table, rows

FILES = (TABLE, CARD, CROISSANT)
"""What an export adds to a set's chunks and manifest."""

__all__ = [
    "CARD",
    "CROISSANT",
    "FILES",
    "HF_PREFIX",
    "TABLE",
    "export",
    "file_sha256",
    "is_dataset",
    "read_table",
    "resolve",
    "validate_croissant",
    "verify",
]


def _is_card(file: Path) -> bool:
    """A dataset card written by :func:`export`: YAML front matter naming the manifest table (a README of
    one's own beside a zoo is not one)."""
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    front = text.split("---", 2)[1] if text.startswith("---") and text.count("---") >= 2 else ""
    return TABLE in front


def is_dataset(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like an exported dataset (its table or Croissant file is there, its card
    names the table, or its manifest has an ``"export"`` record); :func:`verify` then checks it in
    full."""
    path = Path(path)
    if (path / TABLE).is_file() or (path / CROISSANT).is_file() or _is_card(path / CARD):
        return True
    if store.kind_of(path) is None:
        return False
    return "export" in store.read_manifest(path)


def _remove_leftovers(parent: Path, name: str) -> None:
    """Delete the temporary folders that killed exports to ``parent / name`` left (their process is
    gone; an export still running keeps its own)."""
    prefix = f".{name}.export-"
    for tmp in parent.glob(f"{glob.escape(prefix)}*.tmp"):
        pid = tmp.name[len(prefix): -len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and store.alive(int(pid)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)


def export(
    path: str | os.PathLike,
    to: str | os.PathLike,
    *,
    name: str | None = None,
    license: str = "mit",
    repo: str | None = None,
    validate: bool | None = None,
) -> Path:
    """Export a complete zoo or posterior sample set as a dataset folder (module docstring).

    Every chunk is checked (:func:`symlib.zoo.read_chunk`, or the sample set's checks) and a zoo's
    manifest against its chunks before anything is copied; the folder is assembled under a temporary
    name beside ``to`` and renamed at the end, so an interrupted export leaves nothing at ``to``, and the
    temporary folder a killed export left is removed by the next export to ``to``.

    Args:
        path: the zoo or sample-set folder.
        to: the dataset folder to create; it must not exist (an empty folder is accepted).
        name: the dataset's name in the card and Croissant (default: the folder name of ``to``).
        license: the weights' license, a Hub license identifier (default ``"mit"``;
            :data:`symlib.zoo.dataset.card.LICENSES`).
        repo: ``"owner/name"`` on the Hub, for the card's loading snippet and Croissant's url.
        validate: validate the Croissant description with ``mlcroissant`` (``None``: when installed).

    Returns:
        ``to``.

    Raises:
        StoreError: ``to`` exists (nothing is overwritten), lies under a file or in a folder that is not
            writable; the source is incomplete, damaged or not a checkpoint set; the Croissant
            description is invalid (``validate``).
        ValueError: ``license`` is not a Hub license identifier.
    """
    src, to = Path(path), Path(to)
    license = check_license(license)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise StoreError(
            f"{to}: already exists; an export never overwrites anything: choose another --to or remove it"
        )
    store.check_folder(to, "dataset", "--to")  # under a file, or not writable: before any work
    if to.exists():  # an empty folder, replaced by the rename at the end: its parent must be writable
        store.check_folder(to.parent, "dataset", "--to")
    man = store.read_manifest(src, how=f"export a zoo folder (`symlib zoo train --out {src}`)")
    table, files = rows(src, man)
    name = name or to.name
    to.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(to.parent, to.name)
    tmp = to.parent / f".{to.name}.export-{os.getpid()}.tmp"
    tmp.mkdir()
    try:
        hashes = {}
        for f in files:
            shutil.copyfile(src / f, tmp / f)
            hashes[f] = file_sha256(tmp / f)
        for r in table:
            r["chunk_sha256"] = hashes[r["chunk_file"]]
        csv = encode(table)
        # plain writes (mode from the umask): the whole folder appears at once, by the rename below
        (tmp / TABLE).write_bytes(csv)
        record = {
            "table": TABLE, "card": CARD, "croissant": CROISSANT, "name": name, "license": license,
            "repo": repo,
            "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "exported_by": store.provenance(),
        }
        exported = {**{k: v for k, v in man.items() if k != "export"}, "export": record}
        recipe = store.architecture(man, str(src))  # a source written before manifests recorded one
        if recipe is not None:
            exported["architecture"] = recipe.record()
        (tmp / MANIFEST).write_text(json.dumps(exported, indent=1))
        all_hashes = {TABLE: hashlib.sha256(csv).hexdigest(), **hashes}
        all_hashes[MANIFEST] = file_sha256(tmp / MANIFEST)
        cr = description(man, table, all_hashes, name, URLS.get(license, license), repo or "", CITATION)
        (tmp / CROISSANT).write_text(json.dumps(cr, indent=1))
        (tmp / CARD).write_text(card(man, table, files, name, license, repo or ""))
        if validate or validate is None:
            try:
                validate_croissant(tmp)
            except ImportError:
                if validate:
                    raise
        if to.exists():
            to.rmdir()  # empty (checked above)
        os.rename(tmp, to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return to


def verify(path: str | os.PathLike) -> list[dict[str, str]]:
    """Check a dataset folder: its card has its manifest table and symlib manifest, the table lists every
    chunk of the manifest, every chunk file matches the sha256 the table records, and every cell of the
    table is what the manifest and the chunks' headers record (:func:`symlib.zoo.dataset.table.check_table`).

    Returns:
        The table's rows.

    Raises:
        StoreError: naming the file and the fix.
    """
    path = Path(path)
    table = read_table(path)
    if not (path / MANIFEST).is_file():
        raise StoreError(
            f"{path / MANIFEST}: missing beside the manifest table: the dataset is incomplete (an "
            f"interrupted upload or download?); download it again"
        )
    man = store.read_manifest(path)
    want: dict[str, str] = {}
    for r in table:
        if want.setdefault(r["chunk_file"], r["chunk_sha256"]) != r["chunk_sha256"]:
            raise StoreError(f"{path / TABLE}: two sha256 for {r['chunk_file']}: the table is damaged")
    listed = {ch.get("file") for ch in man.get("chunks", []) if isinstance(ch, dict)}
    if set(want) != listed:
        raise StoreError(
            f"{path / TABLE}: lists the chunks {sorted(want)[:5]}, the manifest {sorted(listed)[:5]}: the "
            f"table and the manifest belong to different exports; export again"
        )
    for f, h in sorted(want.items()):
        file = path / f
        if not file.is_file():
            raise StoreError(f"{file}: missing (the manifest table lists it); download the dataset again")
        got = file_sha256(file)
        if got != h:
            raise StoreError(
                f"{file}: sha256 {got[:16]}... does not match {h[:16]}..., recorded in {TABLE}: the file was "
                f"damaged or replaced since the export; download it again (nothing was loaded)"
            )
    check_table(path, man, table)
    return table
