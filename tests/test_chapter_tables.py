"""Tables in the chapters keep their keys as labels: no index is relabelled by position.

A table built from a dict (``{"ns": ..., "raw": ...}``) whose index is then overwritten by a list of labels
depends on the dict's order; once that order changed (a sorted key set puts ``"ns"`` first), the labels of
two published rows were swapped without any error. The chapters rename by key (``.rename(index={key:
label})``) or build tables whose index comes from the same keys (:func:`symlib.paper.truth.labelled`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CHAPTERS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.md"))
POSITIONAL = re.compile(r"^\s*[A-Za-z_][\w.]*\.(index|columns)\s*=\s*\[", re.M)


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_no_chapter_relabels_a_table_by_position(chapter):
    text = chapter.read_text()
    hits = [text[: m.start()].count("\n") + 1 for m in POSITIONAL.finditer(text)]
    assert not hits, (f"{chapter.name}, line(s) {hits}: a table's labels set by position; rename by key "
                      "instead (.rename(index={key: label}))")


def test_the_check_sees_the_pattern_it_forbids():
    assert POSITIONAL.search('agreement.index = ["raw weights (MMD)", "symmetries removed (NS)"]\n')
    assert POSITIONAL.search('    noise.columns = [f"{x}" for x in y]\n')
    assert not POSITIONAL.search('versus = versus.rename(index={"raw": "raw weights"})\n')
    assert not POSITIONAL.search('f.index = pd.MultiIndex.from_tuples(list(scored))\n')
