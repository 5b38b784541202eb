"""pipeline-train's command line before any training: it parses its arguments before importing
torch (--help and a mistyped flag answer at once), and a keys folder that is not there is one
line naming `pipeline-keys DIR`, exit 2, not a traceback. Each test is a fresh interpreter (a
few tenths of a second): whether torch was imported is a property of the whole process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TRAIN_BIN = Path(sys.executable).parent / "pipeline-train"

_PROBE = """
import sys
from batchwire.train.cli import main
try:
    main({argv!r})
except SystemExit as exc:
    print("exit", exc.code)
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.fresh_python
@pytest.mark.parametrize(("argv", "code"), [(["--bogus"], 2), (["--help"], 0)])
def test_arguments_are_parsed_before_torch_is_imported(argv: list[str], code: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(argv=argv)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"exit {code}\ntorch imported: False" in done.stdout, done.stdout + done.stderr


@pytest.mark.fresh_python
def test_the_package_and_its_config_import_without_torch() -> None:
    probe = (
        "import sys, batchwire.train as t\n"
        "from batchwire.train.config import MODEL_NAMES, SCHEDULES, TrainConfig\n"
        "TrainConfig().validate()\n"
        "print('torch' in sys.modules)\n"
        "t.TrainConfig, t.ConfigError\n"  # torch-free names stay torch-free
        "print('torch' in sys.modules)\n"
        "t.build_model\n"  # a torch name imports torch, on access
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True"], done.stdout


def test_a_missing_keys_folder_is_one_line_naming_pipeline_keys(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-keys"
    done = subprocess.run(
        [str(TRAIN_BIN), "--keys", str(missing), "--server", "tcp://127.0.0.1:9"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"pipeline-train: error: --keys {missing}: {missing}/client.key_secret is missing "
        "(make the folder with `pipeline-keys DIR`)"
    ], done.stderr
