"""No batchwire module reads the environment or a file, or draws a random number, as it is
imported.

Why it matters: settings are read when they are used, so a variable set after import (a test's
monkeypatch, a launcher's env for a child) is honoured; and the suite's fork server
(tests/forkserver.py, `OWN_PRELOAD`) imports batchwire's command lines once for all its children,
which is only the same as a fresh interpreter while importing reads nothing from outside.

What runs at import: module and class bodies, decorators, default values and annotations of
functions (the bodies of functions and lambdas run later, and are skipped).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "client",
    "common",
    "monitor",
    "native",
    "pipeline",
    "prepare",
    "server",
    "train",
    "wire",
)
#: Names whose use at import reads the environment.
ENVIRONMENT = {"environ", "getenv", "environb"}
#: Calls that read the file system.
FILE_READS = {
    "open", "read_text", "read_bytes", "exists", "is_file", "is_dir", "glob", "rglob", "iterdir",
    "listdir", "scandir", "stat", "home", "cwd", "getcwd", "expanduser", "which",
    # importlib.metadata's look-ups read a distribution's files found on sys.path
    "version", "metadata", "distribution", "distributions", "entry_points",
}  # fmt: skip


#: Calls that draw random numbers (a key drawn at import would be shared by forked processes).
RANDOM_DRAWS = {"urandom", "getrandom", "token_bytes", "token_hex", "token_urlsafe", "randbits"}


def import_time_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node evaluated when the module is imported."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += node.decorator_list
            todo += [d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None]
            continue  # the body runs when called
        if isinstance(node, ast.Lambda):
            todo += node.args.defaults
            continue
        yield node
        todo += ast.iter_child_nodes(node)


def _reads(nodes: Iterable[ast.AST], readers: set[str]) -> Iterator[tuple[int, str]]:
    """(line, what) for each read among ``nodes``; ``readers``: the module's own functions
    that read, whose calls count as reads too."""
    for node in nodes:
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Name):
            name = node.id
        if name in ENVIRONMENT:
            yield node.lineno, f"reads the environment ({name})"
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in FILE_READS or called in RANDOM_DRAWS or called in readers:
                yield node.lineno, f"calls {called}()"


def reads_at_import(path: Path, root: Path = ROOT) -> list[str]:
    """Where ``path`` reads the environment or a file, or draws, at import (directly, or by
    calling one of its own functions that does), as ``file:line what``."""
    tree = ast.parse(path.read_text(), str(path))
    readers = {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(True for _ in _reads(ast.walk(node), set()))
    }
    where = path.relative_to(root)
    return [f"{where}:{line} {what}" for line, what in _reads(import_time_nodes(tree), readers)]


def product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_reads_the_environment_or_a_file_or_draws_at_import(package: str) -> None:
    found = [hit for p in sorted((ROOT / package).rglob("*.py")) for hit in reads_at_import(p)]
    assert not found, "\n".join(found)


def test_the_check_sees_what_runs_at_import_and_skips_what_runs_later(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os\n"
        "A = os.environ.get('X')\n"  # module body: import time
        "class C:\n"
        "    B = open('f')\n"  # class body: import time
        "def f(d=os.getenv('Y')):\n"  # a default: import time
        "    return os.environ['Z'], open('g')\n"  # the body: later
        "g = lambda: os.environ\n"  # a lambda's body: later
        "K = os.urandom(16)\n"  # a draw: import time
        "def reader():\n"
        "    return open('h')\n"
        "V = reader()\n"  # a call of the module's own reader: import time
    )
    hits = reads_at_import(sample, root=tmp_path)
    assert sorted(h.split(" ", 1)[0] for h in hits) == [
        "sample.py:11",
        "sample.py:2",
        "sample.py:4",
        "sample.py:5",
        "sample.py:8",
    ], hits


def test_the_fork_server_preloads_only_modules_this_test_covers() -> None:
    spec = importlib.util.spec_from_file_location("_forkserver", ROOT / "tests" / "forkserver.py")
    assert spec is not None and spec.loader is not None
    forkserver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(forkserver)
    for name in forkserver.OWN_PRELOAD:
        assert name.split(".")[1] in PACKAGES, name
    assert product_files(), "no product files found"
