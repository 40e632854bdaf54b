r"""Auto-graded assignments from the chapters' computational exercises, with nbgrader.

``make assignments`` runs ``python -m course assignments [--scale S] [chapter ...]``: for
every chapter of ``_toc.yml`` with an executed notebook ``book/<name>.ipynb`` it writes an nbgrader
course under ``build/assignments/`` (``nbgrader_config.py`` included, so nbgrader's own commands
work there):

* ``source/<name>/<name>.ipynb``, the teacher's version: the chapter (its prose and code, every
  solution removed, outputs cleared) where each computational exercise is followed by a solution
  cell (the code of the chapter's own solution) and a test cell (the ``assert`` statements of
  that solution, as nbgrader's hidden tests, one point);
* ``release/<name>/<name>.ipynb``, the student's version made by ``nbgrader generate_assignment``:
  the same notebook with an empty answer cell and the test cell emptied of its tests;
* ``gradebook.db``, nbgrader's record of the source cells, from which ``autograde`` puts the hidden
  tests back.

A computational exercise is one whose solution (``{solution-start}`` ... ``{solution-end}``) holds
code cells. Its tests are the code cells of the solution that assert something, and the top-level
``assert`` statements of its other cells; the rest of its code is the answer. The answer cell names
the variables the tests read (the names the tests use that some solution of the chapter assigns),
since a student's code must define them. The chapter's own code cells are locked: nbgrader restores
them before grading, so a submission is graded on the chapter as published. The parameters cell is
the exception a student may edit (the release says ``scale = "tiny"``, for a laptop); grading puts
back the source's, the scale given to ``make assignments`` (``SCALE``, ``cpu`` by default, the scale
at which the committed chapters ran, and so checked, every solution).

``make grade SUBMISSIONS=dir`` grades a folder of submissions (:mod:`course.grading`). A chapter
without computational exercises gets no assignment.

nbgrader, not otter-grader: nbgrader grades on the teacher's machine with a Jupyter kernel and
nothing else (otter's ``otter grade`` runs every submission in a docker container; its local
``otter run`` grades one file at a time), keeps hidden tests in the teacher's source notebook and
database by design (``### BEGIN HIDDEN TESTS``), records one grade per test cell in an SQLite
gradebook, which gives the per-exercise table directly, and brings no browser or docker client
into the environment.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import ROOT
from .asserts import active_asserts, has_assert, split_asserts
from .book import executed_chapters, scan_notebook
from .notebooks import read, source, tags, write

COURSE = ROOT / "build/assignments"
STUDENT_SCALE = "tiny"
TIMEOUT_S = 1800  # per cell: the gentle example's exercises train thousands of networks

_EXERCISE = re.compile(r"^\s*(?:`{3,}|:{3,})\s*\{exercise\}\s*(?P<title>.*)\n(?P<opts>(?:\s*:[\w-]+:.*\n)*)",
                       re.M)
_OPEN = re.compile(r"^\s*(`{3,}|:{3,})\s*\{(solution|solution-start)\}\s*(?P<label>\S*)")


@dataclass
class Exercise:
    """A computational exercise: its label, title, the solution's answer code and tests."""

    label: str
    title: str = ""
    answer: list[str] = field(default_factory=list)
    tests: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)


def solution_index(nb: dict) -> list[list[int | None]]:
    """For every cell, for every line: the index of the solution the line belongs to, or None."""
    marks, solutions = scan_notebook(nb)
    out, current = [], -1
    for cell, flags in zip(nb["cells"], marks, strict=False):
        lines = source(cell).splitlines()
        row = []
        for line, flag in zip(lines, flags, strict=False):
            if flag and cell["cell_type"] == "markdown" and _OPEN.match(line):
                current += 1
            row.append(current if flag else None)
        out.append(row)
    if current + 1 != len(solutions):
        raise ValueError(f"found {current + 1} solution openings for {len(solutions)} solutions")
    return out


