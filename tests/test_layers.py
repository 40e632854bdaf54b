"""The package's layers: nothing imports a layer above it, and no two modules import each other.

Every ``import`` of a symlib module is read from the source (function-level imports included), mapped to
the unit it lives in (``symlib.stats.mmd.kernels`` -> ``stats``) and checked against the order below,
which the README's layout section describes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import symlib

ROOT = Path(symlib.__file__).parent

# unit -> rank; a module may import its own unit or a unit of lower rank
RANK = {
    "_version": 0, "_lazy": 0, "errors": -1, "params": 0, "scales": 0, "progress": 0, "kernels": 0,
    "models": 0, "plotting": 0, "threads": 0,
    "data": 1, "store": 1,
    "symmetry": 2, "training": 2,
    "zoo": 3, "stats": 3,
    "posteriors": 4,
    "checkpoints": 5, "paper": 5,
    "ckpt": 6,
    "comparison": 7,
    "cli": 8,
    "__main__": 9,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Dotted names of the symlib modules ``path`` imports (``from symlib.x import y`` counts ``symlib.x.y``
    when that is a module)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("symlib")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("symlib"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


FILES = sorted(ROOT.rglob("*.py"))
MODULES = {_module_name(p) for p in FILES}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_rank():
    units = {_unit(m) for m in MODULES} - {"__init__"}
    assert units <= set(RANK), f"units without a layer: {sorted(units - set(RANK))}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_runs_up(path):
    me = _unit(_module_name(path))
    if me == "__init__":  # the package face resolves names lazily and imports only _version
        assert _imports(path) <= {"symlib._version"}
        return
    for dep in _imports(path):
        other = _unit(dep)
        if other == "__init__":
            continue  # `import symlib` for its __version__ attribute only
        assert other == me or RANK[other] < RANK[me], (
            f"{_module_name(path)} (layer {me}, rank {RANK[me]}) imports {dep} (layer {other}, "
            f"rank {RANK[other]}): an import that runs up"
        )


def test_no_cycles_between_modules():
    graph = {_module_name(p): {d for d in _imports(p) if d in MODULES} for p in FILES}
    # imports of a package's own face (``from symlib.stats import mmd`` inside stats) are not edges of a
    # cycle: the face resolves names lazily
    faces = {m for m in MODULES if (ROOT.parent / m.replace(".", "/") / "__init__.py").exists()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in graph.get(m, ()):
            if d in faces and d != m and m.startswith(d):
                continue
            if state.get(d) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*stack, m, d])}")
            if d not in state:
                visit(d, [*stack, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_public_nouns_resolve():
    for name in symlib.__all__:
        assert getattr(symlib, name) is not None, name
    assert symlib.mmd.__module__ == "symlib.stats.mmd.compare"
    assert symlib.minmass.__module__.startswith("symlib.symmetry.minmass")


def test_checkpoint_sets_do_not_go_through_the_posterior_layer():
    """Imported and canonical sets are written in the store's format of stacked sets, not through the
    posterior layer: no module of ``symlib.ckpt`` imports ``symlib.posteriors`` (function-level imports
    included), and convert writes through ``symlib.store.sets``."""
    ckpt = [p for p in FILES if _unit(_module_name(p)) == "ckpt"]
    assert any(p.name == "convert.py" for p in ckpt)
    for path in ckpt:
        bad = sorted(d for d in _imports(path) if _unit(d) == "posteriors")
        assert not bad, f"{_module_name(path)} imports {bad}: write sets through symlib.store.sets"
    assert "symlib.store.sets" in _imports(ROOT / "ckpt" / "convert.py")
