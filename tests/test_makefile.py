"""The Makefile's parallel chapter lanes: never more lanes than chapters or cores, never more threads in
all than cores, one lane on a GPU."""

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
