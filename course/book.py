r"""The book as a course, in plain Python: its chapters, their solutions, its two editions.

The Sphinx extension ``book/_ext/course_book.py`` (``sphinx: local_extensions`` in ``_config.yml``)
makes the teacher and student editions and the launch buttons with what this module finds; the
assignments and the slides use the same functions, so that no solution reaches a student's notebook
or a deck.

**Solutions.** A solution is a ``{solution}`` of sphinx-exercise, or a *gated* one (``{solution-start}``
... ``{solution-end}`` around executed code cells). :func:`notebook_solutions` finds them in a
notebook, :func:`strip_markdown`, :func:`strip_notebook` and :func:`strip_file` remove them (also used
by ``tests/test_book_pages.py``).

**Editions.** The teacher edition (the default) shows every solution as a toggle; the student edition
removes every solution, chosen by the environment variable ``BOOK_EDITION=student`` (:data:`EDITION_ENV`).

**Launch buttons from one setting.** :func:`launch_options` turns the Binder and Colab launch buttons
and the repository button on or off from ``repository: url:`` in ``_config.yml``.
"""

from __future__ import annotations

import re
from pathlib import Path

from .notebooks import read, source, tags, write

EDITIONS = ("teacher", "student")
EDITION_ENV = "BOOK_EDITION"
# jupyter-book's default `repository.url`: a book that never set one has no repository of its own.
JUPYTER_BOOK_DEFAULT_URL = "https://github.com/executablebooks/jupyter-book"

# --------------------------------------------------------------------------------------------------
# Finding solutions in MyST text and notebooks (no Sphinx needed)
# --------------------------------------------------------------------------------------------------

_DIRECTIVE = re.compile(r"^\s*(?P<fence>`{3,}|:{3,})\s*\{(?P<name>solution|solution-start|solution-end)\}")
_OPTION = re.compile(r"^\s*:[\w-]+:")


def closes(line: str, fence: str) -> bool:
    """Whether ``line`` closes a MyST block opened by ``fence`` (backticks or colons, at least as many)."""
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
                if closes(line, fence):
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
        raise ValueError("a solution is not closed (a {solution-start} without {solution-end}, "
                         "or an open fence)")
    return marks, solutions


def _md_solutions(text: str):
    lines = text.splitlines(keepends=True)
    marks, sols = _scan([("md", lines)])
    return lines, marks[0], sols


def strip_markdown(text: str) -> str:
    """``text`` (MyST markdown, e.g. a jupytext chapter) with every solution removed."""
    lines, flags, _ = _md_solutions(text)
    return "".join(line for line, f in zip(lines, flags, strict=False) if not f)


def _cells(nb: dict) -> list[tuple[str, list[str]]]:
    out = []
    for cell in nb["cells"]:
        kind = "md" if cell["cell_type"] == "markdown" else cell["cell_type"]
        if kind == "code" and ({"remove-input", "remove-cell"} & tags(cell)):
            kind = "code-hidden"
        out.append((kind, source(cell).splitlines(keepends=True)))
    return out


def scan_notebook(nb: dict) -> tuple[list[list[bool]], list[list[tuple[str, str]]]]:
    """The solutions of a notebook, line by line: for every cell one flag per line of its source (True:
    the line is part of a solution), and for every solution the ``(kind, line)`` pairs of its body
    (``kind`` as in :func:`notebook_solutions`)."""
    return _scan(_cells(nb))


def notebook_solutions(nb: dict) -> list[list[tuple[str, str]]]:
    """The solutions of a notebook (``nbformat`` JSON as a dict): per solution, ``(kind, line)`` pairs.

    ``kind`` is ``"md"`` for markdown, ``"code"`` for the source of an executed code cell shown on the
    page, ``"code-hidden"`` for a code cell whose input the page does not show.
    """
    return scan_notebook(nb)[1]


def strip_notebook(nb: dict) -> dict:
    """A copy of ``nb`` without its solutions (code cells inside gated solutions dropped, markdown
    cells cut, cells left empty dropped)."""
    marks, _ = scan_notebook(nb)
    cells = []
    for cell, flags in zip(nb["cells"], marks, strict=False):
        if not any(flags):
            cells.append(cell)
            continue
        if all(flags):
            continue
        lines = source(cell).splitlines(keepends=True)
        kept = "".join(line for line, f in zip(lines, flags, strict=False) if not f)
        if kept.strip():
            cells.append({**cell, "source": kept})
    return {**nb, "cells": cells}


def strip_file(path: Path) -> bool:
    """Remove the solutions of a ``.ipynb`` or ``.md`` file in place; True if it had any."""
    text = path.read_text(encoding="utf-8")
    if "{solution" not in text:
        return False
    if path.suffix == ".ipynb":
        write(path, strip_notebook(read(path)))
    else:
        path.write_text(strip_markdown(text), encoding="utf-8")
    return True


# --------------------------------------------------------------------------------------------------
# The chapters
# --------------------------------------------------------------------------------------------------

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


def select_chapters(names: list[str] | None, root: Path) -> list[str]:
    """The chapters a course tool was asked for (every executed chapter when ``names`` is empty), checked
    before anything is written: an unknown name, or a chapter without its executed notebook, is a
    :class:`course.output.CourseError` that names it and the fix."""
    import difflib

    from .output import CourseError

    executed = executed_chapters(root)
    if not names:
        if not executed:
            raise CourseError("no chapter to work on: _toc.yml lists no book/<name> with an executed "
                              "book/<name>.ipynb (run `make chapters`)")
        return executed
    known = toc_chapters(root)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise CourseError(f"unknown chapter {name!r}: {hint}the chapters are {', '.join(known)}")
        if name not in executed:
            raise CourseError(f"chapter {name!r} has no executed notebook book/{name}.ipynb: run "
                              f"`make chapters CHAPTERS={name}` first")
    return list(dict.fromkeys(names))


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
        for key in ("use_repository_button", "use_issues_button", "use_edit_page_button",
                    "use_source_button"):
            opts[key] = False
    else:
        opts["use_repository_button"] = True
    if not url or edition == "student":
        opts["launch_buttons"] = {}
    return opts
