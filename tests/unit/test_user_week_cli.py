"""A first-week user's pipeline-server command lines (parsed as the console script parses them)."""

from __future__ import annotations

import pytest
from batchwire.server.cli import parse_config


def test_val_transform_without_a_val_split_is_refused(tmp_path, capsys) -> None:
    """--train DIR without --val serves no val split: --val-transform would be ignored, unsaid."""
    (tmp_path / "t.py").write_text("def f(image, generator):\n    return image\n")
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--train", str(tmp_path), "--val-transform", f"{tmp_path}/t.py:f"])
    assert exit_.value.code == 2
    assert "--val-transform" in capsys.readouterr().err


def test_both_transforms_with_both_splits_are_taken(tmp_path) -> None:
    (tmp_path / "t.py").write_text("def f(image, generator):\n    return image\n")
    spec = f"{tmp_path}/t.py:f"
    config = parse_config(
        ["--train", str(tmp_path), "--val", str(tmp_path), "--transform", spec,
         "--val-transform", spec]
    )  # fmt: skip
    assert (config.transform, config.val_transform) == (spec, spec)
