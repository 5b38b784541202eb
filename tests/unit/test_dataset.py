"""Datasets on real files: ImageFolder trees, list files, the index cache, the cache folder."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from batchwire.pipeline import paths
from batchwire.pipeline.dataset import open_dataset, read_list_file
from batchwire.pipeline.index_cache import index_file
from PIL import Image


def _touch(path: Path, data: bytes | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if data is not None else path.name.encode())
    return path


def _age(root: Path, seconds: float = 3600.0) -> None:
    """Backdate every folder's mtime: listings of folders changed within the last seconds are
    deliberately not cached (coarse timestamps could hide a change made during the walk)."""
    past = os.stat(root).st_mtime - seconds
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.utime(folder, (past, past))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    _touch(root / "zebra" / "b.jpg")
    _touch(root / "zebra" / "a.JPEG")
    _touch(root / "zebra" / "nested" / "deeper" / "c.Png")
    _touch(root / "ant" / "x.webp")
    _touch(root / "ant" / "y.tif")
    _touch(root / "ant" / "notes.txt")  # not an image extension
    _touch(root / "ant" / ".hidden.jpg")  # hidden: never data
    _touch(root / "moth" / "with space.bmp")
    (root / "empty_class").mkdir()
    (root / ".git").mkdir()  # hidden folder is not a class
    _touch(root / "stray.jpg")  # files beside the classes belong to no class
    _age(root)
    return root


def test_image_folder_listing(tree: Path, tmp_path: Path) -> None:
    ds = open_dataset(tree, cache_dir=tmp_path / "cache")
    assert ds.classes == ["ant", "empty_class", "moth", "zebra"]
    rel = [os.path.relpath(p, tree) for p in ds.paths]
    assert rel == [
        "ant/x.webp",
        "ant/y.tif",
        "moth/with space.bmp",
        "zebra/a.JPEG",
        "zebra/b.jpg",
        "zebra/nested/deeper/c.Png",
    ]
    assert all(os.path.isabs(p) for p in ds.paths)
    assert ds.labels.dtype == np.int64
    assert ds.labels.tolist() == [0, 0, 2, 3, 3, 3]
    assert ds.class_counts().tolist() == [2, 0, 1, 3]
    assert len(ds) == 6 and ds.num_classes == 4 and ds.root == tree.resolve()
    assert ds.read_bytes(2) == b"with space.bmp"
    assert ds.read_bytes(-1) == b"c.Png"
    with pytest.raises(IndexError):
        ds.read_bytes(6)
    assert "6 images" in repr(ds)


def test_index_cache_is_reused_and_invalidated(tree: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = open_dataset(tree, cache_dir=cache)
    assert not first.from_cache
    assert index_file(tree.resolve(), cache).is_file()

    second = open_dataset(tree, cache_dir=cache)
    assert second.from_cache
    assert second.paths == first.paths and second.classes == first.classes
    np.testing.assert_array_equal(second.labels, first.labels)

    # A file added deep inside a class changes only that sub-folder's mtime.
    _touch(tree / "zebra" / "nested" / "deeper" / "d.jpg")
    third = open_dataset(tree, cache_dir=cache)
    assert not third.from_cache
    assert str(tree.resolve() / "zebra/nested/deeper/d.jpg") in third.paths
    assert not open_dataset(tree, cache_dir=cache).from_cache, "changed just now: not cached"
    _age(tree)
    assert not open_dataset(tree, cache_dir=cache).from_cache  # mtimes moved: re-walked once
    assert open_dataset(tree, cache_dir=cache).from_cache

    # A removed file, and a new class folder, are both noticed.
    (tree / "ant" / "x.webp").unlink()
    after_remove = open_dataset(tree, cache_dir=cache)
    assert not after_remove.from_cache and len(after_remove) == len(third) - 1
    _touch(tree / "bee" / "1.jpg")
    with_bee = open_dataset(tree, cache_dir=cache)
    assert not with_bee.from_cache and with_bee.classes[1] == "bee"
    assert with_bee.labels[with_bee.paths.index(str(tree.resolve() / "bee/1.jpg"))] == 1


def test_symlink_loop_does_not_hang(tmp_path: Path) -> None:
    root = tmp_path / "loopy"
    _touch(root / "cls" / "a.jpg")
    (root / "cls" / "again").symlink_to(root / "cls", target_is_directory=True)
    ds = open_dataset(root, cache_dir=tmp_path / "cache")
    assert [os.path.relpath(p, root) for p in ds.paths] == ["cls/a.jpg"]


def test_corrupt_index_cache_is_rebuilt(tree: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    good = open_dataset(tree, cache_dir=cache)
    index_file(tree.resolve(), cache).write_bytes(b"not a zip file at all")
    again = open_dataset(tree, cache_dir=cache)
    assert not again.from_cache and again.paths == good.paths
    assert open_dataset(tree, cache_dir=cache).from_cache  # rewritten


def test_unwritable_cache_still_opens(tree: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    ds = open_dataset(tree, cache_dir=blocker)
    assert len(ds) == 6 and not ds.from_cache


def test_list_file(tmp_path: Path) -> None:
    imgs = tmp_path / "imgs"
    a = _touch(imgs / "a.jpg")
    b = _touch(imgs / "sub dir" / "b c.jpg")
    elsewhere = _touch(tmp_path / "elsewhere" / "abs.png")
    lst = imgs / "train.txt"
    lst.write_text(
        "# comment line\n"
        "\n"
        "a.jpg 3\n"
        "  sub dir/b c.jpg\t0  \n"
        f"{elsewhere} 1\n"
        "../elsewhere/abs.png 1\n"
    )
    with pytest.raises(ValueError, match=r"train.txt:5: .* is outside the list file's folder"):
        open_dataset(lst)  # an absolute entry: refused unless allowed
    lst.write_text(lst.read_text().replace(f"{elsewhere} 1\n", ""))
    with pytest.raises(ValueError, match=r"train.txt:5: '../elsewhere/abs.png' is outside"):
        open_dataset(lst)  # climbing out with '..': the same
    lst.write_text(lst.read_text() + f"{elsewhere} 1\n")
    ds = open_dataset(lst, allow_outside_root=True)
    assert ds.kind == "list"
    assert ds.paths == [str(a), str(b), str(elsewhere), str(elsewhere)]
    assert ds.labels.tolist() == [3, 0, 1, 1]
    assert ds.classes == ["0", "1", "2", "3"]
    assert ds.read_bytes(1) == b"b c.jpg"


@pytest.mark.parametrize(
    "line,message",
    [
        ("lonely_path.jpg", "no label"),
        ("a.jpg cat", "must be an integer"),
        ("a.jpg -2", ">= 0"),
    ],
)
def test_list_file_bad_line_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    lst = tmp_path / "list.txt"
    lst.write_text(f"ok.jpg 0\n# fine\n{line}\n")
    with pytest.raises(ValueError, match=message) as err:
        read_list_file(lst)
    assert f"{lst}:3" in str(err.value)


def test_empty_and_missing_datasets_are_clear_errors(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        open_dataset(tmp_path / "does-not-exist", cache_dir=cache)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=f"no class folders in {empty}"):
        open_dataset(empty, cache_dir=cache)
    _touch(empty / "cls" / "readme.txt")
    with pytest.raises(ValueError, match=f"no image files in {empty}"):
        open_dataset(empty, cache_dir=cache)
    lst = tmp_path / "empty.txt"
    lst.write_text("# nothing here\n\n")
    with pytest.raises(ValueError, match="names no images"):
        open_dataset(lst)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00garbage 1\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        open_dataset(binary)


def test_a_single_image_given_as_a_split_is_named_as_one(tmp_path: Path) -> None:
    """`--train photo.jpg`: a split's path that is one image, read as a list file, says so."""
    photo = tmp_path / "photo.jpg"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(photo)
    with pytest.raises(ValueError, match=r"photo\.jpg is a JPEG image, not a dataset"):
        open_dataset(photo)


