"""`--version` on every console script, and the documented `__version__` spelling."""

from __future__ import annotations

import importlib
from importlib.metadata import version

import pytest

# console script -> the module whose main() it runs (pyproject's [project.scripts])
SCRIPTS = {
    "pipeline-server": "batchwire.server.cli",
    "pipeline-train": "batchwire.train.cli",
    "pipeline-monitor": "batchwire.monitor.cli",
    "pipeline-bench": "batchwire.bench.cli",
    "pipeline-keys": "batchwire.wire.keys",
    "pipeline-prepare": "batchwire.prepare.cli",
}


def test_version_is_the_distributions() -> None:
    from batchwire.common import __version__

    assert __version__ == version("batchwire") != "0+unknown"


def test_import_batchwire_has_a_version_as_every_library_does() -> None:
    """What a user types first: ``import batchwire; batchwire.__version__``."""
    import batchwire

    assert batchwire.__version__ == version("batchwire")
    with pytest.raises(AttributeError):
        _ = batchwire.no_such_attribute


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_cli_prints_its_version(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    main = importlib.import_module(SCRIPTS[script]).main
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.strip() == f"{script} (batchwire {version('batchwire')}, wire protocol v2)"
