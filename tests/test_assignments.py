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

import contextlib
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course import __main__ as course_main  # noqa: E402
from course import assignments as course_assignments  # noqa: E402
from course import book as course_book  # noqa: E402
from course import grading as course_grading  # noqa: E402
from course import output as course_output  # noqa: E402

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


@pytest.mark.slow
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


@pytest.mark.slow
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
    with pytest.raises(course_output.CourseError, match="not a folder"):
        course_grading._submissions(tmp_path / "nothing", {"toy"})
    (tmp_path / "loose.ipynb").write_text("{}")
    with pytest.raises(course_output.CourseError, match="no student folder in it"):
        course_grading._submissions(tmp_path, {"toy"})
    (tmp_path / "ada").mkdir()
    (tmp_path / "ada" / "tyo.ipynb").write_text("{}")
    ada = course_grading._submissions(tmp_path, {"toy"})["ada"]  # reported for ada alone
    assert not ada.files and "`tyo.ipynb` not graded: it is not named after an assignment" in ada.notes[0]
    assert ada.reason == "no notebook of an assignment found."
    with pytest.raises(course_output.CourseError, match="make assignments"):
        course_grading.grade(tmp_path, tmp_path / "out", course=tmp_path / "no-course")


def test_a_notebook_is_matched_to_its_chapter_only_when_unambiguous():
    chapters = ["toy", "minmass", "architectures", "own_network", "true_posterior", "table1"]
    match = course_grading.match_chapter
    for name, chapter in [("architectures", "architectures"), ("architectures (1)", "architectures"),
                          ("Copy of toy", "toy"), ("toy-copy", "toy"), ("ada_own_network", "own_network"),
                          ("architecture", "architectures"), ("Own Network (2)", "own_network"),
                          ("true-posterior", "true_posterior"), ("table1 final", "table1")]:
        assert match(name, chapters) == chapter, name
    for name in ["toy_minmass", "homework", "Untitled", "tyo", "posterior"]:
        assert match(name, chapters) is None, name


def test_the_cell_time_limit_is_measured_at_the_grading_scale(tmp_path):
    def executed(path: Path, scale: str, seconds: list[float]) -> None:
        cells = [{"cell_type": "code", "source": "", "outputs": [],
                  "metadata": {"papermill": {"duration": t}}} for t in seconds]
        meta = {"papermill": {"parameters": {"scale": scale}}}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cells": cells, "metadata": meta}))

    executed(tmp_path / "book/ch.ipynb", "cpu", [1.0, 95.5, 3.0])
    limit, how = course_assignments.cell_timeout("ch", "cpu", tmp_path)
    assert limit == 287 and "95.5 s at scale cpu" in how  # 3 x the slowest cell
    limit, how = course_assignments.cell_timeout("ch", "tiny", tmp_path)  # no tiny run: cpu's, an upper bound
    assert limit == 287 and "scale cpu" in how
    executed(tmp_path / "build/check/nb/ch.ipynb", "tiny", [0.5, 2.0])  # make check's run, at tiny
    assert course_assignments.cell_timeout("ch", "tiny", tmp_path)[0] == course_assignments.TIMEOUT_FLOOR_S
    limit, how = course_assignments.cell_timeout("ch", "paper", tmp_path)  # nothing measured at paper
    assert limit == course_assignments.TIMEOUT_UNMEASURED_S and "no executed" in how