def test_cache_dir_follows_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "explicit"))
    assert paths.cache_dir() == (tmp_path / "explicit").resolve()
    assert (tmp_path / "explicit").is_dir()
    monkeypatch.delenv("BATCHWIRE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == (tmp_path / "xdg" / "batchwire").resolve()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == (tmp_path / "home" / ".cache" / "batchwire").resolve()


def test_default_cache_dir_used_when_none_given(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHWIRE_CACHE", str(tmp_path / "envcache"))
    assert not open_dataset(tree).from_cache
    assert index_file(tree.resolve(), tmp_path / "envcache").is_file()
    assert open_dataset(tree).from_cache


def test_a_list_file_that_is_an_image_is_named_as_one() -> None:
    """A bucket's list file read as text (`storage.listing`): an image's bytes say what they are."""
    from batchwire.pipeline.listfile import decode_list_text

    with pytest.raises(ValueError, match=r"s3://b/x\.txt is a PNG image"):
        decode_list_text(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff", "s3://b/x.txt")
    with pytest.raises(ValueError, match=r"x\.txt: list file is not UTF-8 text"):
        decode_list_text(b"a/b.jpg 1\n\xff\n", "x.txt")
    assert decode_list_text(b"a/b.jpg 1\n", "x.txt") == "a/b.jpg 1\n"
