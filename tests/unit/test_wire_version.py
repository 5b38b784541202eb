"""wire/version.py: the version read from the installed distribution's metadata (one number to
bump), the line ``--version`` prints, and the flag on a parser of one's own. Every console
script's ``--version`` and the documented spellings are tests/unit/test_version.py's."""

from __future__ import annotations

import argparse
import importlib.metadata
import re

import pytest
from batchwire.wire import version as wire_version
from batchwire.wire.errors import PROTOCOL_VERSION


def test_the_version_is_the_installed_distributions() -> None:
    assert wire_version.__version__ == importlib.metadata.version("batchwire")
    assert re.fullmatch(r"\d+(\.\d+)*\S*", wire_version.__version__)


def test_a_source_tree_that_is_not_installed_has_a_placeholder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(wire_version, "version", not_installed)  # importlib.metadata's, as used
    # (the uncached reader: the cached one may have read the installed version already)
    assert wire_version.installed_version.__wrapped__() == "0+unknown"  # PEP 440 local version


def test_the_version_line_names_the_command_and_both_versions() -> None:
    line = wire_version.version_line("pipeline-thing")
    assert line == (
        f"pipeline-thing (batchwire {wire_version.__version__}, wire protocol v{PROTOCOL_VERSION})"
    )


def test_the_flag_prints_the_line_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="my-tool")
    parser.add_argument("--steps", type=int, required=True)
    wire_version.add_version_argument(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--version"])  # before the required flag is missed
    assert info.value.code == 0
    captured = capsys.readouterr()
    assert captured.out == wire_version.version_line("my-tool") + "\n" and captured.err == ""
    assert "--version" in parser.format_help() and "print the version and exit" in (
        parser.format_help()
    )
    assert parser.parse_args(["--steps", "3"]).steps == 3  # otherwise the parser is unchanged


def test_the_flag_takes_the_parsers_own_name() -> None:
    parser = argparse.ArgumentParser(prog="pipeline-server")
    wire_version.add_version_argument(parser)
    action = next(a for a in parser._actions if "--version" in a.option_strings)
    assert action.version == wire_version.version_line("pipeline-server")
    assert action.option_strings == ["--version"]  # no -V: a short flag may be a tool's own
