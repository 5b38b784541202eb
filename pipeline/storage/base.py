"""The `Store` protocol: list, read and range-read objects under one root, and write whole
objects atomically (`put`, `open_writer`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its key (relative to the store's root, '/'-separated), size in bytes, and a
    version tag that changes when its contents do (an ETag, or size and mtime for a file), so
    an index built from it can be keyed to the contents it describes."""

    key: str
    size: int
    version: str


@runtime_checkable
class ObjectWriter(Protocol):
    """One object being written (`Store.open_writer`): `write` appends, `tell` is the bytes
    written so far, `commit` makes the object visible under its key whole, `abort` drops it.
    Nothing is visible under the key before `commit` returns (a local file is a hidden
    temporary renamed into place; an object store's upload completes at once or not at all), so
    a reader never sees a torn object. As a context manager: `abort` on an exception, and on
    a clean exit without `commit` (committing is always explicit)."""

    def write(self, data: bytes | memoryview) -> int: ...

    def tell(self) -> int: ...

    def commit(self) -> int:
        """Finish the object; returns its size. OSError when it could not be stored."""
        ...

    def abort(self) -> None: ...

    def __enter__(self) -> ObjectWriter: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@runtime_checkable
class Store(Protocol):
    """Objects under one root. Implementations are safe to call from several threads."""

    @property
    def display(self) -> str:
        """The root as a user may see it in logs and errors: never a credential."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key."""
        ...

    def head(self, key: str) -> ObjectInfo:
        """One object's info (`FileNotFoundError` if absent)."""
        ...

    def read(self, key: str) -> bytes:
        """The whole object."""
        ...

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Byte ranges [start, end) of one object, in the order given; one request where the
        store can coalesce them. A range past the object's end comes back short: callers that
        know what length to expect check it (a truncated tar member is a bad sample)."""
        ...

    def read_many(self, keys: Sequence[str]) -> list[bytes | OSError]:
        """Whole objects, concurrently where the store allows; a failed one is its error (the
        others are still returned), so one bad sample does not fail a batch."""
        ...

    def read_ranges_many(
        self, requests: Sequence[tuple[str, Sequence[tuple[int, int]]]]
    ) -> list[list[bytes] | OSError]:
        """`read_ranges` of several objects at once, e.g. the members of one batch spread over
        several tar shards or Parquet files: `(key, ranges)` per object, concurrently where the
        store allows (object stores: up to their concurrency in flight, each object's ranges
        coalesced); a failed object is its error, the others still returned."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Write a whole (small) object atomically, replacing any object under `key`."""
        ...

    def open_writer(self, key: str) -> ObjectWriter:
        """A streaming writer of one object (a tar shard of any size): see `ObjectWriter`.
        An object store uploads it in parts while it is written (memory stays bounded)."""
        ...
