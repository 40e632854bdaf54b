"""The Makefile's parallel chapter lanes: never more lanes than chapters or cores, never more threads in
all than cores, one lane on a GPU; and `make check`, the fast inner loop (its dry runs create empty folders
under build/ only)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def show(expr: str, **var: str) -> list[str]:
    """The words of ``expr`` as the Makefile expands it with these variables."""
    rule = f"show-it: ; @echo {expr}"
    args = [f"{k}={v}" for k, v in var.items()]
    run = subprocess.run(["make", "-s", "--no-print-directory", "--eval", rule, "show-it", *args],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return run.stdout.split()


def lanes(**var: str) -> tuple[int, int]:
    """``(LANES, LANE_THREADS)`` as the Makefile computes them for these variables."""
    n_lanes, threads = show("$(LANES) $(LANE_THREADS)", **var)
    return int(n_lanes), int(threads)


@pytest.mark.parametrize("ncpu", [1, 2, 3, 16])
@pytest.mark.parametrize("jobs", [1, 2, 4])
@pytest.mark.parametrize("chapters", ["", "toy", "toy marginals", "table1 alignment collapse toy"])
def test_lanes_never_oversubscribe(ncpu, jobs, chapters):
    n_lanes, threads = lanes(NCPU=str(ncpu), JOBS=str(jobs), CHAPTERS=chapters)
    n_chapters = len(chapters.split())
    assert 1 <= n_lanes <= max(1, min(jobs, n_chapters, ncpu))
    assert threads >= 1
    assert n_lanes * threads <= ncpu
    if n_lanes == 1:  # a single lane uses every core
        assert threads == ncpu


def test_defaults_two_lanes_on_a_cpu_one_on_a_gpu():
    assert lanes(NCPU="2") == (2, 1)
    assert lanes(NCPU="2", DEVICE="cuda") == (1, 2)
    assert lanes(NCPU="1") == (1, 1)


def test_default_chapters_are_every_notebook_once():
    out = show("$(CHAPTERS)")
    assert sorted(out) == sorted(p.stem for p in (ROOT / "notebooks").glob("*.md"))
    assert len(out) == len(set(out))


@pytest.mark.parametrize("ncpu", [1, 2, 3, 16])
def test_unit_workers_never_oversubscribe(ncpu):
    workers, threads = (int(v) for v in show("$(UNIT_WORKERS) $(UNIT_THREADS)", NCPU=str(ncpu)))
    assert 1 <= workers <= ncpu and threads >= 1 and workers * threads <= ncpu


def test_nbval_runs_every_chapter_in_the_lanes_of_make_chapters():
    """`make nbval` checks each chapter once, LANES at a time, with the lanes' thread count (dry run)."""
    cmd = ["make", "-n", "--no-print-directory", "nbval", "NCPU=2", "CACHES_READY=1"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    script = run.stdout
    assert "xargs -P 2 -I{}" in script and "OMP_NUM_THREADS=1" in script
    assert "--nbval-lax" in script and "book/{}.ipynb" in script
    chapters = show("$(CHAPTERS)")
    assert f"nbval over {len(chapters)} chapter(s)" in script


def dry_run(target: str, *args: str) -> str:
    """What ``make -n target`` would run (recursive makes included: make runs those even with ``-n``)."""
    cmd = ["make", "-n", "--no-print-directory", target, "NCPU=2", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_check_runs_lint_unit_tiny_chapters_and_the_strict_book_in_order():
    """`make check`: ruff, the unit tests but the slow ones, then every chapter at scale=tiny with the strict
    book beside them, stopping at the first failure (the phases of `make test`), listed in `make help`."""
    assert show("$(CHECK_PHASES)") == ["lint", "unit-fast", "check-tiny-and-book"]
    script = dry_run("check")
    assert "for phase in lint unit-fast check-tiny-and-book; do" in script
    fast = dry_run("unit-fast")
    assert '-m "not slow" --ignore=tests/book tests' in fast  # make check leaves the slow tests out
    assert '-m "' not in dry_run("unit")  # make test runs them all
    assert "phase times" in script  # the phases macro: stops at the first failure, then reports
    assert "ruff check symlib tests benchmarks" in dry_run("lint")
    unit = dry_run("unit")
    assert "-m pytest" in unit and "--ignore=tests/book tests" in unit
    book = dry_run("book-check", "CACHES_READY=1")
    assert "jupyter-book build . -W -n --keep-going" in book and "pytest" in book and "tests/book" in book
    lines = (ROOT / "Makefile").read_text().splitlines()
    phony = " ".join(line.split(":", 1)[1] for line in lines if line.startswith(".PHONY:")).split()
    assert {"check", "check-chapters", "check-tiny-and-book", "unit-fast", "book-check-teacher"} <= set(phony)
    both = dry_run("check-tiny-and-book", "CACHES_READY=1")  # the book's dry run goes to its log
    assert "-m symlib.paper.lanes" in both and "--scale tiny" in both and "jupyter-book build" not in both
    log = (ROOT / show("$(CHECK_DIR)")[0] / "book-check.log").read_text()
    # make check's book: the teacher's edition, strictly, and its checks (make test builds both editions)
    assert "jupyter-book build . -W -n --keep-going" in log and "tests/book" in log
    assert "BOOK_EDITION=teacher" in log and "BOOK_EDITION=student" not in log
    assert "SYMLIB_BOOK_EDITIONS=teacher" in log
    assert "BOOK_EDITION=student" in book and "BOOK_EDITION=teacher" in book  # make test: both
    assert "== the tiny chapters: green" in both and "== the strict book and its checks: green" in both
    helped = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True,
                            check=True)
    assert "make check" in helped.stdout


def test_bytecode_is_written_as_modules_are_imported():
    """The Makefile's commands write bytecode as they import (Python's default, even where the environment
    sets PYTHONDONTWRITEBYTECODE), so that no bytecode pass over the whole venv is needed."""
    import os

    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = ["make", "-s", "--no-print-directory", "--eval",
           "show-env: ; @echo \"[$${PYTHONDONTWRITEBYTECODE-unset}]\"", "show-env"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "[unset]"
    assert "compileall" not in dry_run("env", "-B")


def test_check_runs_every_chapter_at_tiny_scale_into_build_only():
    """`make check`'s chapters: the tiny caches of their own first (never build/zoo-cache), then every
    chapter once with papermill at scale=tiny in the lanes of `make chapters` (symlib.paper.lanes), every
    file it writes under build/check/ (book/*.ipynb hold the committed cpu-scale chapters); `make chapters`
    still writes book/."""
    script = dry_run("check-chapters")
    lines = script.splitlines()
    tiny = show("$(CHECK_CACHE)")[0]
    assert tiny != show("$(SYMLIB_CACHE)")[0] and tiny.endswith("/build/zoo-cache-tiny")
    caches = [i for i, line in enumerate(lines) if "-m symlib.paper.caches --scale tiny --device cpu" in line]
    runs = [i for i, line in enumerate(lines) if "-m symlib.paper.lanes" in line]
    assert caches and runs and caches[0] < runs[0]
    joined = script.replace("\\\n", "")
    steps = [line for line in joined.splitlines() if re.search(r" (zoo|chapters) SCALE=tiny", line)]
    assert len(steps) == 2 and all(f"SYMLIB_CACHE={tiny}" in line for line in steps), steps
    assert "1 thread(s) each (scale=tiny, device=cpu)" in script
    (names, scale, device, n_lanes, threads, work, out), = re.findall(
        r"-m symlib\.paper\.lanes (.+?) --scale (\S+) --device (\S+) --lanes (\d+) +--threads (\d+) "
        r"+--work (\S+) --out (\S+)", joined)
    chapters = sorted(p.stem for p in (ROOT / "notebooks").glob("*.md"))
    assert sorted(names.split()) == chapters  # every chapter once
    assert (scale, device, n_lanes, threads) == ("tiny", "cpu", "2", "1")
    assert (work, out) == ("build/check/src", "build/check/nb")
    assert "jupytext" not in script and "book/" not in script
    default = dry_run("chapters", "CHAPTERS=toy", "CACHES_READY=1").replace("\\\n", "")
    assert re.search(r"-m symlib\.paper\.lanes toy --scale cpu --device cpu .*--work build/nb --out book",
                     default)
    alone = dry_run("chapter", "CH=toy").replace("\\\n", "")  # a chapter on its own: one lane, every core
    assert re.search(r"-m symlib\.paper\.lanes toy --scale cpu --device cpu --threads 2 +--work build/nb "
                     r"--out book", alone)


def test_assignments_honours_its_chapter_list():
    """``make assignments CHAPTERS="toy minmass"`` builds those chapters only; without it, every one."""
    given = dry_run("assignments", "CHAPTERS=toy minmass")
    line = next(x for x in given.splitlines() if "-m course assignments" in x)
    assert line.split()[-2:] == ["toy", "minmass"], line
    default = next(x for x in dry_run("assignments").splitlines() if "-m course assignments" in x)
    assert default.split()[-2:] == ["--scale", "cpu"], default
