"""No test module imports another: what two test files share lives in a helper module in tests/.

A test module imported for its helpers runs its module-level code (fixtures, constants, skip marks)
in the importer, ties the importer to the other file's layout, and leaves the reader to find a
helper among tests. Every ``import`` / ``from ... import`` counts, function-level ones included.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every (line, module name) an import statement anywhere in ``tree`` names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split("."))


def test_no_test_module_imports_a_test_module() -> None:
    offenders = [
        f"{path.relative_to(TESTS)}:{line}: imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, name in _imported_modules(ast.parse(path.read_text(), filename=str(path)))
        if _is_test_module(name)
    ]
    assert not offenders, "move the shared helpers into a tests/ helper module:\n" + "\n".join(
        offenders
    )


def test_the_check_sees_function_level_imports() -> None:
    tree = ast.parse("def f():\n    from test_other import helper\n    import test_more\n")
    assert list(_imported_modules(tree)) == [(2, "test_other"), (3, "test_more")]