def test_exercises_that_assert_nothing_at_the_scale_are_left_out_of_the_gradebook():
    if "permfreq" not in course_book.executed_chapters(ROOT):
        pytest.skip("no permfreq chapter")
    nb = _notebook(ROOT / "book/permfreq.ipynb")
    src, exs = course_assignments.source_notebook("permfreq", nb, "tiny")
    ungraded = [ex.label for ex in exs if not ex.graded]
    assert ungraded == ["pf-lr"], "its claims need more networks than tiny trains"
    ids = {c["metadata"].get("nbgrader", {}).get("grade_id"): c for c in src["cells"]}
    assert "pf-lr" in ids and "pf-lr-tests" not in ids, "an answer cell, for practice, and no test to pass"
    assert all(f"{ex.label}-tests" in ids for ex in exs if ex.graded)
    note = _src(src["cells"][src["cells"].index(ids["pf-lr"]) - 1])
    assert "Not graded in this release" in note and "RELEASE.md" in note
    notes = course_assignments.release_notes("tiny", {"permfreq": exs}, {"permfreq": 60})
    assert "Not graded in this release" in notes and "(`pf-lr`)" in notes and "at most 60 s" in notes
    src, exs = course_assignments.source_notebook("permfreq", nb, "cpu")
    assert all(ex.graded for ex in exs)


def test_feedback_names_the_cause_of_a_failure():
    def cell(gid, src, *errors, solution=False, grade=False):
        return {"cell_type": "code", "source": src, "outputs": list(errors),
                "metadata": {"nbgrader": {"grade_id": gid, "solution": solution, "grade": grade}}}

    def error(ename, evalue, line=None):
        tb = [f"\x1b[36mCell\x1b[39m \x1b[32mIn[7]\x1b[39m, line {line}\n"] if line else []
        return {"output_type": "error", "ename": ename, "evalue": evalue, "traceback": tb}

    name_error = error("NameError", "name 'small_spec' is not defined", 3)
    timeout = [error("KeyboardInterrupt", "", 2), error("CellTimeoutError", "")]
    nb = {"cells": [
        cell("ch-cell-001", "import os\nfrom symlib import x\n", error("ImportError", "in /home/t/x.py", 2)),
        cell("a", "x = 1\nwhile True:\n    pass\n", *timeout, solution=True),
        cell("a-tests", "assert small_spec", name_error, grade=True),
        cell("b", "y = 2\n\nraise RuntimeError('not yet')\n", error("RuntimeError", "not yet", 3),
             solution=True),
        cell("b-tests", "assert err", name_error, grade=True),
        cell("c", "# YOUR CODE HERE\n", solution=True),
        cell("c-tests", "assert z", name_error, grade=True),
        cell("d", "z = 3\n", solution=True),
        cell("d-tests", "assert z == 4, 'z is 4'", error("AssertionError", "z is 4", 1), grade=True),
        cell("e", "w = 1\n", solution=True),
        cell("e-tests", "assert v", error("NameError", "name 'v' is not defined", 1), grade=True),
    ]}
    fb = lambda label: course_grading.exercise_feedback(nb, label, 42, ("/home/t",))  # noqa: E731
    assert fb("a") == ("your answer cell: stopped after 42 s, the time limit of a cell (line 2: "
                       "`while True:`): an endless loop, or far more work than the exercise needs?")
    assert fb("b") == "your answer cell: RuntimeError: not yet (line 3: `raise RuntimeError('not yet')`)"
    assert fb("c") == "NameError: name 'small_spec' is not defined (your answer cell is empty)"
    assert fb("d") == "AssertionError: z is 4", "a hidden test: its message, never its line"
    assert fb("e") == ("NameError: name 'v' is not defined; an earlier cell failed first, the chapter's code "
                       "cell 1: ImportError: in …/x.py (line 2: `from symlib import x`)"), "no teacher's path"
    assert fb("f") == "the test cell is missing from the submission"


# ---------------------------------------------------------------------------------------------------
# The course folder: written only where the tool may
# ---------------------------------------------------------------------------------------------------


