"""The book as a course: the front page lists every page, the course map knows every chapter, and the
two editions differ exactly by the solutions.

The edition tests build HTML with jupyter-book from the committed chapters (``book/*.ipynb``, never
re-executed): the teacher edition must contain the text of every solution, as a toggle; the student
edition, pages and downloadable files alike, none of it. The solutions' texts are read from the
chapters themselves (``course/book.py`` finds the solutions, gated or not).
"""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(ROOT))
from course import book as course_book  # noqa: E402


def _toc_parts() -> list[tuple[str, list[str]]]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [(part.get("caption", ""), [c["file"] for c in part["chapters"]]) for part in toc["parts"]]


def _chapters() -> list[str]:
    """The chapters of the table of contents (``book/<name>`` with a source ``notebooks/<name>.md``)."""
    out = []
    for _, files in _toc_parts():
        for f in files:
            if Path(f).parent == Path("book") and (ROOT / "notebooks" / f"{Path(f).name}.md").is_file():
                out.append(Path(f).name)
    return out


# ---------------------------------------------------------------------------------------------------
# Front page and course map
# ---------------------------------------------------------------------------------------------------


def _doc_links(md: Path, text: str | None = None) -> list[str]:
    """The pages the ``{doc}`` roles of ``md`` (or of ``text``, a part of it) point to, in the order they
    appear, as paths from the repository root without suffix."""
    out = []
    for m in re.finditer(r"\{doc\}`([^`]*)`", md.read_text() if text is None else text):
        target = m.group(1)
        if target.endswith(">") and "<" in target:
            target = target[target.rindex("<") + 1 : -1]
        path = (ROOT / target.lstrip("/")) if target.startswith("/") else (md.parent / target)
        out.append(os.path.relpath(os.path.normpath(path), ROOT).removesuffix(".md").removesuffix(".ipynb"))
    return out


def _doc_targets(md: Path) -> set[str]:
    """Every page a ``{doc}`` role of ``md`` points to, as a path from the repository root without suffix."""
    return set(_doc_links(md))


def test_front_page_lists_every_page_of_the_toc():
    """Every page of ``_toc.yml`` is linked from ``book/intro.md``. A part that opens with an ``index``
    page (the API reference) is represented by that page."""
    listed = _doc_targets(ROOT / "book/intro.md")
    missing = []
    for caption, files in _toc_parts():
        required = files[:1] if Path(files[0]).name == "index" else files
        missing += [f"{f} ({caption})" for f in required if f not in listed]
    assert not missing, f"book/intro.md does not link these pages of _toc.yml: {missing}"


def _out_of_order(links: list[str], order: list[str]) -> list[tuple[str, str]]:
    """The consecutive first mentions in ``links`` (of pages in ``order``) that ``order`` reverses."""
    rank = {page: i for i, page in enumerate(order)}
    firsts = [p for p in dict.fromkeys(links) if p in rank]
    return [(a, b) for a, b in zip(firsts, firsts[1:], strict=False) if rank[a] > rank[b]]


def test_front_page_follows_the_order_of_the_toc():
    """The front page names the pages in the sidebar's order: the chapters, by their first link anywhere on
    the page, and every table or list of links (the chapter table, the teaching and reference lists)."""
    intro = ROOT / "book/intro.md"
    order = [f for _, files in _toc_parts() for f in files]
    chapters = [f"book/{c}" for c in _chapters()]
    wrong = _out_of_order(_doc_links(intro), chapters)
    assert not wrong, f"book/intro.md names these chapters in the reverse of _toc.yml's order: {wrong}"
    blocks = re.findall(r"(?:^(?:\|.*|[*-] .*)\n)+", intro.read_text(), re.M)  # tables and bullet lists
    assert len(blocks) >= 3
    wrong = [pair for block in blocks for pair in _out_of_order(_doc_links(intro, block), order)]
    assert not wrong, f"a table or list of book/intro.md reverses _toc.yml's order: {wrong}"
    assert _out_of_order(["book/transformers", "book/own_network"], chapters)  # the check sees a swap


def test_course_map_knows_every_chapter_and_its_figure_is_current():
    chapter_map = _load("chapter_map", ROOT / "book/course/chapter_map.py")
    chapters = _chapters()
    assert chapters, "no executed chapter in _toc.yml"
    missing = [c for c in chapters if c not in chapter_map.CHAPTERS]
    assert not missing, f"book/course/chapter_map.py has no box for {missing}: add them and redraw"
    unknown = [c for c in chapter_map.CHAPTERS if c not in chapters]
    assert not unknown, f"book/course/chapter_map.py draws chapters not in _toc.yml: {unknown}"
    for name, (_, _, _, needs) in chapter_map.CHAPTERS.items():
        assert set(needs) <= set(chapter_map.CHAPTERS), name
    linked = _doc_targets(ROOT / "book/course/map.md")
    assert not [c for c in chapters if f"book/{c}" not in linked], "the course map must link every chapter"
    assert chapter_map.SVG.read_text(encoding="utf-8") == chapter_map.svg_text(), (
        "book/course/chapter_map.svg is out of date: run .venv/bin/python book/course/chapter_map.py"
    )


