"""The documentation site builds without a warning, and every code block in it is run or checked.

- `mkdocs build --strict` (in process): broken links, pages outside the nav, docstrings the API
  reference cannot read all fail the build.
- Every fenced block carries its language, and each is checked by what it is:
  - ``bash``: every `pipeline-*` command line (after `torchrun ... --no-python` too) is parsed by
    that command's own parser, so a flag the docs name exists and takes the value shown;
  - ``python``: compiled, and each ``import``/``from batchwire... import`` in it resolves;
  - ``yaml`` / ``toml``: parsed;
  - ``text``: output shown to the reader, not run.
- Blocks run as written by the end-to-end tests (the recipes, the loop snippets, the local
  store) are listed in `RUN_ELSEWHERE` with the test that runs them.
"""

from __future__ import annotations

import ast
import importlib
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```", re.S | re.M)
LANGUAGES = {"bash", "python", "yaml", "toml", "text"}

# Where each command's parser is built (the console scripts of pyproject).
PARSERS: dict[str, tuple[str, str]] = {
    "pipeline-server": ("batchwire.server.cli", "build_parser"),
    "pipeline-train": ("batchwire.train.cli", "build_parser"),
    "pipeline-monitor": ("batchwire.monitor.cli", "build_parser"),
    "pipeline-bench": ("batchwire.bench.cli", "build_parser"),
    "pipeline-prepare": ("batchwire.prepare.cli", "parser"),
    "pipeline-keys": ("batchwire.wire.keys", "build_parser"),
    "pipeline-store": ("batchwire.common.devstore", "build_parser"),
}

# Blocks that end-to-end tests run as written (a phrase of the block -> the test).
RUN_ELSEWHERE = {
    'eval "$(pipeline-store start': "tests/e2e/test_pipeline_store.py",
    "loader = RemoteLoader(": "tests/e2e/test_readme_recipes.py (the loop snippets)",
}


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def blocks() -> Iterator[tuple[str, str, str]]:
    """(where, language, code) of every fenced block of every page."""
    for page in pages():
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text[: match.start()].count("\n") + 1
            yield f"{page.name}:{line}", match.group(1), match.group(2)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    build(config)  # strict (mkdocs.yml): any warning aborts
    assert (tmp_path / "site" / "api" / "index.html").exists()
    assert "RemoteLoader" in (tmp_path / "site" / "api" / "index.html").read_text()


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    assert [p.name for p in pages() if f": {p.name}" not in nav] == []


def test_every_block_says_its_language() -> None:
    unknown = [
        f"{where} ({lang or 'none'})" for where, lang, _ in blocks() if lang not in LANGUAGES
    ]
    assert unknown == [], f"fence these with one of {sorted(LANGUAGES)}"


def _commands(code: str) -> Iterator[tuple[str, list[str]]]:
    """(command, args) of every `pipeline-*` invocation in a shell block."""
    joined = code.replace("\\\n", " ")
    for line in joined.splitlines():
        for part in re.split(r"\s*(?:&&|\|\||;|\||&(?!>))\s*", line):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:  # an unbalanced quote inside $(...): not one of ours
                continue
            for i, word in enumerate(words):
                if word in PARSERS:  # "..." stands for flags the page leaves out
                    yield word, [w for w in words[i + 1 :] if w != "..."]
                    break


def _parser(command: str) -> Callable[[], object]:
    module, name = PARSERS[command]
    return getattr(importlib.import_module(module), name)


def shell_blocks() -> list[tuple[str, str]]:
    return [(where, code) for where, lang, code in blocks() if lang == "bash"]


@pytest.mark.parametrize(("where", "code"), shell_blocks(), ids=[w for w, _ in shell_blocks()])
def test_shell_commands_parse_with_their_own_parsers(where: str, code: str) -> None:
    for command, args in _commands(code):
        parser = _parser(command)()
        try:
            parser.parse_args(args)  # type: ignore[attr-defined]
        except SystemExit as exc:
            if exc.code == 0:  # --help, --version
                continue
            pytest.fail(f"{where}: `{command} {shlex.join(args)}` does not parse (exit {exc})")


def python_blocks() -> list[tuple[str, str]]:
    return [(where, code) for where, lang, code in blocks() if lang == "python"]


@pytest.mark.parametrize(("where", "code"), python_blocks(), ids=[w for w, _ in python_blocks()])
def test_python_blocks_compile_and_their_imports_resolve(where: str, code: str) -> None:
    tree = ast.parse(code, filename=where)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    importlib.import_module(f"{node.module}.{alias.name}")


@pytest.mark.parametrize(
    ("where", "lang", "code"),
    [b for b in blocks() if b[1] in ("yaml", "toml")],
    ids=[b[0] for b in blocks() if b[1] in ("yaml", "toml")],
)
def test_config_blocks_parse(where: str, lang: str, code: str) -> None:
    if lang == "yaml":
        list(yaml.safe_load_all(code))
    else:
        tomllib.loads(code)


def test_the_blocks_run_elsewhere_are_still_there() -> None:
    """The end-to-end tests find their blocks by these phrases: each names one block."""
    codes = [code for _, _, code in blocks()]
    for phrase, test in RUN_ELSEWHERE.items():
        assert sum(phrase in code for code in codes) >= 1, f"{test} runs a block with {phrase!r}"
        assert (ROOT / test.split(" ")[0]).exists()
