"""Manifest rows: confined to the manifest's own root, NUL bytes refused at start naming the file
and line, and kept compact (a million-row manifest cost ~460 MB at its peak when every row was
Python objects: paths in one buffer now, labels and metadata in arrays)."""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path

import pytest
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.sources.manifest import ManifestError
from batchwire.pipeline.sources.metadata import PackedMetadata
from batchwire.pipeline.sources.packed import PackedStrings


def test_packed_strings_are_the_list_they_stand_for():
    items = ["/d/a.jpg", "/d/sub/b é.jpg", "/elsewhere/c.jpg", "/d/", "s3://b/k.jpg", "/d/\0x"]
    packed = PackedStrings("/d/")
    for s in items:
        packed.append(s)
    assert len(packed) == len(items) and list(packed) == items and packed == items
    assert packed[-1] == items[-1] and packed[1:4] == items[1:4] and packed[::2] == items[::2]
    with pytest.raises(IndexError):
        packed[len(items)]
    assert packed != items[:-1] and packed != "not a sequence"


def test_packed_metadata_keeps_none_and_dicts():
    rows = [None, {"a": 1}, None, {"b": "x", "c": None}, None]
    packed = PackedMetadata(rows)
    assert [packed[i] for i in range(5)] == rows and packed[-2] == rows[-2]
    assert packed.nbytes(0) == 1 and packed.any and not PackedMetadata([None, None]).any


@pytest.mark.parametrize(
    ("name", "body", "needle"),
    [
        ("m.csv", "path,label\na.jpg,1\nb\0.jpg,2\n", r"m\.csv:3: the path holds a NUL byte"),
        ("m.jsonl", '{"path": "a.jpg", "label": 1}\n{"path": "b\\u0000.jpg", "label": 1}\n',
         r"m\.jsonl:2: the path holds a NUL byte"),
        ("m.txt", "a.jpg tench\nb\0.jpg goldfish\n", r"m\.txt:2: the path holds a NUL byte"),
    ],
)  # fmt: skip
def test_a_nul_byte_in_a_path_is_an_error_naming_file_and_line(tmp_path, name, body, needle):
    (tmp_path / name).write_text(body)
    with pytest.raises(ManifestError, match=needle):
        open_dataset(tmp_path / name)


@pytest.mark.parametrize(
    "row",
    ["s3://otherbucket/x.jpg", "gs://b/x.jpg", "/etc/passwd", "../up.jpg", "a/../../up.jpg"],
)
def test_local_manifest_rows_stay_in_its_folder(tmp_path, row):
    """A bucket URL leaves a local manifest's folder as much as '..' does: refused at start,
    naming the file and line and the way out."""
    path = tmp_path / "m.csv"
    path.write_text(f"path,label\nok.jpg,0\n{row},1\n")
    with pytest.raises(ManifestError, match=r"m\.csv:3: .* outside the manifest's") as err:
        open_dataset(path)
    assert "--allow-outside-root" in str(err.value)


def test_local_manifest_outside_rows_with_allow_outside_root(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "data").mkdir()
    path = tmp_path / "data" / "m.jsonl"
    path.write_text(
        json.dumps({"path": "in.jpg", "label": "a"})
        + "\n"
        + json.dumps({"path": "../elsewhere/out.jpg", "label": "b"})
        + "\n"
    )
    got = open_dataset(path, allow_outside_root=True)
    assert list(got.paths) == [
        str(tmp_path / "data" / "in.jpg"),
        str(tmp_path / "elsewhere/out.jpg"),
    ]
    assert got.reader is None  # files, read as files


def _traced_peak_and_kept(fn) -> tuple[object, int, int]:
    """fn()'s result, and the peak and the retained growth of what Python allocated while it ran
    (tracemalloc, numpy's buffers included): the listing's own memory. Not the process's RSS,
    which a test worker's other threads and the allocator's arenas move by tens of MB."""
    gc.collect()
    tracemalloc.start()
    try:
        got = fn()
        gc.collect()
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return got, peak, kept


ROWS = 20_000


def test_a_large_manifest_costs_little_memory(tmp_path: Path):
    """ImageNet-style paths and class names, by what Python allocates per row (tracemalloc):
    a str, a list slot and a label str per row kept ~230 bytes (~44 MiB for 200k rows); the
    paths in one buffer and the labels in an array keep ~50 bytes, ~110 at the peak."""
    path = tmp_path / "train.csv"
    with path.open("w") as f:
        f.write("path,label\n")
        for i in range(ROWS):
            c = i % 1000
            f.write(f"n{c:08d}/n{c:08d}_{i:08d}.JPEG,class{c:04d}\n")
    got, peak, kept = _traced_peak_and_kept(lambda: open_dataset(path, verify_checksums="off"))
    assert len(got) == ROWS and got.num_classes == 1000  # type: ignore[arg-type]
    last = f"n00000999/n00000999_{ROWS - 1:08d}.JPEG"
    assert got.paths[ROWS - 1] == str(tmp_path / last)  # type: ignore[attr-defined]
    assert peak < 180 * ROWS, f"peak {peak / ROWS:.0f} bytes per row"
    assert kept < 100 * ROWS, f"kept {kept / ROWS:.0f} bytes per row"
