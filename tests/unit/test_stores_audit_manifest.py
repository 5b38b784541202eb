"""Stores audit: CSV manifests whose rows do not fit their header are refused, naming the line.

A path with an unquoted comma (`img/a,b.jpg,tench`) splits into more fields than the header
has: read as path `img/a` and label `b.jpg`, it made a class named "b.jpg" and dropped the real
label in silence (the missing file was the only trace). docs/your-data.md: "A malformed row ... is
an error naming the file and line (the manifest is read at start: the server exits 2)". A header
naming the label (or path) column twice is as ambiguous. Trailing empty fields, which some
spreadsheet exports write, stay fine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from batchwire.pipeline.local import LocalLoader
from jpegchecks import SAMPLE_DIR

_PHOTOS = sorted(SAMPLE_DIR.glob("*.JPEG"))


def _open(manifest: Path) -> LocalLoader:
    return LocalLoader(
        str(manifest), split="val", batch_size=2, image_size=32, verify_checksums="off"
    )


@pytest.fixture
def images(tmp_path: Path) -> Path:
    if len(_PHOTOS) < 3:
        pytest.skip("the sample JPEGs are not here")
    (tmp_path / "img").mkdir()
    for name, photo in zip(("a.jpg", "b.jpg", "c.jpg"), _PHOTOS, strict=False):
        shutil.copyfile(photo, tmp_path / "img" / name)
    return tmp_path


@pytest.mark.parametrize(
    ("text", "said"),
    [
        pytest.param(
            "path,label\nimg/a.jpg,tench\nimg/b,c.jpg,goldfish\n", ":3:", id="unquoted-comma"
        ),
        pytest.param(
            "path,label,site\nimg/a.jpg,tench,s1\nimg/b.jpg,goldfish,s2,extra\n",
            ":3:",
            id="field-past-the-header",
        ),
        pytest.param("img/a.jpg,tench\nimg/b,c.jpg,goldfish\n", "first row has 2", id="no-header"),
        pytest.param("path,label,label\nimg/a.jpg,tench,goldfish\n", "'label'", id="label-twice"),
        pytest.param("path,PATH,label\nimg/a.jpg,img/b.jpg,tench\n", "'path'", id="path-twice"),
    ],
)
def test_a_row_that_does_not_fit_its_header_is_an_error_naming_it(images, text, said):
    manifest = images / "train.csv"
    manifest.write_text(text)
    with pytest.raises(ValueError, match=r"train\.csv") as info:
        _open(manifest).close()
    assert said in str(info.value).lower(), info.value


def test_trailing_empty_fields_are_fine(images):
    manifest = images / "train.csv"
    manifest.write_text("path,label,site\nimg/a.jpg,tench,s1,\nimg/b.jpg,goldfish,,\n")
    loader = _open(manifest)
    try:
        assert loader.classes == ["goldfish", "tench"] and len(loader.dataset.paths) == 2
    finally:
        loader.close()
