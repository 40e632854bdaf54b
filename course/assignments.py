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

Students read the notebooks in JupyterLab, which renders MyST (jupyterlab-myst) but resolves no
``{glue}``: the text comes with the values the chapter glued pasted in (:mod:`course.glue`), those of
the executed notebook ``book/<name>.ipynb``, formatted as the book formats them, its glued figures as
cell attachments, and a note under the title that says so (the students' own runs compute their own).

A computational exercise is one whose solution (``{solution-start}`` ... ``{solution-end}``) holds
code cells. Its tests are the code cells of the solution that assert something, and the top-level
``assert`` statements of its other cells; the rest of its code is the answer. The answer cell names
the variables the tests read (the names the tests use that some solution of the chapter assigns),
since a student's code must define them. The chapter's own code cells are locked: nbgrader restores
them before grading, so a submission is graded on the chapter as published. The parameters cell is
the exception a student may edit (the release says ``scale = "tiny"``, for a laptop); grading puts
back the source's, the scale given to ``make assignments`` (``SCALE``, ``cpu`` by default, the scale
at which the committed chapters ran, and so checked, every solution).

An exercise whose tests assert nothing at the grading scale (``if scale != "tiny":`` around every
assert) is not graded in that build: its answer cell stays, for practice, with no test cell, so it is
not in the gradebook and nobody passes it by doing nothing; ``exercises.json`` lists it under
``ungraded`` and ``release/RELEASE.md`` (and ``release/<name>/RELEASE.md``), the release notes for the
students, says so. Each chapter's cell time limit for the grading (``timeouts`` in ``exercises.json``)
is :data:`TIMEOUT_FACTOR` times the slowest cell of its executed notebook at the scale, at least
:data:`TIMEOUT_FLOOR_S` (:func:`cell_timeout`; ``--timeout`` sets one for all).

The course folder is new, empty, or one this tool made (:mod:`course.output`): the course is built in
a temporary folder and replaces only the files an earlier build wrote; the chapters' names are checked
first. ``make grade SUBMISSIONS=dir`` grades a folder of submissions (:mod:`course.grading`). A
chapter without computational exercises, or none graded at the scale, gets no assignment.

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
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import ROOT
from . import glue as course_glue
from .asserts import active_asserts, has_assert, split_asserts
from .book import scan_notebook, select_chapters
from .notebooks import read, source, tags, write
from .output import CourseError, Output

COURSE = ROOT / "build/assignments"
STUDENT_SCALE = "tiny"

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
    graded: bool = True  # False: its tests assert nothing at the grading scale (left out of the gradebook)


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


def _markdown(source: str, attachments: dict | None = None) -> dict:
    cell = {"cell_type": "markdown", "metadata": {}, "source": source}
    if attachments:
        cell["attachments"] = attachments
    return cell


def glue_note(name: str, nb: dict) -> str:
    """The note at the top of a notebook whose text holds the values the chapter glued."""
    scale = course_glue.ran_at(nb)
    at = f", at the `{scale}` scale" if scale else ""
    return (":::{note}\nThe numbers and figures in the text are those of the book's own run of this chapter "
            f"(`book/{name}.ipynb`{at}); the code cells, run at the scale of the parameters cell, compute "
            "their own.\n:::\n")


def _set_scale(source: str, scale: str) -> str:
    return re.sub(r"^scale\s*=\s*['\"]\w+['\"]", f'scale = "{scale}"', source, count=1, flags=re.M)


def asserts_at(ex: Exercise, scale: str) -> bool:
    """Whether some test of ``ex`` asserts something at ``scale`` (the ``if scale != "tiny":`` guards
    of the chapter's solutions evaluated)."""
    return any(active_asserts(t, {"scale": scale}) for t in ex.tests)


