r"""``make slides``: every chapter's deck (:mod:`course.slides`), built by Sphinx into reveal.js slides.

``python -m course slides [--out build/slides] [chapter ...]`` writes the deck
notebooks of every chapter of ``_toc.yml`` that has an executed notebook ``book/<name>.ipynb`` under
``<out>/src`` and builds them in one Sphinx run with the ``revealjs`` builder of sphinx-revealjs,
myst-nb (which reads the deck notebooks, outputs and ``glue`` values included, and executes nothing),
sphinx-proof, sphinx-exercise and sphinxcontrib-bibtex, so that a slide renders the chapter's MyST as
the book does. The decks are ``<out>/<name>.html`` and ``<out>/index.html`` lists them. ``<out>`` is
new, empty or made by this tool (its marker ``.symlib-course.json``): the build happens in a
temporary folder and replaces only the files an earlier build wrote (:mod:`course.output`); an
unknown chapter name is refused before anything is written. reveal.js
(shipped inside the sphinx-revealjs wheel) and MathJax 3 (the django-static-mathjax wheel, as for
the book) are copied next to them: the decks open from ``file://`` with no network. The build is
strict: a Sphinx warning fails it.

Why sphinx-revealjs: the chapters are MyST with directives (propositions, exercises, glued
figures, citations) that only Sphinx and its extensions render as the book shows them; nbconvert's
slides exporter renders notebook markdown with mistune, which knows none of them, and loads
reveal.js from a CDN unless given a copy. sphinx-revealjs is maintained, runs inside the same
Sphinx the book uses, and ships reveal.js in its wheel.

This module is also the slides' own Sphinx extension (:func:`setup`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from . import ROOT, slides
from .book import select_chapters
from .notebooks import read
from .output import Output


def _mathjax_dir() -> Path:
    import mathjax

    return Path(mathjax.__file__).parent / "static/mathjax/es5"


CSS = """\
.reveal { font-size: 26px; }
.reveal .slides section { text-align: left; }
.reveal h1 { font-size: 1.6em; text-align: center; }
.reveal h2 { font-size: 1.2em; }
.reveal img { height: 460px; width: auto; max-width: 100%; object-fit: contain; display: block; }
.reveal img { margin: 0 auto; }
.reveal figcaption, .reveal .caption { font-size: 0.6em; }
.reveal table { font-size: 0.75em; margin: 0; }
.reveal table th, .reveal table td { padding: 0.2em 0.4em; }
.reveal .admonition-title, .reveal .proof-title, .reveal .exercise-title { font-weight: bold; }
.reveal div.proof, .reveal div.exercise { border-left: 4px solid #888; padding-left: 0.8em; }
.reveal .cell_output pre { font-size: 0.6em; }
.reveal .docutils.container { width: 100%; }
.reveal table p { margin: 0; }
.reveal a.headerlink { display: none; }
.reveal div.exercise p.admonition-title::after { content: none; }  /* an icon font the decks do not ship */
"""

# Shrink the text of a slide until it fits the slide's height (long propositions, exercises, tables).
FIT_JS = """\
(function () {
  function fit(slide) {
    if (!slide) { return; }
    var height = Reveal.getConfig().height, size = 100;
    slide.style.fontSize = "";
    while (slide.scrollHeight > height && size > 40) { size -= 5; slide.style.fontSize = size + "%"; }
  }
  Reveal.on("ready", function (e) { fit(e.currentSlide); });
  Reveal.on("slidechanged", function (e) { fit(e.currentSlide); });
})();
"""


def sphinx_config(src: Path) -> dict:
    """The slides' Sphinx configuration (overrides; there is no conf.py)."""
    import myst_nb.core.render as render

    html = render.base_render_priority()["html"]
    return {
        "extensions": ["myst_nb", "sphinx_revealjs", "sphinx_proof", "sphinx_exercise",
                       "sphinxcontrib.bibtex", "course.slides_build"],
        "project": "Slides",
        "root_doc": "index",
        "exclude_patterns": ["_build", "**.ipynb_checkpoints"],
        "nb_execution_mode": "off",
        "nb_merge_streams": True,
        "nb_mime_priority_overrides": [("revealjs", k, v) for k, v in html.items()],
        "myst_enable_extensions": ["dollarmath", "amsmath", "colon_fence", "deflist", "substitution"],
        "bibtex_bibfiles": ["references.bib"],
        "bibtex_reference_style": "author_year",
        "bibtex_default_style": "plain",
        "suppress_warnings": ["mystnb.unknown_mime_type"],
        "revealjs_static_path": [str(src / "_static")],
        "revealjs_css_files": ["slides.css"],
        "revealjs_script_files": ["fit.js"],
        "revealjs_style_theme": "white",
        "revealjs_script_conf": {"hash": True, "slideNumber": True, "center": False, "width": 1280,
                                 "height": 800},
        "mathjax_path": "mathjax/tex-mml-chtml.js",
    }


def setup(app):
    """The slides' own Sphinx extension: sphinx-proof and sphinx-exercise put the body of a block in a
    ``section`` node, which the revealjs translator would turn into a slide of its own; only sections
    of the document itself make slides here, the others are plain ``div`` elements."""
    from docutils import nodes
    from sphinx_revealjs.writers import RevealjsSlideTranslator

    def _slide(node) -> bool:
        return isinstance(node.parent, (nodes.section, nodes.document))

    class Translator(RevealjsSlideTranslator):
        def visit_section(self, node):
            if _slide(node):
                return super().visit_section(node)
            self.body.append('<div class="section">\n')

        def depart_section(self, node):
            if _slide(node):
                return super().depart_section(node)
            self.body.append("</div>\n")

    app.set_translator("revealjs", Translator, override=True)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}


