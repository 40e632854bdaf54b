r"""``make grade SUBMISSIONS=dir``: grade a folder of submissions of the assignments, with nbgrader.

``python -m course grade <dir> [--out build/grades]``. The folder holds one folder per
student with that student's notebooks, ``dir/<student>/<chapter>.ipynb`` (nbgrader's layout
``dir/<student>/<chapter>/<chapter>.ipynb`` works too). Every submission is graded by nbgrader's
``autograde`` on this machine: it restores the chapter's locked cells, the parameters (the grading
scale) and the hidden tests from the teacher's source notebook, and executes the notebook with a
local Jupyter kernel, no docker and no network. Each student is graded in a copy of the course of
its own under ``<out>/course/<student>/`` (``JOBS`` of them at a time, default: the cores), and
``<out>`` gets

* ``grades.csv``: one row per student, one column per exercise (``<chapter>:<label>``, 1 point when
  every test of the exercise passes, else 0), and the total;
* ``feedback/<student>.md``: per chapter and exercise, passed, or the error of the failed test
  (the assert's message, or e.g. a ``NameError`` for a name the answer did not define).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import ROOT
from .assignments import COURSE, nbgrader_commands
from .notebooks import read


def _submissions(folder: Path, known: set[str]) -> dict[str, dict[str, Path]]:
    """``{student: {chapter: notebook}}`` from ``folder/<student>/<chapter>.ipynb`` (or nbgrader's
    ``folder/<student>/<chapter>/<chapter>.ipynb``)."""
    if not folder.is_dir():
        raise SystemExit(f"SUBMISSIONS={folder}: not a folder. Give a folder with one folder per student, "
                         "each holding the student's notebooks named <chapter>.ipynb")
    out: dict[str, dict[str, Path]] = {}
    for student in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not re.fullmatch(r"[\w.-]+", student.name):
            raise SystemExit(f"student folder {student.name!r}: use letters, digits, '.', '_' or '-' only")
        files = {p.stem: p for p in student.glob("*.ipynb")}
        files.update({p.parent.name: p for p in student.glob("*/*.ipynb") if p.stem == p.parent.name})
        unknown = sorted(set(files) - known)
        if unknown:
            raise SystemExit(f"{student.name}: {unknown} are not assignments "
                             f"(expected one of {sorted(known)})")
        if files:
            out[student.name] = files
    if not out:
        raise SystemExit(f"SUBMISSIONS={folder}: no <student>/<chapter>.ipynb in it")
    return out


def _feedback(nb: dict, label: str) -> list[str]:
    """The errors of an exercise's test cell in an autograded notebook."""
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == f"{label}-tests":
            return [f"{o.get('ename')}: {o.get('evalue')}".rstrip(": ") for o in cell.get("outputs", [])
                    if o.get("output_type") == "error"]
    return ["the test cell is missing from the submission"]


