r"""Slides from the chapters: what of a chapter goes on its reveal.js deck, read from the chapter itself.

A chapter's deck is made from its committed executed notebook ``book/<name>.ipynb`` (nothing is
re-executed); :mod:`course.slides_build` turns the decks into reveal.js HTML (``make slides``).

**What goes on a slide.** The chapter decides, through its own markup; no slide text is written
anywhere else, so a deck follows its chapter whenever the chapter changes:

* the objectives (the ``{admonition}`` whose title starts with "Objectives"), and its
  prerequisites paragraph on a slide of its own;
* every display equation (``$$ ... $$``) of the prose, with the paragraph that leads into it;
* every ``{prf:...}`` block except proofs (propositions, definitions, theorems, ...);
* every figure (``{glue:figure}``: the image the last run glued; ``{figure}``: the file);
* every code cell tagged ``slide``: its outputs (the "claims checked" tables), never its code;
  the claims it asserts become a table "claim / on this run" (the assert's message, or the comment
  on the assert's line). A chapter without any cell tagged ``slide`` gets the last code cell before
  its exercises that asserts something;
* every markdown cell tagged ``slide``, whole;
* every ``{exercise}``, without its solution (solutions are removed first, with
  :func:`course.book.strip_notebook`, so none can reach a deck);
* the results each section states in its prose: the sentences that carry a glued number
  (``{glue:text}``), at most :data:`MAX_RESULTS` of them, on a slide "Results: <section>" at the
  section's end (the numbers are the last run's, as on the chapter's page).

The result slides of a deck are its glued figures (with their captions) and these sentences; the
claims the chapter asserts follow on the "claims checked" slide.

Each goes on a slide of its own, titled by the chapter's section (``##``) it comes from, in the
chapter's order. Cross references stay links when their target is on some deck (chapters link to
each other's decks with ``{doc}``); glossary terms and references to pages without a deck become
plain text.
"""

from __future__ import annotations

import ast
import base64
import copy
import hashlib
import json
import re
from dataclasses import dataclass, field

from .asserts import walk
from .book import closes, strip_notebook
from .notebooks import source, tags

TAG = "slide"
GLUE_PREFIX = "application/papermill.record/"

_FENCE = re.compile(r"^(?P<fence>`{3,}|:{3,})\s*(?:\{(?P<name>[^}\s]+)\})?\s*(?P<arg>.*)$")
_HEADING = re.compile(r"^(?P<hashes>#{1,6})\s+(?P<title>.+?)\s*#*\s*$")
_ROLE = re.compile(r"\{(?P<role>[\w:-]+)\}`(?P<body>[^`]*)`")
_LABEL = re.compile(r"^\s*:(?:label|name):\s*(\S+)", re.M)
_EQ_LABEL = re.compile(r"\$\$\s*\((?P<label>[\w:-]+)\)\s*$")
_GLUED = re.compile(r"\{glue(?::\w+)?\}`")
# a sentence ends at . ! ? followed by a space and a capital, a role, a parenthesis or emphasis
# ("e.g. the", "Fig. 7" and ":.2f" inside a role do not end one)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z{(*])")
MAX_RESULTS = 4  # sentences on a section's result slide
MAX_SENTENCE = 450  # characters: a longer sentence is an explanation, not a result
RESULT_KINDS = ("figure", "result")  # the slides that show a chapter's results


@dataclass
class Block:
    """A top-level block of MyST markdown: ``kind`` is heading, directive, math, para or other."""

    kind: str
    text: str
    name: str = ""
    arg: str = ""
    level: int = 0


@dataclass
class Slide:
    """One slide of a deck: a title, MyST markdown, and optionally a code cell whose outputs it shows."""

    title: str
    markdown: str = ""
    cell: dict | None = None
    kind: str = "text"


@dataclass
class Deck:
    """The slides of one chapter, with what they need from the chapter: glue values and files."""

    name: str
    title: str
    slides: list[Slide] = field(default_factory=list)
    glue: dict[str, dict] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# MyST markdown, block by block
# --------------------------------------------------------------------------------------------------

