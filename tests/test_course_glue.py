"""The values a chapter glues, pasted into its text (``course/glue.py``) for the students' notebooks, which
JupyterLab shows without myst-nb: every role and directive replaced, formatted as myst-nb formats it."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course import assignments as course_assignments  # noqa: E402
from course import book as course_book  # noqa: E402
from course import glue as course_glue  # noqa: E402
from course.notebooks import source  # noqa: E402

PREFIX = "application/papermill.record/"
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n a figure").decode()


def _glue(name: str, **data: str) -> dict:
    """A display output as myst-nb's ``glue(name, value, display=False)`` stores it."""
    return {"output_type": "display_data", "metadata": {"scrapbook": {"name": name, "mime_prefix": PREFIX}},
            "data": {PREFIX + mime.replace("_", "/", 1): value for mime, value in data.items()}}


def _chapter() -> dict:
    outputs = [_glue("acc", text_plain="83.51234"), _glue("n", text_plain="1000"),
               _glue("word", text_plain="'collapsed'"), _glue("err", text_plain="1.176910584701082e-15"),
               _glue("fig", image_png=PNG, text_plain="<Figure size 640x480 with 1 Axes>"),
               _glue("eq", text_latex="$$x^2$$", text_plain="x**2"),
               _glue("n", text_plain="1024")]  # glued twice: the last value counts
    return {"cells": [{"cell_type": "code", "metadata": {}, "source": "glue(...)", "outputs": outputs}],
            "metadata": {"papermill": {"parameters": {"scale": "cpu"}}}}


def test_values_are_read_from_the_scrapbook_outputs():
    glued = course_glue.values(_chapter())
    assert glued["acc"] == {"text/plain": "83.51234"} and glued["n"] == {"text/plain": "1024"}
    assert glued["fig"]["image/png"] == PNG
    assert course_glue.ran_at(_chapter()) == "cpu"


@pytest.mark.parametrize("text, spec", [("83.51234", ".1f"), ("1000", ""), ("1000", ",d"), ("'ok'", "s"),
                                        ("1.176910584701082e-15", ".1e"), ("0.25", ".0%"),
                                        ("not a literal", "s"), ("3", ".2f"), ("True", "")])
def test_values_are_formatted_as_myst_nb_formats_them(text, spec):
    variables = pytest.importorskip("myst_nb.core.variables")
    assert course_glue.format_text(text, spec) == variables.format_plain_text(text, spec)


def test_roles_become_their_values():
    paster = course_glue.Paster(course_glue.values(_chapter()), "`book/ch.ipynb`")
    text, attachments = paster.paste(
        "Accuracy {glue:text}`acc:.1f`% over {glue:text}`n` networks ({glue}`word`), error\n"
        "{glue:text}`err:.1e`; a table | {glue:text}`acc:.2f` |.")
    assert text == ("Accuracy 83.5% over 1024 networks (collapsed), error\n"
                    "1.2e-15; a table | 83.51 |.")
    assert attachments == {} and paster.pasted == 5 and paster.missing == []


def test_a_missing_value_points_to_the_book():
    paster = course_glue.Paster(course_glue.values(_chapter()), "`book/ch.ipynb` (scale `tiny`)")
    text, _ = paster.paste("Only at the paper's scale: {glue:text}`paper_only:.3f`, "
                           "{glue:text}`other::acc:.1f`.")
    assert "{glue" not in text and paster.missing == ["paper_only", "other::acc"]
    assert "`book/ch.ipynb` (scale `tiny`) does not hold `paper_only`" in text
    assert text.startswith("Only at the paper's scale: *(a value of the book's chapter")


def test_a_glued_figure_becomes_a_figure_of_a_cell_attachment():
    paster = course_glue.Paster(course_glue.values(_chapter()), "`book/ch.ipynb`")
    text, attachments = paster.paste(
        "Before.\n\n```{glue:figure} fig\n:name: fig-label\n:figwidth: 80%\n:other: dropped\n\n"
        "Mean over {glue:text}`n` runs.\n```\n\n:::{note}\n  ::::{glue:figure} fig\n  ::::\n:::\n"
        "\n```{glue:figure} nowhere\n:name: fig-gone\n\nA caption that stays.\n```\n"
        "\n```{glue:math} eq\n:label: eq-x\n```\n")
    assert attachments == {"fig.png": {"image/png": PNG}}
    assert text == (
        "Before.\n\n```{figure} attachment:fig.png\n:name: fig-label\n:width: 80%\n\n"
        "Mean over 1024 runs.\n```\n"
        "\n:::{note}\n  ::::{figure} attachment:fig.png\n  ::::\n:::\n\n"
        "*Here the book's chapter shows a figure (`nowhere`), which `book/ch.ipynb` does not hold: see the "
        "chapter in the book.*\n\nA caption that stays.\n"
        "\n$$\nx^2\n$$ (eq-x)\n")
    assert paster.missing == ["nowhere"]


def test_every_chapters_text_gets_every_value_and_figure():
    """The student's source notebook of every executed chapter: no glue left, no value missing (the
    committed chapters glue every name their text uses), a figure per glued figure outside solutions."""
    chapters = course_book.executed_chapters(ROOT)
    if not chapters:
        pytest.skip("no executed chapter")
    for name in chapters:
        nb = json.loads((ROOT / "book" / f"{name}.ipynb").read_text(encoding="utf-8"))
        src, _ = course_assignments.source_notebook(name, nb, "cpu")
        text = json.dumps(src, ensure_ascii=False)
        assert "{glue" not in text and "does not hold" not in text, name
        figures = sum(len(c.get("attachments", {})) for c in src["cells"])
        shown = sum(source(c).count("{glue:figure}") for c in course_book.strip_notebook(nb)["cells"]
                    if c["cell_type"] == "markdown")
        assert figures == shown, name
