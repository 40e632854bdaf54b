r"""The dataset card of an exported checkpoint set (``README.md``): the Hub's YAML metadata, then how the
set was made, how to load it and how to cite the paper (book: "Checkpoint zoos").

The license is a license identifier of the Hugging Face Hub (:data:`LICENSES`, checked by
:func:`check_license`), so that the Hub shows it and filters by it.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, NamedTuple

from symlib.store import MANIFEST
from symlib.zoo.dataset.croissant import CROISSANT
from symlib.zoo.dataset.table import TABLE

CARD = "README.md"

CITATION = """@inproceedings{laurent2024symmetry,
  title={A symmetry-aware exploration of bayesian neural network posteriors},
  author={Laurent, Olivier and Aldea, Emanuel and Franchi, Gianni},
  booktitle={ICLR},
  year={2024}
}"""
"""The paper's BibTeX entry, in every card and Croissant description."""

LICENSES = (
    "apache-2.0", "mit", "openrail", "bigscience-openrail-m", "creativeml-openrail-m",
    "bigscience-bloom-rail-1.0", "bigcode-openrail-m", "afl-3.0", "artistic-2.0", "bsl-1.0", "bsd",
    "bsd-2-clause", "bsd-3-clause", "bsd-3-clause-clear", "c-uda", "cc", "cc0-1.0", "cc-by-2.0", "cc-by-2.5",
    "cc-by-3.0", "cc-by-4.0", "cc-by-sa-3.0", "cc-by-sa-4.0", "cc-by-nc-2.0", "cc-by-nc-3.0", "cc-by-nc-4.0",
    "cc-by-nd-4.0", "cc-by-nc-nd-3.0", "cc-by-nc-nd-4.0", "cc-by-nc-sa-2.0", "cc-by-nc-sa-3.0",
    "cc-by-nc-sa-4.0", "cdla-sharing-1.0", "cdla-permissive-1.0", "cdla-permissive-2.0", "wtfpl", "ecl-2.0",
    "epl-1.0", "epl-2.0", "etalab-2.0", "eupl-1.1", "agpl-3.0", "gfdl", "gpl", "gpl-2.0", "gpl-3.0", "lgpl",
    "lgpl-2.1", "lgpl-3.0", "isc", "lppl-1.3c", "ms-pl", "mpl-2.0", "odc-by", "odbl", "openrail++",
    "osl-3.0", "postgresql", "ofl-1.1", "ncsa", "unlicense", "zlib", "pddl", "lgpl-lr",
    "deepfloyd-if-license", "llama2", "gemma", "unknown", "other",
)
"""The license identifiers the Hugging Face Hub knows (its documentation's list of repository licenses);
``other`` for any license not listed (its text then belongs in a ``LICENSE`` file of the dataset)."""

URLS = {
    "mit": "https://opensource.org/licenses/MIT",
    "apache-2.0": "https://www.apache.org/licenses/LICENSE-2.0",
    "cc-by-4.0": "https://creativecommons.org/licenses/by/4.0/",
    "cc-by-sa-4.0": "https://creativecommons.org/licenses/by-sa/4.0/",
    "cc0-1.0": "https://creativecommons.org/publicdomain/zero/1.0/",
}
"""The address of the common licenses' texts (Croissant's ``license``; others keep their identifier)."""

__all__ = ["CARD", "CITATION", "LICENSES", "URLS", "card", "check_license"]


def check_license(license: str) -> str:
    """``license`` if it is a license identifier of the Hub (:data:`LICENSES`).

    Raises:
        ValueError: naming the closest identifiers and ``other``.
    """
    if license in LICENSES:
        return license
    near = difflib.get_close_matches(str(license).lower().replace(" ", "-"), LICENSES, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(repr(k) for k in near[:4])}?)" if near else ""
    raise ValueError(
        f"unknown license {license!r}{hint}: --license takes a license identifier of the Hugging Face "
        f"Hub, e.g. mit, apache-2.0, cc-by-4.0 (all {len(LICENSES)}: symlib.zoo.dataset.card.LICENSES, or "
        f"https://huggingface.co/docs/hub/repositories-licenses); for another license, pass other and add "
        f"its text as LICENSE to the dataset folder"
    )


def _size_category(n: int) -> str:
    for bound, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K")):
        if n < bound:
            return label
    return "100K<n<1M"


def _yaml_list(items: list[str]) -> str:
    return "\n".join(f"- {json.dumps(i)}" for i in items)


class _Origin(NamedTuple):
    """What an exported set holds and how it was made, as its card tells it.

    Attributes:
        what: the card's opening sentence, up to "stored as safetensors".
        made: the lines of the section "How it was made" (provenance, then how to reproduce the set).
        arch, dataset: the architecture and the training data (``"checkpoints"`` for an import), tags of
            the Hub's metadata.
        files: the files the section "Files" counts when not the chunk files (an import's source
            checkpoints), else ``None``.
    """

    what: str
    made: list[str]
    arch: Any
    dataset: Any
    files: list | None = None