def blocks(text: str) -> list[Block]:
    """Split MyST markdown into its top-level blocks (directives and fenced code whole, nested ones
    inside their parent; display math from ``$$`` to ``$$``; headings; paragraphs)."""
    lines = text.splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        s = line.strip()
        if not s:
            i += 1
            continue
        m = _FENCE.match(s)
        if m and not line[:1].isspace():
            fence, j = m["fence"], i + 1
            while j < len(lines) and not closes(lines[j], fence):
                j += 1
            kind = "directive" if m["name"] else "other"
            out.append(Block(kind, "\n".join(lines[i : j + 1]), name=m["name"] or "", arg=m["arg"].strip()))
            i = j + 1
            continue
        if s.startswith("$$"):
            j = i
            if not (len(s) > 2 and re.search(r"\$\$\s*(\([\w:-]+\))?\s*$", s[2:])):
                j = i + 1
                while j < len(lines) and not lines[j].strip().startswith("$$"):
                    j += 1
            out.append(Block("math", "\n".join(lines[i : j + 1])))
            i = j + 1
            continue
        h = _HEADING.match(line)
        if h:
            out.append(Block("heading", line, arg=h["title"], level=len(h["hashes"])))
            i += 1
            continue
        if re.match(r"^\([\w:-]+\)=\s*$", s) or s.startswith("%"):
            out.append(Block("other", line))
            i += 1
            continue
        j = i
        while j < len(lines) and lines[j].strip() and not lines[j].strip().startswith("$$") and not (
            _FENCE.match(lines[j].strip()) and not lines[j][:1].isspace()
        ) and not _HEADING.match(lines[j]):
            j += 1
        out.append(Block("para", "\n".join(lines[i:j])))
        i = j
    return out


# --------------------------------------------------------------------------------------------------
# The claims a code cell asserts
# --------------------------------------------------------------------------------------------------

