"""The teaching kit of the living paper: the book's two editions, slides, and auto-graded assignments.

The command-line tools run as ``python -m course <tool>`` from the repository's root (``make slides``,
``make assignments``, ``make grade`` call them)::

    python -m course slides [--out build/slides] [chapter ...]
    python -m course assignments [--course build/assignments] [--scale cpu] [--timeout S] [chapter ...]
    python -m course grade <submissions> [--course build/assignments] [--out build/grades] [--jobs N]
                           [--timeout S] [--fresh]

Each writes only into a new or empty folder, or one it made itself (:mod:`course.output`), and checks
its chapters and folders before it writes anything: a problem is one line on stderr, exit status 2.

One module per concept:

* :mod:`course.notebooks`: a notebook cell's source and tags; reading and writing notebooks;
* :mod:`course.output`: the tools' output folders (written only where the tool may) and their errors;
* :mod:`course.book`: the chapters of ``_toc.yml``, their solutions (found and removed, gated or not),
  the two editions and the launch buttons: the plain Python behind the book's Sphinx extension
  ``book/_ext/course_book.py``;
* :mod:`course.asserts`: the ``assert`` statements of a cell and which of them run at given parameters;
* :mod:`course.glue`: the values a chapter glues, pasted into its text for notebooks read outside the book;
* :mod:`course.assignments`: nbgrader assignments from the computational exercises;
* :mod:`course.grading`: grading a folder of submissions with nbgrader;
* :mod:`course.slides`: what of a chapter goes on its deck;
* :mod:`course.slides_build`: the decks built by Sphinx into reveal.js slides (and the slides' own
  Sphinx extension).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository: ``_toc.yml``, the executed chapters in ``book/``, the outputs in ``build/``."""
