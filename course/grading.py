r"""``make grade SUBMISSIONS=dir``: grade a folder of submissions of the assignments, with nbgrader.

``python -m course grade <dir> [--out build/grades] [--timeout S] [--fresh]``. The folder holds one
folder per student with that student's notebooks, ``dir/<student>/<chapter>.ipynb`` (nbgrader's
layout ``dir/<student>/<chapter>/<chapter>.ipynb`` works too). Every submission is graded by
nbgrader's ``autograde`` on this machine: it restores the chapter's locked cells, the parameters (the
grading scale) and the hidden tests from the teacher's source notebook, and executes the notebook
with a local Jupyter kernel, no docker and no network, each cell for at most the chapter's time limit
(``make assignments`` measured it; ``--timeout`` overrides it). Each student is graded in a copy of
the course of its own, kept under ``<out>/course/<student>/`` (``JOBS`` of them at a time, default:
the cores), and ``<out>`` gets

* ``grades.csv``: one row per student folder found, one column per exercise (``<chapter>:<label>``,
  1 point when every test of the exercise passes, else 0), the total, and ``notes``: why a student
  got nothing (an empty folder, only a ``.zip``), a notebook graded under another name, a notebook
  left ungraded (two different ones for a chapter, an unreadable one, one of no assignment);
* ``feedback/<student>.md``: the same notes, then per chapter and exercise: passed, or why not: the
  answer cell's exception (type, message and the line of the cell) or its timeout, else the failed
  test's message; no path of the teacher's machine.

**Which notebook is which chapter.** ``<chapter>.ipynb`` anywhere in the student's folder (hidden
folders and ``.ipynb_checkpoints`` left out). Another name is matched to a chapter when it can only
mean that one (``architectures (1).ipynb``, ``Copy of toy.ipynb``, ``architecture.ipynb``) and the
notes say so; two different notebooks for one chapter (``x.ipynb`` and ``x/x.ipynb``) are not graded,
and the notes say which to keep. Each problem stays with its student: the rest of the class is graded.

**Incremental.** ``<out>`` is new, empty or made by this tool (:mod:`course.output`). The students
graded in a run replace their own row, feedback and graded copy; every other student's stay as they
were, so a late student is graded with the same ``--out`` as the class. ``--fresh`` starts the table
over (it still writes only into a folder the tool made, and replaces only the files it wrote).
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import ROOT
from .assignments import COURSE, TIMEOUT_UNMEASURED_S, nbgrader_commands
from .notebooks import read, source
from .output import CourseError, Output

ARCHIVES = (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".7z", ".rar")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_LINE = re.compile(r"Cell In\s*\[\d*\],\s*line (\d+)")
_TIMEOUTS = ("CellTimeoutError",)


@dataclass
class Student:
    """What was found in one student's folder."""

    name: str  # the folder's name, as in grades.csv
    files: dict[str, Path] = field(default_factory=dict)  # chapter: the notebook to grade
    notes: list[str] = field(default_factory=list)  # for the student and the teacher
    skipped: dict[str, str] = field(default_factory=dict)  # chapter: why its notebook is not graded
    reason: str = ""  # why nothing at all was graded

    @property
    def id(self) -> str:
        """The student's name for nbgrader: letters, digits, ``.``, ``_`` and ``-`` only."""
        return re.sub(r"[^\w.-]", "_", self.name).lstrip(".") or "student"


# --------------------------------------------------------------------------------------------------
# The submissions
# --------------------------------------------------------------------------------------------------

