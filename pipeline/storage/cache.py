"""`CachedStore`: a bounded local-disk cache in front of any `Store` (--cache-dir, --cache-size).

A dataset in a bucket is read once per epoch; from the second epoch on, objects (or byte ranges
of them) fetched before are served from local disk, so a store's latency and egress are paid
once. Bounded: the least recently used entries are deleted once the total passes `max_bytes`.

Entries. One file per object (or per range of an object), named by a hash of the store's
namespace (URL and endpoint), the key, the object's version when the dataset's listing knows it
(an ETag: a rewritten object is fetched again) and the range. The file is a 24-byte header
(magic, payload length, XXH3-64 of the payload) and the payload.

Crash safety. An entry is written to a temporary name in its folder and renamed into place, so
a reader never sees a partial file under an entry's name; and every read checks the length and
checksum (~5 us for a 110 KB photo), so even a file torn by a power loss after the rename
(nothing is fsynced: the cache is only a copy) is found, deleted and fetched again, never
served. Temporary files left by a crash are deleted at the next start (those older than a
minute: a second process may be writing its own).

The index (which entries exist, their sizes, the LRU order) lives in memory and is rebuilt from
the folder at start (ordered by mtime; a hit touches it), so it survives restarts and can never
disagree with the disk for long. Several processes may share a folder (entries are immutable
and renames atomic), but each bounds only what it knows of: give each server its own folder,
or size them together.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash
from batchwire.pipeline.storage.base import ObjectInfo, ObjectWriter, Store

log = logging.getLogger("batchwire.pipeline")

_MAGIC = b"BWC1"
_HEADER = struct.Struct("<4sxxxxQQ")  # magic, 4 pad bytes, payload length, xxh3_64
_TMP_SUFFIX = ".tmp"
_STALE_TMP_S = 60.0
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from `12345`, `500M`, `20G`, `1.5TiB` (binary units); ValueError otherwise."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (bytes, or a number with K, M, G or T)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class CachedStore:
    """`inner` with whole objects and ranges kept under `root`, at most `max_bytes` in all.

    `versions(key)` gives the version the dataset's listing recorded for a key (an ETag), or
    None: it becomes part of the entry's name. Counters (`counters()`): `hits`, `misses`,
    `evicted`, `corrupt` (entries found torn and fetched again), `bytes` held.
    Thread-safe: several producer threads read at once."""

    def __init__(
        self,
        inner: Store,
        root: str | os.PathLike[str],
        max_bytes: int,
        versions: Callable[[str], str | None] | None = None,
    ) -> None:
        if int(max_bytes) < 1:
            raise ValueError(f"cache size must be >= 1 byte, got {max_bytes}")
        self.inner = inner
        self.root = Path(root).expanduser()
        self.max_bytes = int(max_bytes)
        self._versions = versions
        self._namespace = str(getattr(inner, "namespace", inner.display))
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # name -> file size, LRU first
        self._total = 0
        self._counts = {"hits": 0, "misses": 0, "evicted": 0, "corrupt": 0}
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    def pin_versions(self, versions: dict[str, str]) -> None:
        """Key entries of these objects by the versions given (ETags or size and mtime, as
        the source read them at open), so an object rewritten since is fetched again rather
        than served from an older entry: what tar shards and Parquet files call once they
        have looked their objects up (`pin_versions`, the function, pins the store behind
        too). Merged with any lookup given at construction."""
        before = self._versions
        pinned = dict(versions)

        def lookup(key: str) -> str | None:
            got = pinned.get(key)
            return got if got is not None or before is None else before(key)

        self._versions = lookup

    # -- Store -------------------------------------------------------------------------------

    @property
    def display(self) -> str:
        return self.inner.display

    @property
    def namespace(self) -> str:
        return self._namespace

    def where(self, key: str) -> str:
        where = getattr(self.inner, "where", None)
        return where(key) if callable(where) else f"{self.display}/{key}"

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def head(self, key: str) -> ObjectInfo:
        return self.inner.head(key)

    def put(self, key: str, data: bytes) -> None:
        """Written through to the store, not kept: the cache holds what was read (an entry's
        name carries the object's version when known, so a rewritten object is fetched again)."""
        self.inner.put(key, data)

    def open_writer(self, key: str) -> ObjectWriter:
        return self.inner.open_writer(key)

    def read(self, key: str) -> bytes:
        name = self._name(key, None)
        data = self._get(name)
        if data is not None:
            return data
        data = self.inner.read(key)
        self._put(name, data)
        return data

    def read_many(self, keys: Sequence[str]) -> list[bytes | OSError]:
        out: list[bytes | OSError | None] = [None] * len(keys)
        names = [self._name(k, None) for k in keys]
        missing: list[int] = []
        for i, name in enumerate(names):
            data = self._get(name)
            if data is None:
                missing.append(i)
            else:
                out[i] = data
        if missing:
            fetched = self.inner.read_many([keys[i] for i in missing])
            for i, got in zip(missing, fetched, strict=True):
                out[i] = got
                if isinstance(got, bytes):
                    self._put(names[i], got)
        return [o for o in out if o is not None]

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        got = self.read_ranges_many([(key, ranges)])[0]
        if isinstance(got, OSError):
            raise got
        return got

    def read_ranges_many(
        self, requests: Sequence[tuple[str, Sequence[tuple[int, int]]]]
    ) -> list[list[bytes] | OSError]:
        """Each range is its own entry; an object's missing ranges are fetched together."""
        out: list[list[bytes] | OSError] = []
        todo: list[tuple[int, str, list[int], list[tuple[int, int]], list[str]]] = []
        for r, (key, ranges) in enumerate(requests):
            parts: list[bytes] = []
            miss_at: list[int] = []
            miss_ranges: list[tuple[int, int]] = []
            miss_names: list[str] = []
            for j, (start, end) in enumerate(ranges):
                name = self._name(key, (int(start), int(end)))
                data = self._get(name)
                parts.append(data if data is not None else b"")
                if data is None:
                    miss_at.append(j)
                    miss_ranges.append((int(start), int(end)))
                    miss_names.append(name)
            out.append(parts)
            if miss_at:
                todo.append((r, key, miss_at, miss_ranges, miss_names))
        if todo:
            fetched = self.inner.read_ranges_many([(t[1], t[3]) for t in todo])
            for (r, _key, miss_at, miss_ranges, miss_names), got in zip(todo, fetched, strict=True):
                if isinstance(got, OSError):
                    out[r] = got
                    continue
                parts = out[r]
                assert isinstance(parts, list)
                for j, (start, end), name, data in zip(
                    miss_at, miss_ranges, miss_names, got, strict=True
                ):
                    parts[j] = data
                    if len(data) == end - start:  # a short range (past the end) is not kept
                        self._put(name, data)
        return out

    # -- entries ------------------------------------------------------------------------------

    def _name(self, key: str, byte_range: tuple[int, int] | None) -> str:
        version = self._versions(key) if self._versions is not None else None
        parts = [
            self._namespace,
            key,
            version or "",
            "" if byte_range is None else repr(byte_range),
        ]
        return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:40]

    def _path(self, name: str) -> Path:
        return self.root / name[:2] / name

    def _get(self, name: str) -> bytes | None:
        with self._lock:
            if name not in self._entries:
                self._counts["misses"] += 1
                return None
            self._entries.move_to_end(name)
        path = self._path(name)
        data = _read_entry(path)
        if data is None:  # torn, or deleted under us (another process evicted it)
            self._drop(name, corrupt=path.exists())
            with self._lock:
                self._counts["misses"] += 1
            return None
        with self._lock:
            self._counts["hits"] += 1
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU order survives a restart
        return data

    def _put(self, name: str, data: bytes) -> None:
        size = _HEADER.size + len(data)
        if size > self.max_bytes:
            return
        path = self._path(name)
        tmp = path.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, len(data), xxhash.xxh3_64_intdigest(data)))
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:  # a full or read-only disk costs the cache, not the read
            log.warning("cache %s: cannot write an entry: %s", self.root, exc.strerror or exc)
            tmp.unlink(missing_ok=True)
            return
        victims: list[str] = []
        with self._lock:
            old = self._entries.pop(name, None)
            if old is not None:
                self._total -= old
            self._entries[name] = size
            self._total += size
            while self._total > self.max_bytes and self._entries:
                victim, vsize = self._entries.popitem(last=False)
                self._total -= vsize
                self._counts["evicted"] += 1
                victims.append(victim)
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)

    def _drop(self, name: str, corrupt: bool) -> None:
        with self._lock:
            size = self._entries.pop(name, None)
            if size is not None:
                self._total -= size
            if corrupt:
                self._counts["corrupt"] += 1
        if corrupt:
            log.warning("cache %s: entry %s is torn (a crash?): fetching it again", self.root, name)
            self._path(name).unlink(missing_ok=True)

    def _rebuild(self) -> None:
        """The index from the folder: entries by mtime (oldest first), stale temporaries gone,
        then evictions down to `max_bytes` (the size may have shrunk since the last run)."""
        now = time.time()
        found: list[tuple[float, str, int]] = []
        for sub in self.root.iterdir():
            if not (sub.is_dir() and len(sub.name) == 2):
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if entry.name.endswith(_TMP_SUFFIX):
                    if now - st.st_mtime > _STALE_TMP_S:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                if entry.is_file(follow_symlinks=False):
                    found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        with self._lock:
            for _mtime, name, size in found:
                self._entries[name] = size
                self._total += size
        victims: list[str] = []
        with self._lock:
            while self._total > self.max_bytes and self._entries:
                victim, vsize = self._entries.popitem(last=False)
                self._total -= vsize
                victims.append(victim)
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)
        if found:
            log.info(
                "cache %s: %d entries, %.1f MB of %.1f MB",
                self.root,
                len(self._entries),
                self._total / 1e6,
                self.max_bytes / 1e6,
            )

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "bytes": self._total, "entries": len(self._entries)}


def _read_entry(path: Path) -> bytes | None:
    """An entry's payload, or None when it is missing, torn or not an entry."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:
        return None
    if len(blob) < _HEADER.size:
        return None
    magic, length, digest = _HEADER.unpack_from(blob)
    data = blob[_HEADER.size :]
    if magic != _MAGIC or len(data) != length or xxhash.xxh3_64_intdigest(data) != digest:
        return None
    return data


def uncached(store: Store) -> Store:
    """The store under a `CachedStore` (`store` itself otherwise): for objects that must be
    read fresh every time, such as a checksum manifest rewritten in place."""
    return store.inner if isinstance(store, CachedStore) else store


def pin_versions(store: Store, versions: dict[str, str]) -> None:
    """Pin `versions` (each object's, as `head` said when a tar shard or Parquet file was
    indexed) at every layer of `store` that keeps them: a `CachedStore` names its entries by
    them, and the store that fetches (`ObjectStore`, `LocalStore`) checks each ranged read
    against them, so a range of a rewritten object is neither served nor cached under the old
    version's name."""
    for layer in dict.fromkeys((store, uncached(store))):
        pin = getattr(layer, "pin_versions", None)
        if callable(pin):
            pin(versions)
