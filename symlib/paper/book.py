"""Glue for the living paper: numbers and figures from a chapter's run into its prose (myst-nb), and
the one parameters cell a reader sees.

``glue`` is myst-nb's, with two fixes every chapter needs: numpy and torch
scalars become plain Python numbers (numpy 2 prints ``np.float64(...)``, which
myst-nb cannot format in ``{glue:text}`name:.2f```), and a glued figure is
closed so that it appears only where the text places it.
"""

from __future__ import annotations

from typing import Any


def plain(value: Any) -> Any:
    """``value`` as a plain Python scalar when it is a numpy or torch scalar, else unchanged."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    return value


def glue(name: str, value: Any, display: bool = False) -> None:
    """Record ``value`` under ``name`` for ``{glue:text}`` / ``{glue:figure}`` in the chapter's text."""
    from myst_nb import glue as _glue

    value = plain(value)
    _glue(name, value, display=display)
    if type(value).__name__ == "Figure":
        import matplotlib.pyplot as plt

        plt.close(value)


def _assigned(line: str) -> str | None:
    """The name a simple top-level assignment ``name = value  # comment`` assigns, else None."""
    head = line.split("#", 1)[0]
    if "=" not in head or line[:1].isspace():
        return None
    name = head.split("=", 1)[0].strip()
    return name if name.isidentifier() else None


def fold_parameters(notebook: str) -> bool:
    """Show a papermill run's parameters once: in the chapter's own ``parameters`` cell.

    papermill executes a notebook with an extra cell tagged ``injected-parameters`` right after the
    cell tagged ``parameters``, so a rendered page would list the parameters twice, the defaults first.
    This rewrites, in the executed notebook ``notebook`` (in place), every simple assignment of the
    ``parameters`` cell to the value papermill injected (keeping its comment) and tags the injected cell
    ``remove-cell``, which Jupyter Book leaves out of the page. The injected cell stays in the notebook
    and the values are the same in both cells, so re-executing the notebook (nbval) runs exactly what
    papermill ran.

    Returns:
        Whether an injected cell was found.
    """
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    tags = [set(c.get("metadata", {}).get("tags", [])) for c in nb.cells]
    injected = [i for i, t in enumerate(tags) if "injected-parameters" in t]
    params = [i for i, t in enumerate(tags) if "parameters" in t]
    if not injected:
        return False
    inj = nb.cells[injected[0]]
    values = {}
    for line in inj.source.splitlines():
        name = _assigned(line)
        if name is not None:
            values[name] = line.split("=", 1)[1].split("#", 1)[0].strip()
    if params:
        cell = nb.cells[params[0]]
        out = []
        for line in cell.source.splitlines():
            name = _assigned(line)
            if name in values:
                code, _, comment = line.partition("#")
                line = f"{name} = {values.pop(name)}" + (f"  # {comment.strip()}" if comment else "")
            out.append(line)
        out += [f"{k} = {v}" for k, v in values.items()]  # injected names the chapter does not declare
        cell.source = "\n".join(out)
    inj.metadata.setdefault("tags", [])
    if "remove-cell" not in inj.metadata["tags"]:
        inj.metadata["tags"].append("remove-cell")
    nbformat.write(nb, notebook)
    return True
