"""prepare/mirror.py in-process: a rerun removes only what an earlier run wrote for files SRC no
longer has (same source, unchanged since: size and an independently recomputed XXH3-64),
folders only once empty, keeps and says why otherwise, and lists what prepare never wrote.
A manifest row or header folder naming a place outside DST is never acted on."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash
from batchwire.prepare.checksum_manifest import (
    COPIED,
    MANIFEST_NAME,
    REWRITTEN,
    Header,
    Record,
    Writer,
    load,
)
from batchwire.prepare.mirror import Mirror, find_foreign, remove_gone, source_id
from batchwire.prepare.source import discover

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "imagenet-sample"
TENCH = SAMPLE / "n01440764_tench.JPEG"


def jpeg() -> bytes:
    if TENCH.is_file():
        return TENCH.read_bytes()
    return b"\xff\xd8\xff\xe0" + bytes(range(256)) * 8 + b"\xff\xd9"


def xxh(data: bytes) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def put(root: Path, rel: str, data: bytes) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_bytes(data)


def written(dst: Path, files: dict[str, bytes], source: str, *, checksums: bool = True) -> None:
    """DST as a real earlier run left it: the files and a manifest (header, one record each)."""
    for rel, data in files.items():
        put(dst, rel, data)
    dirs = sorted({str(Path(rel).parent.as_posix()) for rel in files} - {"."})
    writer = Writer(dst / MANIFEST_NAME, Header(source, tuple(dirs)))
    records = [
        Record(rel, len(d), 1, REWRITTEN, len(d), len(d), 8, checksum=xxh(d) if checksums else "")
        for rel, d in files.items()
    ]
    writer.finish(records)


def mirror_run(src: Path, dst: Path) -> Mirror:
    source = discover(src)
    mirror = Mirror()
    remove_gone(dst, load(dst / MANIFEST_NAME), source, mirror)
    mirror.foreign = find_foreign(dst, source)
    return mirror


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    return src, dst


def test_source_id_names_the_tree_or_the_list(trees: tuple[Path, Path]) -> None:
    src, _ = trees
    put(src, "a/x.jpg", b"x")
    (src / "train list.txt").write_text("a/x.jpg 0\n")
    assert source_id(discover(src)) == "tree"
    assert source_id(discover(src / "train list.txt")) == "list:train list.txt"


def test_files_gone_from_src_are_removed_and_their_emptied_folders(
    trees: tuple[Path, Path],
) -> None:
    src, dst = trees
    data = jpeg()
    put(src, "cat/keep.jpg", data)
    written(
        dst,
        {"cat/keep.jpg": data, "cat/gone.jpg": data[:900], "dog/deep/gone.jpg": b"z" * 10},
        "tree",
    )
    m = mirror_run(src, dst)
    assert m.removed == ["cat/gone.jpg", "dog/deep/gone.jpg"]
    assert m.removed_dirs == ["dog/deep", "dog"]  # deepest first, "cat" still in SRC
    assert (dst / "cat/keep.jpg").read_bytes() == data
    assert not (dst / "dog").exists() and (dst / "cat").is_dir()
    assert m.kept == [] and m.foreign == []


def test_a_file_changed_in_dst_since_is_kept_with_why(trees: tuple[Path, Path]) -> None:
    src, dst = trees
    data = jpeg()
    written(dst, {"a/same_size.jpg": data, "a/longer.jpg": data, "a/symlink.jpg": data}, "tree")
    edited = bytearray(data)
    edited[len(data) // 2] ^= 0x01  # same size: only the checksum tells
    (dst / "a/same_size.jpg").write_bytes(bytes(edited))
    (dst / "a/longer.jpg").write_bytes(data + b"\0")
    (dst / "a/symlink.jpg").unlink()
    (dst / "a/symlink.jpg").symlink_to(TENCH if TENCH.is_file() else dst / "a/longer.jpg")
    m = mirror_run(src, dst)
    assert m.removed == [] and m.removed_dirs == []
    why = dict(m.kept)
    assert (
        why["a/same_size.jpg"] == why["a/longer.jpg"] == ("changed since pipeline-prepare wrote it")
    )
    assert why["a/symlink.jpg"].startswith("not a regular file now")
    assert (dst / "a/same_size.jpg").read_bytes() == bytes(edited)
    if TENCH.is_file():
        assert TENCH.read_bytes() == data  # the link's target untouched


def test_without_a_recorded_checksum_size_decides(trees: tuple[Path, Path]) -> None:
    src, dst = trees
    written(dst, {"old.bin": b"abc", "grown.bin": b"abc"}, "tree", checksums=False)
    (dst / "old.bin").write_bytes(b"xyz")  # same size, no checksum recorded: removable
    (dst / "grown.bin").write_bytes(b"abcd")
    m = mirror_run(src, dst)
    assert m.removed == ["old.bin"]
    assert m.kept == [("grown.bin", "changed since pipeline-prepare wrote it")]


def test_a_folder_with_files_prepare_never_wrote_stays(trees: tuple[Path, Path]) -> None:
    src, dst = trees
    written(dst, {"cls/gone.jpg": b"g" * 50}, "tree")
    put(dst, "cls/notes.txt", b"mine")
    m = mirror_run(src, dst)
    assert m.removed == ["cls/gone.jpg"] and m.removed_dirs == []
    assert m.foreign == ["cls/"]  # a folder once, not looked into
    assert (dst / "cls/notes.txt").read_bytes() == b"mine"


def test_another_source_keeps_everything(trees: tuple[Path, Path]) -> None:
    src, dst = trees
    put(src, "b/y.jpg", b"y")
    (src / "b.txt").write_text("b/y.jpg 0\n")
    written(dst, {"a/x.jpg": b"x" * 20, "a.txt": b"a/x.jpg 0\n"}, "list:a.txt")
    m = mirror_run(src / "b.txt", dst)
    assert m.removed == [] and m.removed_dirs == []
    assert m.kept == [
        ("a.txt", "DST was last prepared from another source (list:a.txt)"),
        ("a/x.jpg", "DST was last prepared from another source (list:a.txt)"),
    ]
    assert (dst / "a/x.jpg").is_file() and (dst / "a.txt").is_file()


def test_a_manifest_older_than_headers_counts_as_a_folders(trees: tuple[Path, Path]) -> None:
    src, dst = trees
    put(dst, "x/gone.bin", b"12345")
    line = Record("x/gone.bin", 5, 1, COPIED, 5, 5, 8, checksum=xxh(b"12345")).to_line()
    (dst / MANIFEST_NAME).write_text(line + '{"finished": true}\n')
    assert mirror_run(src, dst).removed == ["x/gone.bin"]
    put(src, "y.jpg", b"y")
    (src / "l.txt").write_text("y.jpg 0\n")
    put(dst, "x/gone.bin", b"12345")
    m = mirror_run(src / "l.txt", dst)  # a list: the unknown source is not its own
    assert m.removed == [] and m.kept[0][0] == "x/gone.bin"


def test_bad_manifest_rows_are_skipped_not_fatal(trees: tuple[Path, Path]) -> None:
    src, dst = trees
    put(dst, "gone.bin", b"12345")
    good = Record("gone.bin", 5, 1, COPIED, 5, 5, 8, checksum=xxh(b"12345")).to_line()
    rows = [
        '{"source": "tree", "dirs": ["d"]}',
        "not json",
        "[1, 2]",
        '{"path": "", "size": 1}',
        '{"path": 7, "bytes_out": 1}',
        '{"path": "weird.bin", "unknown_field": 1}',
        good.strip(),
        '{"path": "cut',
    ]
    (dst / MANIFEST_NAME).write_text("\n".join(rows))
    m = mirror_run(src, dst)
    assert m.removed == ["gone.bin"] and m.kept == [] and m.foreign == []


def test_foreign_lists_what_prepare_never_wrote(trees: tuple[Path, Path]) -> None:
    src, dst = trees
    put(src, "a/x.jpg", b"x")
    (src / "a/empty").mkdir()
    written(dst, {"a/x.jpg": b"x"}, "tree")
    (dst / "a/empty").mkdir()
    put(dst, "a/stray name\twith tab.jpg", b"s")
    put(dst, "junk/inner/deep.bin", b"j")
    put(dst, ".batchwire-prepare-report.json", b"{}")
    put(dst, "a/.batchwire-prepare-tmp.abc", b"t")
    os.mkfifo(dst / "a/pipe")
    m = mirror_run(src, dst)
    assert m.foreign == ["a/pipe", "a/stray name\twith tab.jpg", "junk/"]
    assert m.removed == [] and m.kept == []


def test_rows_naming_places_outside_dst_are_never_acted_on(tmp_path: Path) -> None:
    """A hand-edited or foreign manifest ("../x", "/abs/x", a folder symlinked out of DST)
    must not make a rerun delete files or folders outside DST."""
    src, dst, outside = tmp_path / "src", tmp_path / "dst", tmp_path / "outside"
    src.mkdir()
    dst.mkdir()
    put(outside, "victim.bin", b"precious")
    put(outside, "abs.bin", b"precious")
    put(outside, "via_link.bin", b"precious")
    (outside / "empty_a").mkdir()
    (outside / "empty_b").mkdir()
    (dst / "link").symlink_to(outside, target_is_directory=True)
    rec = Record("x", 8, 1, COPIED, 8, 8, 8, checksum=xxh(b"precious"))
    rows = [
        Header("tree", ("../outside/empty_a", str(outside / "empty_b"), "link/empty_a")),
        replace(rec, path="../outside/victim.bin"),
        replace(rec, path=str(outside / "abs.bin")),
        replace(rec, path="link/via_link.bin"),
        replace(rec, path="a/../../outside/victim.bin"),
    ]
    (dst / MANIFEST_NAME).write_text("".join(r.to_line() for r in rows))
    m = mirror_run(src, dst)
    assert m.removed == [] and m.removed_dirs == []
    for name in ("victim.bin", "abs.bin", "via_link.bin"):
        assert (outside / name).read_bytes() == b"precious", name
    assert (outside / "empty_a").is_dir() and (outside / "empty_b").is_dir()
    kept = dict(m.kept)
    assert all("outside DST" in kept[r.path] for r in rows[1:])  # listed, with why
