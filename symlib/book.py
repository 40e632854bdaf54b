"""Glue for the living paper: numbers and figures from a chapter's run into its prose (myst-nb).

``glue`` is myst-nb's, with two fixes every chapter needs: numpy and torch
scalars become plain Python numbers (numpy 2 prints ``np.float64(...)``, which
myst-nb cannot format in ``{glue:text}`name:.2f```), and a glued figure is
closed so that it appears only where the text places it.
"""

from __future__ import annotations

from typing import Any


def plain(value: Any) -> Any:
    """``value`` as a plain Python scalar when it is a numpy or torch scalar, else unchanged."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    return value


def glue(name: str, value: Any, display: bool = False) -> None:
    """Record ``value`` under ``name`` for ``{glue:text}`` / ``{glue:figure}`` in the chapter's text."""
    from myst_nb import glue as _glue

    value = plain(value)
    _glue(name, value, display=display)
    if type(value).__name__ == "Figure":
        import matplotlib.pyplot as plt

        plt.close(value)