def _run(*args: str, in_process: bool = False) -> subprocess.CompletedProcess:
    """``python -m course *args``: a process of its own, or (``in_process``, quicker: a refusal) this one."""
    if not in_process:
        return subprocess.run([sys.executable, "-m", "course", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=900)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = course_main.main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _refused(run: subprocess.CompletedProcess, *words: str) -> None:
    """Exit status 2 with one line on stderr that says ``words``, no traceback."""
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    for w in words:
        assert w in lines[0], lines[0]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict]:
    """The assignments of the chapters graded end to end, at ``tiny``."""
    present = [n for n in GRADED if n in course_book.executed_chapters(ROOT)]
    if len(present) < len(GRADED) or "own_network" not in course_book.executed_chapters(ROOT):
        pytest.skip(f"the chapters graded end to end are not all in the book: {GRADED}")
    course = tmp_path_factory.mktemp("tiny") / "course"
    return course, _build(course, "tiny", (*present, "own_network"))


def test_assignments_never_write_into_a_teachers_folder(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "syllabus.md").write_bytes(b"# My course\n\xe2\x9c\x93\n")
    before = _snapshot(target)
    _refused(_run("assignments", "--course", str(target), "--scale", "tiny", "architectures",
                  in_process=True),
             "did not write", "syllabus.md", "--course")
    assert _snapshot(target) == before and sorted(p.name for p in target.iterdir()) == ["syllabus.md"]
    _refused(_run("assignments", "--course", str(tmp_path / "new"), "--scale", "tiny", "architecturs",
                  in_process=True),
             "unknown chapter 'architecturs'", "did you mean 'architectures'")
    assert not (tmp_path / "new").exists()
    _refused(_run("assignments", "--course", str(tmp_path / "new"), "--scale", "huge", in_process=True),
             "--scale 'huge'")


_GLUE_TEXT = re.compile(r"\{glue:text\}`(?P<key>[^`:]+):(?P<spec>[^`]+)`")


def _glued_output(nb: dict, key: str, mime: str = "text/plain") -> str:
    """What the executed notebook glued as ``key`` (myst-nb's scrapbook output), its last value."""
    outputs = [o for cell in nb["cells"] for o in cell.get("outputs", [])]
    found = [o["data"]["application/papermill.record/" + mime] for o in outputs
             if o.get("metadata", {}).get("scrapbook", {}).get("name") == key]
    return _src({"source": found[-1]})


@pytest.mark.slow
def test_student_notebooks_show_the_glued_values_not_glue_roles(tiny):
    """JupyterLab resolves no {glue} role: the release has every value of the chapter's executed notebook
    pasted in, formatted as the role asks (a value it has no number for would point to the book)."""
    course, made = tiny
    checked = 0
    for name, labels in made.items():
        if not labels:
            continue
        release = _notebook(course / "release" / name / f"{name}.ipynb")
        text = json.dumps(release, ensure_ascii=False)
        assert "{glue" not in text, f"{name}: a glue role or directive in the student's notebook"
        assert "does not hold" not in text, f"{name}: every value of the text is in book/{name}.ipynb"
        executed = _notebook(ROOT / "book" / f"{name}.ipynb")
        assert "at the `cpu` scale" in _src(release["cells"][0]), "the note: the numbers are the book's run"
        md = "\n".join(_src(c) for c in release["cells"] if c["cell_type"] == "markdown")
        for cell in executed["cells"]:  # the first role with a format spec: its line, with the value
            line = next((x for x in _src(cell).splitlines() if _GLUE_TEXT.search(x)), None)
            if cell["cell_type"] == "markdown" and line:
                m = _GLUE_TEXT.search(line)
                value = format(float(_glued_output(executed, m["key"])), m["spec"])
                pasted = line.replace(m.group(0), value)
                assert pasted in md, f"{name}: {m.group(0)} is not {value} in {pasted!r}"
                checked += 1
                break
    assert checked >= 2


