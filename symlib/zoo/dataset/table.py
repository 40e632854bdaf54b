r"""The manifest table of an exported dataset (``checkpoints.csv``): one row per checkpoint, built from
the set's manifest and chunks, and checked against them when the dataset is read (book: "Checkpoint
zoos").

A zoo's rows hold each network's index, seed, chunk file and row, preset, scale, architecture, dataset,
configuration hash, recipe and training metrics; a posterior sample set's rows hold each sample's index,
mode, base seed, chunk file and row, method, preset, scale, architecture, identity hash and recipe. Both
end with the sha256 of the row's chunk file. :func:`check_table` rebuilds the rows from the manifest and
the chunks' headers and compares them cell by cell, so that a table edited after the export (a seed, a
test accuracy) is named rather than trusted.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from symlib import store
from symlib.store import MANIFEST, StoreError, chunk_name

TABLE = "checkpoints.csv"
TYPES = {
    "index": "sc:Integer", "seed": "sc:Integer", "mode": "sc:Integer", "base_seed": "sc:Integer",
    "chunk_row": "sc:Integer", "train_acc": "sc:Float", "train_loss": "sc:Float", "test_acc": "sc:Float",
    "test_loss": "sc:Float",
}
"""The Croissant data type of the table's numeric columns (the others are text)."""

__all__ = ["TABLE", "TYPES", "check_table", "encode", "read_table", "rows"]


def _zoo_rows(src: Path, man: dict[str, Any], full: bool) -> tuple[list[dict[str, Any]], list[str]]:
    from symlib.zoo.cache import _check_complete
    from symlib.zoo.chunks import check_data, check_manifest, check_records, config_of, read

    cfg = config_of(src, man)
    check_manifest(src, man, cfg)
    _check_complete(src, man, cfg)
    recipe = json.dumps(man["recipe"], sort_keys=True)  # the configuration's (check_manifest)
    out, files = [], []
    for c in range(cfg.n_chunks):
        file = src / chunk_name(c)
        got = read(file, cfg, c, full)
        records = got.records
        check_records(src, man, cfg, c, records)
        check_data(src, man, chunk_name(c), got.data)
        start, _ = cfg.chunk_range(c)
        files.append(chunk_name(c))
        for r, rec in enumerate(records):
            out.append({
                "index": start + r,
                "seed": rec["seed"],
                "chunk_file": chunk_name(c),
                "chunk_row": r,
                "preset": cfg.preset,
                "scale": cfg.scale,
                "arch": cfg.arch,
                "dataset": cfg.dataset,
                "config_hash": cfg.hash,
                "recipe": recipe,
                "train_acc": rec["train_acc"],
                "train_loss": rec["train_loss"],
                "test_acc": rec["test_acc"],
                "test_loss": rec["test_loss"],
            })
    return out, files


def _posterior_rows(src: Path, man: dict[str, Any], full: bool) -> tuple[list[dict[str, Any]], list[str]]:
    n, chunk, per_mode = int(man["n_samples"]), int(man["chunk"]), man.get("n_per_mode")
    ranges = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    have = sorted(ch["chunk"] for ch in man.get("chunks", []))
    if not man.get("complete") or have != list(range(len(ranges))):
        raise StoreError(
            f"{src / MANIFEST}: the sample set is incomplete (chunks "
            f"{sorted(set(range(len(ranges))) - set(have))} missing); finish it with `symlib posterior "
            f"sample` before exporting it"
        )
    setup = man.get("setup") or {}
    base = list((man.get("base") or {}).get("seeds") or [])
    expect = {"kind": "posterior", "set_hash": man["set_hash"]}
    fix = "rewrite it with `symlib posterior sample` (the same arguments, `--out` the set's folder)"
    out, files = [], []
    for c, (s, e) in enumerate(ranges):
        file = src / chunk_name(c)
        if full:
            tensors, meta = store.read_chunk(file, expect, fix, legacy=store.LEGACY["posterior"])
            store.check_tensors(file, tensors, man["shapes"], e - s, "the manifest's tensors")
        else:
            meta = store.read_header(file, expect, fix, legacy=store.LEGACY["posterior"])
        files.append(chunk_name(c))
        for r, rec in enumerate(store.sample_records(file, meta, s, e, per_mode, fix)):
            out.append({
                "index": rec["index"],
                "mode": rec["mode"],
                "base_seed": base[rec["mode"]] if rec["mode"] < len(base) else "",
                "chunk_file": chunk_name(c),
                "chunk_row": r,
                "method": man["method"],
                "preset": setup.get("name"),
                "scale": setup.get("scale"),
                "arch": man.get("arch"),
                "set_hash": man["set_hash"],
                "recipe": json.dumps(setup.get("recipe") or {}, sort_keys=True),
            })
    return out, files


