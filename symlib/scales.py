"""Run scales and chapter parameters (book: "Rerunning the book").

Every chapter and every long job takes ``scale``:

* ``"tiny"``: seconds, a smoke test of the code path;
* ``"cpu"``: the published book, minutes per chapter on a 2-core laptop;
* ``"paper"``: the paper's sizes, meant for a GPU.

:func:`pick` chooses a chapter's settings for a scale; :func:`check_device`
validates the ``device`` parameter. Both fail with an error that names the
accepted values.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from symlib.errors import ArgumentError

__all__ = ["SCALES", "check_device", "check_int", "check_scale", "pick"]

SCALES = ("tiny", "cpu", "paper")
_T = TypeVar("_T")


def check_scale(scale: Any) -> str:
    """Return ``scale`` if it is one of :data:`SCALES`, else raise a clear error."""
    if not isinstance(scale, str):
        raise ArgumentError(f"scale must be a string, one of {SCALES}; got {type(scale).__name__} {scale!r}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {SCALES} (e.g. papermill -p scale cpu)")
    return scale


def pick(scale: str, **by_scale: _T) -> _T:
    """The value for ``scale`` among keyword arguments ``tiny=..., cpu=..., paper=...``."""
    check_scale(scale)
    missing = [s for s in SCALES if s not in by_scale]
    if missing:
        raise ValueError(f"pick() needs a value for every scale; missing {missing}")
    return by_scale[scale]


def check_device(device: Any) -> torch.device:
    """Validate a ``device`` parameter ("cpu", "cuda", "cuda:1", ...) and that it is usable here."""
    if not isinstance(device, (str, torch.device)):
        raise ArgumentError(
            f"device must be a string such as 'cpu' or 'cuda'; got {type(device).__name__} {device!r}"
        )
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}; use 'cpu' or 'cuda'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"device {device!r} was asked for but CUDA is not available here; use device='cpu'"
        )
    return dev


def check_int(name: str, value: Any, minimum: int = 0) -> int:
    """Validate an integer parameter (``seed``, a count) and return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
