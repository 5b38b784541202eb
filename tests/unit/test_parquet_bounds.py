"""Parquet row groups are read within bounds: the image column's declared size decides, before
anything is read, between a whole read, a read in slices of rows, and no read at all (bad
samples); an image over the cap is a bad sample. The bounds are lowered here so that small
files cross them (tests/e2e/test_bad_input_sources.py has the 2 GiB row group itself)."""

from __future__ import annotations

import logging
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode.files import is_transient
from batchwire.pipeline.sources import parquet

ROWS = 40


@pytest.fixture
def blobs() -> list[bytes]:
    rng = random.Random(5)
    return [rng.randbytes(rng.randint(1000, 5000)) for _ in range(ROWS)]


@pytest.fixture
def one_group(tmp_path, blobs):
    """One row group of ROWS rows (the bytes need not be images: reads are what is tested)."""
    path = tmp_path / "one.parquet"
    images = pa.StructArray.from_arrays(
        [pa.array(blobs, pa.binary()), pa.array([None] * ROWS, pa.string())],
        names=["bytes", "path"],
    )
    table = pa.table({"image": images, "label": pa.array([i % 3 for i in range(ROWS)])})
    pq.write_table(table, path, row_group_size=ROWS, compression="zstd")
    return path


def test_a_large_row_group_is_read_in_slices(one_group, blobs, monkeypatch):
    monkeypatch.setattr(parquet, "SLICE_BYTES", 20_000)  # about 6 rows of these
    ds = open_dataset(one_group, verify_checksums="off")
    reader = ds.reader
    assert isinstance(reader, parquet.ParquetReader)
    declared = reader.declared[0]
    assert declared > sum(map(len, blobs)) and declared > parquet.SLICE_BYTES
    per = reader.slice_rows(0)
    assert 1 <= per < ROWS and per == 20_000 * ROWS // declared
    order = list(range(ROWS))
    random.Random(1).shuffle(order)
    assert [ds.read_bytes(i) for i in order] == [blobs[i] for i in order]
    cached = reader.cache._items
    assert len(cached) == -(-ROWS // per)  # one entry per slice, none the whole group
    for (_f, _rg, first), (part, _size) in cached.items():
        assert part.start == first and len(part.column) <= per


def test_a_small_row_group_is_read_whole(one_group, blobs):
    ds = open_dataset(one_group, verify_checksums="off")
    assert ds.reader.slice_rows(0) == ROWS
    assert ds.read_bytes(ROWS - 1) == blobs[-1] and ds.read_bytes(0) == blobs[0]
    assert list(ds.reader.cache._items) == [(0, 0, 0)]


def test_an_image_over_the_cap_is_a_bad_sample(one_group, blobs, monkeypatch):
    monkeypatch.setattr(parquet, "SLICE_BYTES", 20_000)
    monkeypatch.setattr(parquet, "MAX_MEMBER_BYTES", 3000)
    ds = open_dataset(one_group, verify_checksums="off")
    for i, blob in enumerate(blobs):
        if len(blob) <= 3000:
            assert ds.read_bytes(i) == blob
            continue
        with pytest.raises(
            OSError, match=f"row {i} of row group 0: image of {len(blob)} bytes"
        ) as err:
            ds.read_bytes(i)
        assert not is_transient(err.value)  # the sample's: counted and replaced


def test_a_row_group_declaring_too_much_is_never_read(one_group, monkeypatch, caplog):
    monkeypatch.setattr(parquet, "MAX_ROW_GROUP_BYTES", 50_000)
    with caplog.at_level(logging.WARNING, logger="batchwire.pipeline"):
        ds = open_dataset(one_group, verify_checksums="off")
    assert "row group 0 declares" in caplog.text and f"its {ROWS} samples are bad" in caplog.text
    with pytest.raises(OSError, match=r"declares .* bytes of images, over the 50000") as err:
        ds.read_bytes(7)
    assert not is_transient(err.value)
    assert ds.reader.cache.misses == 0  # nothing was read