def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") or part == "__MACOSX" for part in rel.parts)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def match_chapter(stem: str, chapters: list[str]) -> str | None:
    """The chapter a notebook named ``stem`` (without ``.ipynb``) can only be, or None.

    The name itself; else the one chapter whose name appears in it as a word (``architectures (1)``,
    ``Copy of toy``, ``ada-own_network``); else the one chapter it is a near miss of (``architecture``).
    """
    if stem in chapters:
        return stem
    norm = _norm(stem)
    inside = [c for c in chapters if re.search(rf"(?:^|_){re.escape(_norm(c))}(?:_|$)", norm)]
    if len(inside) == 1:
        return inside[0]
    if inside:
        return None
    by_norm = {_norm(c): c for c in chapters}
    close = difflib.get_close_matches(norm, list(by_norm), n=2, cutoff=0.8)
    if len(close) == 1 or (len(close) == 2 and difflib.SequenceMatcher(None, norm, close[0]).ratio() >
                                                  difflib.SequenceMatcher(None, norm, close[1]).ratio()):
        return by_norm[close[0]]
    return None


def _student(folder: Path, known: list[str], ungraded: list[str]) -> Student:
    st = Student(folder.name)
    found = sorted((p for p in folder.rglob("*") if not _hidden(p.relative_to(folder))),
                   key=lambda p: (len(p.relative_to(folder).parts), str(p)))
    notebooks = [p for p in found if p.suffix.lower() == ".ipynb" and p.is_file()]
    others = [p.relative_to(folder).as_posix() for p in found if p.is_file() and p not in notebooks]
    by_chapter: dict[str, list[Path]] = {}
    for nb in notebooks:
        rel = nb.relative_to(folder).as_posix()
        chapter = match_chapter(nb.stem, known)
        if chapter is None:
            if match_chapter(nb.stem, ungraded):
                st.notes.append(f"`{rel}` not graded: its chapter has no graded exercise in this release "
                                "(see RELEASE.md).")
            else:
                st.notes.append(f"`{rel}` not graded: it is not named after an assignment (name it "
                                f"<chapter>.ipynb, one of {', '.join(known)}).")
            continue
        by_chapter.setdefault(chapter, []).append(nb)
    for chapter, paths in by_chapter.items():
        rels = [p.relative_to(folder).as_posix() for p in paths]
        if len({p.read_bytes() for p in paths}) > 1:
            st.skipped[chapter] = (f"{len(paths)} different notebooks for {chapter}: "
                                   + ", ".join(f"`{r}`" for r in rels)
                                   + f"; none graded: keep only the one to grade, as {chapter}.ipynb.")
            continue
        st.files[chapter] = paths[0]
        if len(paths) > 1:
            st.notes.append(f"{', '.join(f'`{r}`' for r in rels)} are the same notebook: graded once, "
                            f"as {chapter}.")
        elif paths[0].name != f"{chapter}.ipynb":
            st.notes.append(f"`{rels[0]}` graded as {chapter} (its name is not {chapter}.ipynb).")
    if not st.files and not st.skipped:
        archives = [o for o in others if o.lower().endswith(ARCHIVES)]
        if not found:
            st.reason = "nothing handed in: the folder is empty."
        elif archives:
            st.reason = (f"no notebook found, only {', '.join(f'`{a}`' for a in archives)}: unpack it into "
                         "the student's folder and grade again.")
        elif not notebooks:
            shown = ", ".join(f"`{o}`" for o in others[:3]) + (" ..." if len(others) > 3 else "")
            st.reason = f"no notebook found (only {shown})."
        else:
            st.reason = "no notebook of an assignment found."
    return st


def _submissions(folder: Path, known: set[str] | list[str],
                 ungraded: set[str] | list[str] = ()) -> dict[str, Student]:
    """``{student: Student}`` for every folder of ``folder`` (one per student); ``known``: the chapters
    with graded exercises, ``ungraded``: the course's chapters without."""
    if not folder.is_dir():
        raise CourseError(f"SUBMISSIONS={folder}: not a folder. Give a folder with one folder per student, "
                          "each holding the student's notebooks named <chapter>.ipynb")
    known, ungraded = sorted(known), sorted(set(ungraded) - set(known))
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not _hidden(Path(p.name)))
    if not students:
        loose = [p.name for p in folder.iterdir() if p.suffix == ".ipynb"]
        hint = (f" (it holds {len(loose)} notebook(s) directly: put each in its student's folder)"
                if loose else "")
        raise CourseError(f"SUBMISSIONS={folder}: no student folder in it{hint}. Give a folder with one "
                          "folder per student, each holding the student's notebooks named <chapter>.ipynb")
    out = {p.name: _student(p, known, ungraded) for p in students}
    ids: dict[str, str] = {}
    for st in out.values():
        if st.id in ids:
            raise CourseError(f"student folders {ids[st.id]!r} and {st.name!r} have the same name for "
                              f"nbgrader ({st.id!r}): rename one")
        ids[st.id] = st.name
    return out


