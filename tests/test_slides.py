"""The slides: one reveal.js deck per chapter of ``_toc.yml``, made from its committed executed notebook
(``course/slides.py`` chooses what goes on a slide, ``course/slides_build.py`` builds).

The decks are built once for the module from the committed chapters. Every chapter must have one;
a deck's figures must be the images of the chapter's current notebook (byte for byte); no solution
may reach a deck; a deck must load nothing from the network. A headless Chromium (Debian's
``chromium``, installed by ``make data``) then opens every deck from ``file://`` and checks that
its math is typeset, that the arrow keys go through every slide, and that every slide fits.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course import book as course_book  # noqa: E402
from course import slides as course_slides  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def decks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("slides")
    run = subprocess.run([sys.executable, "-m", "course", "slides", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def _notebook(name: str) -> dict:
    return json.loads((ROOT / "book" / f"{name}.ipynb").read_text(encoding="utf-8"))


def _src(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def _chapters() -> list[str]:
    """The chapters with an executed notebook (a chapter of ``_toc.yml`` without one fails the first test)."""
    names = course_book.executed_chapters(ROOT)
    assert names, "_toc.yml lists no executed chapter"
    return names


# ---------------------------------------------------------------------------------------------------
# The decks, built
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_chapter_of_the_toc_has_a_deck(decks):
    chapters = course_book.toc_chapters(ROOT)
    unexecuted = [c for c in chapters if not (ROOT / "book" / f"{c}.ipynb").is_file()]
    assert not unexecuted, f"chapters without book/<name>.ipynb (run make chapters): {unexecuted}"
    missing = [c for c in chapters if not (decks / f"{c}.html").is_file()]
    assert not missing, f"chapters without a deck: {missing}"
    for c in chapters:
        kinds = [s.kind for s in course_slides.deck(c, _notebook(c)).slides]
        assert "objectives" in kinds and "exercise" in kinds, f"{c}: objectives and exercises on its deck"
        assert "code" in kinds, f"{c}: no claims on its deck (tag the cell of its claims `slide`)"
        titles = re.findall(r"<h2>(.*?)</h2>", (decks / f"{c}.html").read_text(encoding="utf-8"))
        pieces = len(kinds) + ("References" in titles)  # a deck that cites ends with its references
        assert len(titles) == pieces, f"{c}: {len(titles)} slides for {pieces} pieces of the chapter"
    index = (decks / "index.html").read_text(encoding="utf-8")
    assert all(f'href="{c}.html"' in index for c in chapters)


def _deck_images(deck: Path) -> list[str]:
    text = deck.read_text(encoding="utf-8")
    return [hashlib.sha256((deck.parent / src).read_bytes()).hexdigest()
            for src in re.findall(r'<img[^>]*\bsrc="([^"]+)"', text)]


def _chapter_images(nb: dict) -> list[str]:
    """The figures a deck must show: the glued figures its prose places, the ``{figure}`` files, and the
    images output by cells tagged ``slide``, as the committed notebook has them."""
    stripped = course_book.strip_notebook(nb)
    text = "\n".join(_src(c) for c in stripped["cells"] if c["cell_type"] == "markdown")
    names = set(re.findall(r"^(?:`{3,}|:{3,})\{glue:figure\}\s*(\S+)", text, re.M))
    out = list(course_slides.figure_hashes(nb, names).values())
    assert len(out) == len(names), f"glued figures missing from the notebook: {names}"
    for path in re.findall(r"^(?:`{3,}|:{3,})\{figure\}\s*(\S+)", text, re.M):
        out.append(hashlib.sha256((ROOT / "book" / path).read_bytes()).hexdigest())
    for cell in stripped["cells"]:
        if cell["cell_type"] == "code" and course_slides.TAG in cell.get("metadata", {}).get("tags", []):
            for o in cell.get("outputs", []):
                png = o.get("data", {}).get("image/png")
                if png and "scrapbook" not in o.get("metadata", {}):
                    out.append(hashlib.sha256(base64.b64decode(_src({"source": png}))).hexdigest())
    return out


def test_deck_figures_are_the_chapters_current_ones(decks):
    n = 0
    for c in _chapters():
        expected, shown = _chapter_images(_notebook(c)), _deck_images(decks / f"{c}.html")
        assert sorted(shown) == sorted(expected), f"{c}: the deck's figures are not the chapter's current"
        n += len(shown)
    assert n > 0, "no figure on any deck"


_TAGS = re.compile(r"<(script|style)\b.*?</\1>|<[^>]+>", re.S | re.I)


def _norm(text: str) -> str:
    return " ".join(text.split())


def _solution_probes(nb: dict) -> list[str]:
    """Lines of the chapter's solutions that appear nowhere else in the chapter: code lines of 20
    characters or more, and prose lines of six words or more without markup."""
    outside = _norm(" ".join(_src(c) for c in course_book.strip_notebook(nb)["cells"]))
    probes = []
    for sol in course_book.notebook_solutions(nb):
        for kind, line in sol:
            s = _norm(line)
            if kind == "md" and (len(s.split()) < 6 or re.search(r"[`$*_{}\[\]<>|\\#:]", s)):
                continue
            if kind != "md" and (len(s) < 20 or s.startswith(("#", "import ", "from "))):
                continue
            if s not in outside:
                probes.append(s)
    return probes


def test_no_solution_text_in_any_deck(decks):
    n = 0
    for c in _chapters():
        nb = _notebook(c)
        probes = _solution_probes(nb)
        n += len(probes)
        page = (decks / f"{c}.html").read_text(encoding="utf-8")
        shown = _norm(html.unescape(_TAGS.sub(" ", page)))
        deck_nb = json.loads((decks / "src" / f"{c}.ipynb").read_text(encoding="utf-8"))
        source = _norm(" ".join(_src(cell) for cell in deck_nb["cells"]))
        leaked = [p for p in probes if p in shown or p in source]
        assert not leaked, f"{c}: solution text on the deck: {leaked[:3]}"
        assert not re.search(r'class="[^"]*\bsolution\b', page), f"{c}: a solution element on the deck"
        assert "{solution" not in source
    assert n > 20, "the chapters' solutions gave too few probes for this check to mean anything"


def test_decks_load_nothing_from_the_network(decks):
    for page in [*decks.glob("*.html")]:
        text = page.read_text(encoding="utf-8")
        refs = re.findall(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="([^"]+)"', text)
        remote = [r for r in refs if re.match(r"^(https?:)?//", r)]
        assert not remote, f"{page.name} loads {remote}"
        missing = [r for r in refs if not (page.parent / r.split("?")[0].split("#")[0]).is_file()]
        assert not missing, f"{page.name} refers to missing files {missing}"
    assert (decks / "_static/revealjs/dist/reveal.js").is_file()
    assert (decks / "_static/mathjax/tex-mml-chtml.js").is_file()


# ---------------------------------------------------------------------------------------------------
# The output folder: written only where the tool may
# ---------------------------------------------------------------------------------------------------


def _slides(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "course", "slides", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def _refused(run: subprocess.CompletedProcess, *words: str) -> None:
    """Exit status 2 and one line on stderr that says ``words``; no traceback."""
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr, run.stderr
    assert all(w in run.stderr for w in words), run.stderr


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_slides_never_write_into_a_teachers_folder(tmp_path):
    talks = tmp_path / "talks"
    (talks / "src").mkdir(parents=True)
    (talks / "index.html").write_text("<h1>My talks</h1>\n")
    (talks / "src" / "notes.md").write_text("# Notes\n")
    before = _snapshot(talks)
    _refused(_slides("--out", str(talks), _chapters()[0]), "did not write", "'index.html'", "'src'", "--out")
    assert _snapshot(talks) == before
    _refused(_slides("--out", str(tmp_path / "new"), "tyo"), "unknown chapter 'tyo'")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_a_rebuild_keeps_a_teachers_file_and_never_overwrites_an_edited_one(tmp_path):
    out, chapter = tmp_path / "slides", _chapters()[0]
    run = _slides("--out", str(out), chapter)
    assert run.returncode == 0, run.stderr[-3000:]
    (out / "notes.txt").write_text("the teacher's\n")
    (out / "src" / "extra.md").write_text("the teacher's too\n")
    run = _slides("--out", str(out), chapter)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "notes.txt").read_text() == "the teacher's\n"
    assert (out / "src" / "extra.md").read_text() == "the teacher's too\n"
    assert (out / f"{chapter}.html").is_file()
    with (out / "index.html").open("a") as f:
        f.write("<!-- edited -->\n")
    before = _snapshot(out)
    _refused(_slides("--out", str(out), chapter), "index.html changed since")
    assert _snapshot(out) == before


# ---------------------------------------------------------------------------------------------------
# What goes on a slide (no build)
# ---------------------------------------------------------------------------------------------------

_PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"fixture-image").decode()


def _fixture() -> dict:
    md = lambda s: {"cell_type": "markdown", "metadata": {}, "source": s}  # noqa: E731

    def code(src, tags=(), outputs=()):
        return {"cell_type": "code", "metadata": {"tags": list(tags)}, "source": src,
                "outputs": list(outputs), "execution_count": 1}

    glued = {"output_type": "display_data", "metadata": {"scrapbook": {"name": "fig", "mime_prefix":
             course_slides.GLUE_PREFIX}}, "data": {course_slides.GLUE_PREFIX + "image/png": _PNG}}
    table = {"output_type": "execute_result", "metadata": {}, "data": {"text/html": "<table>t</table>"}}
    return {"metadata": {}, "nbformat": 4, "nbformat_minor": 5, "cells": [
        md("# A fixture chapter\n\n:::{admonition} Objectives and prerequisites\n:class: tip\n\nAfter this "
           "chapter you can count.\n\n**Prerequisites.** None at all.\n:::\n\nSome prose.\n\n"
           "The mass of a network is\n\n$$\nM = \\sum_i w_i^2\n$$\n\n"
           ":::{prf:proposition} Convex\n:label: fx-prop\n\nIt is convex.\n:::\n\n"
           ":::{prf:proof}\nObvious.\n:::"),
        code('scale = "cpu"', tags=["parameters"]),
        code("glue('fig', fig)", outputs=[glued]),
        md("## Results\n\n```{glue:figure} fig\n:name: fig-fixture\n\nThe figure.\n```\n\nMore prose."),
        code("claims_table", tags=["hide-input", "slide"], outputs=[table]),
        code('assert ok, "the first claim"\nassert fine  # the second claim\nassert bare\n'
             'if scale == "paper":\n    assert big, "a claim for the paper scale"',
             tags=["hide-input", "slide"]),
        {**md("## Summary\n\nA whole cell on a slide.\n\n$$\ny = 1\n$$"), "metadata": {"tags": ["slide"]}},
        md("## Exercises\n\n::::{exercise} Computational: count\n:label: fx-count\n\nCount them.\n::::\n\n"
           ":::{solution-start} fx-count\n:class: dropdown\n:::\n\nThe hidden prose of the solution."),
        code("answer_of_the_solution = 6"),
        md(":::{solution-end}\n:::"),
    ]}


def test_the_pieces_of_a_fixture_chapter():
    d = course_slides.deck("fixture", _fixture())
    assert d.title == "A fixture chapter"
    assert [s.kind for s in d.slides] == ["objectives", "objectives", "math", "prf", "figure", "code", "code",
                                          "cell", "exercise"]
    assert d.slides[7].title == "Summary" and d.slides[7].markdown.startswith("A whole cell")
    assert "count" in d.slides[0].markdown and "None at all" in d.slides[1].markdown
    assert d.slides[2].markdown.startswith("The mass of a network is") and "w_i^2" in d.slides[2].markdown
    assert "Obvious" not in "".join(s.markdown for s in d.slides), "proofs stay in the chapter"
    claims = d.slides[6].markdown
    assert "| the first claim | ✓ held |" in claims and "| the second claim | ✓ held |" in claims
    assert "| a claim for the paper scale | – not checked at this scale |" in claims
    assert "1 further check: 1 held" in claims
    assert d.slides[6].title == "Claims checked on this run" and d.slides[5].title == "Results"
    nb = course_slides.deck_notebook(d, _fixture(), {"fixture"}, course_slides.labels(d), {})
    text = json.dumps(nb)
    assert "hidden prose" not in text and "answer_of_the_solution" not in text
    assert "fx-prop" in course_slides.labels(d) and "fig-fixture" in course_slides.labels(d)
    glue = [c for c in nb["cells"] if "remove-cell" in c["metadata"].get("tags", [])]
    assert len(glue) == 1 and glue[0]["outputs"][0]["metadata"]["scrapbook"]["name"] == "fig"
    assert course_slides.figure_hashes(_fixture()) == {
        "fig": hashlib.sha256(base64.b64decode(_PNG)).hexdigest()}


def test_a_failed_claim_says_so_and_an_untagged_chapter_shows_its_last_checks():
    cell = {"cell_type": "code", "metadata": {}, "source": 'assert x, "a claim"',
            "outputs": [{"output_type": "error", "ename": "AssertionError", "evalue": "a claim",
                         "traceback": []}]}
    assert course_slides.claims(cell, {}) == [("a claim", "failed")]
    nb = _fixture()
    for c in nb["cells"]:
        c["metadata"]["tags"] = [t for t in c["metadata"].get("tags", []) if t != course_slides.TAG]
    code = [s for s in course_slides.deck("fixture", nb).slides if s.kind == "code"]
    assert len(code) == 1 and "the first claim" in code[0].markdown


def test_roles_without_a_target_on_the_slides_become_text():
    text = ("{term}`orbit`, {term}`modes <mode>`, {doc}`toy`, {doc}`the map <course/map>`, "
            "{prf:ref}`fx-prop`, {prf:ref}`other-prop`, {numref}`Fig. %s <fig-x>`, {cite}`key`")
    out = course_slides.inline(text, {"toy"}, {"fx-prop"}, {"toy": "A gentle example"})
    assert out == ("orbit, modes, {doc}`A gentle example <toy>`, the map, {prf:ref}`fx-prop`, `other-prop`, "
                   "Fig. %s, {cite}`key`")


def test_blocks_of_myst():
    text = ("# T\n\npara one\nstill one\n\n$$\na\n$$\n\n"
            "::::{exercise} X\n:label: y\n\n```{code}\nz\n```\n::::\n")
    kinds = [(b.kind, b.name) for b in course_slides.blocks(text)]
    assert kinds == [("heading", ""), ("para", ""), ("math", ""), ("directive", "exercise")]


# ---------------------------------------------------------------------------------------------------
# The results on a deck
# ---------------------------------------------------------------------------------------------------


def test_a_sections_stated_results_close_it_on_a_slide():
    """The sentences with a glued number, at most MAX_RESULTS of a section, on a slide at the section's
    end; sentences without one, and the exercises' prose, stay in the chapter; their glue values travel."""
    assert course_slides.result_sentences(
        "A run takes {glue:text}`secs:.1f` s. It is fast, e.g. on a laptop.\nFig. 2 shows "
        "{glue:text}`n` networks (of {glue:text}`m:,.0f`). Nothing here.") == [
        "A run takes {glue:text}`secs:.1f` s.",
        "Fig. 2 shows {glue:text}`n` networks (of {glue:text}`m:,.0f`)."]
    nb = _fixture()
    glued = [{"output_type": "display_data", "metadata": {"scrapbook": {"name": k, "mime_prefix":
              course_slides.GLUE_PREFIX}}, "data": {course_slides.GLUE_PREFIX + "text/plain": v}}
             for k, v in (("n", "12"), ("acc", "97.5"))]
    nb["cells"].insert(2, {"cell_type": "code", "metadata": {}, "source": "glue(...)", "outputs": glued,
                           "execution_count": 1})
    many = " ".join(f"Claim {i} is {{glue:text}}`n`." for i in range(course_slides.MAX_RESULTS + 2))
    stated = f"We trained {{glue:text}}`n` networks. Accuracy {{glue:text}}`acc:.1f`%.\n\n{many}"
    nb["cells"].insert(5, {"cell_type": "markdown", "metadata": {}, "source": stated})
    ex = next(c for c in nb["cells"] if "## Exercises" in _src(c))
    ex["source"] = ex["source"].replace("Count them.", "Count the {glue:text}`n` of them. Then more.")
    exercises_prose = {"cell_type": "markdown", "metadata": {}, "source": "Use {glue:text}`n` here."}
    nb["cells"].insert(nb["cells"].index(ex) + 1, exercises_prose)
    d = course_slides.deck("fixture", nb)
    kinds = [s.kind for s in d.slides]
    assert kinds == ["objectives", "objectives", "math", "prf", "figure", "code", "code", "result", "cell",
                     "exercise"]
    result = d.slides[7]
    assert result.title == "Results: Results"
    assert result.markdown.count("\n* ") == course_slides.MAX_RESULTS - 1  # the first MAX_RESULTS only
    assert result.markdown.startswith("* We trained {glue:text}`n` networks.")
    assert "More prose" not in result.markdown and "Then more" not in result.markdown
    deck_nb = course_slides.deck_notebook(d, nb, {"fixture"}, course_slides.labels(d), {})
    carried = [o["metadata"]["scrapbook"]["name"] for c in deck_nb["cells"]
               if "remove-cell" in c["metadata"].get("tags", []) for o in c["outputs"]]
    assert sorted(carried) == ["acc", "fig", "n"]


