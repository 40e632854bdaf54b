"""Sphinx helpers of the book's API reference (``book/api/``), loaded through ``_config.yml``.

* **References mean what the name means in Python.** A cross-reference (in a docstring or a signature)
  that names no documented object as written is looked up as Python would in the module where it is
  written: ``Spec`` in a module that imports it is :class:`symlib.symmetry.spec.Spec`, ``symlib.act``
  is :func:`symlib.symmetry.ops.act`, ``nn.Module`` is ``torch.nn.Module``. Each object is documented
  once, at its home module, and every name it is imported under links there. Sphinx alone searches
  by suffix, finds re-exports ambiguous, and cannot link a type alias (``Params``) from a signature.
  A name that Python cannot resolve either stays broken, and the strict build (``-n``) reports it.
  A summary row of an autosummary table is read in the context of the object it summarises.
* The public nouns of ``import symlib`` (``symlib.act``, ``symlib.mmd``, ...) are shown on the ``symlib``
  page with their signature and the first paragraph of their docstring, and a link to their full entry.
* A module-level constant without a doc-comment would show the docstring of its type (a tuple's, a
  dataclass's): it shows its name and value only.
* A dataclass field with a ``default_factory`` shows ``...`` as its default (autodoc's ``<factory>`` is not
  Python, and the whole signature would print unparsed).
* Two habits of symlib's Google-style docstrings that napoleon would misread: an ``Attributes:`` entry
  naming several attributes at once (``x, y: images and labels``) is split into one entry per name, as
  napoleon does for ``Args:``; and the docstring of a constant or property that opens with prose and a
  colon (``The normalised value of a black pixel: ...``) is not taken for ``type: description``.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.transforms.post_transforms import SphinxPostTransform

_MISSING = object()


def _walk(obj, parts):
    """``obj.parts[0].parts[1]...`` and the object each step went through, or ``_MISSING``."""
    path = [obj]
    for p in parts:
        obj = getattr(obj, p, _MISSING)
        if obj is _MISSING:
            return _MISSING, path
        path.append(obj)
    return obj, path


def _import(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - not a module, or one that cannot be imported here
        return None


def _python_object(module: str | None, cls: str | None, target: str):
    """What ``target`` names in Python, seen from ``module`` (and class ``cls``) where it is written, then
    as an absolute dotted name: ``(object, parent, attribute name)`` or ``None``."""
    parts = target.split(".")
    starts = []
    here = _import(module) if module else None
    if here is not None:
        if cls:
            owner, _ = _walk(here, cls.split("."))
            if owner is not _MISSING:
                starts.append(owner)
        starts.append(here)
    for start in starts:
        obj, path = _walk(start, parts)
        if obj is not _MISSING:
            return obj, path[-2], parts[-1]
    for i in range(len(parts), 0, -1):
        base = _import(".".join(parts[:i]))
        if base is None:
            continue
        obj, path = _walk(base, parts[i:])
        if obj is not _MISSING:
            return obj, (path[-2] if len(path) > 1 else None), parts[-1]
        break
    return None


def _home(obj, parent, attr: str, objects: dict, data_index: dict) -> str | None:
    """The full name under which ``obj`` is documented (or, outside symlib, its own full name)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    named = inspect.isclass(obj) or inspect.isroutine(obj)
    if isinstance(module, str) and isinstance(qualname, str) and named:
        name = f"{module}.{qualname}"
        if name in objects:
            return name
    if parent is not None and inspect.isclass(parent):  # a property or attribute of a documented class
        owner = _home(parent, None, parent.__name__, objects, data_index)
        if owner and f"{owner}.{attr}" in objects:
            return f"{owner}.{attr}"
    candidates = [n for n in data_index.get(id(obj), ()) if n.rpartition(".")[2] == attr]
    return candidates[0] if len(candidates) == 1 else None


