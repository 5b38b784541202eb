"""Stores audit: a list file saved with a UTF-8 byte-order mark (Windows Notepad, Excel's
"UTF-8" text) names its first file as written, not as BOM + path.

The CSV and JSON-lines manifests drop a BOM already (`sources.manifest`); the `path label`
list file read it into its first path, so the first image was "missing": a bad sample,
replaced by another photo, for a file that is there."""

from __future__ import annotations

import codecs
import shutil

import pytest
from batchwire.pipeline.local import LocalLoader
from jpegchecks import SAMPLE_DIR

_PHOTOS = sorted(SAMPLE_DIR.glob("*.JPEG"))


def test_a_list_file_with_a_byte_order_mark_serves_its_first_file(tmp_path):
    if len(_PHOTOS) < 4:
        pytest.skip("the sample JPEGs are not here")
    lines = []
    for i, photo in enumerate(_PHOTOS[:4]):
        (tmp_path / "img").mkdir(exist_ok=True)
        shutil.copyfile(photo, tmp_path / "img" / f"{i}.jpg")
        lines.append(f"img/{i}.jpg {i % 2}")
    text = "\r\n".join(lines) + "\r\n"
    (tmp_path / "train.txt").write_bytes(codecs.BOM_UTF8 + text.encode())
    loader = LocalLoader(
        str(tmp_path / "train.txt"),
        split="val",
        batch_size=2,
        image_size=32,
        output_dtype="uint8",
        verify_checksums="off",
    )
    try:
        assert loader.dataset.paths[0] == str(tmp_path / "img" / "0.jpg")
        assert sum(len(labels) for _, labels in loader) == 4
        assert loader.counts()["bad_total"] == 0, loader.counts()
    finally:
        loader.close()
