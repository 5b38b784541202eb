"""ARCHITECTURE.md's import rules, checked over every import of every product file.

What counts: every ``import`` / ``from ... import`` statement wherever it stands: at module level,
inside a function (a lazy import is still a dependency, and one that only dodges a circle is still
a circle) and under ``if TYPE_CHECKING:``. Relative imports are resolved; ``from pkg import name``
is an import of the submodule ``pkg.name`` when that is a module, else of ``pkg``. A module named
in a string (``importlib.import_module``) is not seen: the two package ``__init__``s that load
their names so (pipeline/decode, train) list the same modules under ``TYPE_CHECKING``, which is.

- Layers: each top-level folder imports only the folders ``ALLOWED`` lists. Type-only imports
  count: an annotation naming another layer's class is a dependency on that layer.
- Circles: the graph of module -> imported module has no cycle, type-only imports included (a
  reader, a type checker and a refactoring all follow them; a type-only circle is the runtime
  circle of the day someone needs the name at run time). A cycle is reported with the import
  lines that make it.
- ``ALLOWED`` is written once, here. ARCHITECTURE.md quotes the table ``rules_table()`` renders
  from it, and a test keeps the two equal: change both in the same commit.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOT = "batchwire"  # src/batchwire: only __version__; anyone may import it

#: Each product package (``batchwire.<folder>``; ``batchwire`` itself is src/batchwire) and the
#: other packages it may import. ``examples/`` is not installed; its scripts are held to it too.
#: Nothing but tests may import ``server``: client/, monitor/ and train/ never do.
ALLOWED: dict[str, tuple[str, ...]] = {
    ROOT: ("wire",),
    "wire": (),
    "common": ("wire",),
    "native": (),
    "pipeline": ("wire", "common", "native"),
    "prepare": ("wire", "common", "native", "pipeline"),
    "server": ("wire", "common", "pipeline"),
    "client": ("wire", "common"),
    "train": ("wire", "common", "pipeline", "client"),
    "monitor": ("wire",),
    "bench": ("wire", "common", "native", "pipeline", "prepare", "client", "train"),
    "examples": ("client",),
}


@dataclass(frozen=True)
class Import:
    """One batchwire module imported by one statement of one file."""

    importer: str  # dotted module name of the importing file
    where: str  # "path:line" of the statement
    target: str  # the dotted batchwire module imported


def folder_of(package: str, root: Path = REPO) -> Path:
    return root / "src" / ROOT if package == ROOT else root / package


def module_name(path: Path, root: Path = REPO) -> str:
    """``pipeline/sources/locate.py`` -> ``batchwire.pipeline.sources.locate``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    parts = parts[1:] if parts[0] == "src" else [ROOT, *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_files(root: Path = REPO) -> list[Path]:
    return sorted(p for pkg in ALLOWED for p in folder_of(pkg, root).rglob("*.py"))


def _import_statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement anywhere in the tree (functions, classes, if/try blocks)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _from_base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module ``from X import ...`` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(path: Path, modules: set[str], root: Path = REPO) -> list[Import]:
    """Every batchwire module the file imports (see the module docstring for what counts)."""
    importer = module_name(path, root)
    found = []
    statements = _import_statements(ast.parse(path.read_text(), str(path)))
    for node in sorted(statements, key=lambda n: n.lineno):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _from_base(node, importer, path.name == "__init__.py")
            targets = [
                base if f"{base}.{a.name}" not in modules else f"{base}.{a.name}"
                for a in node.names
            ]
        where = f"{path.relative_to(root)}:{node.lineno}"
        found += [
            Import(importer, where, t) for t in dict.fromkeys(targets) if package_of(t) in ALLOWED
        ]
    return found


def all_imports(root: Path = REPO) -> list[Import]:
    files = product_files(root)
    modules = {module_name(p, root) for p in files}
    return [imp for p in files for imp in imports_of(p, modules, root)]


def package_of(module: str) -> str:
    """``batchwire.pipeline.sources`` -> ``pipeline``; ``batchwire`` -> ``batchwire``;
    anything not batchwire's -> ""."""
    parts = module.split(".")
    if parts[0] != ROOT:
        return ""
    return parts[1] if len(parts) > 1 else ROOT


def layer_breaches(imports: list[Import]) -> list[str]:
    return [
        f"{imp.where}: {package_of(imp.importer)} imports {imp.target}"
        for imp in imports
        if package_of(imp.target)
        not in {ROOT, package_of(imp.importer), *ALLOWED[package_of(imp.importer)]}
    ]


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (or a node importing itself),
    each sorted: every module in one imports every other, directly or not (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1 or node in edges.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(cycles)


def cycle_report(imports: list[Import]) -> list[str]:
    """Each import cycle's modules and the statements that close it; [] for none."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.importer, set()).add(imp.target)
    lines = []
    for cycle in find_cycles(edges):
        lines.append("cycle: " + ", ".join(cycle))
        lines += [
            f"  {imp.where}: {imp.importer} -> {imp.target}"
            for imp in imports
            if imp.importer in cycle and imp.target in cycle
        ]
    return lines


def rules_table() -> str:
    """The table ARCHITECTURE.md quotes, rendered from ``ALLOWED``."""
    rows = ["| package | may import (besides itself and `batchwire`) |", "|---|---|"]
    for package, allowed in ALLOWED.items():
        folder = "`src/batchwire/` (`batchwire`)" if package == ROOT else f"`{package}/`"
        rows.append(f"| {folder} | {', '.join(f'`{a}`' for a in allowed) or 'nothing'} |")
    return "\n".join(rows)


def test_every_package_imports_only_what_architecture_allows() -> None:
    breaches = layer_breaches(all_imports())
    assert not breaches, "imports ARCHITECTURE.md's table does not allow:\n" + "\n".join(breaches)


def test_no_import_cycles() -> None:
    lines = cycle_report(all_imports())
    assert not lines, "import cycles (every import counts):\n" + "\n".join(lines)


def test_architecture_quotes_the_rules_table() -> None:
    text = (REPO / "ARCHITECTURE.md").read_text()
    assert rules_table() in text, "ARCHITECTURE.md must quote this table:\n" + rules_table()


def test_the_rules_are_layers() -> None:
    """The allowed imports themselves form no circle, so no cross-package cycle can pass the
    layer test; and only tests import the server."""
    edges = {pkg: set(allowed) for pkg, allowed in ALLOWED.items()}
    assert find_cycles(edges) == []
    assert not [pkg for pkg, allowed in ALLOWED.items() if "server" in allowed]


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checks_see_lazy_relative_and_type_only_imports(tmp_path: Path) -> None:
    """The walker on a small tree: a circle closed only inside a function, one closed only
    under TYPE_CHECKING, relative imports, and a forbidden import inside a function are all
    reported with their lines."""
    _write(tmp_path, "pipeline/__init__.py", "")
    _write(tmp_path, "pipeline/a.py", "from . import b\n")
    _write(tmp_path, "pipeline/b.py", "def f():\n    from batchwire.pipeline.a import x\n")
    _write(tmp_path, "pipeline/c.py", "from .d import y\n")
    _write(
        tmp_path,
        "pipeline/d.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..pipeline import c\n",
    )
    _write(tmp_path, "client/__init__.py", "")
    _write(tmp_path, "client/e.py", "import os\n\ndef g():\n    import batchwire.server.core\n")
    imports = all_imports(tmp_path)

    assert layer_breaches(imports) == ["client/e.py:4: client imports batchwire.server.core"]
    assert cycle_report(imports) == [
        "cycle: batchwire.pipeline.a, batchwire.pipeline.b",
        "  pipeline/a.py:1: batchwire.pipeline.a -> batchwire.pipeline.b",
        "  pipeline/b.py:2: batchwire.pipeline.b -> batchwire.pipeline.a",
        "cycle: batchwire.pipeline.c, batchwire.pipeline.d",
        "  pipeline/c.py:1: batchwire.pipeline.c -> batchwire.pipeline.d",
        "  pipeline/d.py:3: batchwire.pipeline.d -> batchwire.pipeline.c",
    ]
