r"""Checkpoint sets as published datasets: export a zoo (or a posterior sample set) to a folder in the
layout the Hugging Face Hub expects, check such a folder, and resolve ``hf://`` addresses through the
Hub's cache (book: "Checkpoint zoos").

:func:`export` writes a *dataset folder*:

* ``chunk-00000.safetensors``, ...: the set's chunks, byte for byte (every file still carries the
  sha256 of its tensors, :mod:`symlib.store`);
* ``manifest.json``: the set's manifest, plus an ``"export"`` record naming the files below;
* ``checkpoints.csv`` (:data:`TABLE`): the *manifest table*, one row per checkpoint: its index, seed,
  chunk file and row, preset, scale, architecture, recipe and configuration hash, training metrics,
  test accuracy and the **sha256 of its chunk file** (the hash the Hub's LFS stores too);
* ``README.md`` (:data:`CARD`): the dataset card, YAML metadata first (license, task, size, tags, the
  table as the dataset viewer's data), then how the set was trained, how to load it and how to cite
  the paper;
* ``croissant.json`` (:data:`CROISSANT`): a Croissant 1.0 JSON-LD description (every file with its
  sha256, the table as a record set), validated with ``mlcroissant`` when it is installed.

The folder is still a checkpoint folder: ``symlib.load(folder)`` reads it, after :func:`verify` has
checked that every chunk matches the table's sha256. ``symlib.load("hf://owner/name")`` first resolves
the address with ``huggingface_hub`` (:func:`resolve`: the Hub's cache, ``HF_HUB_OFFLINE=1`` honoured).
Uploading is one command of the Hub's own client (not run by symlib)::

    hf upload owner/name OUT . --repo-type dataset   # huggingface_hub >= 1.0; older: huggingface-cli upload
"""

from __future__ import annotations

import csv
import datetime
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

from symlib import store
from symlib.store import MANIFEST, StoreError, chunk_name

TABLE = "checkpoints.csv"
CARD = "README.md"
CROISSANT = "croissant.json"
FILES = (TABLE, CARD, CROISSANT)
HF_PREFIX = "hf://"

CITATION = """@inproceedings{laurent2024symmetry,
  title={A symmetry-aware exploration of bayesian neural network posteriors},
  author={Laurent, Olivier and Aldea, Emanuel and Franchi, Gianni},
  booktitle={ICLR},
  year={2024}
}"""

_LICENSE_URLS = {
    "mit": "https://opensource.org/licenses/MIT",
    "apache-2.0": "https://www.apache.org/licenses/LICENSE-2.0",
    "cc-by-4.0": "https://creativecommons.org/licenses/by/4.0/",
    "cc-by-sa-4.0": "https://creativecommons.org/licenses/by-sa/4.0/",
    "cc0-1.0": "https://creativecommons.org/publicdomain/zero/1.0/",
}

# The JSON-LD context of Croissant 1.0 (as mlcroissant writes it).
_CONTEXT = {
    "@language": "en",
    "@vocab": "https://schema.org/",
    "citeAs": "cr:citeAs",
    "column": "cr:column",
    "conformsTo": "dct:conformsTo",
    "cr": "http://mlcommons.org/croissant/",
    "rai": "http://mlcommons.org/croissant/RAI/",
    "data": {"@id": "cr:data", "@type": "@json"},
    "dataType": {"@id": "cr:dataType", "@type": "@vocab"},
    "dct": "http://purl.org/dc/terms/",
    "equivalentProperty": "cr:equivalentProperty",
    "examples": {"@id": "cr:examples", "@type": "@json"},
    "extract": "cr:extract",
    "field": "cr:field",
    "fileProperty": "cr:fileProperty",
    "fileObject": "cr:fileObject",
    "fileSet": "cr:fileSet",
    "format": "cr:format",
    "includes": "cr:includes",
    "isLiveDataset": "cr:isLiveDataset",
    "jsonPath": "cr:jsonPath",
    "key": "cr:key",
    "md5": "cr:md5",
    "parentField": "cr:parentField",
    "path": "cr:path",
    "recordSet": "cr:recordSet",
    "references": "cr:references",
    "regex": "cr:regex",
    "repeated": "cr:repeated",
    "replace": "cr:replace",
    "samplingRate": "cr:samplingRate",
    "sc": "https://schema.org/",
    "separator": "cr:separator",
    "source": "cr:source",
    "subField": "cr:subField",
    "transform": "cr:transform",
}