def build(out: Path, root: Path = ROOT, names: list[str] | None = None,
          quiet: bool = True) -> dict[str, Path]:
    """Write the deck notebooks under ``out/src`` and build every deck into ``out/<name>.html``.

    ``out`` must be new, empty or made by this tool (:class:`course.output.Output`); the decks are
    built in a temporary folder and moved into ``out`` once the build succeeded, replacing only the
    files an earlier build wrote there."""
    names = select_chapters(names, root)
    output = Output(out, "slides", "--out")
    output.check_replace()
    with output.stage() as tmp:
        stage = Path(tmp) / "out"
        _build(stage, Path(tmp) / "doctrees", root, names, quiet)
        output.commit(stage, chapters=names)
    return {n: output.folder / f"{n}.html" for n in names}


def _build(out: Path, doctrees: Path, root: Path, names: list[str], quiet: bool) -> None:
    from sphinx.application import Sphinx

    src = out / "src"
    (src / "_static").mkdir(parents=True)
    shutil.copytree(_mathjax_dir(), src / "_static/mathjax",
                    ignore=shutil.ignore_patterns("*.map", "tex-chtml*.js", "tex-svg*.js", "tex-mml-svg.js",
                                                  "mml-*.js", "tex-chtml.js", "startup.js", "latest.js"))
    (src / "_static/slides.css").write_text(CSS)
    (src / "_static/fit.js").write_text(FIT_JS)
    shutil.copyfile(root / "book/references.bib", src / "references.bib")
    notebooks = {n: read(root / "book" / f"{n}.ipynb") for n in names}
    decks = {n: slides.deck(n, nb) for n, nb in notebooks.items()}
    known = set().union(*(slides.labels(d) for d in decks.values()))
    titles = {n: d.title for n, d in decks.items()}
    for n, d in decks.items():
        deck_nb = slides.deck_notebook(d, notebooks[n], set(decks), known, titles)
        (src / f"{n}.ipynb").write_text(json.dumps(deck_nb, indent=1, ensure_ascii=False), encoding="utf-8")
        for f in d.files:
            if (root / "book" / f).is_file():
                (src / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / "book" / f, src / f)
    index = ["# Slides\n", "One deck per chapter, built from the chapter's executed notebook.\n"]
    index += [f"* {{doc}}`{d.title} <{n}>`" for n, d in decks.items()]
    index += ["", "```{toctree}", ":hidden:", "", *names, "```", ""]
    (src / "index.md").write_text("\n".join(index), encoding="utf-8")
    app = Sphinx(str(src), None, str(out), str(doctrees), "revealjs",
                 confoverrides=sphinx_config(src), status=None if quiet else sys.stdout, warning=sys.stderr,
                 freshenv=True, warningiserror=True, keep_going=True)
    app.build()
    if app.statuscode:
        raise SystemExit(f"the slides' build failed (status {app.statuscode}); see the warnings above; "
                         "nothing was written to the output folder")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course slides",
                                     description="One reveal.js deck per chapter, from book/<name>.ipynb.")
    parser.add_argument("--out", type=Path, default=ROOT / "build/slides", help="output folder")
    parser.add_argument("chapters", nargs="*", help="chapters (default: every chapter of _toc.yml)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    built = build(args.out.resolve(), names=args.chapters or None)
    for n, path in built.items():
        print(f"{n}: file://{path}")
    print(f"{len(built)} decks in {time.perf_counter() - start:.0f} s")
    return 0
