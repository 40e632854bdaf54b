r"""Table 1 as a reader sees it (book: chapter "Table 1"): p-values at their test's floor (:func:`format_p`),
values with their intervals (:func:`with_interval`), the side-by-side table in column groups narrow enough
for the page (:func:`paper_tables`) and a pandas ``Styler`` that reads like a paper's table
(:func:`display`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from symlib import scales as _scales
from symlib.paper.table1.frames import paper_frame, side_by_side

MISSING = "\u2013"  # an en dash: a value the paper does not report
NON_BREAKING_HYPHEN = "\u2011"  # "multi-mode" stays on one line
# The side-by-side table in column groups narrow enough for the book's text width.
PAPER_GROUPS = (("MMD", "NS", "Acc", "ECE"), ("Brier", "AUPR", "FPR95", "IDMI", "OODMI"))


def p_floor(n_resamples: int, two_sided: bool = False) -> float:
    r"""The smallest p-value a resampling test can return: ``1 / (B + 1)`` for the permutation test of
    :func:`symlib.stats.mmd.mmd` (``(1 + #{T_b >= T}) / (1 + B)``), ``2 / (R + 1)`` for the two-sided
    bootstrap p-value of :func:`symlib.stats.mmd.difference`."""
    n = _scales.check_int("n_resamples", n_resamples, 1)
    return (2.0 if two_sided else 1.0) / (n + 1)


def _ceil_one_digit(x: float) -> float:
    """``x > 0`` rounded up to one significant digit (0.0099 -> 0.01, 0.004975 -> 0.005)."""
    unit = 10.0 ** math.floor(math.log10(x))
    return math.ceil(round(x / unit, 9)) * unit


def format_p(p: float, floor: float | None = None, digits: int = 2) -> str:
    """A p-value for a table: ``"≤ 0.01"`` at the test's floor (it means "at most ``floor``", the
    resolution of ``B`` resamples, not "0.01"), ``"–"`` when missing, else ``digits`` decimals.

    Args:
        p: the p-value.
        floor: the test's smallest possible value (:func:`p_floor`), or ``None`` (no floor marked).
        digits: decimals of the other values.
    """
    if p is None or p != p:
        return MISSING
    if floor is not None and p <= floor * (1 + 1e-9):
        return f"\u2264 {_ceil_one_digit(floor):g}"
    return f"{p:.{digits}f}"


def paper_tables(ours, paper=None, groups: Sequence[Sequence[str]] = PAPER_GROUPS) -> list:
    """:func:`~symlib.paper.table1.frames.side_by_side` split into column groups (:data:`PAPER_GROUPS`:
    distances, accuracy and calibration; then OOD detection and mutual information), each narrow enough for
    the text width."""
    paper = paper_frame() if paper is None else paper
    return [side_by_side(ours, paper, [c for c in g if c in ours]) for g in groups]


def display(frame, digits: int = 1, p_columns: Sequence = (), floor: float | None = None,
            missing: str = MISSING, uuid: str | None = None, caption: str | None = None):
    """A DataFrame styled to read like a paper's table (a pandas ``Styler``; the frame is not changed).

    Numbers get ``digits`` decimals, missing values print as ``missing`` ("–", not NaN), the columns
    named in ``p_columns`` are p-values (:func:`format_p`, ``"≤ 0.01"`` at ``floor``), strings pass
    through. Hyphens in the row labels become non-breaking ("multi-mode" never wraps), no cell wraps, and
    a table wider than the page scrolls horizontally instead of being cut off. A ``caption`` is part of the
    table (an HTML ``<caption>`` above it): a cell that shows several tables gives each its own caption
    this way, where printed captions would be merged into one stream above all the tables.

    Args:
        frame: the table (any index; MultiIndex columns allowed).
        digits: decimals of the numeric cells.
        p_columns: column keys holding p-values.
        floor: the p-values' floor (:func:`p_floor`).
        missing: what a missing value prints as.
        uuid: a fixed id for the HTML (stable outputs across runs).
        caption: the table's caption, or ``None``.

    Returns:
        ``frame.style`` with the formats and the table styles set.
    """
    from pandas import NA

    def cell(v):
        if isinstance(v, str):
            return v
        if v is None or v is NA or (isinstance(v, float | np.floating) and np.isnan(v)):
            return missing  # NaN, or pd.NA in an integer column (dtype "Int64")
        if isinstance(v, int | np.integer) and not isinstance(v, bool):
            return str(v)
        return f"{float(v):.{digits}f}"

    def label(v):
        return str(v).replace("-", NON_BREAKING_HYPHEN)

    styler = frame.style
    if uuid is not None:
        styler = styler.set_uuid(uuid)
    p_columns = [c for c in p_columns if c in frame.columns]
    others = [c for c in frame.columns if c not in p_columns]
    if others:
        styler = styler.format(cell, subset=others)
    if p_columns:
        styler = styler.format(lambda v: format_p(v, floor) if not isinstance(v, str) else v,
                               subset=p_columns)
    styler = styler.format_index(label, axis=0)
    styles = [{"selector": "", "props": "display: block; overflow-x: auto; max-width: 100%;"},
              {"selector": "th, td", "props": "white-space: nowrap;"}]
    if caption is not None:
        styler = styler.set_caption(caption)
        styles.append({"selector": "caption",
                       "props": "caption-side: top; text-align: left; padding: 0 0 0.3em;"})
    return styler.set_table_styles(styles)


def with_interval(frame, column: str, digits: int = 1) -> list[str]:
    """``"value [lo, hi]"`` strings of ``column`` and its ``_lo``/``_hi`` bounds, for display."""
    out = []
    for v, lo, hi in zip(frame[column], frame[f"{column}_lo"], frame[f"{column}_hi"], strict=True):
        out.append(f"{v:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]")
    return out
