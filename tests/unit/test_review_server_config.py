"""pipeline-server command lines and configs that started on 9611bed and exit 2 now."""

from __future__ import annotations

import pytest
from batchwire.server.cli import parse_config


def test_val_transform_on_the_embedded_dataset_is_taken(tmp_path) -> None:
    """Without --train the embedded dataset is served, val split included (cli --help): its
    --val-transform applies to it, as it did."""
    (tmp_path / "t.py").write_text("def f(image, generator):\n    return image\n")
    spec = f"{tmp_path}/t.py:f"
    assert parse_config(["--val-transform", spec]).val_transform == spec


@pytest.mark.parametrize("line", ["max-pixels = 1e9", "share-window = 8.0", "seed = 1.0"])
def test_a_whole_float_for_an_integer_setting_in_toml_is_taken(tmp_path, line) -> None:
    config = tmp_path / "server.toml"
    config.write_text(line + "\n")
    parse_config(["--config", str(config)])