# --------------------------------------------------------------------------------------------------
# Feedback: why an exercise failed
# --------------------------------------------------------------------------------------------------

def _errors(cell: dict) -> list[dict]:
    return [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]


def _clean(text: str, paths: tuple[str, ...]) -> str:
    """``text`` without ANSI colours and without the grading machine's folders."""
    text = _ANSI.sub("", str(text))
    for p in sorted(paths, key=len, reverse=True):
        if p:
            text = text.replace(p, "…")
    return " ".join(text.split())


def describe_error(errors: list[dict], cell: dict, limit: int | float, paths: tuple[str, ...] = (),
                   show_line: bool = True) -> str:
    """One error of a cell as a student reads it: a timeout with the cell's time limit, or the
    exception's type and message, with the line of the cell it happened on (``show_line``)."""
    timeout = any(e.get("ename") in _TIMEOUTS for e in errors)
    err = errors[0]
    line = ""
    if show_line:
        tb = _ANSI.sub("", "\n".join(err.get("traceback", [])))
        m = _CELL_LINE.search(tb)
        lines = source(cell).splitlines()
        if m and 0 < int(m[1]) <= len(lines):
            line = f" (line {m[1]}: `{_clean(lines[int(m[1]) - 1].strip(), paths)}`)"
    if timeout:
        return (f"stopped after {limit:g} s, the time limit of a cell{line}: an endless loop, or far more "
                "work than the exercise needs?")
    text = _clean(f"{err.get('ename', 'Error')}: {err.get('evalue', '')}".rstrip(": "), paths)
    return f"{text}{line}"


def exercise_feedback(nb: dict, label: str, limit: int | float, paths: tuple[str, ...] = ()) -> str:
    """Why exercise ``label`` failed in an autograded notebook: its answer cell's error (exception or
    timeout, with the line), else the test's error, with the first earlier cell that failed when the
    test misses a name."""
    cells = nb["cells"]
    gid = [c.get("metadata", {}).get("nbgrader", {}).get("grade_id") for c in cells]
    if f"{label}-tests" not in gid:
        return "the test cell is missing from the submission"
    test = gid.index(f"{label}-tests")
    answer = gid.index(label) if label in gid else None
    if answer is not None and _errors(cells[answer]):
        return "your answer cell: " + describe_error(_errors(cells[answer]), cells[answer], limit, paths)
    errors = _errors(cells[test])
    if not errors:
        return "the tests did not pass"
    out = describe_error(errors, cells[test], limit, paths, show_line=False)  # hidden tests: no line
    if any(e.get("ename") in _TIMEOUTS for e in errors):
        return "the tests were " + out
    if errors[0].get("ename") == "NameError":
        if answer is not None and not _code_of(source(cells[answer])):
            return f"{out} (your answer cell is empty)"
        for i in range(test):  # the first earlier cell that failed: the name may be missing because of it
            meta = cells[i].get("metadata", {}).get("nbgrader", {})
            if _errors(cells[i]) and not meta.get("grade"):
                what = (f"your answer to `{meta['grade_id']}`" if meta.get("solution") else
                        f"the chapter's code cell {i + 1}")
                return (f"{out}; an earlier cell failed first, {what}: "
                        + describe_error(_errors(cells[i]), cells[i], limit, paths))
        return f"{out} (your answer must define it)"
    return out


