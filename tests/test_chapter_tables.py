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


# ---------------------------------------------------------------------------------------------------
# A cell's captions stay beside their tables
# ---------------------------------------------------------------------------------------------------
# The book merges a cell's printed streams into one (``nb_merge_streams: true`` in _config.yml, as myst-nb
# does it: every later stdout chunk joins the first), so a cell that prints a caption, shows a table,
# prints a second caption and shows a second table puts both captions above both tables. A caption goes
# with its table instead (``table1.display(..., caption=...)``) or into a cell of its own.

import ast  # noqa: E402
import json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_CODE_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.M | re.S)


def _events(statements) -> list[str]:
    """What the statements write, in order: ``"print"`` (a stdout stream) or ``"display"`` (an output of its
    own); a loop's body counts twice (two turns interleave as much as the cell would)."""
    out = []
    for st in statements:
        if isinstance(st, ast.For | ast.While | ast.AsyncFor):
            out += 2 * _events(st.body) + _events(st.orelse)
        elif isinstance(st, ast.If | ast.With | ast.Try):
            for block in ("body", "orelse", "finalbody"):
                out += _events(getattr(st, block, []))
            for handler in getattr(st, "handlers", []):
                out += _events(handler.body)
        elif not isinstance(st, ast.FunctionDef | ast.ClassDef):
            for node in ast.walk(st):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    if node.func.id == "print":
                        out.append("print")
                    elif node.func.id == "display":
                        out.append("display")
    return out


def _reorders(events: list[str]) -> bool:
    """Whether a merged stream would move a print above a display that the cell showed before it."""
    seen_print = seen_display_after = False
    for e in events:
        if e == "print":
            if seen_display_after:
                return True
            seen_print = True
        elif seen_print:
            seen_display_after = True
    return False


def _cells(text: str) -> list[str]:
    """The code of every code cell of a MyST chapter, without its ``:key: value`` options."""
    return [re.sub(r"\A(?:[ \t]*(?::\w[\w-]*:.*)?\n)*", "", m.group(1)) for m in _CODE_CELL.finditer(text)]


def _parse(source: str):
    return ast.parse("\n".join("" if ln.lstrip().startswith(("%", "!", ":")) else ln
                               for ln in source.splitlines()))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_no_cell_prints_on_both_sides_of_a_displayed_output(chapter):
    """In the chapter's source: no cell prints, then displays, then prints again (its second print would
    land in the first's stream, above the display)."""
    bad = []
    for source in _cells(chapter.read_text()):
        events = _events(_parse(source).body)
        if _reorders(events + ["display"]):  # the cell's last expression, if any, comes last anyway
            bad.append(source.strip().splitlines()[0])
    assert not bad, (f"{chapter.name}: cells that print around a displayed output, whose printed lines the "
                     f"book merges above it: {bad}; give each table its caption "
                     "(table1.display(caption=...))")


def _visible(output: dict) -> bool:
    """An output the page shows (a glue output carries only ``application/papermill.record/...`` data)."""
    return output["output_type"] == "stream" or any(
        not k.startswith("application/papermill.record") for k in output.get("data", {}))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_no_executed_cell_has_a_stream_split_by_a_displayed_output(chapter):
    """In the committed book/<name>.ipynb, every cell run from the chapter's current source: no stream has
    a displayed output between two of its chunks (the merge would move the later chunk above it). A cell
    whose source changed since the chapter ran is checked in the source by the test above."""
    executed = ROOT / "book" / f"{chapter.stem}.ipynb"
    if not executed.is_file():
        pytest.skip(f"{executed.name} not executed")
    current = {s.strip() for s in _cells(chapter.read_text())}
    bad = []
    for cell in json.loads(executed.read_text(encoding="utf-8"))["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or source.strip() not in current:
            continue
        shown = [o for o in cell.get("outputs", []) if _visible(o)]
        for name in {o["name"] for o in shown if o["output_type"] == "stream"}:
            kinds = ["print" if o.get("name") == name else "display" for o in shown
                     if o["output_type"] != "stream" or o.get("name") == name]
            if _reorders(kinds):
                bad.append(source.strip().splitlines()[-1])
    assert not bad, (f"{executed.name}: cells whose printed lines the book moves above a displayed "
                     f"output: {bad}")


def test_the_stream_checks_see_the_pattern_they_forbid():
    caption_twice = 'print("to A:")\ndisplay(a)\nprint("to B:")\ndisplay(b)\n'
    assert _reorders(_events(_parse(caption_twice).body))
    in_a_loop = 'for t in tables:\n    print(t.name)\n    display(t)\n'
    assert _reorders(_events(_parse(in_a_loop).body))
    assert not _reorders(_events(_parse('display(a)\nprint("a summary")\nprint("another line")\n').body))
    assert not _reorders(_events(_parse('print("one caption")\ndisplay(a)\n').body))
    glued = {"output_type": "display_data", "data": {"application/papermill.record/text/plain": "1"}}
    assert not _visible(glued)
