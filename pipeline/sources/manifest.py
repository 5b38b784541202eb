"""CSV and JSON-lines manifests: one sample per row, its path (or URL) and its label.

CSV: a header row naming the columns (a path column: `path`, `file`, `filename`, `image`,
`image_path` or `url`; a label column: `label`, `class`, `cls`, `category` or `target`), or no
header and then `path,label` first; `.tsv` is tab-separated. JSON lines: one object per line
with the same keys. Other columns or keys are per-sample metadata (`metadata.py`: JSON-able
scalars, bounded, checked here at start; `ImageDataset.metadata`).

A label is an integer id or a class name (sorted names give ids, as an ImageFolder does:
`labels.LabelTable`), or a list of them (multi-label: a JSON array; in a CSV cell also names or
ids separated by `|`), which makes the dataset's labels an [N, K] table (`label_rows`).
Relative paths are relative to the manifest's folder (on an object store: keys beside it); as
in a list file, a local entry may not leave that folder unless `allow_outside_root`. A
malformed row is an error naming the file and line.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from batchwire.pipeline.dataset import ImageDataset, dataset_root
from batchwire.pipeline.listfile import confined_path
from batchwire.pipeline.sources.labels import LabelError, LabelTable, parse_labels
from batchwire.pipeline.sources.locate import Located, is_url
from batchwire.pipeline.sources.metadata import MetadataError, PackedMetadata, check_metadata
from batchwire.pipeline.storage import LocalStore, Store

PATH_COLUMNS = ("path", "file", "filename", "image", "image_path", "url")
LABEL_COLUMNS = ("label", "class", "cls", "category", "target")
#: Largest manifest read (about 1 KB a row for 64 M rows: far beyond any image dataset's).
MAX_MANIFEST_BYTES = 1 << 30


class ManifestError(ValueError):
    """A manifest row that makes no sense; the message names the file and line."""


@dataclass
class _Row:
    line: int
    path: str
    label: object
    meta: dict[str, object] | None = None


def _pick(names: list[str], wanted: tuple[str, ...]) -> int | None:
    low = [n.strip().lower() for n in names]
    return next((low.index(w) for w in wanted if w in low), None)


def _csv_rows(text: str, where: str, delimiter: str) -> Iterator[_Row]:
    reader = csv.reader(io.StringIO(text), delimiter=delimiter)
    path_col, label_col, first = 0, 1, True
    names: list[str] = []
    try:
        for row in reader:
            if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                continue
            if first:
                first = False
                p, lab = _pick(row, PATH_COLUMNS), _pick(row, LABEL_COLUMNS)
                if p is not None or lab is not None:
                    if p is None or lab is None:
                        raise ManifestError(
                            f"{where}:{reader.line_num}: header {row!r} needs a path column "
                            f"({', '.join(PATH_COLUMNS)}) and a label column "
                            f"({', '.join(LABEL_COLUMNS)})"
                        )
                    path_col, label_col = p, lab
                    names = [n.strip() for n in row]
                    continue
            if len(row) <= max(path_col, label_col):
                raise ManifestError(
                    f"{where}:{reader.line_num}: expected a path and a label, got {row!r}"
                )
            meta = {
                n: row[c]
                for c, n in enumerate(names[: len(row)])
                if c not in (path_col, label_col) and n
            }
            yield _Row(reader.line_num, row[path_col].strip(), row[label_col], meta or None)
    except csv.Error as exc:
        raise ManifestError(f"{where}:{reader.line_num}: not CSV ({exc})") from None


def _list_rows(text: str, where: str) -> Iterator[_Row]:
    """A list file's `path label` lines whose labels are class names (`namedlist`)."""
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2:
            raise ManifestError(f"{where}:{lineno}: expected 'path label', got {raw!r}")
        yield _Row(lineno, parts[0].strip(), parts[1])


