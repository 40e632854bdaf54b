r"""The values a chapter glues, pasted into its text for notebooks read outside the book.

A chapter computes its numbers and figures in code cells and hands them to the text with myst-nb's
``glue(name, value)``: the executed notebook ``book/<name>.ipynb`` keeps each value as a display output of
the cell that glued it, its mime types prefixed with ``application/papermill.record/`` and the name in
the output's ``metadata.scrapbook``. The book's pages paste them where the text says
``{glue:text}`name:.3f```, ``{glue}`name``` or ``{glue:figure} name``. Outside the book (a student's
notebook in JupyterLab) nothing resolves these: :func:`paste` replaces each by the value itself, as
myst-nb would show it (``{glue:text}`` formatted by its format spec, :func:`format_text`; a figure as a
MyST ``{figure}`` of a cell attachment, with its caption and label), and a value the executed notebook
does not hold by a short sentence that points to the book.
"""

from __future__ import annotations

import re
from ast import literal_eval

from .book import closes

GLUE_PREFIX = "application/papermill.record/"
IMAGES = {"image/png": "png", "image/jpeg": "jpg", "image/svg+xml": "svg"}

_ROLE = re.compile(r"\{glue(?::(?P<kind>[\w-]+))?\}`(?P<body>[^`]*)`")
_DIRECTIVE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|:{3,})\{glue(?::(?P<kind>[\w-]+))?\}"
                        r"[ \t]*(?P<arg>.*)$")
_OPTION = re.compile(r"^[ \t]*:(?P<key>[\w-]+):[ \t]*(?P<value>.*)$")
# myst-nb's glue:figure options, as the options of a MyST {figure} (the others are dropped)
_FIGURE_OPTIONS = {"name": "name", "alt": "alt", "figwidth": "width", "align": "align", "classes": "class"}


def values(nb: dict) -> dict[str, dict[str, str]]:
    """Every value glued in an executed notebook: ``{name: {mime type: data}}`` (the prefix removed,
    the data as one string); a name glued twice keeps its last value."""
    out: dict[str, dict[str, str]] = {}
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        for o in cell.get("outputs", []):
            scrap = o.get("metadata", {}).get("scrapbook")
            if not isinstance(scrap, dict) or "name" not in scrap:
                continue
            prefix = scrap.get("mime_prefix", GLUE_PREFIX)
            out[scrap["name"]] = {k[len(prefix):]: v if isinstance(v, str) else "".join(v)
                                  for k, v in o.get("data", {}).items() if k.startswith(prefix)}
    return out


def format_text(text: str, spec: str) -> str:
    """A glued ``text/plain`` as ``{glue:text}`name:spec``` shows it (myst-nb's rule: the text read as a
    Python literal where it is one, then formatted by ``spec``, whose last letter says the type)."""
    try:
        value = literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    if spec == "":
        return str(value)
    kind = spec[-1]
    if kind == "s":
        value = str(value)
    elif kind in "bcdoxX":
        value = int(value)
    elif kind in "eEfFgGn%":
        value = float(value)
    return format(value, spec)


