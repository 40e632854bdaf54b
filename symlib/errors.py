"""The project's error types, at the bottom of the package so that every layer raises the same ones.

Every one is a :class:`ValueError` (bad input, a damaged file, a network symlib cannot handle): its message
names the problem and the fix, and the ``symlib`` command prints it as one line. Anything else that escapes
a command is a bug, shown with its traceback (:mod:`symlib.cli`).

* :class:`StoreError`: a checkpoint folder or file that is missing, corrupt, incomplete or not what was
  asked for (``symlib.zoo.ZooError`` is this class); :class:`DamagedError`, one that writing it again
  repairs; :class:`CheckpointError`, checkpoint files or a network recipe that cannot be read or built
  as asked;
* :class:`ArgumentError`: an argument of the wrong type or an unknown name (also a :class:`TypeError`);
* :class:`SymmetryError`: a network or parameter set that a symmetry operation cannot handle;
  :class:`InputShapeError`, one that does not run on an input of the shape it was traced with;
* :class:`CorruptFileError`: a data file that exists but is damaged.

Each class is also importable from where it is raised (``symlib.store.StoreError``,
``symlib.ckpt.CheckpointError``, ``symlib.symmetry.spec.SymmetryError``,
``symlib.data.idx.CorruptFileError``).
"""

from __future__ import annotations

__all__ = ["USER_ERRORS", "ArgumentError", "CheckpointError", "CorruptFileError", "DamagedError",
           "InputShapeError", "StoreError", "SymmetryError"]


class StoreError(ValueError):
    """A checkpoint folder or file that is missing, corrupt, incomplete or not what was asked for.

    ``symlib.zoo.ZooError`` is this class (zoos and sample sets share the format)."""


class DamagedError(StoreError):
    """A file of a checkpoint set that is missing, unreadable or fails its checksum (a damaged disk, an
    interrupted copy): writing it again from the same computation repairs it. A file that is intact but
    belongs to another set is a plain :class:`StoreError`: it is never overwritten."""


class CheckpointError(StoreError):
    """Checkpoint files that cannot be read as asked: a missing file or empty glob, a file of another
    kind, another architecture or shape, a missing or ambiguous prefix, non-finite weights, a pickle
    that needs code, or a network recipe that cannot be built. The message names the file and, where
    there is one, the fix. Nothing is written when it is raised (it is a :class:`StoreError`, so the
    ``symlib`` command reports it)."""


class ArgumentError(ValueError, TypeError):
    """An argument of the wrong type or an unknown name (a hyper-parameter, a scale): a :class:`TypeError`
    for Python callers, and a :class:`ValueError` like every user error, so the ``symlib`` command reports
    it as one line."""


class SymmetryError(ValueError):
    """A network or a parameter set that a symmetry operation cannot handle."""


class InputShapeError(SymmetryError):
    """A network that does not run on one input of the shape it was traced with (the tracer's own error
    is its ``__cause__``)."""


class CorruptFileError(ValueError):
    """A data file exists but is damaged, truncated or not what its name says."""


USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, ImportError,
                                                FloatingPointError)
"""What a command reports as one line: the project's errors and input validation (every one a
:class:`ValueError`), a missing file, a missing optional package, a diverged computation."""
