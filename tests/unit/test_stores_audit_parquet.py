"""Stores audit: Parquet cells a user's own writer can leave empty are named for what they are.

A Hugging Face `Image` column holds `{bytes, path}` structs; a row whose whole cell is null
(pyarrow writes one for a `None` in the list) is a bad sample like a path-only image, but the
log must say which, so the user looks for the right bug in their writer."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchwire.pipeline.local import LocalLoader
from jpegchecks import SAMPLE_DIR

_PHOTOS = sorted(SAMPLE_DIR.glob("*.JPEG"))
_IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


@pytest.mark.parametrize(
    ("cell", "said"),
    [
        pytest.param(None, "null image cell", id="null-cell"),
        pytest.param({"bytes": None, "path": "2.jpg"}, "path-only image", id="path-only"),
    ],
)
def test_an_empty_image_cell_is_a_bad_sample_named_for_what_it_is(tmp_path, caplog, cell, said):
    if len(_PHOTOS) < 6:
        pytest.skip("the sample JPEGs are not here")
    cells = [{"bytes": p.read_bytes(), "path": p.name} for p in _PHOTOS[:6]]
    cells[2] = cell
    table = pa.table({"image": pa.array(cells, type=_IMAGE), "label": [i % 3 for i in range(6)]})
    pq.write_table(table, tmp_path / "train-0.parquet", row_group_size=4)
    loader = LocalLoader(
        str(tmp_path / "train-0.parquet"),
        split="val",
        batch_size=3,
        image_size=32,
        output_dtype="uint8",
        verify_checksums="off",
    )
    try:
        with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
            assert sum(len(labels) for _, labels in loader) == 6
        counts = loader.counts()
    finally:
        loader.close()
    assert counts["bad_total"] == 1 and counts["replaced_total"] == 1, counts
    lines = [r.getMessage() for r in caplog.records if "train-0.parquet#2" in r.getMessage()]
    assert len(lines) == 1 and said in lines[0], caplog.text
