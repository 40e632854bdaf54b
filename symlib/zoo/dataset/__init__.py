r"""Checkpoint sets as published datasets: export a zoo (or a posterior sample set) to a folder in the
layout the Hugging Face Hub expects, check such a folder, and resolve ``hf://`` addresses through the
Hub's cache (book: "Checkpoint zoos").

:func:`export` writes a *dataset folder*:

* ``chunk-00000.safetensors``, ...: the set's chunks, byte for byte (every file still carries the
  sha256 of its header and of its tensors, :mod:`symlib.store`);
* ``manifest.json``: the set's manifest, plus an ``"export"`` record naming the files below, with the
  sha256 of the card and of the Croissant description (:data:`ZEROS`: the latter with the manifest's own
  sha256 in it zeroed, since the description records the manifest's);
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
checked that every chunk matches the table's sha256, that every cell of the table is what the manifest
and the chunks record, that every file matches the sha256 the Croissant description records (the
manifest included) and that the card and the description match the sha256 the manifest records. No
command writes into a dataset folder (:func:`symlib.store.check_out`).
``symlib.load("hf://owner/name")`` first resolves the address with ``huggingface_hub``
(:func:`~symlib.zoo.dataset.hub.resolve`: the Hub's cache, ``HF_HUB_OFFLINE=1`` honoured). Uploading is
one command of the Hub's own client (not run by symlib)::

    hf upload owner/name OUT . --repo-type dataset   # huggingface_hub >= 1.0; older: huggingface-cli upload
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from symlib import store
from symlib.store import MANIFEST, StoreError, file_sha256
from symlib.zoo.dataset.card import CARD, CITATION, URLS, card, check_license
from symlib.zoo.dataset.croissant import CROISSANT, description, validate_croissant
from symlib.zoo.dataset.hub import HF_PREFIX, resolve
from symlib.zoo.dataset.table import TABLE, check_table, encode, read_table, rows

FILES = (TABLE, CARD, CROISSANT)
"""What an export adds to a set's chunks and manifest."""
ZEROS = "0" * 64
"""What stands for the manifest's sha256 in the Croissant description when the sha256 of the description
is computed (the manifest records that sha256, so the description cannot hold the manifest's own)."""