def _names(code: str) -> tuple[set[str], set[str]]:
    """``(loaded, stored)`` variable names of ``code``."""
    loaded, stored = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (stored if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stored |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return loaded, stored


def exercises(nb: dict) -> list[Exercise]:
    """The computational exercises of an executed chapter, in order."""
    index = solution_index(nb)
    found: dict[int, Exercise] = {}
    for cell, row in zip(nb["cells"], index, strict=False):
        sol = next((i for i in row if i is not None), None)
        if sol is None:
            continue
        if cell["cell_type"] == "markdown":
            for line, line_sol in zip(source(cell).splitlines(), row, strict=False):
                m = _OPEN.match(line)
                if m and line_sol is not None:
                    found.setdefault(line_sol, Exercise(m["label"]))
            continue
        ex = found.setdefault(sol, Exercise(f"solution-{sol}"))
        code = source(cell).strip()
        if has_assert(code) and tags(cell) & {"hide-input", "remove-input", "remove-cell"}:
            ex.tests.append(code)
        else:
            answer, tests = split_asserts(code)
            ex.answer += [answer] if answer else []
            ex.tests += [tests] if tests else []
    out = [ex for ex in found.values() if ex.answer or ex.tests]
    stored_any = set().union(*(_names("\n".join(ex.answer))[1] for ex in out)) if out else set()
    for ex in out:
        loaded, stored = _names("\n\n".join(ex.tests))
        ex.reads = sorted((loaded - stored) & stored_any)
    titles = _exercise_titles(nb)
    for ex in out:
        ex.title = titles.get(ex.label, ex.label)
    return out


def _exercise_titles(nb: dict) -> dict[str, str]:
    out = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = source(cell)
        for m in _EXERCISE.finditer(text):
            label = re.search(r":label:\s*(\S+)", m["opts"])
            if label:
                out[label.group(1)] = m["title"].strip()
    return out


# --------------------------------------------------------------------------------------------------
# The teacher's notebook in nbgrader's form
# --------------------------------------------------------------------------------------------------

def _nbgrader(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3, "solution": solution,
            "task": False}
    if points is not None:
        meta["points"] = points
    return meta


def _code(source: str, meta: dict, tags: list[str] | None = None) -> dict:
    md = {"nbgrader": meta}
    if tags:
        md["tags"] = tags
    return {"cell_type": "code", "execution_count": None, "metadata": md, "outputs": [], "source": source}


def _markdown(source: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": source}


def _set_scale(source: str, scale: str) -> str:
    return re.sub(r"^scale\s*=\s*['\"]\w+['\"]", f'scale = "{scale}"', source, count=1, flags=re.M)


def source_notebook(name: str, nb: dict, scale: str) -> tuple[dict, list[Exercise]]:
    """The teacher's nbgrader notebook of chapter ``name`` (executed notebook ``nb``), graded at ``scale``."""
    exs = exercises(nb)
    by_label = {ex.label: ex for ex in exs}
    index = solution_index(nb)
    labels: dict[int, str] = {}
    for cell, row in zip(nb["cells"], index, strict=False):
        if cell["cell_type"] == "markdown":
            for line, sol in zip(source(cell).splitlines(), row, strict=False):
                m = _OPEN.match(line)
                if m and sol is not None:
                    labels[sol] = m["label"]
    cells, placed, n = [], set(), 0
    for cell, row in zip(nb["cells"], index, strict=False):
        cell_tags = tags(cell)
        if "injected-parameters" in cell_tags:
            continue
        sols = [s for s in row if s is not None]
        if cell["cell_type"] == "markdown":
            lines = zip(source(cell).splitlines(), row, strict=False)
            kept = "\n".join(line for line, s in lines if s is None).strip()
            if kept:
                cells.append(_markdown(kept + "\n"))
            continue
        if cell["cell_type"] != "code":
            continue
        if sols:  # a solution's code cell: the exercise's answer and test cells, once
            label = labels.get(sols[0], f"solution-{sols[0]}")
            ex = by_label.get(label)
            if ex is None or label in placed:
                continue
            placed.add(label)
            reads = ", ".join(f"`{r}`" for r in ex.reads) or "the names the exercise asks for"
            cells.append(_markdown(f"**Your answer to *{ex.title}*.** Write it in the cell below; it is "
                                   f"graded by hidden tests, which read {reads} from your code.\n"))
            cells.append(_code("### BEGIN SOLUTION\n" + "\n\n".join(ex.answer) + "\n### END SOLUTION\n",
                               _nbgrader(label, solution=True)))
            cells.append(_code(f"# The tests of {label}: hidden, they run when the notebook is graded.\n"
                               "### BEGIN HIDDEN TESTS\n" + "\n".join(ex.tests) + "\n### END HIDDEN TESTS\n",
                               _nbgrader(f"{label}-tests", grade=True, locked=True, points=1)))
            continue
        src = source(cell)
        if "parameters" in cell_tags:
            src = _set_scale(src, scale)
        n += 1
        cells.append(_code(src, _nbgrader(f"{name}-cell-{n:03d}", locked=True), sorted(cell_tags) or None))
    meta = {k: v for k, v in nb.get("metadata", {}).items() if k in ("kernelspec", "language_info")}
    for i, cell in enumerate(cells):
        cell["id"] = f"{name}-{i:03d}"
    return {"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}, exs


# --------------------------------------------------------------------------------------------------
# nbgrader
# --------------------------------------------------------------------------------------------------

CONFIG = f"""\
# nbgrader's settings for this course (written by course/assignments.py): run nbgrader's own
# commands from this folder, e.g. `nbgrader autograde <chapter>`, `nbgrader generate_feedback <chapter>`.
import os

c = get_config()  # noqa: F821
c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.ClearSolutions.code_stub = {{"python": "# YOUR CODE HERE\\n"}}
c.Execute.timeout = {TIMEOUT_S}  # seconds per cell
c.Execute.kernel_name = "python3"
"""


def nbgrader_commands() -> None:
    """Put this environment's commands on ``PATH``: nbgrader runs the ``alembic`` command of its
    environment to check the gradebook's schema."""
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def _api(course: Path):
    """nbgrader's Python API on the course at ``course``, with its ``nbgrader_config.py``."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config.loader import PyFileConfigLoader

    nbgrader_commands()
    cfg = PyFileConfigLoader("nbgrader_config.py", str(course)).load_config()
    cfg.NbGraderAPI.log_level = "WARN"
    return NbGraderAPI(coursedir=CourseDirectory(config=cfg), config=cfg)


def _check(result: dict, what: str) -> None:
    if not result.get("success"):
        raise SystemExit(f"nbgrader {what} failed:\n{result.get('log', '')}\n{result.get('error', '')}")


def build(course: Path = COURSE, scale: str = "cpu", names: list[str] | None = None,
          root: Path = ROOT) -> dict:
    """Write the source notebooks and make nbgrader's student versions. Returns, per chapter, its
    exercise labels."""
    names = executed_chapters(root) if names is None else names
    if course.exists():
        shutil.rmtree(course)
    (course / "source").mkdir(parents=True)
    (course / "nbgrader_config.py").write_text(CONFIG)
    made, vacuous = {}, []
    for name in names:
        nb = read(root / "book" / f"{name}.ipynb")
        src, exs = source_notebook(name, nb, scale)
        for ex in exs:
            if not ex.tests or not any(active_asserts(t, {"scale": scale}) for t in ex.tests):
                vacuous.append(f"{name}:{ex.label}")
        (course / "source" / name).mkdir()
        write(course / "source" / name / f"{name}.ipynb", src)
        made[name] = [ex.label for ex in exs]
    without = [n for n, labels in made.items() if not labels]
    graded = [n for n in names if n not in without]
    api = _api(course)
    for name in graded:
        _check(api.generate_assignment(name, force=True, create=True), f"generate_assignment {name}")
        rel = course / "release" / name / f"{name}.ipynb"
        nb = read(rel)
        for cell in nb["cells"]:  # students run the chapter at a laptop's scale; grading uses the source's
            if "parameters" in tags(cell):
                cell["source"] = _set_scale(source(cell), STUDENT_SCALE)
                cell["metadata"]["editable"] = True
        write(rel, nb)
    for name in without:
        shutil.rmtree(course / "source" / name)
    if vacuous:
        print(f"warning: at scale {scale!r} these exercises' tests assert nothing (grade at a larger SCALE, "
              f"or add an assert to the solution in notebooks/<name>.md): {', '.join(vacuous)}",
              file=sys.stderr)
    (course / "exercises.json").write_text(json.dumps({"scale": scale, "chapters": made}, indent=1) + "\n")
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course assignments",
                                     description="nbgrader assignments from the computational exercises.")
    parser.add_argument("--course", type=Path, default=COURSE, help="the nbgrader course folder")
    parser.add_argument("--scale", default=os.environ.get("SCALE", "cpu"), help="the scale of the grading")
    parser.add_argument("chapters", nargs="*", help="chapters (default: every chapter of _toc.yml)")
    args = parser.parse_args(argv)
    if args.scale not in ("tiny", "cpu", "paper"):
        raise SystemExit(f"--scale {args.scale!r}: expected tiny, cpu or paper")
    made = build(args.course.resolve(), args.scale, args.chapters or None)
    for name, labels in made.items():
        where = args.course / "release" / name / f"{name}.ipynb"
        print(f"{name}: {len(labels)} graded exercise(s)" + (f", {where}" if labels else ""))
    return 0