def source_notebook(name: str, nb: dict, scale: str) -> tuple[dict, list[Exercise]]:
    """The teacher's nbgrader notebook of chapter ``name`` (executed notebook ``nb``), graded at ``scale``.

    An exercise whose tests assert nothing at ``scale`` is not graded (``graded`` False): it keeps its
    answer cell, for practice, and says so, but gets no test cell, so it is not in the gradebook and
    no notebook can pass it by doing nothing."""
    exs = exercises(nb)
    for ex in exs:
        ex.graded = asserts_at(ex, scale)
    ran = course_glue.ran_at(nb)
    paster = course_glue.Paster(course_glue.values(nb),
                                f"`book/{name}.ipynb`" + (f" (scale `{ran}`)" if ran else ""))
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
            if kept:  # the glued values pasted in: nothing outside the book resolves {glue} roles
                text, attachments = paster.paste(kept)
                cells.append(_markdown(text + "\n", attachments))
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
            if ex.graded:
                cells.append(_markdown(f"**Your answer to *{ex.title}*.** Write it in the cell below; it is "
                                       f"graded by hidden tests, which read {reads} from your code.\n"))
            else:
                cells.append(_markdown(f"**Your answer to *{ex.title}*.** Not graded in this release: at the "
                                       f"`{scale}` scale of the grading its tests check nothing (see "
                                       "RELEASE.md). Write it in the cell below for practice.\n"))
            cells.append(_code("### BEGIN SOLUTION\n" + "\n\n".join(ex.answer) + "\n### END SOLUTION\n",
                               _nbgrader(label, solution=True)))
            if ex.graded:
                cells.append(_code(f"# The tests of {label}: hidden, they run when the notebook is graded.\n"
                                   "### BEGIN HIDDEN TESTS\n" + "\n".join(ex.tests) +
                                   "\n### END HIDDEN TESTS\n",
                                   _nbgrader(f"{label}-tests", grade=True, locked=True, points=1)))
            continue
        src = source(cell)
        if "parameters" in cell_tags:
            src = _set_scale(src, scale)
        n += 1
        cells.append(_code(src, _nbgrader(f"{name}-cell-{n:03d}", locked=True), sorted(cell_tags) or None))
    if paster.pasted:  # under the title: the numbers of the text are those of the book's run
        first = cells[0] if cells and cells[0]["cell_type"] == "markdown" else None
        title, _, rest = first["source"].partition("\n") if first else ("", "", "")
        if first and title.startswith("# "):
            first["source"] = f"{title}\n\n{glue_note(name, nb)}\n{rest.lstrip()}"
        else:
            cells.insert(0, _markdown(glue_note(name, nb)))
    meta = {k: v for k, v in nb.get("metadata", {}).items() if k in ("kernelspec", "language_info")}
    for i, cell in enumerate(cells):
        cell["id"] = f"{name}-{i:03d}"
    return {"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 5}, exs


# --------------------------------------------------------------------------------------------------
# nbgrader
# --------------------------------------------------------------------------------------------------

SCALES = ("tiny", "cpu", "paper")  # in growing cost
TIMEOUT_FLOOR_S = 60
TIMEOUT_FACTOR = 3
TIMEOUT_UNMEASURED_S = 1800
# Where executed chapters lie, with the time of every cell: the book's (`make book`, at its SCALE) and
# `make check`'s (scale tiny).
MEASURED = ("book", "build/check/nb")


def cell_seconds(nb: dict) -> list[float]:
    """How long each code cell of an executed notebook ran (papermill's record, else the kernel's
    timestamps); cells without a record are left out."""
    from datetime import datetime

    out = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        meta = cell.get("metadata", {})
        duration = meta.get("papermill", {}).get("duration")
        if duration is None:
            ex = meta.get("execution", {})
            try:
                start, end = (datetime.fromisoformat(ex[k].replace("Z", "+00:00"))
                              for k in ("iopub.execute_input", "shell.execute_reply"))
            except (KeyError, ValueError):
                continue
            duration = (end - start).total_seconds()
        out.append(float(duration))
    return out


def cell_timeout(name: str, scale: str, root: Path = ROOT) -> tuple[int, str]:
    """The time limit of every cell when chapter ``name`` is graded at ``scale``, and how it was found:
    :data:`TIMEOUT_FACTOR` times the slowest cell of the chapter as executed at ``scale`` (a larger
    scale's run, an upper bound, where none at ``scale`` is found under :data:`MEASURED`), at least
    :data:`TIMEOUT_FLOOR_S`; :data:`TIMEOUT_UNMEASURED_S` when no run was found."""
    import math

    found: dict[str, tuple[float, Path]] = {}
    for folder in MEASURED:
        path = Path(root) / folder / f"{name}.ipynb"
        if not path.is_file():
            continue
        try:
            nb = read(path)
        except ValueError:
            continue
        ran_at = nb.get("metadata", {}).get("papermill", {}).get("parameters", {}).get("scale")
        seconds = cell_seconds(nb)
        if ran_at in SCALES and seconds and ran_at not in found:
            found[ran_at] = (max(seconds), path)
    for ran_at in SCALES[SCALES.index(scale):]:
        if ran_at in found:
            slowest, path = found[ran_at]
            limit = max(TIMEOUT_FLOOR_S, math.ceil(TIMEOUT_FACTOR * slowest))
            return limit, (f"{TIMEOUT_FACTOR} x the slowest cell of {path.relative_to(root)} "
                           f"({slowest:.1f} s at scale {ran_at}), at least {TIMEOUT_FLOOR_S} s")
    return TIMEOUT_UNMEASURED_S, f"no executed book/{name}.ipynb at scale {scale} or larger to measure"


def nbgrader_config(timeout: int) -> str:
    """The course's ``nbgrader_config.py``, with a cell time limit of ``timeout`` seconds."""
    return f"""\
# nbgrader's settings for this course (written by `python -m course assignments`): run nbgrader's own
# commands from a copy of this folder, e.g. `nbgrader autograde <chapter>` (they write the gradebook, which
# `python -m course assignments` then refuses to overwrite).
import os

c = get_config()  # noqa: F821
c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))
c.ClearSolutions.code_stub = {{"python": "# YOUR CODE HERE\\n"}}
c.Execute.timeout = {int(timeout)}  # seconds per cell (`python -m course grade` sets each chapter's own)
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
        raise SystemExit(f"nbgrader {what} failed (nothing was written to the course folder):\n"
                         f"{result.get('log', '')}\n{result.get('error', '')}")


def release_notes(scale: str, exs: dict[str, list[Exercise]], timeouts: dict[str, int],
                  chapters: list[str] | None = None) -> str:
    """``RELEASE.md``, for the students: what is graded, what is not and why, and the time limits."""
    chapters = list(exs) if chapters is None else chapters
    lines = ["# Release notes", "",
             f"Your notebooks are graded at the `{scale}` scale: the grading puts back the parameters cell "
             "of the chapter (your copy says `scale = \"tiny\"`, for a laptop) and the chapter's own code, "
             "runs the notebook from start to end, and gives one point per graded exercise whose hidden "
             "tests all pass.", ""]
    for name in chapters:
        graded = [ex for ex in exs[name] if ex.graded]
        ungraded = [ex for ex in exs[name] if not ex.graded]
        if not exs[name]:
            continue
        lines += [f"## {name}", ""]
        if graded:
            lines += [f"Graded ({len(graded)}): " + ", ".join(f"*{ex.title}* (`{ex.label}`)" for ex in graded)
                      + ".", "", f"Each cell of the notebook may run for at most {timeouts[name]} s when "
                      "graded; a cell that runs longer (an endless loop, say) is stopped, and what it "
                      "should have defined is missing for the cells after it.", ""]
        else:
            lines += ["No assignment in this release: none of its exercises is graded (below).", ""]
        if ungraded:
            lines += [f"Not graded in this release: at the `{scale}` scale the tests of these exercises "
                      "check nothing (their claims need more networks than this scale trains), so they "
                      "count for nothing, neither passed nor failed; do them for practice:", ""]
            lines += [f"* *{ex.title}* (`{ex.label}`)" for ex in ungraded] + [""]
    return "\n".join(lines)


def build(course: Path = COURSE, scale: str = "cpu", names: list[str] | None = None,
          root: Path = ROOT, timeout: int | None = None) -> dict:
    """Write the source notebooks and make nbgrader's student versions. Returns, per chapter, the labels
    of its graded exercises.

    Everything is checked (the chapters' names, ``scale``, ``course`` being new, empty or made by this
    tool) before anything is written; the course is made in a temporary folder and moved into ``course``
    once complete, replacing only what an earlier build wrote (:class:`course.output.Output`).
    ``timeout``: the cell time limit of the grading (default: :func:`cell_timeout`, per chapter)."""
    if scale not in SCALES:
        raise CourseError(f"--scale {scale!r}: expected one of {', '.join(SCALES)}")
    if timeout is not None and timeout <= 0:
        raise CourseError(f"--timeout {timeout}: give the seconds a cell may run, a positive number")
    names = select_chapters(names, root)
    output = Output(course, "assignments", "--course")
    output.check_replace()
    notebooks = {name: read(root / "book" / f"{name}.ipynb") for name in names}
    with output.stage() as tmp:
        stage = Path(tmp)
        (stage / "source").mkdir()
        made, ungraded, all_exs, timeouts = {}, {}, {}, {}
        for name in names:
            src, exs = source_notebook(name, notebooks[name], scale)
            all_exs[name] = exs
            made[name] = [ex.label for ex in exs if ex.graded]
            if len(made[name]) < len(exs):
                ungraded[name] = {ex.label: ex.title for ex in exs if not ex.graded}
            if made[name]:
                (stage / "source" / name).mkdir()
                write(stage / "source" / name / f"{name}.ipynb", src)
                timeouts[name] = timeout or cell_timeout(name, scale, root)[0]
        (stage / "nbgrader_config.py").write_text(nbgrader_config(max(timeouts.values(), default=timeout or
                                                                      TIMEOUT_FLOOR_S)))
        graded = [n for n in names if made[n]]
        api = _api(stage)
        for name in graded:
            _check(api.generate_assignment(name, force=True, create=True), f"generate_assignment {name}")
            rel = stage / "release" / name / f"{name}.ipynb"
            nb = read(rel)
            for cell in nb["cells"]:  # students run the chapter at a laptop's scale; grading, the source's
                if "parameters" in tags(cell):
                    cell["source"] = _set_scale(source(cell), STUDENT_SCALE)
                    cell["metadata"]["editable"] = True
            write(rel, nb)
            (stage / "release" / name / "RELEASE.md").write_text(
                release_notes(scale, all_exs, timeouts, [name]), encoding="utf-8")
        (stage / "release").mkdir(exist_ok=True)
        notes = release_notes(scale, all_exs, timeouts)
        (stage / "release" / "RELEASE.md").write_text(notes, encoding="utf-8")
        meta = {"scale": scale, "chapters": made, "ungraded": ungraded, "timeouts": timeouts}
        (stage / "exercises.json").write_text(json.dumps(meta, indent=1) + "\n")
        output.commit(stage, scale=scale)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course assignments",
                                     description="nbgrader assignments from the computational exercises.")
    parser.add_argument("--course", type=Path, default=COURSE,
                        help="the nbgrader course folder: new, empty, or made by this tool")
    parser.add_argument("--scale", default=os.environ.get("SCALE", "cpu"), help="the scale of the grading")
    parser.add_argument("--timeout", type=int, default=None,
                        help=f"seconds a cell may run when graded (default, per chapter: {TIMEOUT_FACTOR} x "
                             "the slowest cell of its executed notebook at the scale, at least "
                             f"{TIMEOUT_FLOOR_S} s)")
    parser.add_argument("chapters", nargs="*", help="chapters (default: every chapter of _toc.yml)")
    args = parser.parse_args(argv)
    made = build(args.course, args.scale, args.chapters or None, timeout=args.timeout)
    meta = json.loads((args.course / "exercises.json").read_text())
    for name, labels in made.items():
        where = args.course / "release" / name / f"{name}.ipynb"
        skipped = meta["ungraded"].get(name, {})
        print(f"{name}: {len(labels)} graded exercise(s)" + (f", {where}" if labels else "")
              + (f", cells stopped after {meta['timeouts'][name]} s" if labels else "")
              + (f"; not graded at scale {args.scale} (their tests check nothing there): "
                 f"{', '.join(skipped)}" if skipped else ""))
    print(f"Release notes for the students: {args.course / 'release' / 'RELEASE.md'}")
    return 0
