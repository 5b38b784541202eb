"""docs/bad-input.md: anything that is not a regular file (a FIFO, a device, a folder) is logged
with its path. In an ImageFolder such a name with an image extension is left out of the listing: the
operator must be told which, as a tar-shard folder does, not lose the sample without a word."""

from __future__ import annotations

import logging
import os

import numpy as np
from batchwire.pipeline.index_cache import scan_image_folder
from PIL import Image


def test_a_fifo_or_dangling_link_in_a_class_folder_is_named_in_the_log(tmp_path, caplog) -> None:
    (tmp_path / "a").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "a" / "ok.jpg")
    os.mkfifo(tmp_path / "a" / "pipe.jpg")
    os.symlink(tmp_path / "gone.jpg", tmp_path / "a" / "dangling.jpg")
    with caplog.at_level(logging.WARNING):
        index = scan_image_folder(tmp_path)
    assert index.rel_paths == ["a/ok.jpg"]
    assert "pipe.jpg" in caplog.text and "dangling.jpg" in caplog.text, caplog.text
