r"""The book as a course: two editions, launch buttons from one setting, `.md` downloads.

A local Sphinx extension (``sphinx: local_extensions`` in ``_config.yml``). It does three things; the
plain Python it uses (finding and removing solutions, the launch options) is in the ``course``
package at the repository's root (``course/book.py``).

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
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

# Sphinx puts book/_ext on the path to load this extension; the course package is at the repository's root.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from course.book import EDITION_ENV, EDITIONS, launch_options, strip_file  # noqa: E402


def _config_inited(app, config) -> None:
    from sphinx.errors import ConfigError

    edition = os.environ.get(EDITION_ENV, "").strip() or config.course_edition
    if edition not in EDITIONS:
        raise ConfigError(f"course edition {edition!r} (${EDITION_ENV} or course_edition): "
                          f"expected one of {EDITIONS}")
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
