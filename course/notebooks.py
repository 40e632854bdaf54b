"""A notebook's cells (``nbformat`` JSON as a dict): their source and tags; notebooks read and written."""

from __future__ import annotations

import json
from pathlib import Path


def source(cell: dict) -> str:
    """The source of a cell as one string (nbformat stores it as a string or a list of lines)."""
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def tags(cell: dict) -> set[str]:
    """The tags of a cell."""
    return set(cell.get("metadata", {}).get("tags", []))


def read(path: Path) -> dict:
    """The notebook at ``path``."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write(path: Path, nb: dict) -> None:
    """Write ``nb`` to ``path`` as nbformat JSON (indented by one, UTF-8, a final newline)."""
    Path(path).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
