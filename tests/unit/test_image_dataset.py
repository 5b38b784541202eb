"""`ImageDataset`: the record every source opens as. Paths and labels as opened from the embedded
dataset and from a list file over good and bad files; how sample i's bytes are read (a file, a
source's reader, several at once); labels of single- and multi-label batches; checksums."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash
from badinputcorpus import write_corpus
from batchwire.pipeline.checksums import Checksums, Verdict
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode.files import NotARegularFile
from batchwire.pipeline.image_dataset import ImageDataset, dataset_root
from batchwire.pipeline.storage.listing import ObjectReader
from batchwire.pipeline.storage.local import LocalStore
from batchwire.pipeline.synthetic import default_dataset


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> ImageDataset:
    """The embedded dataset's val split, opened as an ImageFolder (index cache under tmp)."""
    return open_dataset(default_dataset().val_root, tmp_path_factory.mktemp("index"))


def test_an_image_folder_opens_as_absolute_paths_and_int64_labels(embedded: ImageDataset):
    root = default_dataset().val_root
    assert embedded.kind == "folder" and embedded.root == root
    assert embedded.classes == sorted(p.name for p in root.iterdir() if p.is_dir())
    assert embedded.num_classes == 10 and embedded.label_width == 0
    assert embedded.labels.dtype == np.int64 and len(embedded.labels) == len(embedded)
    for i in (0, len(embedded) // 2, len(embedded) - 1):
        path = Path(embedded.paths[i])
        assert path.is_absolute() and path.parent.name == embedded.classes[embedded.labels[i]]
        assert embedded.read_bytes(i) == path.read_bytes()
    assert embedded.class_counts().sum() == len(embedded)
    assert (
        repr(embedded) == f"ImageDataset(folder {str(root)!r}: {len(embedded)} images, 10 classes)"
    )


def test_read_bytes_index_range(embedded: ImageDataset) -> None:
    n = len(embedded)
    assert embedded.read_bytes(-1) == Path(embedded.paths[n - 1]).read_bytes()
    assert embedded.read_bytes(np.int64(3)) == Path(embedded.paths[3]).read_bytes()
    for bad in (n, -n - 1, True, False):  # a bool is no index, though it is an int
        with pytest.raises(IndexError, match=f"sample index {bad} out of range for {n} images"):
            embedded.read_bytes(bad)


def test_local_files_read_one_at_a_time(embedded: ImageDataset) -> None:
    """No reader: `read_many` is None (the sample loader reads each file on decode threads), no
    read-ahead, and a bad sample's substitutes come from the whole dataset."""
    assert embedded.read_many([0, 1], epoch=0, upcoming=[[2, 3]]) is None
    assert embedded.read_ahead_batches == 0 and embedded.read_ahead_bytes == 0
    assert embedded.substitute_range(5) == (0, len(embedded))


def test_a_list_of_bad_files_reads_each_as_bytes_or_an_oserror(tmp_path: Path) -> None:
    """Corrupt files are bytes (the decoders judge them); a FIFO, a link to one, a folder and
    /dev/null are `NotARegularFile`, read without being opened (a FIFO would block); a file
    gone since listing is FileNotFoundError. Each is the sample loader's to count."""
    listing, bad = write_corpus(tmp_path / "corpus")
    ds = open_dataset(listing, tmp_path / "index", allow_outside_root=True)
    assert ds.kind == "list" and ds.root == listing
    assert ds.classes == ["0", "1", "2"] and ds.labels[:4].tolist() == [0, 1, 2, 0]
    not_regular = {str(tmp_path / "corpus" / n) for n in ("pipe.jpg", "link_to_pipe.jpg")}
    not_regular |= {str(tmp_path / "corpus" / "folder.jpg"), "/dev/null"}
    for i, path in enumerate(ds.paths):
        if path in not_regular:
            with pytest.raises(NotARegularFile):
                ds.read_bytes(i)
        else:
            assert ds.read_bytes(i) == Path(path).read_bytes(), path
    assert not_regular <= bad and not_regular <= set(ds.paths)
    os.unlink(ds.paths[0])
    with pytest.raises(FileNotFoundError):
        ds.read_bytes(0)


def _object_dataset(embedded: ImageDataset, count: int) -> ImageDataset:
    """The first `count` embedded samples as a bucket-like source: keys read through a
    `LocalStore` (the local `Store`) by the `ObjectReader` bucket datasets use."""
    root = default_dataset().val_root
    keys = [os.path.relpath(p, root) for p in embedded.paths[:count]]
    return ImageDataset(
        paths=[f"{root}/{k}" for k in keys],
        labels=embedded.labels[:count],
        classes=embedded.classes,
        root=root,
        kind="list",
        reader=ObjectReader(LocalStore(root), keys),
    )


def test_a_reader_reads_the_samples_and_read_many_wraps_indices(embedded: ImageDataset):
    ds = _object_dataset(embedded, 5)
    files = [Path(p).read_bytes() for p in ds.paths]
    assert ds.read_bytes(-2) == files[3]
    with pytest.raises(IndexError):
        ds.read_bytes(5)
    assert ds.read_many([4, 0, 7, -1]) == [files[4], files[0], files[2], files[4]]
    # No read-ahead here: an epoch and upcoming batches change nothing.
    assert ds.read_ahead_batches == 0
    assert ds.read_many([1, 6], epoch=3, upcoming=[[2], [3]]) == [files[1], files[1]]


def test_a_reader_that_fails_a_sample_hands_back_its_oserror(embedded: ImageDataset):
    ds = _object_dataset(embedded, 3)
    ds.reader.keys[1] = "missing/nothing.jpg"  # type: ignore[union-attr]
    got = ds.read_many([0, 1])
    assert got[0] == Path(ds.paths[0]).read_bytes()
    assert isinstance(got[1], FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        ds.read_bytes(1)


def test_root_keeps_a_url_as_a_string_and_makes_anything_else_a_path(tmp_path: Path) -> None:
    assert dataset_root("s3://bucket/prefix") == "s3://bucket/prefix"
    assert dataset_root("gs://b//double") == "gs://b//double"
    assert dataset_root(tmp_path) == tmp_path and isinstance(dataset_root(str(tmp_path)), Path)
    assert dataset_root("data/s3://x") == Path("data/s3://x")  # no scheme at the start
    url = ImageDataset([], np.zeros(0), [], root="s3://bucket/prefix")
    assert url.root == "s3://bucket/prefix" and "s3://bucket/prefix" in repr(url)

    assert ImageDataset([], np.zeros(0), [], root=tmp_path).root == tmp_path

    class Where(os.PathLike):
        def __fspath__(self) -> str:
            return "s3://b/p"

    assert ImageDataset([], np.zeros(0), [], root=Where()).root == "s3://b/p"


def test_labels_become_int64_and_sizes_must_agree() -> None:
    ds = ImageDataset(["a", "b"], np.array([1, 9, 0], dtype=np.int8)[::2], ["x", "y"], "r")
    assert ds.labels.dtype == np.int64 and ds.labels.flags.c_contiguous
    assert ds.labels.tolist() == [1, 0]
    with pytest.raises(ValueError, match="2 paths but 3 labels"):
        ImageDataset(["a", "b"], np.zeros(3), ["x"], "r")
    with pytest.raises(ValueError, match=r"label_rows must be \[2, K\]"):
        ImageDataset(["a", "b"], np.zeros(2), ["x"], "r", label_rows=np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"label_rows must be \[2, K\]"):
        ImageDataset(["a", "b"], np.zeros(2), ["x"], "r", label_rows=np.zeros(2))
    with pytest.raises(ValueError, match="2 paths but 1 metadata rows"):
        ImageDataset(["a", "b"], np.zeros(2), ["x"], "r", metadata=[{}])


def test_single_label_batches_and_counts() -> None:
    ds = ImageDataset(["a", "b", "c", "d"], [2, 0, 2, 2], ["x", "y", "z", "w"], "r")
    assert ds.class_counts().tolist() == [1, 0, 3, 0]  # every class, empty ones too
    labels = np.array([2, -1, 0])
    assert ds.batch_labels(np.array([0, 0, 1]), labels, np.array([1, 0, 1], bool)) is labels


def test_multi_label_batches_and_counts() -> None:
    rows = np.array([[0, 2], [1, -1], [2, -1]], dtype=np.int32)
    ds = ImageDataset(["a", "b", "c"], rows[:, 0], ["x", "y", "z", "w"], "r", label_rows=rows)
    assert ds.label_width == 2 and ds.label_rows.dtype == np.int64
    assert ds.class_counts().tolist() == [1, 1, 2, 0]  # images having each class; -1 is none
    got = ds.batch_labels(np.array([2, 0, 0]), np.array([2, -7, 0]), np.array([1, 0, 1], bool))
    assert got.tolist() == [[2, -1], [-7, -7], [0, 2]]  # the padded slot: its padding label
    assert rows.tolist() == [[0, 2], [1, -1], [2, -1]]  # the dataset's rows are left alone


def test_checksums_judge_the_bytes_read() -> None:
    good, other = b"\xff\xd8recorded\xff\xd9", b"\xff\xd8recordeX\xff\xd9"
    plain = ImageDataset(["a", "b"], np.zeros(2), ["x"], "r")
    assert plain.checksum_problem(0, good) is None
    assert plain.checksum_verdict(0, good) == Verdict(None)
    sums = Checksums(
        np.array([len(good), -1]),
        np.array([xxhash.xxh3_64_intdigest(good), 0], dtype=np.uint64),
        ["m.json"],
        np.array([True, False]),
    )
    ds = ImageDataset(["a", "b"], np.zeros(2), ["x"], "r", checksums=sums)
    assert ds.checksum_verdict(0, good) == Verdict(None, True)  # recorded, and intact
    assert "differ from those recorded in m.json" in ds.checksum_problem(0, other)
    assert "1 bytes read" in ds.checksum_problem(np.int64(0), b"x")
    assert ds.checksum_verdict(0, other).intact is False
    assert ds.checksum_verdict(1, other) == Verdict(None)  # nothing recorded for it
