"""Print pip's package sources as uv arguments: `make env` installs the lock with uv, which reads neither
pip's configuration files nor its PIP_* variables.

On machines whose pip is configured with local indexes (torch's CUDA build on the machine's own disk, say),
uv would otherwise download the same wheels from PyPI. What is carried over: the index, the extra indexes,
the find-links folders and the constraint files, each from pip's environment variables if set there, else
from its `install` section, else from its `global` one (pip's own order). Nothing configured: nothing
printed, and uv uses PyPI as pip does.

Usage: python tools/uv_sources.py [PYTHON]   (PYTHON: the interpreter whose pip to ask; default this one)
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "find-links": "--find-links", "constraint": "--constraint"}
SECTIONS = (":env:", "install", "global")  # the first that sets a key wins, as in pip


def parse(listing: str) -> dict[str, list[str]]:
    """``{key: values}`` from the output of ``pip config list`` (``section.key='value'`` per line)."""
    found: dict[tuple[str, str], list[str]] = {}
    for line in listing.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.strip().rpartition(".")
        if not sep or not dot or key not in OPTIONS:
            continue
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip().strip("'\"")
        found[(section, key)] = str(value).split()
    return {key: found[(section, key)] for key in OPTIONS for section in reversed(SECTIONS)
            if (section, key) in found}


def arguments(values: dict[str, list[str]]) -> list[str]:
    """uv's options for :func:`parse`'s values (uv takes one ``--index-url``: the last that pip lists)."""
    out: list[str] = []
    for key, flag in OPTIONS.items():
        items = values.get(key, [])
        if key == "index-url":
            items = items[-1:]
        for item in items:
            out += [flag, item]
    return out


def main(argv: list[str]) -> int:
    python = argv[1] if len(argv) > 1 else sys.executable
    try:
        run = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
        failed = run.stderr.strip() if run.returncode != 0 else ""
    except OSError as e:
        failed = str(e)
    if failed:
        print(f"uv_sources: `{python} -m pip config list` failed: {failed}", file=sys.stderr)
        return 2
    print(shlex.join(arguments(parse(run.stdout))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
