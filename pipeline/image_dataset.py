"""`ImageDataset`: what every source kind opens as (sample names, int64 labels, class names, and
how sample i's bytes are read). Nothing here opens or decodes anything.

A plain record at the bottom of the dataset code: the sources (`pipeline.sources`), bucket
listings (`pipeline.storage.listing`) and `pipeline.dataset.open_dataset` all build it, and the
sampler, the sample loader, the server and `LocalLoader` read it, so it imports none of them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from batchwire.pipeline.checksums import Checksums, Verdict

__all__ = ["ImageDataset", "dataset_root"]

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

    @property
    def read_ahead_batches(self) -> int:
        """How many upcoming batches' samples `read_many` may read along (0: it reads none:
        local files, any source but tar shards in a bucket; `pipeline.storage.readahead`)."""
        return int(getattr(self.reader, "ahead_batches", 0))

    @property
    def read_ahead_bytes(self) -> int:
        """The most bytes of upcoming batches' samples the source holds (0 where it reads
        none ahead): what a server adds to its expected memory for this dataset."""
        return int(getattr(self.reader, "ahead_bytes", 0))

    def read_many(
        self,
        indices: Sequence[int],
        epoch: int | None = None,
        upcoming: Sequence[Sequence[int]] = (),
    ) -> list[bytes | OSError | None] | None:
        """The bytes of several samples read together (an object store keeps many requests
        in flight: `pipeline.storage`), a failed one as its OSError; None when the source
        reads one sample at a time (local files: the sample loader reads each on the
        decoder's threads), and a None entry for a sample to read alone (a mix's local
        part). A source offers it through `reader.read_many`. ``epoch`` and ``upcoming``
        (the samples of the epoch's next `read_ahead_batches` batches, batch by batch) let a
        source that reads ahead read them along and have them ready for their batch."""
        many = getattr(self.reader, "read_many", None)
        if many is None:
            return None
        n = len(self.paths)
        wanted = [int(i) % n for i in indices]
        if epoch is None or not self.read_ahead_batches:
            return many(wanted)
        return many(wanted, epoch, [[int(i) % n for i in batch] for batch in upcoming])

    def checksum_problem(self, i: int, data: bytes) -> str | None:
        """Why `data` is not what the checksum manifest recorded for sample `i`, or None (also
        when there is no manifest or no record for it)."""
        return None if self.checksums is None else self.checksums.problem(int(i), data)

    def checksum_verdict(self, i: int, data: bytes) -> Verdict:
        """`checksum_problem`, and whether `data` is known intact: the recorded bytes of a file
        recorded as passing the strict full decode (what lets decoders read less than all of
        it: `DecodeRequest.intact`). Not intact without a manifest or a record for it."""
        return Verdict(None) if self.checksums is None else self.checksums.verdict(int(i), data)
