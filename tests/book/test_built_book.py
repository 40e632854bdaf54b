"""The book as a gate (``make book-check``, part of ``make test``): both editions of the whole book, API
reference included, built strictly from the committed chapters (``make html-both``), then checked.

* The strict flags fail a build on a broken cross-reference, an unknown glossary term or an unknown role
  (a fixture book with one of each, built with the Makefile's own ``JB_FLAGS``), and every
  ``jupyter-book build`` of the Makefile uses them.
* The built editions: every page of ``_toc.yml`` was written, the teacher's pages hold the text of every
  solution (as toggles) and the student's none of it, pages and downloads alike.

The checks of built HTML read ``build/_build/html`` and ``build/student/_build/html``; run without them,
they skip, unless ``SYMLIB_REQUIRE_BUILT_BOOK=1`` (set by ``make book-check``), where a missing build fails.
``SYMLIB_BOOK_EDITIONS=teacher`` (``make book-check-teacher``, in ``make check``) checks the teacher's only.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_book_pages import _chapters, _check_editions, _n_exercises, course_book

ROOT = Path(__file__).resolve().parents[2]
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")
TEACHER = ROOT / "build/_build/html"
STUDENT = ROOT / "build/student/_build/html"


def _make(*args: str) -> str:
    run = subprocess.run(["make", "-s", "--no-print-directory", *args], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return run.stdout


def _jb_flags() -> list[str]:
    return _make("--eval", "show-it: ; @echo $(JB_FLAGS)", "show-it").split()


def test_every_build_of_the_makefile_is_strict():
    flags = _jb_flags()
    assert {"-W", "-n", "--keep-going"} <= set(flags)
    # `make -n` prints the recipes without running them (the static step's copy included)
    builds = [line for line in _make("-n", "html", "html-both").splitlines() if "jupyter-book build" in line]
    assert len(builds) == 3, builds  # html, and html-both's two editions
    for line in builds:
        assert set(flags) <= set(shlex.split(line)), line


def test_the_strict_flags_fail_on_a_broken_reference(tmp_path):
    """A fixture book with the book's Sphinx configuration and three defects, each on its own page: the
    build must fail and name every one (the build step's exit status is what ``make test`` sees)."""
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    book = tmp_path / "book"
    book.mkdir()
    sphinx = dict(cfg["sphinx"])
    sphinx["local_extensions"] = {k: str(ROOT / v) for k, v in sphinx["local_extensions"].items()}
    static = ("html_static_path", "mathjax_path")  # the fixture serves no MathJax of its own
    sphinx["config"] = {k: v for k, v in sphinx["config"].items() if k not in static}
    fixture = {"title": "fixture", "only_build_toc_files": True, "execute": {"execute_notebooks": "off"},
               "parse": cfg["parse"], "sphinx": sphinx, "repository": {"url": ""},
               "launch_buttons": cfg["launch_buttons"]}
    (book / "_config.yml").write_text(yaml.safe_dump(fixture))
    (book / "_toc.yml").write_text(yaml.safe_dump({"format": "jb-book", "root": "intro", "chapters": [
        {"file": "reference"}, {"file": "term"}, {"file": "role"}]}))
    (book / "intro.md").write_text("# Intro\n\n```{glossary}\nweight space\n  Where networks live.\n```\n")
    (book / "reference.md").write_text("# Reference\n\nSee {func}`symlib.symmetry.ops.no_such_function`.\n")
    (book / "term.md").write_text("# Term\n\nA {term}`no such glossary entry` is not defined.\n")
    (book / "role.md").write_text("# Role\n\nAn {no-such-role}`text` is not a role.\n")
    env = {**os.environ, "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    run = subprocess.run([str(JUPYTER_BOOK), "build", str(book), *_jb_flags(), "--path-output",
                          str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode != 0, "the strict build passed a book with three broken references:\n" + log[-3000:]
    assert "no_such_function" in log, log[-3000:]
    assert "no such glossary entry" in log, log[-3000:]
    assert "no-such-role" in log, log[-3000:]


def _editions() -> set[str]:
    """The editions built (``SYMLIB_BOOK_EDITIONS``: ``make check`` builds the teacher's only)."""
    return set(os.environ.get("SYMLIB_BOOK_EDITIONS", "teacher student").split())


def _built(*editions: str) -> None:
    editions = editions or ("teacher", "student")
    skipped = sorted(set(editions) - _editions())
    if skipped:
        pytest.skip(f"the {' and '.join(skipped)} edition is not built here (SYMLIB_BOOK_EDITIONS)")
    where = {"teacher": TEACHER, "student": STUDENT}
    missing = [where[e] / "index.html" for e in editions if not (where[e] / "index.html").is_file()]
    if missing:
        why = f"no built book at {missing[0].parent}: run `make html-both`"
        if os.environ.get("SYMLIB_REQUIRE_BUILT_BOOK") == "1":
            pytest.fail(why)
        pytest.skip(why)


def _toc_pages() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"], *(c["file"] for part in toc["parts"] for c in part["chapters"])]


@pytest.mark.parametrize("edition", ["teacher", "student"])
def test_every_page_of_the_toc_was_built(edition):
    _built(edition)
    html = TEACHER if edition == "teacher" else STUDENT
    missing = [p for p in _toc_pages() if not (html / f"{p}.html").is_file()]
    assert not missing, f"the {edition} edition lacks {missing}"
    newer = [p for p in ("book/api/index", "book/api/cli")
             if (html / f"{p}.html").stat().st_mtime < (ROOT / f"{p}.md").stat().st_mtime]
    assert not newer, f"the {edition} edition is older than {newer}: run `make html-both`"


def test_the_editions_differ_by_the_solutions():
    """Every committed chapter that has solutions: the teacher's page shows each as a toggle, the student's
    page and downloads none of them."""
    _built()
    pages, stale = {}, {}
    for name in _chapters():
        path = ROOT / "book" / f"{name}.ipynb"
        nb = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"cells": []}
        n_source = len(course_book._md_solutions((ROOT / "notebooks" / f"{name}.md").read_text())[2])
        if len(course_book.notebook_solutions(nb)) != n_source:
            stale[name] = n_source
        elif n_source:
            pages[f"book/{name}"] = nb
    assert not stale, f"executed chapters older than their sources (run make chapters): {stale}"
    assert pages, "no chapter has solutions"
    few = {p: n for p, nb in pages.items() if (n := _n_exercises(nb)) < 4}
    assert not few, f"chapters with fewer than 4 exercises: {few}"
    _check_editions(TEACHER, STUDENT, pages)


@pytest.mark.parametrize("edition", ["teacher", "student"])
def test_result_tables_are_styled_with_padding_and_scroll(edition):
    """The styled tables had no cell padding and wide ones were cut at the right: every chapter page links
    the book's table style, which pads cells, keeps row labels on one line and scrolls wide tables."""
    _built(edition)
    html = TEACHER if edition == "teacher" else STUDENT
    css = (html / "_static" / "tables.css").read_text()
    assert "padding: 0.25em 0.75em" in css and "overflow-x: auto" in css and "white-space: nowrap" in css
    for page in ("true_posterior", "table1"):
        text = (html / f"book/{page}.html").read_text()
        assert "_static/tables.css" in text, page