def _within(inner, outer) -> bool:
    return outer.contains(*inner.p0) and outer.contains(*inner.p1)


def test_course_map_arrows_cross_no_box_but_their_own():
    """The drawn course map: every arrow starts on the box of a chapter it builds on and ends on the box of
    the chapter that needs it, and its path crosses no other box and no other text (an arrow from
    "Permutations" to "Transformers" once ran through "Functional collapse")."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import FancyBboxPatch

    chapter_map = _load("chapter_map", ROOT / "book/course/chapter_map.py")
    with plt.style.context("default"), plt.rc_context(chapter_map.RC):
        fig = chapter_map.draw()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        boxes = [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, FancyBboxPatch)]
        labels = [t for t in ax.texts if t.get_text()]
        words = {t.get_text().replace("\n", " "): t.get_window_extent(renderer) for t in labels}
        arrows = [t.arrow_patch for t in ax.texts if getattr(t, "arrow_patch", None) is not None]
        n_needs = sum(len(needs) for *_, needs in chapter_map.CHAPTERS.values())
        assert len(boxes) == len(chapter_map.CHAPTERS) and len(arrows) == n_needs
        crossed = []
        for arrow in arrows:
            path = arrow.get_transform().transform_path(arrow.get_path())
            points = [v[-2:] for v, code in path.iter_segments(simplify=False) if code != path.CLOSEPOLY]
            start = points[0]
            end = max(points, key=lambda v: (v[0] - start[0]) ** 2 + (v[1] - start[1]) ** 2)  # the head's tip
            ends = [b for b in boxes if b.expanded(1.02, 1.02).contains(*start)
                    or b.expanded(1.02, 1.02).contains(*end)]
            assert len(ends) == 2, f"an arrow from {start} to {end} does not join two boxes"
            shaft = [start + t * (end - start) for t in np.linspace(0, 1, 400)]  # the straight line drawn
            others = [("a box", b) for b in boxes if b not in ends] + [
                (name, b) for name, b in words.items() if not any(_within(b, e) for e in ends)]
            joined = " -> ".join(n for e in ends for n, b in words.items() if _within(b, e))
            crossed += [(joined, name) for name, b in others if any(b.contains(*q) for q in shaft)]
        plt.close(fig)
    assert not crossed, f"arrows cross boxes or labels not at their ends: {crossed}"


# ---------------------------------------------------------------------------------------------------
# Finding and removing solutions (no build)
# ---------------------------------------------------------------------------------------------------

FIXTURE_MD = """\
# A chapter

Some prose before the exercises.

```{exercise}
:label: ex-pen

How many orderings does a layer of three neurons have?
```

````{solution} ex-pen
:class: dropdown

Three distinct neurons can be put in six different orders in total.

```python
orderings_of_three_neurons = 3 * 2 * 1
```
````

```{exercise}
:label: ex-code

Count them with code.
```

```{solution-start} ex-code
:class: dropdown
```

The factorial function counts the orderings of three distinct neurons directly.

```{code-cell} ipython3
import math
n_orderings_of_three = math.factorial(3)
assert n_orderings_of_three == 6, "three neurons have six orderings"
```

```{solution-end}
```

:::{solution} ex-pen
A colon fence works the same way for every reader of this text.
:::