def _figure_names(text: str) -> set[str]:
    return set(re.findall(r"^(?:`{3,}|:{3,})\{glue:figure\}\s*(\S+)", text, re.M))


@pytest.mark.parametrize("chapter", [c for c in course_book.toc_chapters(ROOT)
                                     if (ROOT / "book" / f"{c}.ipynb").is_file()])
def test_every_deck_shows_a_result_figure_and_stated_results(chapter):
    """A chapter's deck has result slides: at least one glued figure of the committed run (an image on the
    slide) and the sentences that state its numbers."""
    nb = _notebook(chapter)
    d = course_slides.deck(chapter, nb)
    assert any(s.kind == "result" for s in d.slides), f"{chapter}: no glued number stated on the deck"
    in_source = _figure_names((ROOT / "notebooks" / f"{chapter}.md").read_text(encoding="utf-8"))
    images = course_slides.figure_hashes(nb)
    stale = sorted(in_source - set(images))
    if stale and in_source:
        pytest.skip(f"book/{chapter}.ipynb predates notebooks/{chapter}.md (no glued {stale}): rerun it")
    shown = [s for s in d.slides if s.kind == "figure" and set(_figure_names(s.markdown)) & set(images)]
    assert shown, f"{chapter}: no result slide with an image (glue a figure, place it with {{glue:figure}})"


