"""A mistyped flag is answered with the flag meant, by every console script's parser."""

from __future__ import annotations

import pytest
from batchwire.wire.cli import ArgumentParser, flag_hints


def test_a_close_flag_is_suggested() -> None:
    flags = ["--epochs", "--batch-size", "--image-size", "-h", "--help"]
    assert flag_hints("unrecognized arguments: --epoch 3", flags) == [
        "--epoch: did you mean --epochs?"
    ]
    assert flag_hints("unrecognized arguments: --batchsize=64 --zzz", flags) == [
        "--batchsize: did you mean --batch-size?"
    ]
    assert flag_hints("argument --epochs: invalid int value: 'x'", flags) == []


def test_the_parser_says_it_in_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    parser = ArgumentParser(prog="pipeline-x")
    parser.add_argument("--image-size", type=int)
    sub = parser.add_subparsers(dest="cmd")
    sub.add_parser("serve").add_argument("--port", type=int)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--imagesize=3"])
    assert exit_info.value.code == 2
    assert "--imagesize: did you mean --image-size?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prot", "1"])
    assert "--prot: did you mean --port?" in capsys.readouterr().err