def _code_of(text: str) -> str:
    """``text`` without comments and blank lines."""
    return "\n".join(line for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


def _unreadable(path: Path) -> str:
    """Why ``path`` is not a notebook that nbgrader can grade, or ``""``."""
    import nbformat

    try:
        nbformat.read(str(path), as_version=4)
    except Exception as e:  # any reason: the message is for the student
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (f"`{path.name}` is not a notebook Jupyter can open ({type(e).__name__}"
                + (f": {first[:120]}" if first else "")
                + "): open it in Jupyter, save it, and hand it in again.")
    return ""


# --------------------------------------------------------------------------------------------------
# Grading
# --------------------------------------------------------------------------------------------------

def _autograde(tasks: list[tuple[Path, str, str, int]], jobs: int) -> dict[tuple[str, str], Path]:
    """Run ``nbgrader autograde <chapter> --student <id>`` in each task's course folder (``(home,
    chapter, id, timeout)``), ``jobs`` at a time, each notebook's kernel with its share of the cores
    and every cell stopped after ``timeout`` s. Returns the log of every ``(id, chapter)`` that
    nbgrader could not grade."""
    nbgrader_commands()
    nbgrader = str(Path(sys.executable).with_name("nbgrader"))
    jobs = max(1, min(jobs, len(tasks) or 1))
    limit = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    threads = str(max(1, min(limit, (os.cpu_count() or 1) // jobs)))
    env = {**os.environ, "TQDM_DISABLE": "1"}
    env.update({k: threads for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    pending, running, failed = list(tasks), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            home, chapter, student, timeout = pending.pop(0)
            log = (home / f"autograde-{chapter}.log").open("w")
            cmd = [nbgrader, "autograde", chapter, "--student", student, "--force",
                   f"--Execute.timeout={int(timeout)}"]
            proc = subprocess.Popen(cmd, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, log, home, chapter, student, time.perf_counter()))
        time.sleep(0.2)
        for item in list(running):
            proc, log, home, chapter, student, start = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            print(f"graded {student}/{chapter} in {time.perf_counter() - start:.0f} s", flush=True)
            if proc.returncode:
                failed[(student, chapter)] = home / f"autograde-{chapter}.log"
    return failed


def _course(course: Path) -> dict:
    """The course's ``exercises.json``, checked."""
    meta = course / "exercises.json"
    needed = ("exercises.json", "gradebook.db", "nbgrader_config.py")
    missing = [f for f in needed if not (course / f).is_file()]
    if missing:
        raise CourseError(f"--course {course} has no assignments (no {missing[0]}): run `make assignments` "
                          "first, or give the --course it wrote")
    try:
        return json.loads(meta.read_text())
    except ValueError as e:
        raise CourseError(f"{meta} is not readable ({e}): run `make assignments` again") from None


def _nested(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def _read_rows(table: Path) -> tuple[list[str], list[dict]]:
    if not table.is_file():
        return [], []
    with table.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def grade(submissions: Path, out: Path, course: Path = COURSE, jobs: int | None = None,
          timeout: int | None = None, fresh: bool = False) -> Path:
    """Grade every student folder of ``submissions``; merge their rows into ``out/grades.csv`` and write
    their ``out/feedback/<student>.md`` (``fresh``: start the table over). ``timeout``: seconds per cell
    (default: each chapter's, from ``make assignments``). Everything is checked before grading starts;
    nothing is written into ``out`` until every submission is graded."""
    from nbgrader.api import Gradebook

    course, out, submissions = Path(course).resolve(), Path(out).resolve(), Path(submissions).resolve()
    meta = _course(course)
    made = meta["chapters"]
    if timeout is not None and timeout <= 0:
        raise CourseError(f"--timeout {timeout}: give the seconds a cell may run, a positive number")
    if _nested(out, submissions) or _nested(out, course):
        raise CourseError(f"--out {out} must lie outside the submissions ({submissions}) and the course "
                          f"({course}), and they outside it: give another --out")
    output = Output(out, "grade", "--out")
    known = [n for n, labels in made.items() if labels]
    students = _submissions(submissions, known, [n for n in made if n not in known])

    def mine(rel: str) -> bool:  # the files of the students graded now (all of the tool's with fresh)
        return fresh or rel == "grades.csv" or any(
            rel.startswith(f"course/{s}/") or rel == f"feedback/{s}.md" for s in students)

    # fail now, not after grading, if a file to replace is not the tool's or was changed
    output.check_replace(mine)
    output.check(["grades.csv", *(f"feedback/{s}.md" for s in students)])
    loose = sorted(p.name for p in submissions.iterdir() if p.is_file() and not p.name.startswith("."))
    if loose:
        print(f"warning: not graded, outside any student's folder: {', '.join(loose[:5])}"
              + (" ..." if len(loose) > 5 else ""), file=sys.stderr)
    old_columns, old_rows = ([], []) if fresh else _read_rows(out / "grades.csv")
    jobs = jobs or int(os.environ.get("JOBS") or os.cpu_count() or 1)
    limits = {c: timeout or meta.get("timeouts", {}).get(c) or TIMEOUT_UNMEASURED_S for c in known}
    with output.stage() as tmp:
        stage = Path(tmp)
        work = stage / "course"
        tasks, unreadable = [], {}
        for st in students.values():  # a course of its own per student, so that gradings run in parallel
            home = work / st.name
            for chapter, path in st.files.items():
                why = _unreadable(path)
                if why:
                    unreadable[(st.name, chapter)] = why
                    continue
                if not home.exists():
                    home.mkdir(parents=True)
                    shutil.copyfile(course / "nbgrader_config.py", home / "nbgrader_config.py")
                    shutil.copyfile(course / "gradebook.db", home / "gradebook.db")
                shutil.copytree(course / "source" / chapter, home / "source" / chapter)
                (home / "submitted" / st.id / chapter).mkdir(parents=True)
                shutil.copyfile(path, home / "submitted" / st.id / chapter / f"{chapter}.ipynb")
                tasks.append((home, chapter, st.id, limits[chapter]))
        failed = _autograde(tasks, jobs)
        paths = (str(stage), str(out), str(course), str(submissions), str(ROOT), str(Path.home()))
        rows, notes, sections = {}, {}, {}
        for st in students.values():
            rows[st.name], notes[st.name], sections[st.name] = _grade_student(
                st, made, work / st.name, failed, unreadable, limits, paths, Gradebook)
            for (sid, chapter), log in failed.items():
                if sid == st.id:
                    print(f"warning: nbgrader could not grade {st.name}/{chapter}: see "
                          f"{out / log.relative_to(stage)}", file=sys.stderr)
        columns = _columns(made, old_columns, rows)
        feedback = {}
        for name, row in rows.items():  # a chapter some student handed in and this one did not: 0
            for chapter in dict.fromkeys(c.split(":")[0] for c in columns):
                if chapter not in sections[name] and chapter in made:
                    row.update({f"{chapter}:{label}": 0 for label in made[chapter]})
                    sections[name][chapter] = f"## {chapter}\n\nNo submission.\n"
            row["total"] = sum(v for k, v in row.items() if ":" in k)
            text = f"# Feedback for {name}\n\n"
            if notes[name]:
                text += "## Your files\n\n" + "".join(f"* {n}\n" for n in notes[name]) + "\n"
            feedback[name] = text + "\n".join(sections[name][c] for c in made if c in sections[name])
        merged = {r["student"]: {**dict.fromkeys(columns, 0), **r} for r in old_rows
                  if r.get("student") not in rows}
        merged.update(rows)
        with (stage / "grades.csv").open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=["student", *columns, "total", "notes"], restval="",
                                    extrasaction="ignore")
            writer.writeheader()
            writer.writerows(merged[s] for s in sorted(merged))
        (stage / "feedback").mkdir()
        for name, text in feedback.items():
            (stage / "feedback" / f"{name}.md").write_text(text, encoding="utf-8")
        output.commit(stage, replace=mine, course=str(course), scale=meta.get("scale"))
    return out / "grades.csv"


def _columns(made: dict, old: list[str], rows: dict[str, dict]) -> list[str]:
    """The exercise columns: those of the earlier table and of this run's rows, in the course's order."""
    order = [f"{c}:{label}" for c, labels in made.items() for label in labels]
    present = {c for c in old if ":" in c} | {c for r in rows.values() for c in r if ":" in c}
    return [c for c in order if c in present] + sorted(present - set(order))


def _grade_student(st: Student, made: dict, home: Path, failed: dict, unreadable: dict, limits: dict,
                   paths: tuple[str, ...], gradebook) -> tuple[dict, list[str], dict[str, str]]:
    """A student's row of ``grades.csv`` (the chapters found), notes, and feedback per chapter."""
    row: dict = {"student": st.name}
    notes = ([st.reason] if st.reason else []) + list(st.notes)
    problems = []  # the chapters' problems: in the table's notes, and under the chapter in the feedback
    sections = {}
    for chapter in [c for c in made if c in st.files or c in st.skipped]:
        labels = made[chapter]
        log = failed.get((st.id, chapter))
        why = st.skipped.get(chapter) or unreadable.get((st.name, chapter)) or (
            _not_graded(st.files[chapter].name, log) if log else "")
        nb, scores = None, {}
        if not why:
            try:
                nb = read(home / "autograded" / st.id / chapter / f"{chapter}.ipynb")
                with gradebook(f"sqlite:///{home / 'gradebook.db'}") as gb:
                    graded_nb = gb.find_submission_notebook(chapter, chapter, st.id)
                    scores = {g.name: g.score for g in graded_nb.grades}
            except Exception:  # nbgrader failed on it: no graded notebook, or none in its gradebook
                why = _not_graded(st.files[chapter].name, log)
        if why:
            row.update({f"{chapter}:{label}": 0 for label in labels})
            problems.append(why)
            sections[chapter] = f"## {chapter}\n\n{why}\n"
            continue
        lines = [f"## {chapter}\n"]
        for label in labels:
            score = scores.get(f"{label}-tests", 0) or 0
            row[f"{chapter}:{label}"] = int(score) if float(score).is_integer() else score
            why = "passed" if score else "failed: " + exercise_feedback(nb, label, limits[chapter], paths)
            lines.append(f"* `{label}`: {why}")
        sections[chapter] = "\n".join(lines) + "\n"
    row["notes"] = " ".join(notes + problems)
    return row, notes, sections


def _not_graded(name: str, log: Path | None) -> str:
    """Why nbgrader could not grade notebook ``name``, for the student (its log, ``log``, stays the
    teacher's)."""
    text = log.read_text(errors="replace") if log is not None and log.is_file() else ""
    if "DeadKernelError" in text or "Kernel died" in text:
        return (f"`{name}` could not be graded: the notebook's kernel died while it ran (out of memory, or "
                "`exit()` in a cell?).")
    return f"`{name}` could not be graded (nbgrader failed on it; your teacher has the log)."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course grade",
                                     description="Grade <folder>/<student>/<chapter>.ipynb with nbgrader.")
    parser.add_argument("submissions", type=Path, help="the folder of submissions, one folder per student")
    parser.add_argument("--course", type=Path, default=COURSE, help="the course of `make assignments`")
    parser.add_argument("--out", type=Path, default=ROOT / "build/grades",
                        help="where grades.csv goes: new, empty, or made by this tool")
    parser.add_argument("--jobs", type=int, default=None, help="submissions at once (JOBS or the cores)")
    parser.add_argument("--timeout", type=int, default=None,
                        help="seconds a cell may run (default: each chapter's, set by `make assignments`)")
    parser.add_argument("--fresh", action="store_true",
                        help="start grades.csv over instead of merging this run's students into it")
    args = parser.parse_args(argv)
    table = grade(args.submissions, args.out, args.course, args.jobs, args.timeout, args.fresh)
    print(f"grades: {table}\nfeedback: {table.parent / 'feedback'}")
    return 0