__all__ = [
    "CARD",
    "CROISSANT",
    "FILES",
    "HF_PREFIX",
    "TABLE",
    "ZEROS",
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
        what = " (an exported dataset)" if store.exported(to) else ""
        raise StoreError(
            f"{to}: already exists{what}; an export never overwrites anything: choose another --to or "
            f"remove it"
        )
    store.check_folder(to, "dataset", "--to")  # under a file, or not writable: before any work
    if to.exists():  # an empty folder, replaced by the rename at the end: its parent must be writable
        store.check_folder(to.parent, "dataset", "--to")
    man = store.read_manifest(src, how=f"export a zoo folder (`symlib zoo train --out {src}`)")
    if "export" in man:  # a dataset exported again: only as it was exported
        verify(src)
    table, files = rows(src, man)
    full = (f"nothing was left at {to} (the export is assembled under a temporary name): free some space "
            f"and export again")
    with store.assemble(to, "export", full) as tmp:
        _write(tmp, src, man, table, files, name or to.name, license, repo)
        if validate or validate is None:
            try:
                validate_croissant(tmp)
            except ImportError:
                if validate:
                    raise
    return to


def _write(tmp: Path, src: Path, man: dict[str, Any], table: list[dict[str, Any]], files: list[str],
              name: str, license: str, repo: str | None) -> None:
    """Write the dataset folder's files into ``tmp``: the chunks of ``src`` (byte for byte), the table with
    their sha256, the card, then the manifest with its ``"export"`` record (the sha256 of the card and of
    the Croissant description, :data:`ZEROS`) and last the Croissant description with the manifest's
    sha256. Plain writes (mode from the umask): the whole folder appears at once, by the rename."""
    hashes = {}
    for f in files:
        shutil.copyfile(src / f, tmp / f)
        hashes[f] = file_sha256(tmp / f)
    for r in table:
        r["chunk_sha256"] = hashes[r["chunk_file"]]
    csv = encode(table)
    (tmp / TABLE).write_bytes(csv)
    text = card(man, table, files, name, license, repo or "").encode()
    (tmp / CARD).write_bytes(text)
    all_hashes = {TABLE: hashlib.sha256(csv).hexdigest(), **hashes, MANIFEST: ZEROS}
    cr = description(man, table, all_hashes, name, URLS.get(license, license), repo or "", CITATION)
    record = {
        "table": TABLE, "card": CARD, "croissant": CROISSANT, "name": name, "license": license,
        "repo": repo,
        "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "exported_by": store.provenance(),
        "sha256": {CARD: hashlib.sha256(text).hexdigest(),
                   CROISSANT: hashlib.sha256(json.dumps(cr, indent=1).encode()).hexdigest()},
    }
    exported = {**{k: v for k, v in man.items() if k != "export"}, "export": record}
    recipe = store.architecture(man, str(src))  # a source written before manifests recorded one
    if recipe is not None:
        exported["architecture"] = recipe.record()
    (tmp / MANIFEST).write_text(json.dumps(exported, indent=1))
    next(d for d in cr["distribution"] if d["contentUrl"] == MANIFEST)["sha256"] = file_sha256(tmp / MANIFEST)
    (tmp / CROISSANT).write_text(json.dumps(cr, indent=1))


def verify(path: str | os.PathLike) -> list[dict[str, str]]:
    """Check a dataset folder: its card has its manifest table and symlib manifest, the table lists every
    chunk of the manifest, every chunk file matches the sha256 the table records, every cell of the
    table is what the manifest and the chunks' headers record (:func:`symlib.zoo.dataset.table.check_table`),
    every file matches the sha256 the Croissant description records (the manifest included: an edited
    data fingerprint is named), and the card and the description match the sha256 the manifest's
    ``"export"`` record holds (an edited card or description is named).

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
    known = {}
    for f, h in sorted(want.items()):
        file = path / f
        if not file.is_file():
            raise StoreError(f"{file}: missing (the manifest table lists it); download the dataset again")
        known[f] = got = file_sha256(file)
        if got != h:
            raise StoreError(
                f"{file}: sha256 {got[:16]}... does not match {h[:16]}..., recorded in {TABLE}: the file was "
                f"damaged or replaced since the export; download it again (nothing was loaded)"
            )
    check_table(path, man, table)
    _check_files(path, man, known)
    return table


def _edited(file: Path, got: str, want: str, where: str) -> StoreError:
    return StoreError(
        f"{file}: sha256 {got[:16]}... does not match {want[:16]}..., recorded in {where} at the export: the "
        f"file was edited or damaged since; download the dataset again, or export it again with `symlib zoo "
        f"export` (nothing was loaded)"
    )


def _check_files(path: Path, man: dict[str, Any], known: dict[str, str]) -> None:
    """Check the files of a dataset folder against the sha256 the export recorded: every file the Croissant
    description lists (the manifest, the table, the chunks; ``known``: sha256 already computed), then the
    card and the description against the manifest's ``"export"`` record (the description's with the
    manifest's sha256 in it zeroed, :data:`ZEROS`; exports written before the record held them are checked
    against the description only)."""
    file = path / CROISSANT
    if not file.is_file():
        raise StoreError(f"{file}: missing beside the manifest table; download the dataset again")
    raw = file.read_bytes()
    try:
        dist = {d["contentUrl"]: d["sha256"] for d in json.loads(raw)["distribution"]}
    except (ValueError, KeyError, TypeError) as e:
        raise StoreError(f"{file}: unreadable Croissant description ({type(e).__name__}: {e}); download the "
                         f"dataset again, or export it again") from None
    for f, want in sorted(dist.items()):
        if not (path / f).is_file():
            raise StoreError(f"{path / f}: missing ({CROISSANT} lists it); download the dataset again")
        got = known.get(f) or file_sha256(path / f)
        if got != want:
            raise _edited(path / f, got, want, CROISSANT)
    recorded = (man.get("export") or {}).get("sha256") or {}
    if CARD in recorded:
        if not (path / CARD).is_file():
            raise StoreError(f"{path / CARD}: missing (the manifest records it); download the dataset again")
        got = file_sha256(path / CARD)
        if got != recorded[CARD]:
            raise _edited(path / CARD, got, recorded[CARD], MANIFEST)
    if CROISSANT in recorded:
        blank = raw.replace(str(dist.get(MANIFEST, ZEROS)).encode(), ZEROS.encode())
        got = hashlib.sha256(blank).hexdigest()
        if got != recorded[CROISSANT]:
            raise _edited(file, got, recorded[CROISSANT], f"{MANIFEST} (its own sha256 zeroed)")
