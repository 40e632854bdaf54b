"""The chapters' lanes (``python -m symlib.paper.lanes``, behind ``make chapters``): every chapter converted,
executed in a fresh kernel with the parameters and the lane's threads, its parameters folded and moved out;
a failing chapter reported with its partly executed copy while the others still run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from symlib.paper import lanes

HEADER = """---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  name: python3
  display_name: Python 3
  language: python
---
"""


def _chapter(body: str) -> str:
    cells = "".join(f"\n```{{code-cell}} ipython3\n{code}\n```\n" for code in body)
    return HEADER + "\n# A chapter\n" + cells


PARAMETERS = """---
tags: [parameters]
---
scale = "cpu"  # tiny, cpu or paper
device = "cpu\""""

FIRST = [PARAMETERS, """import os, pathlib
leak = 1
print(scale, device, os.environ["OMP_NUM_THREADS"], os.environ["TQDM_DISABLE"], pathlib.Path.cwd().name)"""]
FAILS = [PARAMETERS, 'raise ValueError("this chapter fails on purpose")']
LAST = [PARAMETERS, 'print("leak" in globals())']


@pytest.fixture
def book(tmp_path):
    src = tmp_path / "notebooks"
    src.mkdir()
    for name, body in (("first", FIRST), ("fails", FAILS), ("last", LAST)):
        (src / f"{name}.md").write_text(_chapter(body))
    (tmp_path / "pages").mkdir()
    return tmp_path


def _outputs(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]


def test_lanes_run_every_chapter_and_report_the_one_that_fails(book, capsys):
    failed = lanes.run(["first", "fails", "last"], scale="tiny", device="cpu", lanes=2, threads=1,
                       work=str(book / "work"), out=str(book / "out"), src=str(book / "notebooks"),
                       cwd=str(book / "pages"))
    assert failed == ["fails"]
    assert sorted(p.name for p in (book / "out").iterdir()) == ["first.ipynb", "last.ipynb"]
    # the parameters reached the kernel, with the lane's threads, no progress bars, in the chapter's folder
    assert "tiny cpu 1 1 pages\n" in _outputs(book / "out" / "first.ipynb")
    assert "False\n" in _outputs(book / "out" / "last.ipynb")  # a fresh kernel per chapter
    # the parameters shown once: the chapter's own cell reads the run's values, papermill's is hidden
    nb = json.loads((book / "out" / "first.ipynb").read_text())
    params = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    assert "".join(params["source"]).splitlines()[0] == 'scale = "tiny"  # tiny, cpu or paper'
    injected = next(c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", []))
    assert "remove-cell" in injected["metadata"]["tags"]
    # the failed chapter: its partly executed copy stays where the report says, with the error
    partial = book / "work" / "fails.out.ipynb"
    err = capsys.readouterr().err
    assert "== chapter fails FAILED after" in err and str(partial) in err and "on purpose" in err
    assert "this chapter fails on purpose" in partial.read_text()


def test_the_command_exits_1_on_a_failed_chapter_and_2_on_an_unknown_one(book, capsys):
    args = ["--scale", "tiny", "--work", str(book / "work"), "--out", str(book / "out"), "--src",
            str(book / "notebooks"), "--cwd", str(book / "pages")]
    assert lanes.main(["fails", *args]) == 1
    assert "1 chapter(s) failed: fails" in capsys.readouterr().err
    (book / "notebooks" / "broken.md").write_bytes(b"\xff\xfe not UTF-8")  # jupytext cannot read it
    assert lanes.main(["broken", "first", *args]) == 1  # reported with its chapter, the others still run
    err = capsys.readouterr().err
    assert "== chapter broken FAILED" in err and "1 chapter(s) failed: broken" in err
    assert "partly executed" not in err.split("== chapter broken FAILED")[1].splitlines()[0]  # none was made
    assert (book / "out" / "first.ipynb").is_file()
    (book / "out" / "first.ipynb").unlink()
    assert lanes.main(["first", "nosuch", *args]) == 2
    err = capsys.readouterr().err
    assert "no chapter nosuch in" in err and "the chapters are broken, fails, first, last" in err
    assert not (book / "out" / "first.ipynb").exists()  # refused before running anything
    with pytest.raises(ValueError, match="at least 1"):
        lanes.run(["first"], scale="tiny", device="cpu", lanes=0, threads=1, work=str(book / "w"),
                  out=str(book / "o"), src=str(book / "notebooks"))