def _external(module: str | None, target: str) -> str | None:
    """The full name of a reference to something outside symlib, spelled from its first component as
    imported where it is written (``nn.Module`` -> ``torch.nn.Module``, ``Tensor`` -> ``torch.Tensor``), so
    that ``nitpick_ignore_regex`` recognises it; ``None`` for symlib's own names."""
    head, _, rest = target.partition(".")
    here = _import(module) if module else None
    obj = getattr(here, head, _MISSING) if here is not None else _MISSING
    if obj is _MISSING:
        obj = _import(head)
        if obj is None:
            return None
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    elif inspect.isclass(obj) or inspect.isroutine(obj):
        name = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', head)}"
    else:
        return None
    if name.startswith("symlib"):
        return None
    return f"{name}.{rest}" if rest else name


def _data_index(objects: dict) -> dict:
    """``id(value) -> [full names]`` of every documented module-level datum."""
    index: dict[int, list[str]] = {}
    for name, entry in objects.items():
        if entry.objtype != "data" or entry.aliased:
            continue
        module, _, attr = name.rpartition(".")
        value = getattr(_import(module), attr, _MISSING) if _import(module) else _MISSING
        if value is not _MISSING:
            index.setdefault(id(value), []).append(name)
    return index


def _row_context(node) -> tuple[str | None, str | None] | None:
    """``(module, class)`` of the object an autosummary row describes, when ``node`` is in its summary:
    the summary is written in the object's docstring, so it is read where the object lives."""
    row = node.parent
    while row is not None and not isinstance(row, nodes.row):
        row = row.parent
    if row is None:
        return None
    first = next(iter(row.findall(addnodes.pending_xref)), None)
    if first is None or first is node:
        return None
    parts = first["reftarget"].split(".")
    for i in range(len(parts), 0, -1):
        if _import(".".join(parts[:i])) is not None:
            module, rest = ".".join(parts[:i]), parts[i:]
            owner, _ = _walk(_import(module), rest)
            if rest and inspect.isclass(owner):
                return module, ".".join(rest)
            return module, None
    return None


class ResolveAsPython(SphinxPostTransform):
    """Point Python cross-references at the documented home of what their name means in Python."""

    default_priority = 5  # before Sphinx's ReferencesResolver (10)

    def run(self, **kwargs) -> None:
        objects = self.env.get_domain("py").objects
        aliases = {k: v.lstrip("~") for k, v in (self.config.autodoc_type_aliases or {}).items()}
        index = None
        for node in self.document.findall(addnodes.pending_xref):
            if node.get("refdomain") != "py":
                continue
            target = node["reftarget"].removesuffix("()")
            module, cls = _row_context(node) or (node.get("py:module"), node.get("py:class"))
            local = [f"{module}.{cls}.{target}" if module and cls else "",
                     f"{module}.{target}" if module else "", target]
            hit = next((n for n in local if n in objects), None)
            if hit is None and aliases.get(target) in objects:
                hit = aliases[target]  # a type alias named in a signature written elsewhere
            if hit is None:
                found = _python_object(module, cls, target)
                if found is None:
                    continue
                if index is None:
                    index = _data_index(objects)
                hit = _home(*found, objects, index) or _external(module, target)
                if hit is None:
                    continue
            node["reftarget"] = hit
            if "refspecific" in node.attributes:
                del node["refspecific"]  # an exact name: any object type (a type alias is py:data)


def _noun(name: str):
    """``(object, home name)`` of ``symlib.<noun>``, or ``None`` when ``name`` is not a noun."""
    import symlib

    head, _, noun = name.partition(".")
    if head != "symlib" or "." in noun or noun not in symlib._NOUNS:
        return None
    module, attr = symlib._NOUNS[noun]
    obj = getattr(importlib.import_module(module), attr)
    if inspect.isclass(obj) or inspect.isfunction(obj):
        return obj, f"{obj.__module__}.{obj.__qualname__}"
    return obj, f"{module}.{attr}"  # data (the Params alias): documented where it is assigned


_ROLE = re.compile(r":(func|class|exc|data|meth|attr|obj|mod):`(~?)([^`<>]+)`")