@pytest.mark.slow
def test_glued_figures_are_cell_attachments(course):
    """Every chapter's student notebook holds no glue role; its glued figures travel as attachments of the
    markdown cell that shows them (a MyST {figure} of ``attachment:<name>.png``), byte for byte."""
    out, made = course
    figures = 0
    for name, labels in made.items():
        if not labels:
            continue
        release = _notebook(out / "release" / name / f"{name}.ipynb")
        assert "{glue" not in json.dumps(release, ensure_ascii=False), name
        executed = _notebook(ROOT / "book" / f"{name}.ipynb")
        shown = re.findall(r"^\s*(?:`{3,}|:{3,})\{glue:figure\}\s*(\S+)",
                           "\n".join(_src(c) for c in course_book.strip_notebook(executed)["cells"]
                                     if c["cell_type"] == "markdown"), re.M)
        attached = {}
        for cell in release["cells"]:
            for file, data in cell.get("attachments", {}).items():
                assert f"{{figure}} attachment:{file}" in _src(cell)
                attached[file.rsplit(".", 1)[0]] = data["image/png"]
        assert sorted(attached) == sorted(shown), name
        for key, png in attached.items():
            assert _src({"source": png}) == _glued_output(executed, key, "image/png"), f"{name}: {key}"
        figures += len(attached)
    assert figures > 0


@pytest.mark.slow
def test_a_typo_in_a_chapter_changes_nothing(tiny):
    course, _ = tiny
    before = _snapshot(course)
    _refused(_run("assignments", "--course", str(course), "--scale", "tiny", "architectures", "tyo",
                  in_process=True),
             "unknown chapter 'tyo'", "did you mean 'toy'")
    assert _snapshot(course) == before


@pytest.mark.slow
def test_rebuilding_replaces_only_what_the_tool_wrote(tiny, tmp_path):
    """A rebuild keeps a teacher's files in the course and refuses to overwrite a file changed since;
    exercises that assert nothing at the scale are left out, and RELEASE.md says so."""
    course = tmp_path / "course"
    shutil.copytree(tiny[0], course)
    (course / "notes.md").write_text("the teacher's notes\n")
    (course / "release" / "letter.md").write_text("Dear students\n")
    with (course / "gradebook.db").open("ab") as f:
        f.write(b"\0")  # as if nbgrader's own commands had been run in it
    before = _snapshot(course)
    _refused(_run("assignments", "--course", str(course), "--scale", "tiny", "architectures",
                  in_process=True),
             "gradebook.db changed since")
    assert _snapshot(course) == before
    (course / "gradebook.db").write_bytes((tiny[0] / "gradebook.db").read_bytes())
    run = _run("assignments", "--course", str(course), "--scale", "tiny", "architectures", "marginals")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (course / "notes.md").read_text() == "the teacher's notes\n"
    assert (course / "release" / "letter.md").read_text() == "Dear students\n"
    assert not (course / "release" / "own_network").exists(), "the tool's own files of a chapter left out go"
    meta = json.loads((course / "exercises.json").read_text())
    assert meta["chapters"] == {"architectures": tiny[1]["architectures"], "marginals": []}
    assert sorted(meta["ungraded"]["marginals"]) == ["mg-ks-key", "mg-power"]
    assert not (course / "release" / "marginals").exists(), "nothing graded: no assignment"
    notes = (course / "release" / "RELEASE.md").read_text()
    assert "## marginals" in notes and "(`mg-power`)" in notes and "Not graded in this release" in notes
    assert f"at most {meta['timeouts']['architectures']} s" in notes
    assert (course / "release" / "architectures" / "RELEASE.md").is_file()
    marker = json.loads((course / course_output.MARKER).read_text())
    assert marker["tool"] == "assignments" and "notes.md" not in marker["files"]
    assert "marginals" in run.stdout and "not graded at scale tiny" in run.stdout


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