After the exercises there is a closing sentence that stays in both editions.
"""


def test_solutions_are_found_and_removed_in_markdown():
    lines, flags, sols = course_book._md_solutions(FIXTURE_MD)
    assert len(sols) == 3
    bodies = ["".join(line for _, line in s) for s in sols]
    assert "six different orders" in bodies[0] and "orderings_of_three_neurons" in bodies[0]
    assert ":class:" not in bodies[0] and ":class:" not in bodies[1]
    assert "math.factorial(3)" in bodies[1] and "{code-cell}" in bodies[1]
    assert "colon fence" in bodies[2]
    stripped = course_book.strip_markdown(FIXTURE_MD)
    for word in ("six different orders", "factorial", "solution", "colon fence"):
        assert word not in stripped
    kept = ("Some prose before", "{exercise}", "How many orderings", "Count them with code", "closing")
    assert all(k in stripped for k in kept)
    assert course_book.strip_markdown(stripped) == stripped


def _fixture_notebook() -> dict:
    import jupytext

    nb = jupytext.reads(FIXTURE_MD, fmt="md:myst")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return json.loads(jupytext.writes(nb, fmt="ipynb"))


def test_solutions_are_found_and_removed_in_notebooks():
    nb = _fixture_notebook()
    before = json.dumps(nb)
    sols = course_book.notebook_solutions(nb)
    assert len(sols) == 3
    assert [k for k, line in sols[1] if "math.factorial" in line] == ["code"]
    stripped = course_book.strip_notebook(nb)
    text = json.dumps(stripped)
    assert "factorial" not in text and "six different orders" not in text and "solution" not in text
    assert "closing sentence" in text and "Count them with code" in text
    assert not [c for c in stripped["cells"] if c["cell_type"] == "code"]
    assert json.dumps(nb) == before, "strip_notebook must not modify its input"


def test_an_unclosed_gated_solution_is_an_error():
    with pytest.raises(ValueError, match="not closed"):
        course_book._md_solutions("```{solution-start} ex\n```\n\ntext\n")


def test_launch_buttons_follow_the_repository_url():
    launch = {"binderhub_url": "https://mybinder.org", "colab_url": "https://colab.research.google.com"}
    base = {"launch_buttons": launch, "use_repository_button": False}
    for url in ("", None, course_book.JUPYTER_BOOK_DEFAULT_URL):
        off = course_book.launch_options({**base, "repository_url": url}, "teacher")
        assert off["launch_buttons"] == {} and not off["use_repository_button"]
    url = "https://github.com/someone/symlib"
    on = course_book.launch_options({**base, "repository_url": url + "/"}, "teacher")
    assert on["launch_buttons"] == launch and on["use_repository_button"]
    assert on["repository_url"] == url
    student = course_book.launch_options({**base, "repository_url": url}, "student")
    assert student["launch_buttons"] == {} and student["use_repository_button"]


def test_the_config_uses_the_course_extensions():
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert {"sphinx_exercise", "sphinx_proof"} <= set(cfg["sphinx"]["extra_extensions"])
    assert cfg["sphinx"]["local_extensions"]["course_book"] == "book/_ext"
    assert cfg["repository"]["url"] == "", "the committed book has no launch buttons"
    assert not cfg["sphinx"].get("config", {}).get("hide_solutions"), "the default edition is the teacher's"


# ---------------------------------------------------------------------------------------------------
# The two editions, built
# ---------------------------------------------------------------------------------------------------

_TYPO = str.maketrans(
    {"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-"}
)
_SPLIT = re.compile(r"[`$*_{}\[\]()<>|\\#~^=]|--|\.\.\.|\u2026")
_LIST = re.compile(r"^\s*(?:[-+]|\d+[.)])\s+")


def _norm(text: str) -> str:
    return " ".join(text.translate(_TYPO).replace("\u2026", "...").split())


def _html_text(path: Path) -> str:
    s = path.read_text(encoding="utf-8")
    s = re.sub(r"<(script|style)\b.*?</\1>", " ", s, flags=re.S | re.I)
    s = re.sub(r"</?(?:span|a|em|strong|code|b|i|sup|sub)\b[^>]*>", "", s)  # inline: no space (code tokens)
    return _norm(html.unescape(re.sub(r"<[^>]+>", " ", s)))


def _probes(solution: list[tuple[str, str]], min_words: int = 6) -> list[str]:
    """Strings of a solution that its rendered HTML shows verbatim (after :func:`_norm`): runs of at
    least ``min_words`` plain words of its prose, and its longer code lines."""
    probes, para, fences = [], [], []  # fences: the open fences inside the solution, True for code

    def flush():
        for frag in _SPLIT.split(" ".join(para)):
            if len(frag.split()) >= min_words:
                probes.append(_norm(frag))
        para.clear()

    for kind, line in solution:
        if kind != "md":
            flush()  # a code cell ends the paragraph before it (its output comes in between on the page)
            s = _norm(line)
            if kind == "code" and len(s) >= 20 and not s.startswith(("import ", "from ", "#")):
                probes.append(s)
            continue
        stripped = line.strip()
        fence = re.match(r"^(`{3,}|:{3,})\s*(.*)$", stripped)
        if fence:
            flush()
            if not fence.group(2) and fences:
                fences.pop()
            else:
                fences.append(not fence.group(2).startswith("{"))
            continue
        if fences and fences[-1]:
            if len(_norm(line)) >= 20:
                probes.append(_norm(line))
            continue
        if not stripped or _LIST.match(line) or stripped.startswith(("#", ":")):
            flush()
        if stripped and not stripped.startswith(":"):
            para.append(_LIST.sub("", line).lstrip("#").strip())
    flush()
    return probes


def _solution_probes(nb: dict) -> list[list[str]]:
    """Per solution, the probes that appear nowhere else in the chapter (so the student page, which keeps
    everything else, cannot show them by chance)."""
    outside = _norm(" ".join("".join(c["source"]) for c in course_book.strip_notebook(nb)["cells"]))
    out = []
    for sol in course_book.notebook_solutions(nb):
        for min_words in (6, 3):  # a solution of few words: shorter runs
            probes = [p for p in dict.fromkeys(_probes(sol, min_words)) if p not in outside]
            if probes:
                break
        out.append(probes)
    return out


def _build(book: Path, toc: Path, out: Path, edition: str) -> None:
    env = {**os.environ, course_book.EDITION_ENV: edition, "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    r = subprocess.run([str(JUPYTER_BOOK), "build", str(book), "--toc", str(toc), "--path-output", str(out),
                        "--keep-going"], capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _build_both(book: Path, toc: Path, tmp: Path) -> tuple[Path, Path]:
    """Teacher, then student, in one output folder so that the student build reuses the parsed chapters
    (the edition only changes what is written); the teacher's HTML is copied aside first."""
    _build(book, toc, tmp / "out", "teacher")
    teacher = tmp / "teacher"
    shutil.copytree(tmp / "out/_build/html", teacher)
    _build(book, toc, tmp / "out", "student")
    return teacher, tmp / "out/_build/html"


