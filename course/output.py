"""The folders the course tools write: only folders a tool made, or empty ones, and only the files it wrote.

A course tool (``slides``, ``assignments``, ``grade``) writes its output folder through an :class:`Output`:

* the folder must be new, empty, or one that the same tool made: its marker file :data:`MARKER`
  (``.symlib-course.json``) names the tool and every file the tool wrote there, with its SHA-256. A
  folder with anything else in it is refused before anything is written;
* the tool writes everything into a staging folder of its own (a temporary folder) first; only when
  the whole run has succeeded does :meth:`Output.commit` move the staged files into place. A run that
  fails (a Sphinx warning, an nbgrader error) leaves the output folder as it was;
* the commit replaces or deletes only files listed in the marker whose content is still what the
  tool wrote. A file someone else put into the folder stays, byte for byte; a file of the tool's that
  was changed since (a teacher's edits, nbgrader's own commands run there) is never overwritten: the
  commit refuses, naming it, before it moves anything.

Problems with the command line or its inputs are :class:`CourseError`: ``python -m course`` prints
their one line (the problem and the fix) and exits with status 2, no traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

MARKER = ".symlib-course.json"


class CourseError(SystemExit):
    """A problem with a course tool's command line or inputs: one line that names it and the fix.

    ``python -m course`` prints it and exits with status 2. (A :class:`SystemExit`, so that a tool's
    ``main`` called from Python stops with the message too.)"""

    def __init__(self, message: str):
        message = " ".join(str(message).split())  # one line
        super().__init__(message)
        self.message = message


def digest(path: Path) -> str:
    """The SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative POSIX paths, symbolic links included), sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        base = Path(dirpath)
        out += [(base / f).relative_to(folder).as_posix() for f in filenames]
        out += [(base / d).relative_to(folder).as_posix() for d in dirnames if (base / d).is_symlink()]
    return sorted(out)


def _show(names: Iterable[str], n: int = 3) -> str:
    names = sorted(names)
    return ", ".join(repr(x) for x in names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


class Output:
    """The output folder of one course tool (see the module's docstring).

    Args:
        folder: the folder.
        tool: the tool's name (``slides``, ``assignments``, ``grade``), written into the marker.
        option: the command-line option that names the folder (for the messages), e.g. ``--out``.

    Raises:
        CourseError: the folder is a file, or holds files and is not the tool's (no marker, or another
            tool's marker). Nothing is written.
    """

    def __init__(self, folder: Path, tool: str, option: str):
        self.folder = Path(folder).resolve()
        self.tool = tool
        self.option = option
        self.info: dict = {}
        self.files: dict[str, str] = self._claim()

    @property
    def command(self) -> str:
        return f"`python -m course {self.tool}`"

    def _claim(self) -> dict[str, str]:
        folder, marker = self.folder, self.folder / MARKER
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            raise CourseError(f"{self.option} {folder}: not a folder. Give a new or empty folder for "
                              f"{self.command} to write into.")
        if not folder.exists():
            return {}
        if not marker.is_file():
            entries = [p.name for p in folder.iterdir()]
            if entries:
                raise CourseError(
                    f"{self.option} {folder} holds files that {self.command} did not write "
                    f"({_show(entries)}); it writes only into a new or empty folder, or one it made "
                    f"itself. Give another {self.option}, or move those files away (if an earlier version "
                    f"of this tool made the folder, delete it yourself).")
            return {}
        try:
            data = json.loads(marker.read_text(encoding="utf-8"))
            files = dict(data["files"])
            tool = data["tool"]
        except (ValueError, KeyError, TypeError) as e:
            raise CourseError(f"{marker} is not readable ({type(e).__name__}); it is not {self.command}'s "
                              f"marker: give another {self.option}.") from None
        if tool != self.tool:
            raise CourseError(f"{self.option} {folder} was made by `python -m course {tool}`, not by "
                              f"{self.command}: give another {self.option}.")
        self.info = {k: v for k, v in data.items() if k not in ("tool", "files")}
        return files

    # ----------------------------------------------------------------------------------------------

    def changed(self, rel: str) -> bool:
        """Whether the tool's file ``rel`` is no longer what the tool wrote (missing counts as unchanged)."""
        p = self.folder / rel
        if not (p.exists() or p.is_symlink()):
            return False
        return p.is_symlink() or not p.is_file() or digest(p) != self.files[rel]

    def check(self, paths: Iterable[str]) -> None:
        """Refuse (:class:`CourseError`) if writing or deleting ``paths`` (relative) would touch a file the
        tool did not write, or one changed since it wrote it, or if a folder on their way is a file."""
        for rel in sorted(set(paths)):
            p = self.folder / rel
            for parent in list(Path(rel).parents)[:-1]:
                q = self.folder / parent
                if q.is_symlink() or (q.exists() and not q.is_dir()):
                    raise CourseError(f"{q} is in the way of {self.command}'s output (it is not a folder the "
                                      f"tool made): move it away, or give another {self.option}.")
            if not (p.exists() or p.is_symlink()):
                continue
            if rel not in self.files:
                raise CourseError(f"{p} was not written by {self.command}, which would replace it: move it "
                                  f"away, or give another {self.option}.")
            if self.changed(rel):
                raise CourseError(f"{p} changed since {self.command} wrote it, which would replace it: move "
                                  f"it away (or copy what you need from it), then run again.")

    def check_replace(self, replace: Callable[[str], bool] = lambda rel: True) -> None:
        """:meth:`check` the tool's earlier files that a run would replace or delete (``replace(rel)``),
        before the run starts."""
        self.check(rel for rel in self.files if replace(rel))

    def stage(self) -> tempfile.TemporaryDirectory:
        """A temporary folder (``TMPDIR``) to write the run's output into, removed afterwards."""
        return tempfile.TemporaryDirectory(prefix=f"symlib-course-{self.tool}-")

    def commit(self, stage: Path, replace: Callable[[str], bool] = lambda rel: True, **info) -> list[str]:
        """Move every file under ``stage`` into the output folder, and delete the tool's earlier files
        for which ``replace(rel)`` holds (all of them by default) that the stage does not bring again.

        Checks everything first (:meth:`check`): nothing is moved or deleted if any file in the way
        is not the tool's or was changed. ``info`` goes into the marker. Returns the new files.
        """
        stage = Path(stage)
        new = [rel for rel in _files(stage) if rel != MARKER]
        gone = [rel for rel in self.files if replace(rel) and rel not in set(new)]
        self.check([*new, *gone])
        self.folder.mkdir(parents=True, exist_ok=True)
        files = {rel: h for rel, h in self.files.items() if rel not in set(gone)}
        # the marker first names the files about to be written, so that an interrupted commit leaves
        # a folder the tool still recognises as its own
        hashes = {rel: digest(stage / rel) for rel in new}
        self._write_marker({**files, **hashes}, info)
        emptied = set()
        for rel in gone:
            p = self.folder / rel
            if p.exists():
                p.unlink()
                emptied |= {self.folder / q for q in Path(rel).parents if q != Path(".")}
        for rel in new:
            dest = self.folder / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(stage / rel, dest)
        for d in sorted(emptied, key=lambda p: len(p.parts), reverse=True):  # folders its deletions emptied
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        self.files = {**files, **hashes}
        return new

    def _write_marker(self, files: dict[str, str], info: dict) -> None:
        self.info = {**self.info, **info}
        data = {"tool": self.tool, "note": f"written by {self.command}: it replaces or deletes only the "
                "files listed here, and only while their SHA-256 is the one listed", **self.info,
                "files": dict(sorted(files.items()))}
        tmp = self.folder / (MARKER + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.folder / MARKER)
