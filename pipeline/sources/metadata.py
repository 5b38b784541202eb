"""Per-sample metadata of a manifest: the columns (CSV) or keys (JSON lines) other than the
path and the label, passed through to the trainer (`RemoteLoader(..., with_metadata=True)`).

A sample's metadata is a flat map of string keys to JSON-able scalars (str, int, float, bool,
None: a CSV cell is the string written); nested values are refused. It travels msgpacked in the
batch header, so it is bounded: `MAX_SAMPLE_METADATA_BYTES` per sample, checked here when the
manifest is read (an error naming the file and line at start, never a silent truncation), and
`MAX_BATCH_METADATA_BYTES` per batch (`check_batch_metadata`, at the server's start).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence

import msgpack

#: Largest msgpacked metadata of one sample.
MAX_SAMPLE_METADATA_BYTES = 4096
#: Largest msgpacked metadata of one batch (a batch header must stay far below the wire's
#: 8 MiB frame limit, `wire.frames.MAX_SERVER_FRAME_BYTES`).
MAX_BATCH_METADATA_BYTES = 4 * 1024 * 1024
#: Longest metadata key, and most keys per sample.
MAX_KEY_LEN = 256
MAX_KEYS = 64

Scalar = str | int | float | bool | None


class MetadataError(ValueError):
    """Metadata that cannot travel; the message names where."""


def check_metadata(meta: dict[str, object], where: str) -> dict[str, Scalar]:
    """`meta` if every key is a short string and every value a JSON-able scalar, its msgpack
    within `MAX_SAMPLE_METADATA_BYTES`; a `MetadataError` naming `where` otherwise."""
    if len(meta) > MAX_KEYS:
        raise MetadataError(f"{where}: {len(meta)} metadata fields, more than {MAX_KEYS}")
    for key, value in meta.items():
        if not isinstance(key, str) or not key or len(key) > MAX_KEY_LEN:
            raise MetadataError(f"{where}: metadata key must be 1 to {MAX_KEY_LEN} characters")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise MetadataError(
                f"{where}: metadata {key!r} is a {type(value).__name__}; only strings, numbers, "
                "true/false and null travel (no nested values)"
            )
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not -(1 << 63) <= value < (1 << 64)
        ):
            raise MetadataError(f"{where}: metadata {key!r} is an integer beyond 64 bits")
        if isinstance(value, float) and not math.isfinite(value):
            raise MetadataError(f"{where}: metadata {key!r} is {value} (not finite JSON)")
    size = len(pack_metadata([meta]))
    if size > MAX_SAMPLE_METADATA_BYTES:
        raise MetadataError(
            f"{where}: metadata of {size} bytes, more than the {MAX_SAMPLE_METADATA_BYTES} a "
            "sample may carry"
        )
    return meta  # type: ignore[return-value]


def pack_metadata(rows: list[dict[str, Scalar] | None]) -> bytes:
    """A batch's metadata (None for a sample without) as msgpack."""
    return msgpack.packb(rows, use_bin_type=True)


def metadata_bytes(meta: dict[str, Scalar] | None) -> int:
    return len(pack_metadata([meta])) - 1  # less the array header of one


class PackedMetadata(Sequence):
    """A dataset's per-sample metadata kept msgpacked in one buffer with an end offset per
    sample (a dict per sample, or even a bytes object each, would cost a server holding a
    million-row manifest hundreds of MB for a column no trainer may ask for); `[i]` unpacks
    sample i's dict (None for a sample without: an empty slice, as msgpack never is)."""

    def __init__(self, rows: Iterable[dict[str, Scalar] | None] = ()) -> None:
        self._buf = bytearray()
        self._ends = array("q")
        for meta in rows:
            self.append(meta)

    def append(self, meta: dict[str, Scalar] | None) -> None:
        if meta is not None:
            self._buf += msgpack.packb(meta, use_bin_type=True)
        self._ends.append(len(self._buf))

    @property
    def any(self) -> bool:
        """Whether some sample has metadata."""
        return len(self._buf) > 0

    def __len__(self) -> int:
        return len(self._ends)

    def _raw(self, i: int) -> bytes | None:
        n = len(self._ends)
        if not -n <= int(i) < n:
            raise IndexError(f"metadata index {i} out of range for {n} samples")
        k = int(i) % n
        start = self._ends[k - 1] if k > 0 else 0
        return bytes(self._buf[start : self._ends[k]]) or None

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        raw = self._raw(i)
        return None if raw is None else msgpack.unpackb(raw, raw=False)

    def nbytes(self, i: int) -> int:
        """Sample i's msgpacked size (1 for None, as msgpack's nil)."""
        raw = self._raw(i)
        return 1 if raw is None else len(raw)


def batch_metadata(
    metadata: Sequence[dict[str, Scalar] | None] | None, indices: Sequence[int]
) -> list[dict[str, Scalar] | None]:
    """A batch's per-sample metadata by dataset index: None for a padding slot (a negative
    index) and for every slot of a dataset without metadata. The server's headers and
    `LocalLoader` both take it from here, so the two hand out the same lists."""
    return [None if metadata is None or i < 0 else metadata[int(i)] for i in indices]


def check_batch_metadata(
    metadata: Sequence[dict[str, Scalar] | None], batch_size: int, where: str
) -> None:
    """A `MetadataError` when the largest `batch_size` samples' metadata could pass
    `MAX_BATCH_METADATA_BYTES` (checked at start: any batch may hold them)."""
    if isinstance(metadata, PackedMetadata):
        every = (metadata.nbytes(i) for i in range(len(metadata)))
    else:
        every = (metadata_bytes(m) for m in metadata)
    sizes = sorted(every, reverse=True)[:batch_size]
    total = sum(sizes)
    if total > MAX_BATCH_METADATA_BYTES:
        raise MetadataError(
            f"{where}: a batch of {batch_size} could carry {total} bytes of metadata, more "
            f"than {MAX_BATCH_METADATA_BYTES}; drop metadata columns or use a smaller batch"
        )