def _submit(folder: Path, course: Path, name: str, answer, tamper: bool = False, as_name: str = "") -> None:
    """A student's notebook: the release, each answer cell filled by ``answer(label, teacher's code)``;
    ``tamper``: every test cell replaced by one that fails (grading must use the teacher's tests);
    ``as_name``: the file's name (default: ``<name>.ipynb``)."""
    release = _notebook(course / "release" / name / f"{name}.ipynb")
    teacher = _teacher_answers(_notebook(course / "source" / name / f"{name}.ipynb"))
    for cell in release["cells"]:
        meta = cell["metadata"].get("nbgrader", {})
        if meta.get("solution"):
            cell["source"] = answer(meta["grade_id"], teacher[meta["grade_id"]])
        elif meta.get("grade") and tamper:
            cell["source"] = 'assert False, "a test edited by the student"\n'
    folder.mkdir(parents=True, exist_ok=True)
    (folder / (as_name or f"{name}.ipynb")).write_text(json.dumps(release), encoding="utf-8")


def _reseeded(code: str) -> str:
    """The same answer with other random seeds: a harmless difference that must not cost a point."""
    out = re.sub(r"manual_seed\(([^()]*)\)", r"manual_seed(\1 + 17)", code)
    assert out != code or "manual_seed" not in code
    return out


