"""prepare/source.py in-process: what pipeline-prepare takes from SRC (a folder tree, walked
once per folder through symlinks, odd entries listed as unreadable; a list file, parsed and
confined as the server does) and where it may write (never DST inside SRC or SRC inside DST,
symlinks resolved; no --report or --manifest-dir inside SRC)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from batchwire.pipeline.index_cache import scan_image_folder
from batchwire.pipeline.synthetic import default_dataset
from batchwire.prepare.source import (
    UsageError,
    check_destination,
    check_manifest_dir,
    check_report,
    discover,
    read_list,
    walk_tree,
)

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"


def put(root: Path, rel: str, data: bytes = b"x") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_a_tree_is_every_file_and_folder_sorted(tmp_path: Path) -> None:
    src = tmp_path / "src"
    put(src, "b/2.jpg")
    put(src, "b/1.jpg")
    put(src, "a/deep/er/x.jpg")
    put(src, "top.txt")
    put(src, "a/.hidden.jpg")
    (src / "empty_class").mkdir()  # still takes a label id: mirrored
    s = walk_tree(src)
    assert s.kind == "tree" and s.root == src and s.list_name is None
    assert s.files == ["a/.hidden.jpg", "a/deep/er/x.jpg", "b/1.jpg", "b/2.jpg", "top.txt"]
    assert s.dirs == ["a", "a/deep", "a/deep/er", "b", "empty_class"]
    assert s.unreadable == [] and s.has_classes


def test_prepares_own_files_are_never_taken(tmp_path: Path) -> None:
    src = tmp_path / "src"
    put(src, "a/x.jpg")
    put(src, ".batchwire-prepare.jsonl", b"{}")
    put(src, ".batchwire-prepare-checksums.jsonl", b"{}")
    put(src, "a/.batchwire-prepare-tmp.123")
    put(src, ".batchwire-prepare-old/inside.jpg")
    s = walk_tree(src)
    assert s.files == ["a/x.jpg"] and s.dirs == ["a"]


def test_has_classes_needs_a_visible_top_folder(tmp_path: Path) -> None:
    flat = tmp_path / "flat"
    put(flat, "x.jpg")
    put(flat, ".cache/y.jpg")
    s = walk_tree(flat)
    assert not s.has_classes and s.files == [".cache/y.jpg", "x.jpg"]
    put(flat, "cls/z.jpg")
    assert walk_tree(flat).has_classes


def test_symlinks_followed_once_and_odd_entries_listed(tmp_path: Path) -> None:
    src, outside = tmp_path / "src", tmp_path / "outside"
    put(outside, "o1.jpg")
    put(outside, "sub/o2.jpg")
    put(src, "real/a.jpg")
    (src / "farm").symlink_to(outside, target_is_directory=True)  # out of the tree: followed
    (src / "again").symlink_to(src / "real", target_is_directory=True)  # second link: once
    (src / "real/loop").symlink_to(src, target_is_directory=True)  # a loop: no hang
    (src / "real/file_link.jpg").symlink_to(outside / "o1.jpg")
    (src / "real/dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    os.mkfifo(src / "real/pipe.jpg")
    s = walk_tree(src)
    # "again" (before "real" in name order) is the one walked; "real" is its second link
    assert s.files == [
        "again/a.jpg",
        "again/file_link.jpg",
        "farm/o1.jpg",
        "farm/sub/o2.jpg",
    ]
    # "real" and the loop stay as empty folders: the server's scan of SRC has "real" as a
    # class (with no images), so a prepared DST must have it too, or every later label shifts
    assert s.dirs == ["again", "again/loop", "farm", "farm/sub", "real"]
    top = [d for d in s.dirs if "/" not in d]
    assert top == scan_image_folder(src).classes
    assert sorted(s.unreadable) == [
        ("again/dangling.jpg", "a broken symlink"),
        ("again/pipe.jpg", "not a regular file"),
    ]


def test_odd_names_kept_as_they_are(tmp_path: Path) -> None:
    src = tmp_path / "src"
    names = ["cls/sp ace.jpg", "cls/tab\there.jpg", "cls/nl\nname.jpg", "cls/ünï çødé.jpg"]
    names.append("cls/-dash #hash %.jpg")
    raw = os.fsencode(str(src / "cls")) + b"/bad-\xff.jpg"  # not UTF-8
    for n in names:
        put(src, n)
    Path(os.fsdecode(raw)).write_bytes(b"x")
    s = walk_tree(src)
    assert sorted([*names, "cls/" + os.fsdecode(b"bad-\xff.jpg")]) == s.files
    for rel in s.files:
        assert (src / rel).is_file()  # each name reaches its file again


def test_the_embedded_dataset_walks_as_an_imagefolder() -> None:
    train = Path(default_dataset().train_root)
    s = discover(train)
    assert s.kind == "tree" and s.has_classes and s.unreadable == []
    on_disk = sorted(
        p.relative_to(train).as_posix()
        for p in train.rglob("*")
        if p.is_file() and not p.name.startswith(".batchwire-prepare")
    )
    assert s.files == on_disk and len(s.files) > 0
    assert all("/" in f for f in s.files if f.endswith(".jpg"))


def test_a_list_file_in_order_each_once_with_its_folders(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    for rel in ("b/x.jpg", "a/deep/y.jpg", "z.jpg"):
        put(root, rel)
    lst = root / "train list.txt"
    lst.write_text("b/x.jpg 1\na/deep/y.jpg 0\n\nb/x.jpg 1\nz.jpg 2\n")
    s = discover(lst)
    assert s.kind == "list" and s.list_name == "train list.txt" and s.root == root.resolve()
    assert s.files == ["b/x.jpg", "a/deep/y.jpg", "z.jpg"]
    assert s.dirs == ["a", "a/deep", "b"]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("../escape.jpg 0", "outside the list file's folder"),
        ("/etc/passwd 0", "outside the list file's folder"),
        ("a/../../escape.jpg 0", "outside the list file's folder"),
        ("x.jpg notalabel", "x.jpg"),
        (".batchwire-prepare.jsonl 0", "reserved for pipeline-prepare"),
        ("a/.batchwire-prepare-tmp.1/x.jpg 0", "reserved for pipeline-prepare"),
    ],
)
def test_bad_list_lines_are_a_usage_error_naming_them(tmp_path: Path, line: str, says: str) -> None:
    lst = tmp_path / "list.txt"
    lst.write_text(f"ok.jpg 0\n{line}\n")
    with pytest.raises(UsageError, match=says):
        read_list(lst)


def test_a_list_file_that_is_not_text_is_a_usage_error(tmp_path: Path) -> None:
    lst = tmp_path / "list.txt"
    lst.write_bytes(b"\xff\xfe\x00garbage 0\n")
    with pytest.raises(UsageError, match="not UTF-8"):
        discover(lst)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    s = discover(empty)
    assert s.files == [] and s.dirs == []


def test_src_that_is_missing_or_not_a_folder_or_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        discover(tmp_path / "missing")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="neither a folder nor a list file"):
        discover(tmp_path / "fifo")  # never opened: no hang
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(UsageError, match="does not exist"):
        discover(tmp_path / "dangling")


def test_destination_checks(tmp_path: Path) -> None:
    src = tmp_path / "src"
    put(src, "a/x.jpg")
    s = discover(src)
    with pytest.raises(UsageError, match="DST is SRC"):
        check_destination(s, src)
    with pytest.raises(UsageError, match="is inside SRC"):
        check_destination(s, src / "a" / "out")
    with pytest.raises(UsageError, match="is inside DST"):
        check_destination(s, tmp_path)
    (tmp_path / "sneaky").symlink_to(src / "a", target_is_directory=True)
    with pytest.raises(UsageError, match="is inside SRC"):
        check_destination(s, tmp_path / "sneaky" / "out")  # through a symlink
    put(tmp_path, "a_file")
    with pytest.raises(UsageError, match="not a folder"):
        check_destination(s, tmp_path / "a_file")
    good = check_destination(s, tmp_path / "dst" / "new")
    assert good == (tmp_path / "dst" / "new").resolve() and good.is_absolute()
    assert check_destination(s, tmp_path / "src2") == (tmp_path / "src2").resolve()


def test_a_list_files_folder_is_what_dst_must_stay_out_of(tmp_path: Path) -> None:
    put(tmp_path / "ds", "x.jpg")
    (tmp_path / "ds/list.txt").write_text("x.jpg 0\n")
    s = discover(tmp_path / "ds/list.txt")
    with pytest.raises(UsageError, match="inside the list file's folder"):
        check_destination(s, tmp_path / "ds" / "out")


def test_report_and_manifest_dir_stay_out_of_src(tmp_path: Path) -> None:
    src = tmp_path / "src"
    put(src, "a/x.jpg")
    s = discover(src)
    with pytest.raises(UsageError, match=r"--report .* is inside SRC"):
        check_report(s, src / "a" / "report.json")
    with pytest.raises(UsageError, match=r"--manifest-dir .* is inside SRC"):
        check_manifest_dir(s, src / "sums")
    with pytest.raises(UsageError, match=r"--manifest-dir .* is inside SRC"):
        check_manifest_dir(s, src)
    check_report(s, tmp_path / "report.json")
    check_manifest_dir(s, tmp_path / "sums")


@pytest.mark.skipif(not SAMPLE.is_dir(), reason="needs the shared imagenet-sample")
def test_real_jpegs_read_in_place() -> None:
    """A flat folder of real JPEGs, read in place: every one a file, no class folders."""
    s = walk_tree(SAMPLE)
    assert not s.has_classes and len(s.files) == len(list(SAMPLE.iterdir()))
    assert s.files == sorted(p.name for p in SAMPLE.iterdir())
