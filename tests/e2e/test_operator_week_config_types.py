"""docs/cli.md: `--config FILE.toml` takes the same keys as the command line. A value of the wrong
type is an operator's typo: the error must name the file and the setting, as argparse names
the option for `--batch-size eight`, not only Python's `invalid literal for int()`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.mark.parametrize("line", ['batch-size = "eight"', 'drain-timeout = "soon"'])
def test_a_toml_value_of_the_wrong_type_names_the_file_and_the_setting(tmp_path, line) -> None:
    config = tmp_path / "server.toml"
    config.write_text(line + "\n")
    proc = subprocess.run(
        [str(BIN / "pipeline-server"), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    key = line.split(" = ")[0]
    assert proc.returncode == 2, proc.stderr
    assert str(config) in proc.stderr and key in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
