"""``python -m course <tool> [options]``: the teaching kit's command-line tools (``make slides``,
``make assignments``, ``make grade``). ``python -m course <tool> --help`` gives a tool's options.

A problem with the command line or its inputs (an unknown chapter, a folder the tool did not make)
ends the tool before it writes anything, with one line on stderr and exit status 2."""

from __future__ import annotations

import importlib
import sys

TOOLS = {
    "slides": ("course.slides_build", "one reveal.js deck per chapter, from book/<name>.ipynb"),
    "assignments": ("course.assignments", "nbgrader assignments from the computational exercises"),
    "grade": ("course.grading", "grade <folder>/<student>/<chapter>.ipynb with nbgrader"),
}


def _usage() -> str:
    width = max(map(len, TOOLS))
    return "usage: python -m course {" + ",".join(TOOLS) + "} [options]\n\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, (_, what) in TOOLS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in TOOLS:
        print(f"{_usage()}\n\npython -m course: unknown tool {argv[0]!r}", file=sys.stderr)
        return 2
    from .output import CourseError

    try:
        return importlib.import_module(TOOLS[argv[0]][0]).main(argv[1:])
    except CourseError as e:  # a problem with the command line or its inputs: one line, no traceback
        print(f"python -m course {argv[0]}: error: {e.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