def test_the_transformers_deck_includes_a_figure():
    """The transformers chapter places glued figures (its deck once had eight slides and no result); the deck
    built from its executed notebook shows them once the chapter is run from that source."""
    source = (ROOT / "notebooks/transformers.md").read_text(encoding="utf-8")
    names = _figure_names(source)
    assert names, "notebooks/transformers.md places no glued figure"
    glued = [n for n in names if re.search(rf"glue\(\s*[\"']{re.escape(n)}[\"']", source)]
    assert sorted(glued) == sorted(names), "a placed figure that no cell glues"
    nb = _notebook("transformers")
    images = course_slides.figure_hashes(nb, names)
    if set(images) != names:
        pytest.skip(f"book/transformers.ipynb predates its source (no glued {sorted(names - set(images))}): "
                    "re-execute the chapter")
    figures = [s for s in course_slides.deck("transformers", nb).slides if s.kind == "figure"]
    assert {n for s in figures for n in _figure_names(s.markdown)} == names


# ---------------------------------------------------------------------------------------------------
# In a browser
# ---------------------------------------------------------------------------------------------------


class _Chromium:
    """Headless Chromium driven over the DevTools protocol (websocket-client), a fresh profile each time."""

    def __init__(self, exe: str):
        import websocket

        self.profile = tempfile.mkdtemp(prefix="chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={self.profile}",
             "--remote-debugging-port=0", "--window-size=1280,800", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json") as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60)
        self.n, self.events = 0, []

    def send(self, method: str, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def eval(self, expr: str):
        r = self.send("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def key(self, name: str, code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", type=kind, key=name, code=name, windowsVirtualKeyCode=code)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: `make data` installs Debian's chromium")
@pytest.mark.slow
def test_decks_in_a_browser(decks):
    browser = _Chromium(CHROMIUM)
    try:
        browser.send("Network.enable")
        browser.send("Page.enable")
        for c in _chapters():
            browser.send("Page.navigate", url=(decks / f"{c}.html").as_uri())
            deadline = time.monotonic() + 30
            while not browser.eval("typeof Reveal !== 'undefined' && Reveal.isReady()"):
                assert time.monotonic() < deadline, f"{c}: reveal.js did not start"
                time.sleep(0.1)
            n_math = browser.eval("document.querySelectorAll('.math').length")
            if n_math:
                while not browser.eval("typeof MathJax !== 'undefined' && !!(MathJax.startup || {}).promise"):
                    assert time.monotonic() < deadline, f"{c}: MathJax did not load"
                    time.sleep(0.1)
                browser.eval("MathJax.startup.promise.then(() => true)")
                typeset = browser.eval("Array.from(document.querySelectorAll('.math')).filter("
                                       "e => e.querySelector('mjx-container') "
                                       "&& !e.querySelector('mjx-merror')).length")
                assert typeset == n_math, f"{c}: {n_math - typeset} of {n_math} formulas not typeset"
            total = browser.eval("Reveal.getTotalSlides()")
            assert total == browser.eval("document.querySelectorAll('.slides > section').length") > 3
            overflow = []
            for i in range(total):
                assert browser.eval("Reveal.getIndices().h") == i, f"{c}: ArrowRight did not reach slide {i}"
                if browser.eval("Reveal.getCurrentSlide().scrollHeight > Reveal.getConfig().height + 2"):
                    overflow.append(i)
                browser.key("ArrowRight", 39)
            assert browser.eval("Reveal.isLastSlide()"), f"{c}: ArrowRight went past the last slide"
            browser.key("ArrowLeft", 37)
            assert browser.eval("Reveal.getIndices().h") == total - 2, f"{c}: ArrowLeft did not go back"
            assert not overflow, f"{c}: slides {overflow} do not fit, even with their text shrunk"
        urls = [e["params"]["request"]["url"] for e in browser.events
                if e.get("method") == "Network.requestWillBeSent"]
        remote = sorted({u for u in urls if not u.startswith(("file:", "data:"))})
        assert urls and not remote, f"the decks asked the network for {remote}"
    finally:
        browser.close()