class Paster:
    """Pastes the values of one executed notebook into markdown (:meth:`paste`).

    Args:
        glued: the notebook's values (:func:`values`).
        where: the notebook, as the sentences about a missing value name it
            (e.g. ``"book/toy.ipynb (scale cpu)"``).
    """

    def __init__(self, glued: dict[str, dict[str, str]], where: str):
        self.glued = glued
        self.where = where
        self.pasted = 0
        self.missing: list[str] = []

    # ----------------------------------------------------------------------------------------------

    def _missing_inline(self, key: str) -> str:
        self.missing.append(key)
        return f"*(a value of the book's chapter: {self.where} does not hold `{key}`)*"

    def _missing_block(self, key: str, what: str) -> str:
        self.missing.append(key)
        return (f"*Here the book's chapter shows {what} (`{key}`), which {self.where} does not hold: "
                "see the chapter in the book.*")

    def _role(self, m: re.Match) -> str:
        kind, body = m["kind"] or "any", m["body"].strip()
        if kind in ("text", "md"):
            key, _, spec = body.rpartition(":") if ":" in body else (body, "", "s" if kind == "text" else "")
        else:
            key, spec = body, ""
        data = self.glued.get(key) if "::" not in key else None
        if data is None:
            return self._missing_inline(key)
        self.pasted += 1
        if kind == "md" and "text/markdown" in data:
            return data["text/markdown"].strip()
        if "text/plain" not in data:
            return self._missing_inline(key)
        if kind == "text":
            try:
                return format_text(data["text/plain"], spec)
            except (TypeError, ValueError):
                return data["text/plain"]
        return format_text(data["text/plain"], "")

    def _directive(self, fence: str, kind: str, key: str, options: list[tuple[str, str]], body: str,
                   attachments: dict) -> str:
        data = self.glued.get(key) if "::" not in key else None
        image = next((mime for mime in IMAGES if data and mime in data), None)
        if kind in ("figure", "any") and image:
            self.pasted += 1
            name = f"{key}.{IMAGES[image]}"
            attachments[name] = {image: data[image]}
            opts = [f":{_FIGURE_OPTIONS[k]}: {v}".rstrip() for k, v in options if k in _FIGURE_OPTIONS]
            if kind == "any" and not body.strip():
                return f"![{key}](attachment:{name})"
            caption = ["", body.strip()] if body.strip() else []
            return "\n".join([f"{fence}{{figure}} attachment:{name}", *opts, *caption, fence])
        if data is not None and kind in ("md", "any", "figure") and "text/markdown" in data:
            self.pasted += 1
            return data["text/markdown"].strip() + (f"\n\n{body.strip()}" if body.strip() else "")
        if data is not None and kind == "math" and "text/latex" in data:
            self.pasted += 1
            label = next((v for k, v in options if k in ("label", "name")), "")
            math = data["text/latex"].strip().strip("$").strip()
            return f"$$\n{math}\n$$" + (f" ({label})" if label else "")
        if data is not None and kind in ("any", "figure", "text") and "text/plain" in data:
            self.pasted += 1
            return f"```\n{format_text(data['text/plain'], '')}\n```" + (f"\n\n{body.strip()}" if body.strip()
                                                                          else "")
        what = "a figure" if kind == "figure" else "a value"
        return self._missing_block(key, what) + (f"\n\n{body.strip()}" if body.strip() else "")

    # ----------------------------------------------------------------------------------------------

    def paste(self, text: str) -> tuple[str, dict[str, dict[str, str]]]:
        """``text`` (MyST markdown) with every glue directive and role replaced, and the cell attachments
        the replaced figures use (``{file name: {mime type: base64}}``, nbformat's ``attachments``)."""
        attachments: dict[str, dict[str, str]] = {}
        lines = text.split("\n")
        out: list[str] = []
        i = 0
        while i < len(lines):
            m = _DIRECTIVE.match(lines[i])
            if not m:
                out.append(lines[i])
                i += 1
                continue
            j = i + 1
            options: list[tuple[str, str]] = []
            while j < len(lines) and (o := _OPTION.match(lines[j])):
                options.append((o["key"], o["value"].strip()))
                j += 1
            body_start = j
            while j < len(lines) and not closes(lines[j], m["fence"]):
                j += 1
            body = "\n".join(lines[body_start:j])
            kind, key = m["kind"] or "any", m["arg"].strip()
            new = self._directive(m["fence"], kind, key, options, body, attachments)
            out += [m["indent"] + line if line else line for line in new.split("\n")]
            i = j + 1
        return _ROLE.sub(self._role, "\n".join(out)), attachments


def ran_at(nb: dict) -> str | None:
    """The scale an executed chapter ran at (papermill's record of its parameters), if known."""
    return nb.get("metadata", {}).get("papermill", {}).get("parameters", {}).get("scale")