def _rows(table: Path) -> dict[str, dict]:
    with table.open(newline="") as f:
        return {r["student"]: r for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def graded(tiny, tmp_path_factory):
    """One class graded at ``tiny``: the teacher's answers, one wrong answer, an untouched notebook, a
    broken file, and one student per problem of a submissions folder."""
    course, made = tiny
    tmp = tmp_path_factory.mktemp("graded")
    subs = tmp / "submissions"
    wrong = made["architectures"][-1]  # arch-negative: the student concludes that (a) is a symmetry
    assert wrong == "arch-negative"
    first = made["architectures"][0]
    _submit(subs / "teacher", course, "architectures", lambda label, code: code, tamper=True)
    _submit(subs / "one_wrong", course, "architectures",
            lambda label, code: _reseeded(code) + ("\nrefused = False\n" if label == wrong else ""))
    _submit(subs / "blank", course, "architectures", lambda label, code: "# YOUR CODE HERE\n")
    (subs / "broken").mkdir()
    for name in ("architectures", "own_network"):  # 0, and the others graded
        (subs / "broken" / f"{name}.ipynb").write_text("not a notebook")
    (subs / "empty").mkdir()
    (subs / "zipped").mkdir()
    (subs / "zipped" / "homework.zip").write_bytes(b"PK\x05\x06" + bytes(18))
    # misnamed, and its first answer raises (the second is the teacher's: graded as architectures)
    _submit(subs / "misnamed", course, "architectures",
            lambda label, code: "x = 1\nraise RuntimeError('my own bug')\n" if label == first else code,
            as_name="architectures (1).ipynb")
    _submit(subs / "nested", course, "architectures", lambda label, code: code)  # x.ipynb and x/x.ipynb
    _submit(subs / "nested" / "architectures", course, "architectures", lambda label, code: "")
    jobs = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
    table = course_grading.grade(subs, tmp / "grades", course=course, jobs=jobs)
    return tmp, made, _rows(table)


@pytest.mark.slow
def test_grading_end_to_end(graded):
    """Fake submissions for one chapter, graded by nbgrader at ``tiny``; a second chapter that only a broken
    notebook was handed in for scores 0 for everyone, "No submission" for those who handed in nothing."""
    tmp, made, rows = graded
    wrong = made["architectures"][-1]
    graded_cols = [f"architectures:{label}" for label in made["architectures"]]
    missing = [f"own_network:{label}" for label in made["own_network"]]
    assert list(rows["teacher"]) == ["student", *graded_cols, *missing, "total", "notes"]
    assert all(rows["teacher"][c] == "1" for c in graded_cols), rows["teacher"]
    assert all(rows[s][c] == "0" for s in rows for c in missing), "nothing handed in: 0"
    assert all(rows["blank"][c] == "0" for c in graded_cols), rows["blank"]
    lost = {c for c in graded_cols if rows["one_wrong"][c] == "0"}
    assert lost == {f"architectures:{wrong}"}, rows["one_wrong"]
    assert rows["one_wrong"]["total"] == str(len(graded_cols) - 1)
    assert rows["teacher"]["total"] == str(len(graded_cols)) and rows["blank"]["total"] == "0"
    assert rows["teacher"]["notes"] == rows["one_wrong"]["notes"] == rows["blank"]["notes"] == ""
    feedback = (tmp / "grades/feedback/one_wrong.md").read_text()
    assert f"`{wrong}`: failed: AssertionError: (a) is not a symmetry" in feedback
    assert feedback.count("passed") == len(graded_cols) - 1
    assert all(rows["broken"][c] == "0" for c in graded_cols)
    broken = (tmp / "grades/feedback/broken.md").read_text()
    assert "`architectures.ipynb` is not a notebook Jupyter can open (NotJSONError" in broken
    assert "is not a notebook Jupyter can open" in rows["broken"]["notes"]
    blank = (tmp / "grades/feedback/blank.md").read_text()
    assert "NameError" in blank and "(your answer cell is empty)" in blank
    assert "No submission" in blank  # own_network: nothing handed in
    for text in [p.read_text() for p in (tmp / "grades/feedback").iterdir()] + [str(rows)]:
        for teacher_path in (str(tmp), str(ROOT), ".log"):
            assert teacher_path not in text, f"a path of the teacher's machine: {teacher_path}"


@pytest.mark.slow
def test_every_student_folder_is_in_the_table_with_a_reason(graded):
    tmp, made, rows = graded
    cols = [c for c in rows["teacher"] if ":" in c]
    assert sorted(rows) == sorted(p.name for p in (tmp / "submissions").iterdir())
    for student, reason in [("empty", "nothing handed in: the folder is empty."),
                            ("zipped", "no notebook found, only `homework.zip`: unpack it into the student's "
                                       "folder and grade again.")]:
        assert rows[student]["total"] == "0" and all(rows[student][c] == "0" for c in cols)
        assert rows[student]["notes"] == reason
        assert f"* {reason}\n" in (tmp / f"grades/feedback/{student}.md").read_text()


@pytest.mark.slow
def test_a_misnamed_notebook_is_graded_and_an_exception_named(graded):
    tmp, made, rows = graded
    first, second = made["architectures"]
    row = rows["misnamed"]
    note = "`architectures (1).ipynb` graded as architectures (its name is not architectures.ipynb)."
    assert row["notes"] == note
    assert row[f"architectures:{first}"] == "0" and row[f"architectures:{second}"] == "1"
    assert row["total"] == "1"
    feedback = (tmp / "grades/feedback/misnamed.md").read_text()
    assert f"* {note}\n" in feedback
    assert (f"* `{first}`: failed: your answer cell: RuntimeError: my own bug "
            "(line 2: `raise RuntimeError('my own bug')`)\n") in feedback
    assert f"* `{second}`: passed" in feedback


@pytest.mark.slow
def test_a_nested_duplicate_is_reported_not_graded(graded):
    tmp, made, rows = graded
    row = rows["nested"]
    reason = ("2 different notebooks for architectures: `architectures.ipynb`, "
              "`architectures/architectures.ipynb`; none graded: keep only the one to grade, as "
              "architectures.ipynb.")
    assert row["notes"] == reason and row["total"] == "0"
    assert reason in (tmp / "grades/feedback/nested.md").read_text()


@pytest.mark.slow
def test_grading_never_writes_into_a_teachers_folder(tiny, graded, tmp_path):
    course, _ = tiny
    subs = graded[0] / "submissions"
    target = tmp_path / "grades"
    (target / "course").mkdir(parents=True)
    (target / "course" / "rubric.txt").write_text("my rubric\n")
    before = _snapshot(target)
    _refused(_run("grade", str(subs), "--course", str(course), "--out", str(target)),  # a process of its own
             "did not write", "--out", "'course'")
    _refused(_run("grade", str(subs), "--course", str(course), "--out", str(target), "--fresh",
                  in_process=True),
             "did not write")
    assert _snapshot(target) == before
    _refused(_run("grade", str(subs), "--course", str(course), "--out", str(subs / "out"), in_process=True),
             "outside")
    assert not (subs / "out").exists()
    # a file of the tool's changed since it wrote it is never overwritten
    out = tmp_path / "copy"
    shutil.copytree(graded[0] / "grades", out)
    with (out / "feedback" / "teacher.md").open("a") as f:
        f.write("\nSee me after class.\n")
    before = _snapshot(out)
    _refused(_run("grade", str(subs), "--course", str(course), "--out", str(out), in_process=True),
             "feedback/teacher.md changed since")
    assert _snapshot(out) == before


@pytest.mark.slow
def test_fresh_starts_the_table_over_and_keeps_a_teachers_file(tiny, graded, tmp_path):
    course, _ = tiny
    out = tmp_path / "grades"
    shutil.copytree(graded[0] / "grades", out)
    (out / "notes.txt").write_text("the teacher's\n")
    (tmp_path / "subs" / "newcomer").mkdir(parents=True)  # nothing to grade: no nbgrader run
    run = _run("grade", str(tmp_path / "subs"), "--course", str(course), "--out", str(out), "--fresh")
    assert run.returncode == 0, run.stderr[-3000:]
    assert list(_rows(out / "grades.csv")) == ["newcomer"]
    assert sorted(p.name for p in (out / "feedback").iterdir()) == ["newcomer.md"]
    assert not (out / "course").exists(), "the tool's own files of the old table are gone"
    assert (out / "notes.txt").read_text() == "the teacher's\n"


@pytest.mark.slow
def test_regrading_one_student_keeps_the_others(tiny, graded, tmp_path):
    """A late student and a regraded one, with the same --out: the others' rows and files stay byte for byte,
    the regraded student's old feedback and graded copy are replaced; a cell over --timeout is stopped."""
    course, made = tiny
    out = tmp_path / "grades"
    shutil.copytree(graded[0] / "grades", out)
    (out / "course" / "teacher" / "remark.txt").write_text("the teacher's\n")
    others = {k: v for k, v in _snapshot(out).items() if not re.match(r"(course/|feedback/)(blank|late)\b", k)
              and k not in ("grades.csv", course_output.MARKER)}
    old_rows = _rows(out / "grades.csv")
    first = made["architectures"][0]
    subs = tmp_path / "late"
    _submit(subs / "blank", course, "architectures", lambda label, code: code)  # handed in again, complete
    _submit(subs / "late", course, "architectures",
            lambda label, code: "import time\n\ntime.sleep(600)\n" if label == first else code)
    start = time.perf_counter()
    run = _run("grade", str(subs), "--course", str(course), "--out", str(out), "--timeout", "20", "--jobs",
               "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert time.perf_counter() - start < 300
    rows = _rows(out / "grades.csv")
    assert sorted(rows) == sorted([*old_rows, "late"])
    assert all(rows[s] == old_rows[s] for s in old_rows if s != "blank"), "the others' rows as they were"
    assert rows["blank"]["total"] == str(len(made["architectures"])), "regraded"
    after = _snapshot(out)
    assert {k: after.get(k) for k in others} == others, "the others' files byte for byte"
    blank = (out / "feedback" / "blank.md").read_text()
    assert "NameError" not in blank and blank.count("passed") == len(made["architectures"])
    late = (out / "feedback" / "late.md").read_text()
    assert (f"* `{first}`: failed: your answer cell: stopped after 20 s, the time limit of a cell "
            "(line 3: `time.sleep(600)`)") in late
    assert rows["late"]["total"] == str(len(made["architectures"]) - 1)