def _autograde(tasks: list[tuple[Path, str, str]], jobs: int) -> dict[tuple[str, str], Path]:
    """Run ``nbgrader autograde <chapter> --student <student>`` in each task's course folder, ``jobs``
    at a time, each notebook's kernel with its share of the cores. Returns the log of every
    ``(student, chapter)`` that nbgrader could not grade (an unreadable notebook, for instance)."""
    nbgrader_commands()
    nbgrader = str(Path(sys.executable).with_name("nbgrader"))
    jobs = max(1, min(jobs, len(tasks)))
    limit = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    threads = str(max(1, min(limit, (os.cpu_count() or 1) // jobs)))
    env = {**os.environ, "TQDM_DISABLE": "1"}
    env.update({k: threads for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    pending, running, failed = list(tasks), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            home, chapter, student = pending.pop(0)
            log = (home / f"autograde-{chapter}.log").open("w")
            cmd = [nbgrader, "autograde", chapter, "--student", student, "--force"]
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
                failed[(student, chapter)] = log_path = home / f"autograde-{chapter}.log"
                print(f"warning: could not grade {student}/{chapter}: see {log_path}", file=sys.stderr)
    return failed


def grade(submissions: Path, out: Path, course: Path = COURSE, jobs: int | None = None) -> Path:
    """Grade every submission; write ``out/grades.csv`` and ``out/feedback/<student>.md``."""
    from nbgrader.api import Gradebook

    meta = course / "exercises.json"
    if not meta.is_file():
        raise SystemExit(f"{course} has no assignments: run `make assignments` first")
    made = json.loads(meta.read_text())["chapters"]
    subs = _submissions(submissions.resolve(), {n for n, labels in made.items() if labels})
    jobs = jobs or int(os.environ.get("JOBS") or os.cpu_count() or 1)
    graded = sorted({c for files in subs.values() for c in files})
    work = out / "course"
    if work.exists():
        shutil.rmtree(work)
    tasks = []
    for student, files in subs.items():  # a course of its own per student, so that gradings run in parallel
        home = work / student
        home.mkdir(parents=True)
        shutil.copyfile(course / "nbgrader_config.py", home / "nbgrader_config.py")
        shutil.copyfile(course / "gradebook.db", home / "gradebook.db")
        for chapter, path in files.items():
            shutil.copytree(course / "source" / chapter, home / "source" / chapter)
            (home / "submitted" / student / chapter).mkdir(parents=True)
            shutil.copyfile(path, home / "submitted" / student / chapter / f"{chapter}.ipynb")
            tasks.append((home, chapter, student))
    failed = _autograde(tasks, jobs)
    columns = [f"{c}:{label}" for c in graded for label in made[c]]
    rows, feedback = [], {}
    for student in subs:
        with Gradebook(f"sqlite:///{work / student / 'gradebook.db'}") as gb:
            row, notes = {"student": student}, []
            for chapter in graded:
                if chapter not in subs[student] or (student, chapter) in failed:
                    row.update({f"{chapter}:{label}": 0 for label in made[chapter]})
                    why = "No submission." if chapter not in subs[student] else (
                        f"nbgrader could not grade the notebook (its log: {failed[(student, chapter)]}).")
                    notes.append(f"## {chapter}\n\n{why}\n")
                    continue
                nb_path = work / student / "autograded" / student / chapter / f"{chapter}.ipynb"
                nb = read(nb_path)
                graded_nb = gb.find_submission_notebook(chapter, chapter, student)
                scores = {g.name: g.score for g in graded_nb.grades}
                lines = [f"## {chapter}\n"]
                for label in made[chapter]:
                    score = scores.get(f"{label}-tests", 0) or 0
                    row[f"{chapter}:{label}"] = int(score) if float(score).is_integer() else score
                    errors = [] if score else _feedback(nb, label)
                    lines.append(f"* `{label}`: " + ("passed" if score else "failed: " + "; ".join(errors)))
                notes.append("\n".join(lines) + "\n")
            row["total"] = sum(row[c] for c in columns)
            rows.append(row)
            feedback[student] = f"# Feedback for {student}\n\n" + "\n".join(notes)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "grades.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["student", *columns, "total"])
        writer.writeheader()
        writer.writerows(rows)
    (out / "feedback").mkdir(exist_ok=True)
    for student, text in feedback.items():
        (out / "feedback" / f"{student}.md").write_text(text, encoding="utf-8")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course grade",
                                     description="Grade <folder>/<student>/<chapter>.ipynb with nbgrader.")
    parser.add_argument("submissions", type=Path, help="the folder of submissions")
    parser.add_argument("--course", type=Path, default=COURSE, help="the course of `make assignments`")
    parser.add_argument("--out", type=Path, default=ROOT / "build/grades", help="where grades.csv goes")
    parser.add_argument("--jobs", type=int, default=None, help="submissions at once (JOBS or the cores)")
    args = parser.parse_args(argv)
    table = grade(args.submissions, args.out.resolve(), args.course.resolve(), args.jobs)
    print(f"grades: {table}\nfeedback: {table.parent / 'feedback'}")
    return 0
