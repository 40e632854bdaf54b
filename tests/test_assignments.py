"""Auto-graded assignments: every chapter's computational exercises as nbgrader notebooks with hidden tests
(``course/assignments.py``), graded locally (``course/grading.py``).

The assignments of every chapter are built once (no execution): each computational exercise must be
there with tests that assert something at the grading scale, and the student's notebook must hold
neither a solution nor a hidden test. Then, end to end, fake submissions of two chapters are graded
by nbgrader at the ``tiny`` scale: the teacher's solutions score full marks (even with the test cells
of the submission edited: grading uses the teacher's), the notebook as handed out scores zero, and a
submission with one wrong answer (and other random seeds everywhere else) loses exactly that exercise.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course import assignments as course_assignments  # noqa: E402
from course import book as course_book  # noqa: E402
from course import grading as course_grading  # noqa: E402

GRADED = ["architectures"]  # quick at tiny, no zoo to train: graded end to end (make test pays for it)


def _src(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def _notebook(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("assignments") / "course"
    return out, _build(out, "cpu")


def _build(course: Path, scale: str, names: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """``make assignments`` into ``course``: per chapter, the labels of its graded exercises."""
    cmd = [sys.executable, "-m", "course", "assignments", "--course", str(course), "--scale", scale, *names]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((course / "exercises.json").read_text())["chapters"]


def _computational(nb: dict) -> int:
    """How many solutions of a chapter hold executed code."""
    return sum(any(kind != "md" for kind, _ in sol) for sol in course_book.notebook_solutions(nb))


def test_every_chapter_gets_its_computational_exercises(course):
    out, made = course
    chapters = course_book.executed_chapters(ROOT)
    assert sorted(made) == sorted(chapters)
    assert sum(len(labels) for labels in made.values()) >= len(chapters)
    for name in chapters:
        nb = _notebook(ROOT / "book" / f"{name}.ipynb")
        assert len(made[name]) == _computational(nb), f"{name}: one assignment per computational exercise"
        labels = set(re.findall(r":label:\s*(\S+)", " ".join(_src(c) for c in nb["cells"])))
        assert set(made[name]) <= labels
        release = out / "release" / name / f"{name}.ipynb"
        assert release.is_file() == bool(made[name])
        if not made[name]:
            continue
        source = _notebook(out / "source" / name / f"{name}.ipynb")
        grades = {c["metadata"]["nbgrader"]["grade_id"]: _src(c) for c in source["cells"]
                  if c["metadata"].get("nbgrader", {}).get("grade")}
        assert sorted(grades) == sorted(f"{label}-tests" for label in made[name])
        for gid, tests in grades.items():  # the grading scale of this course: cpu
            body = tests.split("### BEGIN HIDDEN TESTS")[1].split("### END HIDDEN TESTS")[0]
            active = course_assignments.active_asserts(body, {"scale": "cpu"})
            assert active > 0, f"{name}:{gid} asserts nothing"


def _hidden(source: dict) -> list[str]:
    """Every line of the source's hidden tests and of its solutions, stripped."""
    out = []
    for cell in source["cells"]:
        text = _src(cell)
        for kind in ("HIDDEN TESTS", "SOLUTION"):
            a, b = f"### BEGIN {kind}", f"### END {kind}"
            if a in text:
                out += [line.strip() for line in text.split(a)[1].split(b)[0].splitlines() if line.strip()]
    return out


def test_student_notebooks_hold_no_solution_and_no_hidden_test(course):
    out, made = course
    checked = 0
    for name, labels in made.items():
        if not labels:
            continue
        source = _notebook(out / "source" / name / f"{name}.ipynb")
        release = _notebook(out / "release" / name / f"{name}.ipynb")
        chapter = course_book.strip_notebook(_notebook(ROOT / "book" / f"{name}.ipynb"))
        elsewhere = {line.strip() for c in chapter["cells"] for line in _src(c).splitlines()}
        probes = [line for line in _hidden(source) if line not in elsewhere and len(line) > 8]
        assert len(probes) >= len(labels), f"{name}: too few lines of its solutions to check"
        text = "\n".join(_src(c) for c in release["cells"])
        lines = {line.strip() for line in text.splitlines()}
        leaked = [p for p in probes if p in lines]
        assert not leaked, f"{name}: the student's notebook holds solution or test lines: {leaked[:3]}"
        for marker in ("BEGIN SOLUTION", "HIDDEN TESTS", "{solution"):
            assert marker not in text, f"{name}: {marker!r} in the student's notebook"
        answers = [c for c in release["cells"] if c["metadata"].get("nbgrader", {}).get("solution")]
        assert len(answers) == len(labels) and all(_src(c).strip() == "# YOUR CODE HERE" for c in answers)
        assert not any(c.get("outputs") for c in release["cells"] if c["cell_type"] == "code")
        params = [_src(c) for c in release["cells"] if "parameters" in c["metadata"].get("tags", [])]
        assert len(params) == 1 and re.search(r'^scale = "tiny"', params[0], re.M), "students run at tiny"
        checked += len(probes)
    assert checked > 50


