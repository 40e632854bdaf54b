r"""The Croissant description of an exported checkpoint set (``croissant.json``), and its validation with
``mlcroissant`` (book: "Checkpoint zoos").

`Croissant <https://mlcommons.org/croissant/>`_ 1.0 describes a dataset's files (with their sha256) and
its records as JSON-LD; the Hub and dataset search engines read it. Here the records are the manifest
table's rows, one per checkpoint.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

from symlib.store import StoreError
from symlib.zoo.dataset.table import TABLE, TYPES, read_table

CROISSANT = "croissant.json"

__all__ = ["CROISSANT", "description", "validate_croissant"]

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


def description(man: dict[str, Any], rows: list[dict[str, Any]], hashes: dict[str, str], name: str,
                license: str, repo: str, cite: str) -> dict[str, Any]:
    """The Croissant 1.0 description (JSON-LD) of an export: every file with its sha256, the manifest
    table as the record set ``checkpoints`` (one field per column, keyed by ``index``).

    Args:
        man: the set's manifest; rows: the manifest table's rows; hashes: ``{file: sha256}``.
        name, repo: as :func:`symlib.zoo.export`.
        license: the license's identifier or the address of its text.
        cite: the BibTeX entry to cite (:data:`symlib.zoo.dataset.card.CITATION`).
    """
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
            "dataType": TYPES.get(col, "sc:Text"),
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
        "citeAs": cite,
        "license": license,
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
