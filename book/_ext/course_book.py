r"""The book as a course: two editions, launch buttons from one setting, `.md` downloads.

A local Sphinx extension (``sphinx: local_extensions`` in ``_config.yml``). It does three things.

**Editions.** The teacher edition (the default) shows every ``{solution}`` of sphinx-exercise as a
toggle. The student edition removes every solution: from the HTML pages, from the search index,
and from the notebooks and markdown files that the download buttons offer. It is chosen by the
environment variable ``BOOK_EDITION=student`` (``make html EDITION=student`` sets it), by
``course_edition: student``, or by sphinx-exercise's own switch ``hide_solutions: true`` under
``sphinx: config:``. This extension does the hiding itself instead of leaving it to sphinx-exercise,
because sphinx-exercise 1.2 cannot hide *gated* solutions (``{solution-start}`` ...
``{solution-end}`` around executed code cells): the build fails on the orphaned end marker, and the
code cells between the markers would stay (executablebooks/sphinx-exercise#89). Solutions are
therefore parsed as usual and removed once resolved, gated or not.

**Launch buttons from one setting.** ``repository: url:`` in ``_config.yml`` drives the Binder and
Colab launch buttons and the repository button: with a URL they use the ``launch_buttons`` of the
config; with an empty URL (or jupyter-book's default URL) there are none. The student edition has
no launch buttons either, since they open the repository's notebooks, solutions included.

**A `.md` download.** Chapter pages are executed notebooks (``book/<name>.ipynb``); their source
in MyST markdown (``notebooks/<name>.md``, what students open in JupyterLab through jupytext) is
offered next to the ``.ipynb`` in the page's download menu.

The functions that find and remove solutions in MyST text and in notebooks are plain Python
(:func:`notebook_solutions`, :func:`strip_markdown`, :func:`strip_notebook`), also used by
``tests/test_book_pages.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

EDITIONS = ("teacher", "student")
EDITION_ENV = "BOOK_EDITION"
# jupyter-book's default `repository.url`: a book that never set one has no repository of its own.
JUPYTER_BOOK_DEFAULT_URL = "https://github.com/executablebooks/jupyter-book"

# --------------------------------------------------------------------------------------------------
# Finding solutions in MyST text and notebooks (no Sphinx needed)
# --------------------------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"^\s*(?P<fence>`{3,}|:{3,})\s*\{(?P<name>solution|solution-start|solution-end)\}")
_OPTION = re.compile(r"^\s*:[\w-]+:")


def _closes(line: str, fence: str) -> bool:
    s = line.strip()
    return len(s) >= len(fence) and set(s) == {fence[0]}


def _scan(chunks: list[tuple[str, list[str]]]) -> tuple[list[list[bool]], list[list[tuple[str, str]]]]:
    """Mark the lines that belong to a solution.

    Args:
        chunks: ``(kind, lines)`` in reading order; ``kind`` is ``"md"`` (markdown, where directives
            are recognised) or anything else (a code cell: its lines are content, never markup).

    Returns:
        For every chunk one flag per line (True: the line is part of a solution, its directive
        lines included), and the solutions' contents: for every solution the ``(kind, line)``
        pairs of its body, without directive and option lines.
    """
    marks: list[list[bool]] = []
    solutions: list[list[tuple[str, str]]] = []
    state, fence, after, body = "out", "", "out", False
    current: list[tuple[str, str]] = []
    for kind, lines in chunks:
        flags = []
        for line in lines:
            if state == "directive":  # inside the fence of a solution / solution-start / solution-end
                flags.append(True)
                if _closes(line, fence):
                    state = after
                elif body and not (_OPTION.match(line) and not current):
                    current.append((kind, line))
                continue
            m = _DIRECTIVE.match(line) if kind == "md" else None
            opens = m is not None and (state == "gated") == (m["name"] == "solution-end")
            if opens:
                flags.append(True)
                fence = m["fence"]
                state = "directive"
                if m["name"] == "solution":
                    current, after, body = [], "out", True
                    solutions.append(current)
                elif m["name"] == "solution-start":
                    current, after, body = [], "gated", False
                    solutions.append(current)
                else:
                    after, body = "out", False
                continue
            if state == "gated":
                flags.append(True)
                current.append((kind, line))
                continue
            flags.append(False)
        marks.append(flags)
    if state != "out":
        raise ValueError("a solution is not closed (a {solution-start} without {solution-end}, or an open fence)")
    return marks, solutions


def _md_solutions(text: str):
    lines = text.splitlines(keepends=True)
    marks, sols = _scan([("md", lines)])
    return lines, marks[0], sols


def strip_markdown(text: str) -> str:
    """``text`` (MyST markdown, e.g. a jupytext chapter) with every solution removed."""
    lines, flags, _ = _md_solutions(text)
    return "".join(line for line, f in zip(lines, flags) if not f)


def _cells(nb: dict) -> list[tuple[str, list[str]]]:
    out = []
    for cell in nb["cells"]:
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        kind = "md" if cell["cell_type"] == "markdown" else cell["cell_type"]
        tags = cell.get("metadata", {}).get("tags", [])
        if kind == "code" and ({"remove-input", "remove-cell"} & set(tags)):
            kind = "code-hidden"
        out.append((kind, src.splitlines(keepends=True)))
    return out


def notebook_solutions(nb: dict) -> list[list[tuple[str, str]]]:
    """The solutions of a notebook (``nbformat`` JSON as a dict): per solution, ``(kind, line)`` pairs.

    ``kind`` is ``"md"`` for markdown, ``"code"`` for the source of an executed code cell shown on the
    page, ``"code-hidden"`` for a code cell whose input the page does not show.
    """
    return _scan(_cells(nb))[1]


def strip_notebook(nb: dict) -> dict:
    """A copy of ``nb`` without its solutions (code cells inside gated solutions dropped, markdown
    cells cut, cells left empty dropped)."""
    marks, _ = _scan(_cells(nb))
    cells = []
    for cell, flags in zip(nb["cells"], marks):
        if not any(flags):
            cells.append(cell)
            continue
        if all(flags):
            continue
        src = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        kept = "".join(line for line, f in zip(src.splitlines(keepends=True), flags) if not f)
        if kept.strip():
            cells.append({**cell, "source": kept})
    return {**nb, "cells": cells}


def strip_file(path: Path) -> bool:
    """Remove the solutions of a ``.ipynb`` or ``.md`` file in place; True if it had any."""
    text = path.read_text(encoding="utf-8")
    if "{solution" not in text:
        return False
    if path.suffix == ".ipynb":
        nb = json.loads(text)
        path.write_text(json.dumps(strip_notebook(nb), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    else:
        path.write_text(strip_markdown(text), encoding="utf-8")
    return True


def toc_chapters(root: Path) -> list[str]:
    """The chapters of the book at ``root``: the entries ``book/<name>`` of its ``_toc.yml`` that have a
    source ``notebooks/<name>.md``, in the order of the table of contents."""
    import yaml

    toc = yaml.safe_load((Path(root) / "_toc.yml").read_text(encoding="utf-8"))
    out = []
    for part in toc.get("parts", [{"chapters": toc.get("chapters", [])}]):
        for entry in part.get("chapters", []):
            f = Path(entry.get("file", ""))
            if f.parent == Path("book") and (Path(root) / "notebooks" / f"{f.name}.md").is_file():
                out.append(f.name)
    return out


def executed_chapters(root: Path) -> list[str]:
    """The chapters of :func:`toc_chapters` that have an executed notebook ``book/<name>.ipynb``."""
    return [n for n in toc_chapters(root) if (Path(root) / "book" / f"{n}.ipynb").is_file()]


# --------------------------------------------------------------------------------------------------
# Launch buttons from the repository URL
# --------------------------------------------------------------------------------------------------

def launch_options(theme_options: dict, edition: str) -> dict:
    """The theme options with the repository and launch buttons on or off, from ``repository_url`` alone.

    On (teacher edition, a repository URL): the repository button and the ``launch_buttons`` of the
    config. Off (no URL, jupyter-book's default URL, or the student edition): no launch buttons,
    and no repository, issues or edit buttons without a URL.
    """
    opts = dict(theme_options)
    url = (opts.get("repository_url") or "").strip().rstrip("/")
    if url == JUPYTER_BOOK_DEFAULT_URL:
        url = ""
    opts["repository_url"] = url
    if not url:
        for key in ("use_repository_button", "use_issues_button", "use_edit_page_button", "use_source_button"):
            opts[key] = False
    else:
        opts["use_repository_button"] = True
    if not url or edition == "student":
        opts["launch_buttons"] = {}
    return opts


# --------------------------------------------------------------------------------------------------
# Sphinx hooks
# --------------------------------------------------------------------------------------------------

def _config_inited(app, config) -> None:
    from sphinx.errors import ConfigError

    edition = os.environ.get(EDITION_ENV, "").strip() or config.course_edition
    if edition not in EDITIONS:
        raise ConfigError(f"course edition {edition!r} (${EDITION_ENV} or course_edition): expected one of {EDITIONS}")
    if config.hide_solutions:  # sphinx-exercise's switch asks for the student edition
        edition = "student"
    config.course_edition = edition
    # Solutions are always parsed (gated ones need it) and removed by _doctree_resolved.
    config.hide_solutions = False
    config.html_theme_options = launch_options(config.html_theme_options, edition)


def _doctree_resolved(app, doctree, docname) -> None:
    from sphinx_exercise.nodes import solution_end_node, solution_node, solution_start_node

    student = app.config.course_edition == "student"
    for node in list(doctree.findall(solution_node)) + list(doctree.findall(solution_start_node)) + list(
        doctree.findall(solution_end_node)
    ):
        if student:
            node.parent.remove(node)
        elif isinstance(node, solution_node) and "dropdown" not in node["classes"]:
            node["classes"].append("dropdown")  # a toggle, closed until the reader opens it


def _markdown_source(app, pagename: str) -> Path | None:
    src = Path(app.env.doc2path(pagename))
    if src.suffix != ".ipynb":
        return None
    md = Path(app.srcdir) / app.config.course_markdown_sources / (src.stem + ".md")
    return md if md.is_file() else None


def _page_context(app, pagename, templatename, context, doctree) -> None:
    md = _markdown_source(app, pagename)
    if md is None:
        return
    target = Path(app.outdir) / "_sources" / (pagename + ".md")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(md, target)
    for group in context.get("header_buttons", []):
        if group.get("label") == "download-buttons":
            buttons = group["buttons"]
            at = next((i + 1 for i, b in enumerate(buttons) if b.get("label") == "download-source-button"), 0)
            buttons.insert(at, {
                "type": "link",
                "url": f"{context['pathto']('_sources', 1)}/{pagename}.md",
                "text": ".md",
                "tooltip": "Download the chapter as MyST markdown (open it in JupyterLab through jupytext)",
                "icon": "fas fa-file-lines",
                "label": "download-markdown-button",
            })


def _build_finished(app, exception) -> None:
    if exception is not None or app.builder.format != "html" or app.config.course_edition != "student":
        return
    sources = Path(app.outdir) / "_sources"
    if sources.is_dir():
        for path in sources.rglob("*"):
            if path.suffix in (".ipynb", ".md", ".txt") and path.is_file():
                strip_file(path)


def setup(app):
    app.setup_extension("sphinx_exercise")
    app.add_config_value("course_edition", "teacher", "html", types=[str])
    app.add_config_value("course_markdown_sources", "notebooks", "html", types=[str])
    app.connect("config-inited", _config_inited, priority=800)
    app.connect("doctree-resolved", _doctree_resolved)
    app.connect("html-page-context", _page_context, priority=510)
    app.connect("build-finished", _build_finished)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
