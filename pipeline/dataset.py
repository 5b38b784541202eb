"""Datasets: which files exist and what their labels are. Nothing here decodes.

Two sources, picked by what the path is:
- a directory is an ImageFolder: one sub-folder per class, sorted names give label ids, image
  files found recursively inside each class folder (listing cached, see `index_cache`);
- a file is a list file: `path label` per line, relative paths resolved against the list
  file's folder, blank lines and `#` comments ignored. The label is the last whitespace-separated
  field, so paths may contain spaces.

File contents are not checked here: a 1.3 M-file dataset must open in seconds, and unreadable
files (FIFOs and devices named in a list file included) are the sample loader's business
(logged, counted, replaced). What is loaded here is the checksum manifest, if the dataset has
one (`checksums`): the sample loader checks each file's bytes against it as it reads them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from batchwire.pipeline import paths as _paths
from batchwire.pipeline.checksums import Checksums, Verdict, load_checksums
from batchwire.pipeline.index_cache import IMAGE_EXTENSIONS, cached_folder_index
from batchwire.pipeline.listfile import confined_path, parse_list_line

__all__ = ["IMAGE_EXTENSIONS", "ImageDataset", "dataset_root", "open_dataset", "read_list_file"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def dataset_root(location: str | os.PathLike[str]) -> Path | str:
    """What `ImageDataset.root` holds for a location: a URL (`s3://bucket/prefix`) stays the
    string it is (a `Path` would fold its `//` into `s3:/bucket`), anything else is a Path."""
    text = os.fspath(location)
    if _URL.match(text):
        return text
    return Path(text)


@dataclass
class ImageDataset:
    """Absolute file paths with int64 labels, and the class names the labels index.

    `root` is where the dataset is, as logs, errors and stats show it: a local Path (an
    ImageFolder's root, a list file, a shard or Parquet file), or the URL string of an
    object-store dataset (never a credential: sources build it from the redacted URL)."""

    paths: Sequence[str]  # a list, or a manifest's PackedStrings (one buffer, offsets)
    labels: np.ndarray
    classes: list[str]
    root: Path | str
    kind: str = "folder"  # "folder", "list", or a `pipeline.sources` kind ("csv", "tar", ...)
    from_cache: bool = False  # the ImageFolder listing came from the index cache
    checksums: Checksums | None = None  # recorded checksums (pipeline.checksums), if any
    _counts: np.ndarray | None = field(default=None, repr=False)
    # How sample i's bytes are read when they are not the file `paths[i]` (a tar member, a
    # Parquet row, an object): `pipeline.sources`; `paths[i]` then only names the sample.
    reader: Callable[[int], bytes] | None = field(default=None, repr=False)
    # Multi-label sources (a manifest with lists of labels): int64 [N, K], each sample's label
    # ids in the order written then -1 (`sources.labels.NO_LABEL`); `labels` holds the first.
    # None for single-label datasets (what every batch then carries is `labels`, [B]).
    label_rows: np.ndarray | None = field(default=None, repr=False)
    # Per-sample metadata (a manifest's other columns: `sources.metadata`), None without.
    # Kept msgpacked (`sources.metadata.PackedMetadata`): `metadata[i]` is sample i's dict.
    metadata: Sequence[dict[str, Any] | None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.root, (Path, str)):
            self.root = dataset_root(self.root)
        self.labels = np.ascontiguousarray(self.labels, dtype=np.int64)
        if len(self.paths) != len(self.labels):
            raise ValueError(f"{len(self.paths)} paths but {len(self.labels)} labels")
        if self.label_rows is not None:
            self.label_rows = np.ascontiguousarray(self.label_rows, dtype=np.int64)
            if self.label_rows.ndim != 2 or len(self.label_rows) != len(self.paths):
                raise ValueError(f"label_rows must be [{len(self.paths)}, K]")
        if self.metadata is not None and len(self.metadata) != len(self.paths):
            raise ValueError(f"{len(self.paths)} paths but {len(self.metadata)} metadata rows")

    def __len__(self) -> int:
        return len(self.paths)

    def __repr__(self) -> str:
        return (
            f"ImageDataset({self.kind} {str(self.root)!r}: {len(self)} images, "
            f"{self.num_classes} classes)"
        )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def label_width(self) -> int:
        """K of a multi-label dataset's [B, K] label batches; 0 for single labels ([B])."""
        return 0 if self.label_rows is None else int(self.label_rows.shape[1])

    def batch_labels(
        self, sources: np.ndarray, labels: np.ndarray, valid: np.ndarray
    ) -> np.ndarray:
        """A batch's labels: `labels` ([B], padded slots already PADDING_LABEL) as they are for
        a single-label dataset; for a multi-label one the rows of `sources` (the samples whose
        pixels the batch holds), a padded slot's row all PADDING_LABEL."""
        if self.label_rows is None:
            return labels
        rows = self.label_rows[np.asarray(sources, dtype=np.int64)]
        rows[~np.asarray(valid, dtype=bool)] = labels[~np.asarray(valid, dtype=bool)][:, None]
        return rows

    def class_counts(self) -> np.ndarray:
        """Images per class (int64 [num_classes]; multi-label: images having each class)."""
        if self._counts is None:
            ids = self.labels if self.label_rows is None else self.label_rows[self.label_rows >= 0]
            self._counts = np.bincount(ids, minlength=self.num_classes).astype(np.int64)
        return self._counts

    def read_bytes(self, i: int) -> bytes:
        """The raw file contents of sample `i` (regular files only: `decode.read_file`).

        OSError propagates: the sample loader retries a transient one (`decode.is_transient`)
        and counts any other, `NotARegularFile` (a FIFO, device, directory) included, as a bad
        file."""
        n = len(self.paths)
        if isinstance(i, bool) or not (-n <= int(i) < n):
            raise IndexError(f"sample index {i} out of range for {n} images")
        if self.reader is not None:
            return self.reader(int(i) % n)
        from batchwire.pipeline.decode.files import read_file  # keeps `dataset` import-light

        return read_file(self.paths[int(i)])

    def substitute_range(self, i: int) -> tuple[int, int]:
        """The indices [lo, hi) a bad sample ``i``'s substitutes are drawn from: the whole
        dataset (a mix: its part, `pipeline.sources.mix`)."""
        return 0, len(self.paths)

    def read_many(self, indices: Sequence[int]) -> list[bytes | OSError | None] | None:
        """The bytes of several samples read together (an object store keeps many requests
        in flight: `pipeline.storage`), a failed one as its OSError; None when the source
        reads one sample at a time (local files: the sample loader reads each on the
        decoder's threads), and a None entry for a sample to read alone (a mix's local
        part). A source offers it through `reader.read_many`."""
        many = getattr(self.reader, "read_many", None)
        if many is None:
            return None
        n = len(self.paths)
        return many([int(i) % n for i in indices])

    def checksum_problem(self, i: int, data: bytes) -> str | None:
        """Why `data` is not what the checksum manifest recorded for sample `i`, or None (also
        when there is no manifest or no record for it)."""
        return None if self.checksums is None else self.checksums.problem(int(i), data)

    def checksum_verdict(self, i: int, data: bytes) -> Verdict:
        """`checksum_problem`, and whether `data` is known intact: the recorded bytes of a file
        recorded as passing the strict full decode (what lets decoders read less than all of
        it: `DecodeRequest.intact`). Not intact without a manifest or a record for it."""
        return Verdict(None) if self.checksums is None else self.checksums.verdict(int(i), data)


def read_list_file(
    list_path: str | os.PathLike[str], *, allow_outside_root: bool = False
) -> tuple[list[str], np.ndarray]:
    """Parse a list file into absolute paths and labels; a bad line is an error naming it.

    Entries are confined to the list file's folder: an absolute path, or one that climbs out
    with ``..``, is an error unless ``allow_outside_root`` (a list file may come from
    elsewhere, and a server often runs as root: it must not read /etc/shadow because a line
    says so). Symlinks inside the folder are followed wherever they point: whoever placed them
    owns the dataset (symlink farms are a common way to build subsets).
    """
    list_path = Path(list_path).resolve()
    base = list_path.parent
    out_paths: list[str] = []
    out_labels: list[int] = []
    try:
        text = list_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{list_path}: list file is not UTF-8 text ({exc})") from None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        parsed = parse_list_line(raw, f"{list_path}:{lineno}")
        if parsed is None:
            continue
        p, label = parsed
        path = confined_path(base, p, allow_outside_root)
        if path is None:
            raise ValueError(
                f"{list_path}:{lineno}: {p!r} is outside the list file's folder {base} "
                "(absolute, or climbing out with '..'); move the list file next to the "
                "images, or allow it explicitly (pipeline-server --allow-outside-root, "
                "open_dataset(..., allow_outside_root=True))"
            )
        out_paths.append(path)
        out_labels.append(label)
    return out_paths, np.asarray(out_labels, dtype=np.int64)


def open_dataset(
    path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    allow_outside_root: bool = False,
    verify_checksums: str = "auto",
    checksum_dirs: Sequence[str | os.PathLike[str]] = (),
) -> ImageDataset:
    """Open an ImageFolder directory or a list file (see the module doc), or any other source
    kind `pipeline.sources` knows (tar shards, Parquet, CSV / JSON lines, URLs).

    `cache_dir` is where ImageFolder listings are cached (default `paths.cache_dir()`).
    `allow_outside_root`: a list file may name files outside its folder (see `read_list_file`).
    `verify_checksums`: "auto" checks files against a checksum manifest when one is found
    (beside the data, or in one of `checksum_dirs`: `pipeline.checksums`; for tar shards,
    Parquet and bucket datasets, per sample through the dataset's store), "on" requires one
    (`ChecksumManifestError`, a ValueError, without), "off" never checks.
    Raises FileNotFoundError for a missing path and ValueError for an empty or malformed one.
    """
    dataset = _open_listing(path, cache_dir, allow_outside_root)
    keys = getattr(dataset.reader, "sample_keys", None)  # tar members, Parquet rows, objects
    dataset.checksums = load_checksums(
        dataset.paths,
        dataset.root,
        dataset.kind,
        verify=verify_checksums,
        manifest_dirs=checksum_dirs,
        sample_keys=keys() if callable(keys) and verify_checksums != "off" else None,
    )
    return dataset


def _open_listing(
    path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None,
    allow_outside_root: bool,
) -> ImageDataset:
    """The dataset's files and labels (`open_dataset` without the checksums). Tar shards,
    Parquet, CSV / JSON-lines manifests and URLs are `pipeline.sources`' (it calls back here
    for the two kinds below)."""
    from batchwire.pipeline import sources  # lazy: sources build on this module

    if not sources.is_classic(path):
        from batchwire.pipeline.storage.listing import open_bucket_dataset

        in_bucket = open_bucket_dataset(path, cache_dir)  # an ImageFolder or list file there
        if in_bucket is not None:
            return in_bucket
        return sources.open_source(path, cache_dir, allow_outside_root=allow_outside_root)
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"dataset path does not exist: {p}")
    p = p.resolve()
    if p.is_dir():
        index, from_cache = cached_folder_index(p, cache_dir or _paths.cache_dir())
        if not index.classes:
            raise ValueError(
                f"no class folders in {p}: an ImageFolder dataset needs one sub-folder per class "
                "(or pass a list file)"
            )
        if not index.rel_paths:
            raise ValueError(
                f"no image files in {p} ({len(index.classes)} class folders; extensions looked "
                f"for: {', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
        root_s = str(p)
        sep = os.sep
        if sep != "/":
            abs_paths = [root_s + sep + r.replace("/", sep) for r in index.rel_paths]
        else:
            abs_paths = [root_s + sep + r for r in index.rel_paths]
        return ImageDataset(
            paths=abs_paths,
            labels=index.labels,
            classes=list(index.classes),
            root=p,
            kind="folder",
            from_cache=from_cache,
        )

    file_paths, labels = read_list_file(p, allow_outside_root=allow_outside_root)
    if not file_paths:
        raise ValueError(f"list file {p} names no images")
    num_classes = int(labels.max()) + 1
    return ImageDataset(
        paths=file_paths,
        labels=labels,
        classes=[str(c) for c in range(num_classes)],
        root=p,
        kind="list",
    )
