"""Every console script answers a typo or --help before importing torch (well under a second,
where importing torch alone takes 1-3 s on a small machine), and names the flag meant."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Whether torch was imported is a property of a fresh process, not of a fork server's child.
pytestmark = pytest.mark.fresh_python

# console script -> the module whose main() it runs (pyproject's [project.scripts])
SCRIPTS = {
    "pipeline-monitor": "batchwire.monitor.cli",
    "pipeline-bench": "batchwire.bench.cli",
    "pipeline-keys": "batchwire.wire.keys",
    "pipeline-prepare": "batchwire.prepare.cli",
    "pipeline-store": "batchwire.common.devstore",
    "pipeline-train": "batchwire.train.cli",
    "pipeline-server": "batchwire.server.cli",
}
PROBE = """
import sys
from {module} import main
try:
    main({argv!r})
except SystemExit as exc:
    print("exit", exc.code, file=sys.stderr)
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
"""


def _run(module: str, argv: list[str]) -> str:
    code = PROBE.format(module=module, argv=argv)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    return done.stderr


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_needs_no_torch(script: str) -> None:
    err = _run(SCRIPTS[script], ["--help"])
    assert "exit 0" in err and "torch imported: False" in err, err


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_mistyped_flag_is_named_without_torch(script: str) -> None:
    # A positional first where the command needs one, so argparse reaches the flag.
    positional = {"pipeline-monitor": ["tcp://127.0.0.1:5555"], "pipeline-keys": ["/tmp/k"],
                  "pipeline-prepare": ["src"], "pipeline-store": ["stop", "/tmp/s"]}  # fmt: skip
    err = _run(SCRIPTS[script], [*positional.get(script, []), "--verison"])
    assert "exit 2" in err and "torch imported: False" in err, err
    assert "--verison: did you mean --version?" in err, err
