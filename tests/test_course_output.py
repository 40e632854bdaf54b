"""The course tools' output folders (``course/output.py``): a tool writes only into a folder it made (its
marker ``.symlib-course.json``) or an empty one, replaces only the files it wrote and that nobody changed
since, checks everything before it moves anything, and fails with one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course.output import MARKER, CourseError, Output  # noqa: E402


def _stage(tmp: Path, files: dict[str, str]) -> Path:
    stage = tmp / "stage"
    for rel, text in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_text(text)
    return stage


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_or_empty_folder_is_claimed_and_a_teachers_is_refused(tmp_path):
    out = Output(tmp_path / "new" / "deep", "slides", "--out")
    assert out.files == {} and not (tmp_path / "new").exists(), "nothing written before the commit"
    out.commit(_stage(tmp_path, {"a.html": "a", "src/b.md": "b"}))
    marker = json.loads((tmp_path / "new/deep" / MARKER).read_text())
    assert marker["tool"] == "slides" and sorted(marker["files"]) == ["a.html", "src/b.md"]
    (tmp_path / "empty").mkdir()
    assert Output(tmp_path / "empty", "grade", "--out").files == {}
    (tmp_path / "teacher").mkdir()
    (tmp_path / "teacher" / "index.html").write_text("mine")
    with pytest.raises(CourseError, match=r"--out .*teacher holds files that `python -m course slides` did "
                                          r"not write \('index.html'\)"):
        Output(tmp_path / "teacher", "slides", "--out")
    with pytest.raises(CourseError, match="was made by `python -m course slides`, not by `python -m course "
                                          "grade`"):
        Output(tmp_path / "new/deep", "grade", "--out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CourseError, match="not a folder"):
        Output(tmp_path / "file", "grade", "--out")


def test_a_commit_replaces_only_the_tools_unchanged_files(tmp_path):
    folder = tmp_path / "out"
    first = _stage(tmp_path / "1", {"a": "1", "d/b": "1", "d/c": "1"})
    Output(folder, "assignments", "--course").commit(first)
    (folder / "teacher.txt").write_text("the teacher's")
    (folder / "d" / "teacher.txt").write_text("the teacher's too")
    out = Output(folder, "assignments", "--course")
    out.commit(_stage(tmp_path / "2", {"a": "2", "e/f": "2"}))  # d/b and d/c: the tool's, not made again
    assert _tree(folder) == {MARKER: (folder / MARKER).read_bytes(), "a": b"2", "e/f": b"2",
                             "teacher.txt": b"the teacher's", "d/teacher.txt": b"the teacher's too"}
    # a file of the tool's changed since, or a teacher's file where the tool would write: nothing moves
    (folder / "a").write_text("edited")
    before = _tree(folder)
    with pytest.raises(CourseError, match=r"out/a changed since `python -m course assignments` wrote it"):
        Output(folder, "assignments", "--course").commit(_stage(tmp_path / "3", {"x": "3"}))
    with pytest.raises(CourseError, match=r"out/teacher.txt was not written by"):
        Output(folder, "assignments", "--course").commit(_stage(tmp_path / "4", {"teacher.txt": "4"}),
                                                         replace=lambda rel: False)
    with pytest.raises(CourseError, match="changed since"):
        Output(folder, "assignments", "--course").check_replace()
    assert _tree(folder) == before


def test_a_partial_commit_keeps_the_others_files(tmp_path):
    folder = tmp_path / "out"
    first = _stage(tmp_path / "1", {"feedback/ada.md": "a", "feedback/bob.md": "b", "grades.csv": "1"})
    Output(folder, "grade", "--out").commit(first)
    out = Output(folder, "grade", "--out")
    out.commit(_stage(tmp_path / "2", {"feedback/bob.md": "b2", "grades.csv": "2"}),
               replace=lambda rel: rel in ("grades.csv", "feedback/bob.md"))
    assert (folder / "feedback/ada.md").read_text() == "a"
    assert (folder / "feedback/bob.md").read_text() == "b2"
    assert sorted(json.loads((folder / MARKER).read_text())["files"]) == [
        "feedback/ada.md", "feedback/bob.md", "grades.csv"]


def test_a_problem_is_one_line_and_exit_status_2():
    cmd = [sys.executable, "-m", "course", "slides", "--out", str(ROOT / "build/never"), "tyo"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == ("python -m course slides: error: unknown chapter 'tyo': did you mean "
                                  "'toy'? the chapters are " + ", ".join(_toc()))
    assert not (ROOT / "build/never").exists()


def _toc() -> list[str]:
    from course.book import toc_chapters

    return toc_chapters(ROOT)