def rows(path: str | os.PathLike, man: dict[str, Any], full: bool = True) -> tuple[list[dict[str, Any]],
                                                                                      list[str]]:
    """The rows of the manifest table of the complete set in ``path`` (without ``chunk_sha256``), and its
    chunk files, every chunk checked first: in ``full`` (:func:`symlib.zoo.read_chunk`, or a sample set's
    checks), else its header only (:func:`symlib.zoo.chunks.read_records`); a zoo's manifest is checked
    against its configuration and chunks too.

    Raises:
        StoreError: the set is incomplete or damaged, or its manifest contradicts its chunks.
    """
    path = Path(path)
    if man.get("kind", "zoo") == "zoo":
        return _zoo_rows(path, man, full)
    return _posterior_rows(path, man, full)


def encode(table: list[dict[str, Any]]) -> bytes:
    """The rows as CSV bytes (a header line, then one line per row)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(table[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(table)
    return buf.getvalue().encode()


def read_table(path: str | os.PathLike) -> list[dict[str, str]]:
    """The manifest table of a dataset folder, one dict of strings per checkpoint.

    Raises:
        StoreError: the table is missing (a card without its table, e.g. an incomplete upload) or
            unreadable.
    """
    path = Path(path)
    file = path / TABLE
    if not file.is_file():
        card = " beside its dataset card (README.md)" if (path / "README.md").is_file() else ""
        raise StoreError(
            f"{file}: no manifest table{card}: the folder is not a complete symlib dataset (an interrupted "
            f"upload or download?); download it again or export it again with `symlib zoo export`"
        )
    try:
        table = list(csv.DictReader(io.StringIO(file.read_text())))
    except (UnicodeDecodeError, csv.Error) as e:
        raise StoreError(f"{file}: unreadable manifest table ({e}); download or export it again") from None
    need = {"index", "chunk_file", "chunk_sha256"}
    if not table or not need <= set(table[0]):
        raise StoreError(f"{file}: not a symlib manifest table (needs the columns {sorted(need)})")
    return table


def check_table(path: str | os.PathLike, man: dict[str, Any], table: list[dict[str, str]]) -> None:
    """Check every cell of a dataset's manifest table (:func:`read_table`) against the rows rebuilt from
    its manifest ``man`` and its chunks' headers (:func:`rows`, headers only): what the table says of a
    network (its seed, metrics, chunk, configuration) must be what the chunk that holds it records. The
    chunks' sha256 are checked against the table first (:func:`symlib.zoo.dataset.verify`).

    Raises:
        StoreError: naming the row, the column, both values and the fix.
    """
    path = Path(path)
    want, _ = rows(path, man, full=False)
    sha = {r["chunk_file"]: r["chunk_sha256"] for r in table}
    want = [{**r, "chunk_sha256": sha.get(r["chunk_file"], "")} for r in want]
    expected = list(csv.DictReader(io.StringIO(encode(want).decode())))
    file = path / TABLE
    fix = ("the table was edited or damaged since the export: download the dataset again, or export it "
           "again with `symlib zoo export`")
    if list(table[0]) != list(expected[0]):
        raise StoreError(f"{file}: has the columns {list(table[0])}, expected {list(expected[0])}; {fix}")
    if len(table) != len(expected):
        raise StoreError(f"{file}: has {len(table)} rows, the set holds {len(expected)} checkpoints; {fix}")
    for i, (got, ref) in enumerate(zip(table, expected, strict=True)):
        for col, value in ref.items():
            if got[col] != value:
                raise StoreError(
                    f"{file}: row {i + 1} (index {ref['index']}) says {col} {got[col]!r}, but "
                    f"{ref['chunk_file']} (row {ref['chunk_row']}) and the manifest record {value!r}; {fix}"
                )