def _zoo_origin(man: dict[str, Any], rows: list[dict[str, Any]], name: str) -> _Origin:
    """A zoo's :class:`_Origin`: its preset, seeds, recipe, data fingerprint, test accuracy (mean, min and
    max of the table's ``test_acc``) and the two commands that train and export it again."""
    n = len(rows)
    data = man.get("data") or {}
    cfg = man["config"]
    arch, dataset = man["arch"], cfg["dataset"]
    what = (f"{n} independently trained `{arch}` networks on {dataset} (symlib zoo preset "
            f"`{man['preset']}` at scale `{man['scale']}`, configuration `{man['config_hash']}`)")
    accs = [float(r["test_acc"]) for r in rows]
    mean = sum(accs) / n
    made = [
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
    return _Origin(what, made, arch, dataset)


def _import_origin(man: dict[str, Any], n: int, name: str) -> _Origin:
    """The :class:`_Origin` of ``n`` checkpoints imported with ``symlib import``
    (:mod:`symlib.ckpt.convert`): the model's record, the first ten source files and the commands that
    import and export them again; its ``files`` are the source files."""
    rec, src = man["architecture"], man.get("source") or {}
    files = src.get("files") or []
    what = (f"{n} checkpoints of `{rec.get('target')}` ({rec.get('builder')}), imported from "
            f"{len(files)} checkpoint file(s)")
    model = f"--model {rec.get('target')}" if rec.get("builder") == "factory" else ""
    if rec.get("args"):
        model += f" --model-args '{json.dumps(rec['args'], sort_keys=True)}'"
    if rec.get("input_shape"):
        model += f" --input-shape {','.join(str(d) for d in rec['input_shape'])}"
    made = [
        "Imported from these files (sha256 of each in the manifest's `source`): "
        + ", ".join(f"`{Path(f.get('path', '')).name}`" for f in files[:10])
        + (f" and {len(files) - 10} more" if len(files) > 10 else "") + ".",
        "",
        "Rebuild it from the same files:",
        "",
        "```bash",
        f"symlib import 'FILES' --to set {model}".rstrip(),
        f"symlib zoo export set --to {name}",
        "```",
    ]
    return _Origin(what, made, man.get("arch"), "checkpoints", files)


def _posterior_origin(man: dict[str, Any], n: int, name: str) -> _Origin:
    """The :class:`_Origin` of ``n`` weight samples of a posterior approximation: the method, its
    hyper-parameters, seeds and base models, and the commands that sample and export them again."""
    setup = man.get("setup") or {}
    arch, dataset = man.get("arch"), (setup.get("data") or {}).get("name", setup.get("name"))
    what = (f"{n} weight samples of the `{man['method']}` posterior approximation of `{arch}` on "
            f"{setup.get('name')} ({man['n_modes']} modes x {man['n_per_mode']} samples, set "
            f"`{man['set_hash']}`)")
    made = [
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
    return _Origin(what, made, arch, dataset)


def _metadata(license: str, name: str, origin: _Origin, n: int) -> str:
    """The card's YAML front matter for the Hub: license, pretty name, task, tags (symlib's, the
    architecture's and the dataset's), size category of ``n`` checkpoints, and the manifest table as the
    dataset viewer's data."""
    tags = ["model-zoo", "weight-space", "bayesian-neural-networks", "symmetries", "safetensors", "symlib",
            str(origin.arch), str(origin.dataset)]
    return "\n".join([
        "---",
        f"license: {license}",
        f"pretty_name: {json.dumps(name)}",
        "task_categories:",
        _yaml_list(["image-classification"]),
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


def _files_section(n_files: int) -> list[str]:
    """The card's section "Files": the manifest table, the ``n_files`` chunks, the manifest and the
    Croissant description."""
    return [
        "## Files",
        "",
        "| file | what |",
        "|---|---|",
        f"| `{TABLE}` | one row per checkpoint: index, seed, chunk file and row, recipe and configuration "
        "hash, training metrics, test accuracy, the sha256 of its chunk file |",
        f"| `chunk-*.safetensors` ({n_files} files) | the weights: the state dicts of consecutive "
        "networks, every tensor stacked along a new first axis (network `i` of the table is row "
        "`chunk_row` of `chunk_file`) |",
        f"| `{MANIFEST}` | symlib's manifest: the full configuration, the data fingerprint, provenance |",
        f"| `{CROISSANT}` | a [Croissant](https://mlcommons.org/croissant/) 1.0 description of the files |",
    ]


def _load_section(repo: str) -> list[str]:
    """The card's section "Load it": with symlib from the Hub repository ``repo`` (``OWNER/NAME`` when
    ``""``), without it as plain safetensors and CSV, and how to upload the folder."""
    load = repo or "OWNER/NAME"
    return [
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
    ]


def card(man: dict[str, Any], rows: list[dict[str, Any]], files: list[str], name: str, license: str,
         repo: str) -> str:
    """The dataset card (``README.md``) of an export: YAML metadata for the Hub (license, task, size,
    tags, the manifest table as the dataset viewer's data), then what the set holds, how it was made and
    how to reproduce it, the files, how to load it, its license and the citation of the paper.

    Args:
        man: the set's manifest; rows: the manifest table's rows; files: the chunk files.
        name: the dataset's name; license: a Hub license identifier (:func:`check_license`);
        repo: ``"owner/name"`` on the Hub, or ``""``.
    """
    n = len(rows)
    if man.get("kind", "zoo") == "zoo":
        origin = _zoo_origin(man, rows, name)
    elif man.get("architecture"):  # checkpoint files imported with `symlib import` (symlib.ckpt.convert)
        origin = _import_origin(man, n, name)
    else:
        origin = _posterior_origin(man, n, name)
    body = [
        f"# {name}",
        "",
        f"{origin.what}, stored as safetensors by symlib and exported with "
        f"`symlib zoo export` (symlib {man.get('symlib_version')}, git {man.get('git_commit')}).",
        "",
        "These checkpoints reproduce the setting of Laurent, Aldea & Franchi, *A Symmetry-Aware "
        "Exploration of Bayesian Neural Network Posteriors* (ICLR 2024), whose evidence is many "
        "independently trained networks of one architecture.",
        "",
        *_files_section(len(files if origin.files is None else origin.files)),
        "",
        "## How it was made",
        "",
        *origin.made,
        "",
        *_load_section(repo),
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
    return _metadata(license, name, origin, n) + "\n\n" + "\n".join(body)
