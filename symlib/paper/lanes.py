"""The chapters executed in parallel lanes (``make chapters``, ``make chapter``, ``make check``).

``python -m symlib.paper.lanes toy minmass --scale tiny --lanes 2 --threads 1 --work build/nb --out book``
runs each chapter as a reader's ``papermill`` would, in ``--lanes`` processes that take the next chapter
(in the order given: longest first) when they finish one. Per chapter, a lane

1. converts the chapter's jupytext source ``<src>/<chapter>.md`` to ``<work>/<chapter>.ipynb``;
2. executes it with papermill in a fresh kernel (one per chapter: no state crosses chapters), in
   ``--cwd``, with the parameters ``scale`` and ``device`` and ``--threads`` intra-op threads (the
   kernel inherits ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS``), into
   ``<work>/<chapter>.out.ipynb``;
3. shows the run's parameters once (:func:`symlib.paper.book.fold_parameters`) and moves the executed
   notebook to ``<out>/<chapter>.ipynb``.

A lane imports papermill and jupytext once for all its chapters, where a command per chapter paid
about 2.5 s of start-up each (papermill's, and a second interpreter for the folding). A chapter whose cell
fails leaves its partly executed copy in ``<work>`` and is reported with the error (so is one whose source
cannot be read), and the other chapters still run; the command then exits with status 1 (2 for a chapter
that does not exist).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclasses.dataclass(frozen=True)
class Job:
    """Where one chapter comes from and goes, and how it runs."""

    chapter: str
    src: str
    work: str
    out: str
    cwd: str
    scale: str
    device: str


def _lane(threads: int) -> None:
    """Set up a lane process: the thread count its kernels inherit, no progress bars in their cells."""
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    os.environ["TQDM_DISABLE"] = "1"


def run_one(job: Job) -> tuple[str, float, str | None]:
    """Convert, execute, fold and move one chapter: ``(chapter, seconds, error or None)``."""
    import logging

    import jupytext
    import papermill

    from symlib.paper.book import fold_parameters

    logging.getLogger("papermill").setLevel(logging.WARNING)
    start = time.perf_counter()
    print(f"== chapter {job.chapter} (scale={job.scale}, device={job.device}, "
          f"{os.environ.get('OMP_NUM_THREADS', '?')} thread(s))", flush=True)
    work, out = Path(job.work), Path(job.out)
    source, executed = work / f"{job.chapter}.ipynb", work / f"{job.chapter}.out.ipynb"
    try:
        jupytext.write(jupytext.read(Path(job.src) / f"{job.chapter}.md"), source)
        papermill.execute_notebook(str(source), str(executed), kernel_name="python3", cwd=job.cwd,
                                   parameters={"scale": job.scale, "device": job.device}, progress_bar=False)
    except Exception as err:  # noqa: BLE001 - a source jupytext cannot read, a failed cell, a kernel that
        # died: reported with the chapter, not raised, so that the other chapters still run
        return job.chapter, time.perf_counter() - start, f"{type(err).__name__}: {err}"
    fold_parameters(str(executed))
    shutil.move(executed, out / f"{job.chapter}.ipynb")
    return job.chapter, time.perf_counter() - start, None


def run(chapters: list[str], *, scale: str, device: str, lanes: int, threads: int, work: str, out: str,
        src: str = "notebooks", cwd: str = "book") -> list[str]:
    """Run ``chapters`` in ``lanes`` processes of ``threads`` threads each; the chapters that failed.

    Raises:
        FileNotFoundError: a chapter without a source ``<src>/<chapter>.md``.
    """
    missing = [c for c in chapters if not (Path(src) / f"{c}.md").is_file()]
    if missing:
        known = sorted(p.stem for p in Path(src).glob("*.md"))
        raise FileNotFoundError(f"no chapter {', '.join(missing)} in {src}/: the chapters are "
                                f"{', '.join(known)}")
    if lanes < 1 or threads < 1:
        raise ValueError(f"lanes and threads must be at least 1, got {lanes} and {threads}")
    for folder in (work, out):
        Path(folder).mkdir(parents=True, exist_ok=True)
    jobs = [Job(c, src, work, out, cwd, scale, device) for c in chapters]
    failed = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(lanes, max(len(jobs), 1)), initializer=_lane,
                                                initargs=(threads,)) as pool:
        # submitted in order: a lane that finishes a chapter takes the next one of the list
        running = [pool.submit(run_one, job) for job in jobs]
        for done in concurrent.futures.as_completed(running):
            chapter, seconds, error = done.result()
            if error is None:
                print(f"== chapter {chapter} done in {seconds:.0f} s", flush=True)
            else:
                failed.append(chapter)
                partial = Path(work) / f"{chapter}.out.ipynb"
                where = f" (its partly executed copy: {partial})" if partial.is_file() else ""
                print(f"== chapter {chapter} FAILED after {seconds:.0f} s{where}\n{error}", file=sys.stderr,
                      flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m symlib.paper.lanes",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("chapters", nargs="+", help="chapter names (notebooks/<name>.md), longest first")
    parser.add_argument("--scale", default="cpu", help="the chapters' scale parameter: tiny, cpu or paper")
    parser.add_argument("--device", default="cpu", help="the chapters' device parameter: cpu or cuda")
    parser.add_argument("--lanes", type=int, default=1, help="chapters executed at once (processes)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of each lane's kernels")
    parser.add_argument("--work", required=True, help="folder of the converted and partly executed notebooks")
    parser.add_argument("--out", required=True, help="folder the executed chapters are moved to")
    parser.add_argument("--src", default="notebooks", help="folder of the chapters' jupytext sources")
    parser.add_argument("--cwd", default="book", help="the kernels' working directory")
    args = parser.parse_args(argv)
    try:
        failed = run(args.chapters, scale=args.scale, device=args.device, lanes=args.lanes,
                     threads=args.threads, work=args.work, out=args.out, src=args.src, cwd=args.cwd)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if failed:
        print(f"== {len(failed)} chapter(s) failed: {' '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