def _parameters(nb: dict) -> dict:
    """The literal values of the notebook's ``parameters`` cell (the scale it ran at)."""
    values = {}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and "parameters" in tags(cell):
            try:
                tree = ast.parse(source(cell))
            except SyntaxError:
                return values
            for node in tree.body:
                if isinstance(node, ast.Assign) and [type(t) for t in node.targets] == [ast.Name]:
                    try:
                        values[node.targets[0].id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
    return values


def claims(cell: dict, params: dict) -> list[tuple[str, str]]:
    """``(claim, status)`` for every ``assert`` of a code cell, in order.

    The claim is the assert's message when it is a string, else the comment that ends its line, else
    ``""`` (a check without words). The status says whether the committed run checked it: ``held``
    (the cell ran without an error), ``failed`` (the cell has an error output), or ``not checked at
    this scale`` (an ``if`` on the parameters around it was false in that run).
    """
    src = source(cell)
    try:
        found = walk(src, params)
    except SyntaxError:
        return []
    lines = src.splitlines()
    errored = any(o.get("output_type") == "error" for o in cell.get("outputs", []))
    out = []
    for node, active in found:
        msg, last = node.msg, lines[node.end_lineno - 1]
        if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
            text = msg.value
        elif msg is None and "#" in last:
            text = last.split("#", 1)[1].strip()
        else:
            text = ""
        status = "not checked at this scale" if not active else ("failed" if errored else "held")
        out.append((text, status))
    return out


_MARKS = {"held": "✓ held", "failed": "✗ failed", "not checked at this scale": "– not checked at this scale"}


def claims_table(rows: list[tuple[str, str]]) -> str:
    """The claims with words as a markdown table; the checks without words counted below it."""
    said = [(c, s) for c, s in rows if c]
    body = "".join("| " + c.replace("|", "\\|") + f" | {_MARKS[s]} |\n" for c, s in said)
    out = ("| Claim | On this run |\n|---|---|\n" + body) if said else ""
    rest = [s for c, s in rows if not c]
    if rest:
        counts = ", ".join(f"{rest.count(s)} {_MARKS[s].split(' ', 1)[1]}" for s in _MARKS if s in rest)
        out += f"\n{'And ' if said else ''}{len(rest)} further check{'s' * (len(rest) > 1)}: {counts}.\n"
    return out


# --------------------------------------------------------------------------------------------------
# From a chapter to its deck
# --------------------------------------------------------------------------------------------------

def _lead_in(prev: Block | None) -> str:
    """The paragraph before an equation, or its last sentence when the paragraph is long."""
    if prev is None or prev.kind != "para":
        return ""
    text = prev.text.strip()
    if len(text) <= 400:
        return text
    parts = re.split(r"(?<=[.:;])\s+(?=[A-Z{$])", text)
    return parts[-1]


def result_sentences(paragraph: str) -> list[str]:
    """The sentences of a prose paragraph that state a glued number (a ``{glue:...}`` role), on one line."""
    text = " ".join(paragraph.split())
    return [x for x in _SENTENCE_END.split(text) if _GLUED.search(x) and len(x) <= MAX_SENTENCE]


def _code_slide(cell: dict, params: dict) -> tuple[dict, str]:
    """A copy of a tagged code cell with only its displayed outputs, and its claims as a table."""
    outputs = [o for o in cell.get("outputs", []) if "scrapbook" not in o.get("metadata", {})]
    shown = copy.deepcopy({**cell, "outputs": outputs})
    shown["metadata"] = {"tags": ["remove-input"]}
    rows = claims(cell, params)
    return shown, (claims_table(rows) if rows else "")


def deck(name: str, nb: dict) -> Deck:
    """The slides of chapter ``name`` (its executed notebook ``nb``), in the chapter's order."""
    params = _parameters(nb)
    stripped = strip_notebook(nb)
    cells = stripped["cells"]
    tagged = any(TAG in tags(c) for c in cells)
    if not tagged:  # the chapter's claims: the last asserting code cell before the exercises
        last = None
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "markdown" and re.search(r"^#+\s+Exercises", source(cell), re.M):
                break
            if cell["cell_type"] == "code" and re.search(r"^\s*assert\b", source(cell), re.M):
                last = i
        fallback = {last} if last is not None else set()
    else:
        fallback = set()
    d = Deck(name, name)
    section = "Introduction"
    results: list[str] = []

    def close_section():  # the section's stated results on a slide of their own, at its end
        if results and not section.lower().startswith("exercises"):
            body = "\n".join(f"* {x}" for x in results[:MAX_RESULTS])
            d.slides.append(Slide(f"Results: {section}", body, kind="result"))
        results.clear()

    for i, cell in enumerate(cells):
        src = source(cell)
        if cell["cell_type"] == "code":
            if TAG in tags(cell) or i in fallback:
                shown, table = _code_slide(cell, params)
                rich = any({"text/html", "image/png"} & set(o.get("data", {})) for o in shown["outputs"])
                title = section if rich or not table else "Claims checked on this run"
                d.slides.append(Slide(title or d.title, table, shown, kind="code"))
            continue
        if cell["cell_type"] != "markdown":
            continue
        whole = TAG in tags(cell)  # the cell on a slide as it is, its headings as the slide's title
        if whole:
            if any(b.kind == "heading" and b.level == 2 for b in blocks(src)):
                close_section()  # the section before this cell ends here
            heads = [b.arg for b in blocks(src) if b.kind == "heading"]
            text = "\n".join(x for x in src.splitlines() if not _HEADING.match(x)).strip()
            d.slides.append(Slide(heads[-1] if heads else section, text, kind="cell"))
        prev = None
        for b in blocks(src):
            if whole and b.kind != "heading":
                continue
            if b.kind == "heading":
                if b.level == 1 and d.title == name:
                    d.title = b.arg
                elif b.level == 2:
                    close_section()
                    section = b.arg
            elif b.kind == "directive" and b.name == "admonition" and b.arg.lower().startswith("objectives"):
                body = "\n".join(b.text.splitlines()[1:-1])
                body = "\n".join(x for x in body.splitlines() if not re.match(r"^\s*:\w+:", x)).strip()
                head, _, prereq = body.partition("**Prerequisites.**")
                d.slides.append(Slide("Objectives", head.strip(), kind="objectives"))
                if prereq.strip():
                    d.slides.append(Slide("Prerequisites", prereq.strip(), kind="objectives"))
            elif b.kind == "directive" and b.name.startswith("prf:") and b.name != "prf:proof":
                d.slides.append(Slide(section or d.title, b.text, kind="prf"))
            elif b.kind == "directive" and b.name in ("glue:figure", "figure"):
                d.slides.append(Slide(section or d.title, b.text, kind="figure"))
                if b.name == "figure":
                    d.files.append(b.arg)
            elif b.kind == "directive" and b.name == "exercise":
                d.slides.append(Slide("Exercises", b.text, kind="exercise"))
            elif b.kind == "math":
                lead = _lead_in(prev)
                text = (lead + "\n\n" if lead else "") + b.text
                d.slides.append(Slide(section or d.title, text, kind="math"))
            elif b.kind == "para":
                results.extend(result_sentences(b.text))
            prev = b
    close_section()
    return d


def labels(d: Deck) -> set[str]:
    """The labels a deck defines (propositions, exercises, figures, equations)."""
    out = set()
    for s in d.slides:
        out |= set(_LABEL.findall(s.markdown))
        out |= {m["label"] for m in _EQ_LABEL.finditer(s.markdown)}
    return out


def _plain(body: str) -> str:
    """The text a role shows: ``text <target>`` gives ``text``, ``target`` itself otherwise."""
    m = re.match(r"^(.*?)\s*<([^<>]+)>$", body, re.S)
    return m.group(1) if m else body


def inline(text: str, decks: set[str], known: set[str], titles: dict[str, str]) -> str:
    """Roles that would not resolve in the slides' build made plain text (glossary terms, pages
    without a deck, labels on no slide); the others kept, so that they stay links."""

    def sub(m):
        role, body = m["role"], m["body"]
        target = body[body.rindex("<") + 1 : -1] if body.endswith(">") and "<" in body else body
        if role == "term":
            return _plain(body)
        if role == "doc":
            page = target.split("/")[-1].removesuffix(".md").removesuffix(".ipynb")
            if page in decks:
                return f"{{doc}}`{_plain(body) if target != body else titles.get(page, page)} <{page}>`"
            return _plain(body) if target != body else f"*{page}*"
        if role in ("prf:ref", "numref", "ref", "eq") and target not in known:
            return _plain(body) if target != body else f"`{target}`"
        return m.group(0)

    return _ROLE.sub(sub, text)


def deck_notebook(d: Deck, nb: dict, decks: set[str], known: set[str], titles: dict[str, str]) -> dict:
    """The deck of ``d`` as a notebook that myst-nb reads: a title slide, one ``##`` section a slide,
    the chapter's glue values that the slides use (in a removed cell), and a references slide."""
    text = "\n".join(s.markdown for s in d.slides)
    used = {m["body"].split(":")[0].strip() for m in _ROLE.finditer(text) if m["role"].startswith("glue")}
    for s in d.slides:
        m = re.match(r"^(?:`{3,}|:{3,})\{glue:figure\}\s*(\S+)", s.markdown)
        if m:
            used.add(m.group(1))
    glue_out = []
    for cell in nb["cells"]:
        for o in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            key = o.get("metadata", {}).get("scrapbook", {}).get("name")
            if key in used:
                glue_out.append(o)
    cells = [{"cell_type": "markdown", "metadata": {}, "source": f"# {d.title}\n\nSlides of the chapter "
              f"*{d.title}*, from its executed notebook `book/{d.name}.ipynb`."}]
    if glue_out:
        cells.append({"cell_type": "code", "metadata": {"tags": ["remove-cell"]}, "execution_count": None,
                      "source": "# the chapter's glued values", "outputs": glue_out})
    for s in d.slides:
        md = f"## {s.title}\n\n" + inline(s.markdown, decks, known, titles)
        cells.append({"cell_type": "markdown", "metadata": {}, "source": md.rstrip() + "\n"})
        if s.cell is not None:
            cells.append(s.cell)
    if re.search(r"\{cite(:\w+)?\}`", text):
        cells.append({"cell_type": "markdown", "metadata": {},
                      "source": "## References\n\n```{bibliography}\n:filter: docname in docnames\n```\n"})
    for c in cells:
        c.setdefault("id", hashlib.sha1(json.dumps(c, sort_keys=True).encode()).hexdigest()[:12])
    return {"cells": cells, "metadata": nb.get("metadata", {}), "nbformat": 4, "nbformat_minor": 5}


# --------------------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------------------

def figure_hashes(nb: dict, names: set[str] | None = None) -> dict[str, str]:
    """SHA-256 of every glued figure of an executed notebook (``names``: only those), by glue name."""
    out = {}
    for cell in nb["cells"]:
        for o in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            key = o.get("metadata", {}).get("scrapbook", {}).get("name")
            png = o.get("data", {}).get(GLUE_PREFIX + "image/png") or o.get("data", {}).get("image/png")
            if key and png and (names is None or key in names):
                data = png if isinstance(png, str) else "".join(png)
                out[key] = hashlib.sha256(base64.b64decode(data)).hexdigest()
    return out
