"""`pipeline.listfile`: the `path label` line syntax and the confinement of entries to a folder,
shared by the local list file, the bucket list file and the manifest readers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from batchwire.pipeline.listfile import MAX_LABEL, confined_path, parse_list_line
from batchwire.pipeline.sources import labels
from batchwire.pipeline.sources.folder import read_list_file
from batchwire.pipeline.storage.listing import parse_list_text


@pytest.mark.parametrize("raw", ["", "   ", "\t\n", "# a comment", "   # indented 3"])
def test_blank_lines_and_comments_are_skipped(raw: str) -> None:
    assert parse_list_line(raw, "list.txt:1") is None


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("a.jpg 3", ("a.jpg", 3)),
        ("  cls/a.jpg\t0  \n", ("cls/a.jpg", 0)),
        ("my photos/a b.jpg 7", ("my photos/a b.jpg", 7)),  # the label is the LAST field
        ("a.jpg  \t 12", ("a.jpg", 12)),
        ("x#y.jpg 1", ("x#y.jpg", 1)),  # only a leading '#' makes a comment
    ],
)
def test_path_and_label(raw: str, expected: tuple[str, int]) -> None:
    assert parse_list_line(raw, "list.txt:1") == expected


@pytest.mark.parametrize(
    "raw, message",
    [
        ("lonely.jpg", "list.txt:4: expected 'path label', got 'lonely.jpg' (no label field)"),
        ("a.jpg cat", "list.txt:4: label must be an integer, got 'cat' in 'a.jpg cat'"),
        ("a.jpg 1.5", "list.txt:4: label must be an integer, got '1.5'"),
        ("a.jpg -1", "list.txt:4: label must be >= 0, got -1"),
    ],
)
def test_bad_lines_name_where_and_why(raw: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_list_line(raw, "list.txt:4")
    assert str(info.value).startswith(message), str(info.value)


def test_the_missing_label_note_is_the_callers() -> None:
    with pytest.raises(ValueError, match=r"^b\.txt:9: .*\(no label\)$"):
        parse_list_line("lonely.jpg", "b.txt:9", no_label="no label")


def test_a_huge_label_is_a_bad_line_not_millions_of_classes(tmp_path: Path) -> None:
    """A list file's classes are "0" .. its largest label: one stray id of 10**12 would build
    10**12 class names (memory exhaustion), one beyond int64 raised a bare OverflowError naming
    no line. Both are refused at the line, at the bound every other source applies."""
    assert MAX_LABEL == labels.MAX_LABEL  # one bound for list files, manifests, tar shards...
    assert parse_list_line(f"a.jpg {MAX_LABEL}", "w") == ("a.jpg", MAX_LABEL)
    for label in (MAX_LABEL + 1, 10**12, 2**63, 10**30):
        with pytest.raises(ValueError, match=rf"^list\.txt:2: label must be 0 to {MAX_LABEL}, got"):
            parse_list_line(f"a.jpg {label}", "list.txt:2")
    listing = tmp_path / "list.txt"
    listing.write_text("a.jpg 0\nb.jpg 1000000000000\n")
    with pytest.raises(ValueError, match=rf"^{listing}:2: label must be 0 to"):
        read_list_file(listing)  # the local list reader (a bucket's: `parse_list_text`)
    with pytest.raises(ValueError, match=r"^s3://b/list\.txt:1: label must be 0 to"):
        parse_list_text("a.jpg 99999999999999999999\n", "s3://b/list.txt")


# ---- confinement ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, rel",
    [
        ("a.jpg", "a.jpg"),
        ("cls/./a.jpg", "cls/a.jpg"),
        ("cls/../other/a.jpg", "other/a.jpg"),  # climbs, but stays inside
        ("cls//a.jpg", "cls/a.jpg"),
    ],
)
def test_entries_inside_the_folder_resolve_normalized(tmp_path: Path, entry: str, rel: str):
    for allow in (False, True):
        assert confined_path(tmp_path, entry, allow) == str(tmp_path / rel)


@pytest.mark.parametrize("entry", ["../x.jpg", "cls/../../x.jpg", "/etc/shadow", "..", "../data2"])
def test_entries_escaping_the_folder_are_refused_unless_allowed(tmp_path: Path, entry: str):
    base = tmp_path / "data"
    assert confined_path(base, entry, False) is None
    allowed = confined_path(base, entry, True)
    assert allowed == os.path.normpath(entry if entry.startswith("/") else f"{base}/{entry}")


def test_a_sibling_sharing_the_folders_name_prefix_is_outside(tmp_path: Path) -> None:
    """`data2` starts with `data` as a string but is not inside it: a path comparison, not a
    string prefix."""
    base = tmp_path / "data"
    assert confined_path(base, "../data2/a.jpg", False) is None
    assert confined_path(base, "../data/a.jpg", False) == str(base / "a.jpg")


def test_an_absolute_entry_inside_the_folder_is_still_refused(tmp_path: Path) -> None:
    """Absolute entries are refused whatever they name: a list file is relative to its folder."""
    assert confined_path(tmp_path, str(tmp_path / "a.jpg"), False) is None
    assert confined_path(tmp_path, str(tmp_path / "a.jpg"), True) == str(tmp_path / "a.jpg")


def test_symlinks_are_not_resolved(tmp_path: Path) -> None:
    """A link inside the folder may point anywhere (symlink farms build subsets)."""
    (tmp_path / "elsewhere").mkdir()
    base = tmp_path / "data"
    base.mkdir()
    os.symlink(tmp_path / "elsewhere", base / "link")
    assert confined_path(base, "link/a.jpg", False) == str(base / "link" / "a.jpg")
