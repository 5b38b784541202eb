"""Parquet in the Hugging Face `datasets` layout as a dataset, read by row group with pyarrow.

Layout: an image column of `{bytes: binary, path: string}` structs (the `Image` feature), an
integer label column (`label`, or the one the features call a `ClassLabel`), and the class
names in the schema's `huggingface` metadata (`info.features.<label>.names`) when present.

Access: Parquet cannot hand out one row's value; the smallest read is a column chunk of one
row group. Sample i therefore reads its row group's image column (only that column), and the
decoded row group is kept in a small LRU (`RowGroupCache`, bounded in bytes) because a batch in
a shuffled order hits random row groups and its neighbours in the same row group may come soon
after. The cost is read amplification: a shuffled epoch reads about (row group size) images'
bytes per image, unless the row groups fit the cache. `datasets` writes image row groups of 100
rows by default; for ImageNet-size data convert to tar shards (`pipeline-prepare --shards`),
whose per-sample ranged reads read nothing extra. Measured figures: docs/stores-and-shards.md,
"Parquet".

Bounds: a few hundred KB of zstd may declare gigabytes of zeros, and reading a row group
allocates all it declares. So the image column's declared size (`total_uncompressed_size` of
its column chunks, in the footer) is checked before anything is read: up to `SLICE_BYTES` a row
group is read whole; past it, in slices of rows of about `SLICE_BYTES` each (each slice cached
alone; a shuffled read decodes the row group up to its slice, a cost only such row groups pay);
past `MAX_ROW_GROUP_BYTES` it is not read at all (one slice might still hold most of what it
declares) and its samples are bad samples, named in a warning at open. An image over
`MAX_MEMBER_BYTES` is a bad sample too. All are counted and replaced, as a broken file is.
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from batchwire.pipeline.checksums import SampleKeys
from batchwire.pipeline.image_dataset import ImageDataset, dataset_root
from batchwire.pipeline.sources.labels import LabelTable
from batchwire.pipeline.sources.locate import Located
from batchwire.pipeline.sources.tarindex import MAX_MEMBER_BYTES
from batchwire.pipeline.storage import LocalStore, Store
from batchwire.pipeline.storage.cache import pin_versions

log = logging.getLogger("batchwire.pipeline")

#: Bytes of decoded row groups kept per dataset (a few hundred row groups of photos).
DEFAULT_CACHE_BYTES = 512 << 20
#: A row group whose image column declares up to this many bytes is read whole; larger ones in
#: slices of about this many bytes (module doc).
SLICE_BYTES = 64 << 20
#: A row group declaring more image bytes than this is never read: its samples are bad.
MAX_ROW_GROUP_BYTES = 1 << 30
_LABEL_NAMES = ("label", "labels", "cls", "class")
_IMAGE_NAMES = ("image", "img", "jpg", "png")


#: What pyarrow raises on a damaged file (fuzzed: undecodable names are UnicodeDecodeError).
_PARQUET_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, EOFError)


def _pyarrow() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            "reading Parquet needs pyarrow: pip install 'batchwire[parquet]'"
        ) from None
    return pq


class StoreFile(io.RawIOBase):
    """A read-only, seekable file over one store object (ranged reads), for pyarrow."""

    def __init__(self, store: Store, key: str, size: int) -> None:
        self.store, self.key, self.size, self.pos = store, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.size)[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.store.read_ranges(self.key, [(self.pos, self.pos + n)])[0]
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _source(store: Store, key: str, size: int) -> Any:
    if isinstance(store, LocalStore):
        return store.path(key)
    return StoreFile(store, key, size)


def _features(schema: Any) -> dict[str, Any]:
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return {}
    try:
        doc = json.loads(meta)
        features = doc.get("info", {}).get("features", {})
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def _is_binary(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t))


def _columns(
    schema: Any, features: dict[str, Any], where: str
) -> tuple[str, str, list[str] | None]:
    """(image column, label column, class names or None)."""
    import pyarrow as pa

    images = [
        f.name
        for f in schema
        if pa.types.is_struct(f.type)
        and {"bytes", "path"} <= {c.name for c in f.type}
        and _is_binary(f.type.field("bytes").type)
    ]
    if not images:
        raise ValueError(
            f"{where}: no image column (a struct of 'bytes' and 'path', as Hugging Face "
            "datasets writes its Image feature)"
        )
    image = next((n for n in _IMAGE_NAMES if n in images), images[0])
    ints = [f.name for f in schema if pa.types.is_integer(f.type)]
    class_label = [n for n in ints if isinstance(features.get(n), dict) and "names" in features[n]]
    label = next(iter(class_label), None) or next((n for n in _LABEL_NAMES if n in ints), None)
    if label is None:
        raise ValueError(f"{where}: no integer label column (looked for {', '.join(_LABEL_NAMES)})")
    names = features.get(label, {}).get("names") if isinstance(features.get(label), dict) else None
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        names = None
    return image, label, names


@dataclass
class RowGroupCache:
    """Decoded image columns of recent row groups, least recently used evicted past
    `max_bytes`; one loader per row group at a time (threads asking for one being loaded wait
    for it instead of reading it again)."""

    max_bytes: int = DEFAULT_CACHE_BYTES
    hits: int = 0
    misses: int = 0
    _items: OrderedDict = field(default_factory=OrderedDict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loading: dict = field(default_factory=dict)

    def get(self, key: tuple[int, ...], load: Any) -> Any:
        while True:
            with self._lock:
                if key in self._items:
                    self._items.move_to_end(key)
                    self.hits += 1
                    return self._items[key][0]
                event = self._loading.get(key)
                if event is None:
                    event = self._loading[key] = threading.Event()
                    self.misses += 1
                    break
            event.wait()
        try:
            value = load()
            size = int(value.nbytes)
            with self._lock:
                self._items[key] = (value, size)
                self._bytes += size
                while self._bytes > self.max_bytes and len(self._items) > 1:
                    _, (_, old) = self._items.popitem(last=False)
                    self._bytes -= old
            return value
        finally:
            with self._lock:
                self._loading.pop(key, None)
            event.set()


def declared_image_bytes(md: Any, rg: int, image: str) -> int:
    """What row group `rg` of a file's footer `md` says its image column holds, uncompressed
    (every leaf of the struct: bytes and path): what reading it whole would allocate."""
    group = md.row_group(rg)
    prefix = f"{image}."
    total = 0
    for j in range(group.num_columns):
        chunk = group.column(j)
        if chunk.path_in_schema == image or chunk.path_in_schema.startswith(prefix):
            total += max(0, int(chunk.total_uncompressed_size))
    return total


@dataclass
class _Slice:
    """Rows `start`.. of one row group's image column (a whole row group: `start` 0)."""

    start: int
    column: Any  # pyarrow Array or ChunkedArray of {bytes, path} structs

    @property
    def nbytes(self) -> int:
        return int(self.column.nbytes)


