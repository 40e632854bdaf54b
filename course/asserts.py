"""The ``assert`` statements of a cell's code, and which of them run at given parameters.

One walker (:func:`walk`) decides which asserts run when the notebook's parameters are known (the
``scale`` of a run): the assignments count the asserts of an exercise's tests at the grading scale,
the slides mark each claim of a run as held, failed or not checked at its scale.
"""

from __future__ import annotations

import ast


def _holds(test: ast.expr, params: dict) -> bool:
    """The value of an ``if``'s condition from the parameters alone (no builtins); raises when it
    reads anything else."""
    return bool(eval(compile(ast.Expression(test), "<if>", "eval"), {"__builtins__": {}}, dict(params)))


def walk(code: str, params: dict) -> list[tuple[ast.Assert, bool]]:
    """Every ``assert`` of ``code`` in order, with whether it runs when the parameters are ``params``.

    An ``if`` whose condition reads the parameters only (``if scale != "tiny":`` and the like) is
    evaluated: the asserts of the branch not taken do not run. A condition on other names (the
    run's results) counts as true for both branches: their asserts run where it holds. The bodies of
    ``for``, ``while``, ``with`` and ``try`` are walked. Raises ``SyntaxError`` on code that does not
    parse.
    """
    out: list[tuple[ast.Assert, bool]] = []

    def visit(nodes, active: bool):
        for node in nodes:
            if isinstance(node, ast.Assert):
                out.append((node, active))
            elif isinstance(node, ast.If):
                if not active:  # nothing under a branch that does not run runs
                    visit(node.body, False)
                    visit(node.orelse, False)
                    continue
                try:
                    cond = _holds(node.test, params)
                except Exception:  # a condition on the run's results
                    visit(node.body, active)
                    visit(node.orelse, active)
                else:
                    visit(node.body, cond)
                    visit(node.orelse, not cond)
            elif isinstance(node, (ast.For, ast.While, ast.With, ast.Try)):
                visit(node.body, active)

    visit(ast.parse(code).body, True)
    return out


def active_asserts(tests: str, params: dict) -> int:
    """How many asserts of ``tests`` run when the parameters are ``params`` (``if scale != "tiny":``
    and the like, evaluated; conditions on other names count as true)."""
    return sum(active for _, active in walk(tests, params))


def split_asserts(code: str) -> tuple[str, str]:
    """``(answer, tests)``: the top-level ``assert`` statements of ``code`` apart from the rest."""
    tree = ast.parse(code)
    lines = code.splitlines()
    keep = [True] * len(lines)
    for node in tree.body:
        if isinstance(node, ast.Assert):
            for i in range(node.lineno - 1, node.end_lineno):
                keep[i] = False
    answer = "\n".join(line for line, k in zip(lines, keep, strict=False) if k).strip()
    tests = "\n".join(line for line, k in zip(lines, keep, strict=False) if not k).strip()
    return answer, tests


def has_assert(code: str) -> bool:
    """Whether ``code`` asserts anything, at any depth."""
    return any(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(code)))
