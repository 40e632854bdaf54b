"""The API reference (``book/api/*.md``) documents every public name of symlib, and nothing that is gone.

No Sphinx build: the pages' autodoc and autosummary directives are read as text. The public names of a
module are its ``__all__`` or, without one, the functions, classes and constants its source defines at top
level without a leading underscore. Each must appear on a page (a directive or an autosummary entry,
under the module that re-exports it or the one that defines it) and have a full entry (an ``auto*``
directive) somewhere; every module must have its ``automodule``; and every name a page documents must
still exist. The strict book build (``make html``: ``-W -n``) then checks that the entries render and that
their cross-references resolve.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import types
from pathlib import Path

import pytest
import yaml

import symlib

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "book" / "api"
PACKAGE = Path(symlib.__file__).parent
_spec = importlib.util.spec_from_file_location("sync_pages", ROOT / "book/api/_ext/sync_pages.py")
_SYNC = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_SYNC)

_DIRECTIVE = re.compile(r"^\s*\.\. (auto\w+|currentmodule|module|py:module)::\s*(\S+)\s*$")
_MISSING = object()
_ENTRY_KINDS = {"autofunction", "autoclass", "autoexception", "autodata", "autoattribute", "automethod",
                "autoproperty", "automodule"}


def _module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts[1:]):  # _version, _lazy, __main__: private
            continue
        names.append(".".join(parts))
    return names


MODULES = _module_names()


def _defined(module: str) -> list[str]:
    """Public names a module's source assigns or defines at top level, in source order."""
    path = PACKAGE.parent / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return _SYNC.defined(path)  # the page generator's own reading of a module's names


def _public(module: str) -> list[str]:
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    return list(names) if names is not None else _defined(module)


def _pages() -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(API.glob("*.md"))}


def _read_pages() -> tuple[set[str], set[str], set[str]]:
    """``(entries, listed, modules)``: full names with an ``auto*`` directive, full names on a page at all
    (directives and autosummary rows), and the modules with an ``automodule``."""
    entries, listed, modules = set(), set(), set()
    for text in _pages().values():
        current = None
        in_summary = False
        for line in text.splitlines():
            m = _DIRECTIVE.match(line)
            if m:
                kind, name = m.groups()
                in_summary = kind == "autosummary"
                if kind in ("currentmodule", "module", "py:module"):
                    current = name
                    continue
                if kind == "automodule":
                    current = name
                    modules.add(name)
                full = name if name.startswith("symlib") or current is None else f"{current}.{name}"
                if kind in _ENTRY_KINDS:
                    entries.add(full)
                    listed.add(full)
                continue
            if re.match(r"^\s*\.\. autosummary::", line):
                in_summary = True
                continue
            if in_summary:
                row = line.strip()
                if not row or row.startswith(":"):
                    continue
                if not line.startswith("   ") or row.startswith(".. ") or row == "```":
                    in_summary = False
                    continue
                row = row.lstrip("~")
                listed.add(row if row.startswith("symlib") or current is None else f"{current}.{row}")
    return entries, listed, modules


ENTRIES, LISTED, DOCUMENTED_MODULES = _read_pages()
SYNC = "run `.venv/bin/python book/api/_ext/sync_pages.py` (it rewrites the pages' module sections)"


def _resolve(name: str):
    """The object a full dotted name stands for (importing the longest module prefix)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(name)


def _same(a: str, b: str, obj) -> bool:
    """Whether full name ``b`` documents the object of public name ``a``: the same object, and for data
    (whose identity a small int or a string may share by chance) also the same name."""
    try:
        other = _resolve(b)
    except (ImportError, AttributeError):
        return False
    if other is not obj:
        return False
    if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
        return True
    return a.rpartition(".")[2] == b.rpartition(".")[2]


def test_pages_are_in_the_table_of_contents():
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = {c["file"] for part in toc["parts"] for c in part["chapters"]}
    missing = [p.stem for p in _pages() if f"book/api/{p.stem}" not in files]
    assert not missing, f"book/api pages missing from _toc.yml: {missing}"


@pytest.mark.parametrize("module", MODULES)
def test_every_module_has_its_section(module):
    assert module in DOCUMENTED_MODULES, (
        f"no `.. automodule:: {module}` in book/api/*.md: add a section for it on its subpackage's page; "
        f"{SYNC}"
    )


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_is_documented(module):
    mod = importlib.import_module(module)
    unlisted, no_entry = [], []
    for name in _public(module):
        obj = getattr(mod, name, _MISSING)  # a bare annotation (``x: int``) assigns nothing
        if obj is _MISSING:
            continue
        full = f"{module}.{name}"
        if isinstance(obj, types.ModuleType):
            if obj.__name__ not in DOCUMENTED_MODULES:
                unlisted.append(name)
            continue
        if full not in LISTED and not any(_same(full, other, obj) for other in LISTED):
            unlisted.append(name)
        if full not in ENTRIES and not any(_same(full, other, obj) for other in ENTRIES):
            no_entry.append(name)
    assert not unlisted, (
        f"public names of {module} on no page of book/api/ (add them to its section: an `auto*` directive "
        f"where they are defined, an autosummary row where they are re-exported; {SYNC}): {unlisted}"
    )
    assert not no_entry, f"public names of {module} without an `auto*` entry in book/api/ ({SYNC}): " + str(
        no_entry
    )


def test_every_documented_name_exists():
    gone = []
    for name in sorted(LISTED):
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            gone.append(name)
    assert not gone, f"book/api/*.md documents names that no longer exist ({SYNC}): {gone}"


def test_the_nouns_of_import_symlib_are_on_their_page():
    text = (API / "symlib.md").read_text()
    nouns = [n for n in symlib.__all__ if not isinstance(getattr(symlib, n), types.ModuleType)]
    missing = [n for n in nouns if f"symlib.{n}" not in text]
    assert not missing, f"book/api/symlib.md does not show symlib.{missing}"