def test_answers_and_tests_are_split():
    code = 'x = 1\nassert x == 1, "one"\nif x:\n    assert x\ny = 2'
    answer, tests = course_assignments.split_asserts(code)
    assert answer == "x = 1\nif x:\n    assert x\ny = 2" and tests == 'assert x == 1, "one"'
    loaded, stored = course_assignments._names("import numpy as np\nz = np.sum(w)\nfor i in r: pass")
    assert {"np", "z", "i"} <= stored and {"np", "w", "r"} <= loaded
    guarded = ('assert a\nif scale != "tiny":\n    assert b\nif scale == "cpu":\n    assert c\n'
               "if x > 1:\n    assert d")
    assert course_assignments.active_asserts(guarded, {"scale": "tiny"}) == 2
    assert course_assignments.active_asserts(guarded, {"scale": "cpu"}) == 4


def test_a_bad_submissions_folder_is_explained(tmp_path):
    with pytest.raises(SystemExit, match="not a folder"):
        course_grading._submissions(tmp_path / "nothing", {"toy"})
    (tmp_path / "ada").mkdir()
    (tmp_path / "ada" / "tyo.ipynb").write_text("{}")
    with pytest.raises(SystemExit, match="not assignments"):
        course_grading._submissions(tmp_path, {"toy"})
    with pytest.raises(SystemExit, match="make assignments"):
        course_grading.grade(tmp_path, tmp_path / "out", course=tmp_path / "no-course")


# ---------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------


def _teacher_answers(source: dict) -> dict[str, str]:
    out = {}
    for cell in source["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            out[meta["grade_id"]] = _src(cell).split("### BEGIN SOLUTION\n")[1].split("### END SOLUTION")[0]
    return out


def _submit(folder: Path, course: Path, name: str, answer, tamper: bool = False) -> None:
    """A student's notebook: the release, each answer cell filled by ``answer(label, teacher's code)``;
    ``tamper``: every test cell replaced by one that fails (grading must use the teacher's tests)."""
    release = _notebook(course / "release" / name / f"{name}.ipynb")
    teacher = _teacher_answers(_notebook(course / "source" / name / f"{name}.ipynb"))
    for cell in release["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            cell["source"] = answer(meta["grade_id"], teacher[meta["grade_id"]])
        elif meta.get("grade") and tamper:
            cell["source"] = 'assert False, "a test edited by the student"\n'
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.ipynb").write_text(json.dumps(release), encoding="utf-8")


def _reseeded(code: str) -> str:
    """The same answer with other random seeds: a harmless difference that must not cost a point."""
    out = re.sub(r"manual_seed\(([^()]*)\)", r"manual_seed(\1 + 17)", code)
    assert out != code or "manual_seed" not in code
    return out


def test_grading_end_to_end(tmp_path):
    """Fake submissions for one chapter, graded by nbgrader at ``tiny``; a second chapter that only a broken
    notebook was handed in for scores 0 for everyone, "No submission" for those who handed in nothing."""
    present = [n for n in GRADED if n in course_book.executed_chapters(ROOT)]
    if len(present) < len(GRADED) or "own_network" not in course_book.executed_chapters(ROOT):
        pytest.skip(f"the chapters graded end to end are not all in the book: {GRADED}")
    course = tmp_path / "course"
    made = _build(course, "tiny", (*present, "own_network"))
    wrong = made["architectures"][-1]  # arch-negative: the student concludes that (a) is a symmetry
    assert wrong == "arch-negative"
    subs = tmp_path / "submissions"
    for name in present:
        _submit(subs / "teacher", course, name, lambda label, code: code, tamper=True)
        _submit(subs / "one_wrong", course, name,
                lambda label, code: _reseeded(code) + ("\nrefused = False\n" if label == wrong else ""))
    _submit(subs / "blank", course, "architectures", lambda label, code: "# YOUR CODE HERE\n")
    (subs / "broken").mkdir()
    for name in (*present, "own_network"):  # 0, and the others graded
        (subs / "broken" / f"{name}.ipynb").write_text("not a notebook")
    jobs = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
    table = course_grading.grade(subs, tmp_path / "grades", course=course, jobs=jobs)
    with table.open() as f:
        rows = {r["student"]: r for r in csv.DictReader(f)}
    graded = [f"{n}:{label}" for n in sorted(present) for label in made[n]]
    missing = [f"own_network:{label}" for label in made["own_network"]]
    assert list(rows["teacher"]) == ["student", *graded, *missing, "total"]
    assert all(rows["teacher"][c] == "1" for c in graded), rows["teacher"]
    assert all(rows[s][c] == "0" for s in rows for c in missing), "nothing handed in: 0"
    assert all(rows["blank"][c] == "0" for c in graded), rows["blank"]
    lost = {c for c in graded if rows["one_wrong"][c] == "0"}
    assert lost == {f"architectures:{wrong}"}, rows["one_wrong"]
    assert rows["one_wrong"]["total"] == str(len(graded) - 1)
    assert rows["teacher"]["total"] == str(len(graded)) and rows["blank"]["total"] == "0"
    feedback = (tmp_path / "grades/feedback/one_wrong.md").read_text()
    assert f"`{wrong}`: failed: AssertionError: (a) is not a symmetry" in feedback
    assert feedback.count("passed") == len(graded) - 1
    assert all(rows["broken"][c] == "0" for c in graded)
    assert "could not grade" in (tmp_path / "grades/feedback/broken.md").read_text()
    blank = (tmp_path / "grades/feedback/blank.md").read_text()
    assert "NameError" in blank and "No submission" in blank  # own_network: nothing handed in