def _check_editions(teacher: Path, student: Path, pages: dict[str, dict]) -> int:
    """``pages``: HTML page (path without suffix) -> its notebook. Returns the number of solutions."""
    n_solutions = 0
    for page, nb in pages.items():
        probes = _solution_probes(nb)
        n_solutions += len(probes)
        unprobed = [i for i, p in enumerate(probes) if not p]
        assert not unprobed, f"{page}: solutions {unprobed} have no run of three plain words and no code line"
        t_html = (teacher / f"{page}.html").read_text(encoding="utf-8")
        t_text, s_text = _html_text(teacher / f"{page}.html"), _html_text(student / f"{page}.html")
        absent = [p for sol in probes for p in sol if p not in t_text]
        assert not absent, f"teacher edition of {page} lacks solution text: {absent[:5]}"
        assert len(re.findall(r'class="solution\b[^"]*\bdropdown\b', t_html)) == len(probes), (
            f"{page}: every solution of the teacher edition is a toggle"
        )
        leaked = [p for sol in probes for p in sol if p in s_text]
        assert not leaked, f"student edition of {page} shows solution text: {leaked[:5]}"
        s_html = (student / f"{page}.html").read_text(encoding="utf-8")
        assert not re.search(r'class="solution\b', s_html), f"student edition of {page}: a solution element"
        assert s_html.count('class="exercise') == t_html.count('class="exercise'), "exercises stay"
        for src in sorted((student / "_sources").glob(f"{page}.*")):
            s_src = _norm(src.read_text(encoding="utf-8"))
            if src.suffix == ".ipynb":
                s_src = _norm(" ".join("".join(c["source"]) for c in json.loads(src.read_text())["cells"]))
            leaked = [p for sol in probes for p in sol if p in s_src]
            assert not leaked, f"the student's download {src.name} holds solution text: {leaked[:5]}"
            assert "{solution" not in s_src
    return n_solutions


@pytest.mark.slow
def test_editions_of_a_fixture_chapter(tmp_path):
    """Gated and non-gated solutions, in a small book of its own with the book's extensions."""
    book = tmp_path / "book"
    (book / "notebooks").mkdir(parents=True)
    cfg = yaml.safe_load((ROOT / "_config.yml").read_text())
    fixture_cfg = {
        "title": "fixture", "only_build_toc_files": True, "execute": {"execute_notebooks": "off"},
        "parse": cfg["parse"], "repository": {"url": ""}, "launch_buttons": cfg["launch_buttons"],
        "sphinx": {"extra_extensions": ["sphinx_exercise", "sphinx_proof"],
                   "local_extensions": {"course_book": str(ROOT / "book/_ext")}},
    }
    (book / "_config.yml").write_text(yaml.safe_dump(fixture_cfg))
    (book / "_toc.yml").write_text("format: jb-book\nroot: intro\nchapters:\n  - file: chapter\n")
    (book / "intro.md").write_text("# Intro\n\nThe front page.\n")
    (book / "notebooks/chapter.md").write_text(FIXTURE_MD)
    nb = _fixture_notebook()
    (book / "chapter.ipynb").write_text(json.dumps(nb))
    teacher, student = _build_both(book, book / "_toc.yml", tmp_path)
    assert _check_editions(teacher, student, {"chapter": nb}) == 3
    assert (student / "_sources/chapter.md").is_file(), "the .md download of a chapter"
    assert 'download-markdown-button' in (teacher / "chapter.html").read_text()


def _n_exercises(nb: dict) -> int:
    fence = re.compile(r"^\s*(`{3,}|:{3,})\s*\{(exercise|exercise-start)\}", re.M)
    return sum(len(fence.findall("".join(c["source"]))) for c in nb["cells"] if c["cell_type"] == "markdown")

