"""Bring the reference sections of the API pages (``book/api/*.md``) in line with the code.

    .venv/bin/python book/api/_ext/sync_pages.py

Each page is an introduction written by hand, kept as it is, followed by one section per module
(``## `symlib.x.y```), which this script rewrites from the code: the module's docstring
(``automodule``), a summary table and one ``auto*`` entry per public name the module defines, in source
order, and, for a package, summary tables of the names it re-exports, grouped by the module that
defines them (where their entry is). The public names of a module are its ``__all__`` or, without one,
the functions, classes and constants its source defines at top level without a leading underscore
(``tests/test_api_docs.py`` checks the same rule).

The order of the sections on a page is kept; a module that is gone loses its section; a new module gets a
section after the last one of its package, on that package's page (a new top-level module must be placed
by hand: the script says so). The nouns of ``import symlib`` (``book/api/symlib.md``) are rewritten
after the page's "Nouns" rubric.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
API = ROOT / "book" / "api"
sys.path.insert(0, str(ROOT))

import symlib  # noqa: E402

PACKAGE = Path(symlib.__file__).parent
_HEADING = re.compile(r"^## `(symlib[\w.]*)`", re.M)


def modules() -> dict[str, Path]:
    """Every public module of symlib and its source file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts[1:]):
            continue
        out[".".join(parts)] = path
    return out


def defined(path: Path) -> list[str]:
    """Public names a source file assigns or defines at top level, in source order."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return [n for n in dict.fromkeys(names) if not n.startswith("_")]


_MISSING = object()


class Homes:
    """Where each public object is defined: ``(id, name)`` for any object (a constant's identity may be
    shared by chance), ``id`` alone for classes and functions (whatever name they are imported under)."""

    def __init__(self, mods: dict[str, Path]):
        self.by_name: dict[tuple[int, str], str] = {}
        self.by_id: dict[int, str] = {}
        for name, path in mods.items():
            module = importlib.import_module(name)
            for n in defined(path):
                obj = getattr(module, n, _MISSING)
                if obj is _MISSING:
                    continue
                self.by_name.setdefault((id(obj), n), f"{name}.{n}")
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    self.by_id.setdefault(id(obj), f"{name}.{n}")

    def of(self, obj, name: str) -> str | None:
        return self.by_name.get((id(obj), name)) or self.by_id.get(id(obj))


def _entry(name: str, obj) -> list[str]:
    if inspect.isclass(obj):
        kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
        return [f".. {kind}:: {name}", "   :members:", ""]
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return [f".. autofunction:: {name}", ""]
    simple = isinstance(obj, int | float | str | bool) or (
        isinstance(obj, tuple | list | set | frozenset | dict) and len(repr(obj)) <= 100
    )
    return [f".. autodata:: {name}", *([] if simple else ["   :no-value:"]), ""]


def section(name: str, path: Path, homes: Homes) -> str:
    """The reference section of one module."""
    module = importlib.import_module(name)
    here = defined(path)
    public = getattr(module, "__all__", None)
    names = list(public) if public is not None else here
    own, elsewhere = [], {}
    for n in names:
        obj = getattr(module, n, _MISSING)
        if obj is _MISSING or isinstance(obj, types.ModuleType):
            continue  # a bare annotation; a submodule (its own section)
        home = homes.of(obj, n)
        if home == f"{name}.{n}" or (home is None and n in here):
            own.append(n)
        elif home is not None:
            mod, _, attr = home.rpartition(".")
            elsewhere.setdefault(mod, []).append(attr)
    order = {n: i for i, n in enumerate(here)}
    own.sort(key=lambda n: order.get(n, len(order)))
    lines = [f"## `{name}`", "", "```{eval-rst}", f".. automodule:: {name}", ""]
    if own:
        lines += [".. autosummary::", "   :nosignatures:", "", *(f"   {n}" for n in own), ""]
    if elsewhere:
        lines += [".. rubric:: Re-exported here", ""]
        for mod, attrs in elsewhere.items():
            lines += [f".. currentmodule:: {mod}", "", ".. autosummary::", "   :nosignatures:", ""]
            lines += [*(f"   {a}" for a in attrs), ""]
        lines += [f".. currentmodule:: {name}", ""]
        aliases = []
        for n in names:
            obj = getattr(module, n, _MISSING)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__name__ != n:
                home = homes.of(obj, n)
                if home and home != f"{name}.{n}":
                    role = "func" if inspect.isfunction(obj) else (
                        "exc" if issubclass(obj, BaseException) else "class")
                    aliases.append(f"``{name}.{n}`` is :{role}:`{homes.by_id.get(id(obj), home)}`")
        if aliases:
            lines += ["Under another name: " + "; ".join(aliases) + ".", ""]
    for n in own:
        lines += _entry(n, getattr(module, n))
    lines[-1:] = ["```", ""]
    return "\n".join(lines)


def nouns() -> str:
    """The entries of the nouns of ``import symlib``: signature and summary, the full entry at home."""
    lines = []
    for noun, (module, attr) in symlib._NOUNS.items():
        obj = getattr(importlib.import_module(module), attr)
        if inspect.isclass(obj):
            kind = "autoexception" if issubclass(obj, BaseException) else "autoclass"
        elif inspect.isfunction(obj):
            kind = "autofunction"
        else:
            kind = "autodata"
        lines += [f".. {kind}:: symlib.{noun}", "   :no-index:", ""]
    lines += [".. autodata:: symlib.__version__", "   :no-index:", "",
              "   The installed version of symlib (written into every manifest).", "```", ""]
    return "\n".join(lines)


def main() -> int:
    mods = modules()
    homes = Homes(mods)
    pages = {p: p.read_text() for p in sorted(API.glob("*.md"))}
    layout = {p: _HEADING.findall(text) for p, text in pages.items()}
    placed = {m for ms in layout.values() for m in ms}
    problems = []
    for new in sorted(set(mods) - placed - {"symlib"}):
        parent = new.rpartition(".")[0]
        for page, ms in layout.items():
            idx = [i for i, m in enumerate(ms) if m == parent or m.startswith(parent + ".")]
            if idx and parent != "symlib":
                ms.insert(idx[-1] + 1, new)
                print(f"new section {new} on {page.name}")
                break
        else:
            problems.append(new)
    for page, text in pages.items():
        if page.name == "symlib.md":
            head, rubric, _ = text.partition(".. rubric:: Nouns\n")
            new_text = f"{head}{rubric}\n{nouns()}"
        else:
            m = _HEADING.search(text)
            if m is None:
                continue
            kept = [mod for mod in layout[page] if mod in mods]
            gone = [mod for mod in layout[page] if mod not in mods]
            for mod in gone:
                print(f"removed section {mod} from {page.name}: the module is gone")
            new_text = text[: m.start()] + "\n".join(section(mod, mods[mod], homes) for mod in kept)
        if new_text != text:
            page.write_text(new_text)
            print(f"updated {page.relative_to(ROOT)}")
    for mod in problems:
        print(f"{mod}: no page holds its package; add a section `## \\`{mod}\\`` to a page, then rerun")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
