"""A symlink that points at itself (ELOOP) among a class's images: `pipeline-prepare` counts it
as a file it could not read and prepares the rest (exit 3); the server's ImageFolder scan of the
same tree must leave it out with a warning too, as it does a dangling link, rather than refuse
the whole split."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from batchwire.pipeline.dataset import open_dataset
from oddfiles import pil_jpeg, smooth_image


def test_a_symlink_loop_is_left_out_like_a_dangling_link(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "data"
    (root / "cls").mkdir(parents=True)
    (root / "cls" / "ok.jpg").write_bytes(pil_jpeg(smooth_image(24, 32)))
    os.symlink("loop.jpg", root / "cls" / "loop.jpg")  # points at itself
    os.symlink("nowhere.jpg", root / "cls" / "dangling.jpg")
    with caplog.at_level(logging.WARNING):
        ds = open_dataset(root, cache_dir=tmp_path / "cache")
    assert [Path(p).name for p in ds.paths] == ["ok.jpg"]
    assert "cls/loop.jpg" in caplog.text and "cls/dangling.jpg" in caplog.text