def _unreadable(exc: BaseException, message: str) -> OSError:
    """The OSError for a row group that could not be read: the store's own error keeps its
    class and errno (pyarrow hands back what the file object raised), so a store that timed
    out or restarted is a transient read (EIO: the batch is made again) and a forbidden
    object a denied one, never a bad sample for the wrong reason; anything else (damaged
    bytes) is the samples' (no errno: bad samples, replaced)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return type(exc)(exc.errno, message)
    return OSError(message)


@dataclass
class ParquetReader:
    """`read(i)` for an `ImageDataset`: sample i's image bytes from its row group (or the
    slice of it that holds row i: module doc, "Bounds")."""

    located: Located
    metadata: list[Any]  # FileMetaData per file
    sizes: list[int]
    image: str
    starts: list[int]  # first global row of each (file, row group), in order
    groups: list[tuple[int, int]]  # (file, row group) in that order
    total: int = 0  # rows in all
    declared: list[int] = field(default_factory=list)  # image bytes each group declares
    cache: RowGroupCache = field(default_factory=RowGroupCache)
    _local: threading.local = field(default_factory=threading.local)

    def _file(self, f: int) -> Any:
        """A ParquetFile per thread and file (pyarrow's readers are not shared across
        threads), opened from the footer read once at open."""
        handles = self._local.__dict__.setdefault("files", {})
        pf = handles.get(f)
        if pf is None:
            pq = _pyarrow()
            key = self.located.keys[f]
            pf = pq.ParquetFile(
                _source(self.located.store, key, self.sizes[f]), metadata=self.metadata[f]
            )
            handles[f] = pf
        return pf

    def _rows(self, g: int) -> int:
        end = self.starts[g + 1] if g + 1 < len(self.starts) else self.total
        return end - self.starts[g]

    def slice_rows(self, g: int) -> int:
        """Rows per slice of group `g`: all of them up to `SLICE_BYTES` declared, else about
        `SLICE_BYTES` worth (at least one row)."""
        rows, declared = self._rows(g), self.declared[g]
        if declared <= SLICE_BYTES:
            return max(1, rows)
        return max(1, SLICE_BYTES * rows // declared)

    def _image_slice(self, g: int, first: int, count: int) -> _Slice:
        """Rows first..first+count of group `g`'s image column; a row group pyarrow cannot
        read is an OSError (its samples are bad samples, replaced; a store's own error keeps
        its errno: `_unreadable`), never another exception that would fail a batch. The whole
        row group is read as it is (no combining copy); a slice is streamed (`iter_batches`),
        the rows before it decoded and dropped."""
        import pyarrow as pa

        f, rg = self.groups[g]
        try:
            pf = self._file(f)
            if count >= self._rows(g):
                column = pf.read_row_group(rg, columns=[self.image]).column(0)
                return _Slice(0, column.chunk(0) if column.num_chunks == 1 else column)
            at = 0
            for batch in pf.iter_batches(
                batch_size=count, row_groups=[rg], columns=[self.image], use_threads=False
            ):
                if at + batch.num_rows > first:
                    return _Slice(at, batch.column(0))
                at += batch.num_rows
            raise IndexError(f"row {first} not found")
        except (pa.ArrowException, *_PARQUET_ERRORS) as exc:
            name = self.located.name(self.located.keys[f])
            raise _unreadable(exc, f"{name}: row group {rg} unreadable ({exc})") from None

    def sample_keys(self) -> SampleKeys:
        """Checksum-manifest names ("FILE#ROW", ROW within its file) with each file's size
        (`pipeline.checksums`)."""
        keys: list[str] = []
        sizes: list[int] = []
        first: dict[int, int] = {}
        for g, (f, _rg) in enumerate(self.groups):
            first.setdefault(f, self.starts[g])
            end = self.starts[g + 1] if g + 1 < len(self.starts) else self.total
            base = first[f]
            keys.extend(f"{self.located.keys[f]}#{r - base}" for r in range(self.starts[g], end))
            sizes.extend([self.sizes[f]] * (end - self.starts[g]))
        n = len(keys)
        return SampleKeys(
            self.located.store, keys, np.asarray(sizes, np.int64), np.full(n, -1, np.int64)
        )

    def __call__(self, i: int) -> bytes:
        g = bisect.bisect_right(self.starts, i) - 1
        f, rg = self.groups[g]
        row = i - self.starts[g]
        where = f"{self.located.name(self.located.keys[f])}: row {row} of row group {rg}"
        if self.declared[g] > MAX_ROW_GROUP_BYTES:
            raise OSError(
                f"{where}: the row group declares {self.declared[g]} bytes of images, over the "
                f"{MAX_ROW_GROUP_BYTES} a row group may hold; not read"
            )
        per = self.slice_rows(g)
        first = row // per * per
        got = self.cache.get((f, rg, first), lambda: self._image_slice(g, first, per))
        if not 0 <= row - got.start < len(got.column):
            raise OSError(f"{where}: not in the slice read ({got.start}+{len(got.column)})")
        cell = got.column[row - got.start]
        if not cell.is_valid:
            raise FileNotFoundError(f"{where} has no image (a null image cell)")
        buf = cell["bytes"].as_buffer()
        if buf is None:
            raise FileNotFoundError(f"{where} has no image bytes (a path-only image)")
        if buf.size > MAX_MEMBER_BYTES:
            raise OSError(
                f"{where}: image of {buf.size} bytes, over the {MAX_MEMBER_BYTES} byte cap"
            )
        return buf.to_pybytes()


def open_parquet(located: Located) -> ImageDataset:
    """Every row of every Parquet file of `located`, in order (see the module doc)."""
    pq = _pyarrow()
    import pyarrow as pa

    if not located.keys:
        raise ValueError(f"{located.display}: no Parquet files")
    metadata: list[Any] = []
    sizes: list[int] = []
    starts: list[int] = []
    groups: list[tuple[int, int]] = []
    declared: list[int] = []
    table = LabelTable()
    image = label = None
    names: list[str] | None = None
    paths: list[str] = []
    versions: dict[str, str] = {}
    total = 0
    for f, key in enumerate(located.keys):
        where = located.name(key)
        info = located.store.head(key)
        versions[key] = info.version
        try:
            pf = pq.ParquetFile(_source(located.store, key, info.size))
            schema = pf.schema_arrow
            md = pf.metadata
            rows = [md.row_group(rg).num_rows for rg in range(md.num_row_groups)]
        except (pa.ArrowException, *_PARQUET_ERRORS) as exc:
            raise ValueError(f"{where}: not a readable Parquet file ({exc})") from None
        if sum(rows) != md.num_rows or not 0 <= md.num_rows <= info.size:
            raise ValueError(
                f"{where}: damaged metadata ({md.num_rows} rows claimed in {info.size} bytes, "
                f"{sum(rows)} in its row groups)"
            )
        if image is None:
            image, label, names = _columns(schema, _features(schema), where)
        elif image not in schema.names or label not in schema.names:
            raise ValueError(f"{where}: lacks the first file's columns {image!r}, {label!r}")
        try:
            labels = pf.read(columns=[label]).column(0).to_numpy(zero_copy_only=False)
        except (pa.ArrowException, *_PARQUET_ERRORS) as exc:
            raise ValueError(f"{where}: label column {label!r} unreadable ({exc})") from None
        if len(labels) != md.num_rows:
            raise ValueError(f"{where}: {len(labels)} labels for {md.num_rows} rows")
        if labels.dtype.kind not in "iu":
            raise ValueError(f"{where}: label column {label!r} has nulls or is not integer")
        table.extend_ints(labels, where)
        for rg in range(md.num_row_groups):
            starts.append(total)
            groups.append((f, rg))
            try:  # a damaged footer: a column path that is not UTF-8, a missing row group
                declared.append(declared_image_bytes(md, rg, image))
            except (UnicodeDecodeError, pa.ArrowException, *_PARQUET_ERRORS) as exc:
                raise ValueError(f"{where}: row group {rg}'s footer unreadable ({exc})") from None
            total += md.row_group(rg).num_rows
            if declared[-1] > MAX_ROW_GROUP_BYTES:
                log.warning(
                    "%s: row group %d declares %d bytes of images, over the %d a row group may "
                    "hold: its %d samples are bad samples (rewrite the file with smaller row "
                    "groups, or convert it: pipeline-prepare --shards)",
                    where,
                    rg,
                    declared[-1],
                    MAX_ROW_GROUP_BYTES,
                    md.row_group(rg).num_rows,
                )
        paths.extend(f"{where}#{r}" for r in range(md.num_rows))
        metadata.append(md)
        sizes.append(info.size)
    if total == 0:
        raise ValueError(f"{located.display}: no rows")
    pin_versions(located.store, versions)  # reads and cache entries keyed by them
    ids, classes = table.resolve(names)
    assert image is not None
    reader = ParquetReader(located, metadata, sizes, image, starts, groups, total, declared)
    return ImageDataset(
        paths=paths,
        labels=ids,
        classes=classes,
        root=dataset_root(located.name(located.keys[0])),
        kind="parquet",
        reader=reader,
    )