__all__ = [
    "CARD",
    "CROISSANT",
    "TABLE",
    "export",
    "file_sha256",
    "is_dataset",
    "read_table",
    "resolve",
    "validate_croissant",
    "verify",
]


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes (what the manifest table and Croissant record; read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


# ----------------------------------------------------------------------------- rows of the table


def _zoo_rows(src: Path, man: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    from symlib.zoo.cache import _check_complete
    from symlib.zoo.chunks import config_of, read_chunk

    cfg = config_of(src, man)
    _check_complete(src, man, cfg)
    recipe = json.dumps(man.get("recipe") or {}, sort_keys=True)
    rows, files = [], []
    for c in range(cfg.n_chunks):
        _, records = read_chunk(src / chunk_name(c), cfg)  # every chunk checked before it is published
        start, _ = cfg.chunk_range(c)
        files.append(chunk_name(c))
        for r, rec in enumerate(records):
            rows.append({
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
    return rows, files


def _posterior_rows(src: Path, man: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    n, chunk = int(man["n_samples"]), int(man["chunk"])
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
    rows, files = [], []
    for c, (s, e) in enumerate(ranges):
        file = src / chunk_name(c)
        fix = "rewrite it with `symlib posterior sample`"
        tensors, meta = store.read_chunk(file, {"kind": "posterior", "set_hash": man["set_hash"]}, fix)
        store.check_tensors(file, tensors, man["shapes"], e - s, "the manifest's tensors")
        files.append(chunk_name(c))
        for r, rec in enumerate(json.loads(meta["samples"])):
            rows.append({
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
    return rows, files


_TYPES = {
    "index": "sc:Integer", "seed": "sc:Integer", "mode": "sc:Integer", "base_seed": "sc:Integer",
    "chunk_row": "sc:Integer", "train_acc": "sc:Float", "train_loss": "sc:Float", "test_acc": "sc:Float",
    "test_loss": "sc:Float",
}


def _csv(rows: list[dict[str, Any]]) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
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
        card = " beside its dataset card (README.md)" if (path / CARD).is_file() else ""
        raise StoreError(
            f"{file}: no manifest table{card}: the folder is not a complete symlib dataset (an interrupted "
            f"upload or download?); download it again or export it again with `symlib zoo export`"
        )
    try:
        rows = list(csv.DictReader(io.StringIO(file.read_text())))
    except (UnicodeDecodeError, csv.Error) as e:
        raise StoreError(f"{file}: unreadable manifest table ({e}); download or export it again") from None
    need = {"index", "chunk_file", "chunk_sha256"}
    if not rows or not need <= set(rows[0]):
        raise StoreError(f"{file}: not a symlib manifest table (needs the columns {sorted(need)})")
    return rows


# ----------------------------------------------------------------------------- card and croissant


def _size_category(n: int) -> str:
    for bound, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K")):
        if n < bound:
            return label
    return "100K<n<1M"


def _yaml_list(items: list[str]) -> str:
    return "\n".join(f"- {json.dumps(i)}" for i in items)


def _card(man: dict[str, Any], rows: list[dict[str, Any]], files: list[str], name: str, license: str,
          repo: str) -> str:
    kind = man.get("kind", "zoo")
    n = len(rows)
    data = man.get("data") or {}
    if kind == "zoo":
        cfg = man["config"]
        arch, dataset = man["arch"], cfg["dataset"]
        what = (f"{n} independently trained `{arch}` networks on {dataset} (symlib zoo preset "
                f"`{man['preset']}` at scale `{man['scale']}`, configuration `{man['config_hash']}`)")
        accs = [float(r["test_acc"]) for r in rows]
        mean = sum(accs) / n
        trained = [
            f"Model `i` has seed `{cfg['seed']} + i` (seeds {cfg['seed']}..{cfg['seed'] + n - 1}); from it "
            "symlib derives the initialisation, the data order and the random crops, so every network is "
            "reproducible on its own.",
            "",
            "| setting | value |",
            "|---|---|",
            *(f"| {k} | `{json.dumps(v)}` |" for k, v in man["recipe"].items()),
            f"| training images | {data.get('n_train')} ({data.get('source')}) |",
            f"| data fingerprint | `{data.get('fingerprint')}` |",
            "",
            f"Test accuracy on {data.get('n_test')} test images: mean {mean:.4f}, min "
            f"{min(accs):.4f}, max {max(accs):.4f} (column `test_acc`).",
            "",
            "Reproduce it (bit for bit on the same hardware and software):",
            "",
            "```bash",
            "# in a checkout of symlib (the companion library of the paper's living reproduction)",
            f"symlib zoo train --preset {man['preset']} --scale {man['scale']}"
            + (f" --seed {cfg['seed']}" if cfg["seed"] else "") + " --out zoo",
            f"symlib zoo export zoo --to {name}",
            "```",
        ]
        tasks = ["image-classification"]
    else:
        setup = man.get("setup") or {}
        arch, dataset = man.get("arch"), (setup.get("data") or {}).get("name", setup.get("name"))
        what = (f"{n} weight samples of the `{man['method']}` posterior approximation of `{arch}` on "
                f"{setup.get('name')} ({man['n_modes']} modes x {man['n_per_mode']} samples, set "
                f"`{man['set_hash']}`)")
        trained = [
            f"Method `{man['method']}`, hyper-parameters `{json.dumps(man.get('hyper'), sort_keys=True)}`, "
            f"run seed {man.get('seed')}, base models {json.dumps((man.get('base') or {}).get('seeds'))}.",
            "",
            "Reproduce it:",
            "",
            "```bash",
            f"symlib posterior sample --method {man['method']} --preset {setup.get('name')} --scale "
            f"{setup.get('scale')} --modes {man['n_modes']} --samples {man['n_samples']} --seed "
            f"{man.get('seed')} --out set",
            f"symlib zoo export set --to {name}",
            "```",
        ]
        tasks = ["image-classification"]
    tags = ["model-zoo", "weight-space", "bayesian-neural-networks", "symmetries", "safetensors", "symlib",
            str(arch), str(dataset)]
    yaml = "\n".join([
        "---",
        f"license: {license}",
        f"pretty_name: {json.dumps(name)}",
        "task_categories:",
        _yaml_list(tasks),
        "tags:",
        _yaml_list(tags),
        "size_categories:",
        _yaml_list([_size_category(n)]),
        "configs:",
        "- config_name: default",
        "  data_files:",
        "  - split: train",
        f"    path: {TABLE}",
        "---",
    ])
    load = repo or "OWNER/NAME"
    body = [
        f"# {name}",
        "",
        f"{what}, stored as safetensors by symlib and exported with "
        f"`symlib zoo export` (symlib {man.get('symlib_version')}, git {man.get('git_commit')}).",
        "",
        "These checkpoints reproduce the setting of Laurent, Aldea & Franchi, *A Symmetry-Aware "
        "Exploration of Bayesian Neural Network Posteriors* (ICLR 2024), whose evidence is many "
        "independently trained networks of one architecture.",
        "",
        "## Files",
        "",
        "| file | what |",
        "|---|---|",
        f"| `{TABLE}` | one row per checkpoint: index, seed, chunk file and row, recipe and configuration "
        "hash, training metrics, test accuracy, the sha256 of its chunk file |",
        f"| `chunk-*.safetensors` ({len(files)} files) | the weights: the state dicts of consecutive "
        "networks, every tensor stacked along a new first axis (network `i` of the table is row "
        "`chunk_row` of `chunk_file`) |",
        f"| `{MANIFEST}` | symlib's manifest: the full configuration, the data fingerprint, provenance |",
        f"| `{CROISSANT}` | a [Croissant](https://mlcommons.org/croissant/) 1.0 description of the files |",
        "",
        "## How it was made",
        "",
        *trained,
        "",
        "## Load it",
        "",
        "```python",
        "import symlib                                    # checks every file's sha256",
        f'params, manifest = symlib.load("hf://{load}")   # {{name: tensor (n, ...)}}, network i at index i',
        f'nets, manifest = symlib.load("hf://{load}", as_="models")   # or a list of nn.Module',
        "```",
        "",
        "Without symlib, every chunk is a plain safetensors file:",
        "",
        "```python",
        "from safetensors.torch import load_file",
        'chunk = load_file("chunk-00000.safetensors")     # {name: (networks in the chunk, ...)}',
        "```",
        "",
        "and the table is a CSV file (`datasets.load_dataset`, pandas, or `mlcroissant.Dataset"
        f'("{CROISSANT}").records("checkpoints")`).',
        "",
        "Upload (not run by symlib): `hf upload OWNER/NAME . . --repo-type dataset` from this folder "
        "(older clients: `huggingface-cli upload OWNER/NAME . . --repo-type dataset`).",
        "",
        "## License",
        "",
        f"The weights are released under `{license}`; the training data keeps its own license.",
        "",
        "## Citation",
        "",
        "If you use these checkpoints, please cite the paper:",
        "",
        "```bibtex",
        CITATION,
        "```",
        "",
    ]
    return yaml + "\n\n" + "\n".join(body)


def _croissant(man: dict[str, Any], rows: list[dict[str, Any]], hashes: dict[str, str], name: str,
               license: str, repo: str) -> dict[str, Any]:
    dist = [
        {
            "@type": "cr:FileObject",
            "@id": f,
            "name": f,
            "contentUrl": f,
            "encodingFormat": "text/csv" if f.endswith(".csv") else "application/octet-stream",
            "sha256": h,
        }
        for f, h in hashes.items()
    ]
    fields = [
        {
            "@type": "cr:Field",
            "@id": f"checkpoints/{col}",
            "name": col,
            "dataType": _TYPES.get(col, "sc:Text"),
            "source": {"fileObject": {"@id": TABLE}, "extract": {"column": col}},
        }
        for col in rows[0]
    ]
    kind = man.get("kind", "zoo")
    source = f"zoo {man.get('preset')}" if kind == "zoo" else f"posterior {man.get('method')}"
    desc = (f"{len(rows)} checkpoints of {man.get('arch')} ({source}, symlib) in safetensors chunks, with "
            "one table row per checkpoint.")
    return {
        "@context": _CONTEXT,
        "@type": "sc:Dataset",
        "name": name,
        "description": desc,
        "conformsTo": "http://mlcommons.org/croissant/1.0",
        "citeAs": CITATION,
        "license": _LICENSE_URLS.get(license, license),
        "url": f"https://huggingface.co/datasets/{repo}" if repo else "https://huggingface.co/datasets",
        "version": "1.0.0",
        "datePublished": datetime.date.today().isoformat(),
        "distribution": dist,
        "recordSet": [
            {
                "@type": "cr:RecordSet",
                "@id": "checkpoints",
                "name": "checkpoints",
                "description": "One record per checkpoint (the manifest table).",
                "key": {"@id": "checkpoints/index"},
                "field": fields,
            }
        ],
    }


def validate_croissant(path: str | os.PathLike) -> str:
    """Validate ``croissant.json`` of a dataset folder with ``mlcroissant`` (offline: every file is local)
    and read its records once.

    Returns:
        mlcroissant's report of warnings (empty when there are none).

    Raises:
        ImportError: ``mlcroissant`` is not installed (``pip install mlcroissant``).
        StoreError: the description is not valid Croissant, or its records cannot be read.
    """
    import logging
    import warnings

    import mlcroissant as mlc

    file = Path(path) / CROISSANT
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # mlcroissant logs its warnings too; they are returned instead
    try:  # relative contentUrls resolve against the file's folder
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # rdflib's, inside mlcroissant
            ds = mlc.Dataset(jsonld=str(file))
            n = sum(1 for _ in ds.records("checkpoints"))
    except mlc.ValidationError as e:
        raise StoreError(f"{file}: not valid Croissant: {e}") from None
    except Exception as e:  # mlcroissant raises many types when it cannot read the records
        raise StoreError(f"{file}: mlcroissant cannot read its records ({type(e).__name__}: {e})") from None
    finally:
        absl.setLevel(level)
    rows = len(read_table(file.parent))
    if n != rows:
        raise StoreError(f"{file}: mlcroissant reads {n} records, the table holds {rows}")
    return ds.metadata.issues.report() if ds.metadata.issues.warnings else ""


# ----------------------------------------------------------------------------- export and verify


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

    Every chunk is checked (:func:`symlib.zoo.read_chunk`, or the sample set's checks) before it is
    copied; the folder is assembled under a temporary name beside ``to`` and renamed at the end, so an
    interrupted export leaves nothing at ``to``.

    Args:
        path: the zoo or sample-set folder.
        to: the dataset folder to create; it must not exist (an empty folder is accepted).
        name: the dataset's name in the card and Croissant (default: the folder name of ``to``).
        license: the weights' license, a Hub license identifier (default ``"mit"``).
        repo: ``"owner/name"`` on the Hub, for the card's loading snippet and Croissant's url.
        validate: validate the Croissant description with ``mlcroissant`` (``None``: when installed).

    Returns:
        ``to``.

    Raises:
        StoreError: ``to`` exists (nothing is overwritten), or the source is incomplete, damaged or not a
            checkpoint set; the Croissant description is invalid (``validate``).
    """
    src, to = Path(path), Path(to)
    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise StoreError(
            f"{to}: already exists; an export never overwrites anything: choose another --to or remove it"
        )
    man = store.read_manifest(src, how=f"export a zoo folder (`symlib zoo train --out {src}`)")
    kind = man.get("kind", "zoo")
    rows, files = _zoo_rows(src, man) if kind == "zoo" else _posterior_rows(src, man)
    name = name or to.name
    tmp = to.parent / f".{to.name}.export-{os.getpid()}.tmp"
    to.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        hashes = {}
        for f in files:
            shutil.copyfile(src / f, tmp / f)
            hashes[f] = file_sha256(tmp / f)
        for r in rows:
            r["chunk_sha256"] = hashes[r["chunk_file"]]
        table = _csv(rows)
        # plain writes (mode from the umask): the whole folder appears at once, by the rename below
        (tmp / TABLE).write_bytes(table)
        record = {
            "table": TABLE, "card": CARD, "croissant": CROISSANT, "name": name, "license": license,
            "repo": repo,
            "exported": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "exported_by": store.provenance(),
        }
        exported = {**{k: v for k, v in man.items() if k != "export"}, "export": record}
        (tmp / MANIFEST).write_text(json.dumps(exported, indent=1))
        all_hashes = {TABLE: hashlib.sha256(table).hexdigest(), **hashes}
        all_hashes[MANIFEST] = file_sha256(tmp / MANIFEST)
        cr = _croissant(man, rows, all_hashes, name, license, repo or "")
        (tmp / CROISSANT).write_text(json.dumps(cr, indent=1))
        (tmp / CARD).write_text(_card(man, rows, files, name, license, repo or ""))
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
    chunk of the manifest, and every chunk file matches the sha256 the table records.

    Returns:
        The table's rows.

    Raises:
        StoreError: naming the file and the fix.
    """
    path = Path(path)
    rows = read_table(path)
    if not (path / MANIFEST).is_file():
        raise StoreError(
            f"{path / MANIFEST}: missing beside the manifest table: the dataset is incomplete (an "
            f"interrupted upload or download?); download it again"
        )
    man = store.read_manifest(path)
    want: dict[str, str] = {}
    for r in rows:
        if want.setdefault(r["chunk_file"], r["chunk_sha256"]) != r["chunk_sha256"]:
            raise StoreError(f"{path / TABLE}: two sha256 for {r['chunk_file']}: the table is damaged")
    listed = {ch["file"] for ch in man.get("chunks", [])}
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
    return rows


def resolve(address: str | os.PathLike) -> Path:
    """A local folder for ``address``: a path as it is, or ``hf://owner/name[@revision]`` (also
    ``hf://datasets/owner/name``) resolved through ``huggingface_hub``'s cache (``snapshot_download``;
    with ``HF_HUB_OFFLINE=1`` only the cache is used).

    Raises:
        ImportError: ``hf://`` without ``huggingface_hub`` installed.
        StoreError: the dataset is neither in the cache nor reachable.
    """
    text = str(address)
    if not text.startswith(HF_PREFIX):
        return Path(address)
    repo = text[len(HF_PREFIX):].strip("/")
    repo = repo.removeprefix("datasets/")
    repo, _, revision = repo.partition("@")
    if repo.count("/") != 1:
        raise StoreError(f"{text}: expected hf://owner/name or hf://owner/name@revision")
    try:
        import huggingface_hub
    except ImportError:
        raise ImportError(
            f"{text}: loading from the Hugging Face Hub needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        local = huggingface_hub.snapshot_download(
            repo_id=repo, repo_type="dataset", revision=revision or None
        )
    except Exception as e:  # offline without a cached copy, unknown repository, network errors
        raise StoreError(
            f"{text}: cannot resolve the dataset ({type(e).__name__}: {e}); without a network, download it "
            f"once (`hf download {repo} --repo-type dataset`) or pass a local folder"
        ) from None
    return Path(local)