def _jsonl_rows(text: str, where: str) -> Iterator[_Row]:
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise ManifestError(f"{where}:{lineno}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ManifestError(f"{where}:{lineno}: expected a JSON object, got {line[:80]!r}")
        keys = list(doc)
        p, lab = _pick(keys, PATH_COLUMNS), _pick(keys, LABEL_COLUMNS)
        if p is None or lab is None or not isinstance(doc[keys[p]], str):
            raise ManifestError(
                f"{where}:{lineno}: needs a path ({', '.join(PATH_COLUMNS)}) string and a "
                f"label ({', '.join(LABEL_COLUMNS)})"
            )
        meta = {k: v for k, v in doc.items() if k not in (keys[p], keys[lab])}
        yield _Row(lineno, doc[keys[p]].strip(), doc[keys[lab]], meta or None)


@dataclass
class StoreReader:
    """`read(i)` for samples that are whole objects of stores (URL entries)."""

    stores: list[Store]
    store_of: list[int]
    keys: list[str]

    def __call__(self, i: int) -> bytes:
        return self.stores[self.store_of[i]].read(self.keys[i])

    def read_many(self, indices: Sequence[int]) -> list[bytes | OSError]:
        """Several samples, one `Store.read_many` per store (requests kept in flight)."""
        out: list[bytes | OSError] = [b""] * len(indices)
        by_store: dict[int, list[int]] = {}
        for slot, i in enumerate(indices):
            by_store.setdefault(self.store_of[i], []).append(slot)
        for store, slots in by_store.items():
            got = self.stores[store].read_many([self.keys[indices[s]] for s in slots])
            for s, data in zip(slots, got, strict=True):
                out[s] = data
        return out


def _text_of(located: Located) -> str:
    key = located.keys[0]
    info = located.store.head(key)
    if info.size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{located.name(key)}: {info.size} bytes, too large for a manifest")
    data = located.store.read(key)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{located.name(key)}: not UTF-8 text ({exc})") from None


def _local_path(base: Path, entry: str, where: str, allow_outside_root: bool) -> str:
    path = confined_path(base, entry, allow_outside_root)
    if path is None:
        raise ManifestError(
            f"{where}: {entry!r} is outside the manifest's folder {base} (absolute, or "
            "climbing out with '..'); move the manifest next to the images, or allow it "
            "explicitly (pipeline-server --allow-outside-root)"
        )
    return path


def _url_store(url: str, cache: dict[str, Store]) -> tuple[Store, str]:
    from batchwire.pipeline import storage

    open_store = getattr(storage, "open_store", None)
    if open_store is None:
        raise ManifestError(f"{url}: URLs need batchwire's object-store backend (open_store)")
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    root = f"{scheme}://{bucket}"
    if root not in cache:
        cache[root] = open_store(root)
    return cache[root], key


def open_manifest(located: Located, *, allow_outside_root: bool = False) -> ImageDataset:
    """The samples a CSV / JSON-lines manifest names (see the module doc)."""
    where = located.name(located.keys[0])
    text = _text_of(located)
    if located.kind == "jsonl":
        rows = _jsonl_rows(text, where)
    elif located.kind == "namedlist":
        rows = _list_rows(text, where)
    else:
        rows = _csv_rows(text, where, "\t" if where.lower().endswith(".tsv") else ",")
    local = isinstance(located.store, LocalStore)
    base = Path(located.store.display) if local else None
    folder = located.keys[0].rpartition("/")[0]
    table = LabelTable()
    paths: list[str] = []
    stores: list[Store] = [located.store]
    store_index: dict[str, Store] = {}
    store_of: list[int] = []
    keys: list[str] = []
    metadata: list[dict[str, object] | None] = []
    for row in rows:
        at = f"{where}:{row.line}"
        if not row.path:
            raise ManifestError(f"{at}: empty path")
        try:
            table.add(parse_labels(row.label, at), at)
            metadata.append(None if row.meta is None else check_metadata(row.meta, at))
        except (LabelError, MetadataError) as exc:
            raise ManifestError(str(exc)) from None
        if is_url(row.path):
            store, key = _url_store(row.path, store_index)
            if store not in stores:
                stores.append(store)
            store_of.append(stores.index(store))
            keys.append(key)
            paths.append(row.path)
        elif local:
            assert base is not None
            path = _local_path(base, row.path, at, allow_outside_root)
            paths.append(path)
            store_of.append(-1)
            keys.append(path)
        else:
            key = os.path.normpath(f"{folder}/{row.path}" if folder else row.path)
            if key.startswith("..") or os.path.isabs(row.path):
                raise ManifestError(f"{at}: {row.path!r} climbs out of the manifest's prefix")
            store_of.append(0)
            keys.append(key)
            paths.append(located.name(key))
    if not paths:
        raise ManifestError(f"{where}: names no images")
    labels, label_rows, classes = table.resolve_rows()
    reader = None
    if any(s >= 0 for s in store_of):
        if any(s < 0 for s in store_of):
            stores.append(LocalStore("/"))  # local entries beside URL ones
            keys = [k.lstrip("/") if s < 0 else k for k, s in zip(keys, store_of, strict=True)]
            store_of = [len(stores) - 1 if s < 0 else s for s in store_of]
        reader = StoreReader(stores, store_of, keys)
    return ImageDataset(
        paths=paths,
        labels=labels,
        classes=classes,
        root=dataset_root(where),
        kind="list" if located.kind == "namedlist" else located.kind,
        reader=reader,
        label_rows=label_rows,
        metadata=PackedMetadata(metadata) if any(m is not None for m in metadata) else None,
    )