def _qualify(m: re.Match, module: str) -> str:
    role, tilde, target = m.groups()
    if target.startswith(("symlib", ".")):
        return m.group(0)
    return f":{role}:`~{module}.{target}`"


def _docstring(app: Sphinx, what: str, name: str, obj, options, lines: list[str]) -> None:
    noun = _noun(name)
    if noun is not None:
        target, home = noun
        if what == "data":
            from sphinx.pycode import ModuleAnalyzer

            module, _, attr = home.rpartition(".")
            doc = "\n".join(ModuleAnalyzer.for_module(module).find_attr_docs().get(("", attr), []))
        else:
            doc = inspect.getdoc(target) or ""
        first = doc.strip().split("\n\n")[0].splitlines()
        # the summary is read on the symlib page: its references are qualified as in the home module
        module = home.rpartition(".")[0] if what == "data" else target.__module__
        first = [_ROLE.sub(lambda m: _qualify(m, module), line) for line in first]
        role = {"function": "func", "class": "class", "exception": "exc"}.get(what, "data")
        lines[:] = [*first, "", f"Full entry: :{role}:`{home}`.", ""]
        return
    if what in ("data", "attribute") and lines:
        own = type(obj).__doc__  # a NamedTuple field's type holds a descriptor here, not a string
        own = inspect.cleandoc(own if isinstance(own, str) else "")
        if own and "\n".join(lines).strip() == own.strip():
            lines[:] = []


_TYPE = re.compile(r"^\s*[\w.\[\]~`:]+(\s*[|,]\s*[\w.\[\]~`:]+)*\s*$")


def _prose_colon(app: Sphinx, what: str, name: str, obj, options, lines: list[str]) -> None:
    """Napoleon reads ``text: more`` on the first line of a constant's or property's docstring as
    ``type: description`` (its rendering ends with ``:type: text``); when ``text`` is prose, not a type,
    it is put back in front of the description."""
    if what not in ("data", "attribute", "property"):
        return
    last = max((i for i, line in enumerate(lines) if line.strip()), default=None)
    if last is None or not lines[last].startswith(":type: "):
        return
    prose = lines[last][len(":type: "):]
    if _TYPE.match(prose):
        return
    del lines[last]
    first = next(i for i, line in enumerate(lines) if line.strip())
    lines[first] = f"{prose}: {lines[first]}"


_IVAR = re.compile(r"^(\s*):ivar ([\w*]+(?:\s*,\s*[\w*]+)+):(.*)$")


def _split_ivars(app: Sphinx, what: str, name: str, obj, options, lines: list[str]) -> None:
    """``:ivar x, y: text`` (napoleon's rendering of an ``Attributes:`` entry ``x, y: text``) becomes one
    ``:ivar:`` per name with the same text, as napoleon does for ``Args:``."""
    out, i = [], 0
    while i < len(lines):
        m = _IVAR.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        indent, names, first = m.groups()
        block = [first]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(indent):
            block.append(lines[i])
            i += 1
        for n in (s.strip() for s in names.split(",")):
            out.append(f"{indent}:ivar {n}:{block[0]}")
            out.extend(block[1:])
    lines[:] = out


def _signature(app: Sphinx, what, name, obj, options, signature, return_annotation):
    """A dataclass field with a ``default_factory`` shows ``...`` as its default: autodoc writes
    ``<factory>``, which is not Python, and Sphinx then prints the whole signature unparsed."""
    if signature and "<factory>" in signature:
        return signature.replace("<factory>", "..."), return_annotation
    return None


def setup(app: Sphinx) -> dict:
    app.connect("autodoc-process-signature", _signature)
    app.connect("autodoc-process-docstring", _docstring, priority=100)  # before napoleon (500)
    app.connect("autodoc-process-docstring", _prose_colon, priority=890)  # after napoleon
    app.connect("autodoc-process-docstring", _split_ivars, priority=900)  # after napoleon
    app.add_post_transform(ResolveAsPython)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
