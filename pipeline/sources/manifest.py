"""CSV and JSON-lines manifests: one sample per row, its path (or URL) and its label.

CSV: a header row naming the columns (a path column: `path`, `file`, `filename`, `image`,
`image_path` or `url`; a label column: `label`, `class`, `cls`, `category` or `target`), or no
header and then `path,label` first; `.tsv` is tab-separated. JSON lines: one object per line
with the same keys. Other columns or keys are per-sample metadata (`metadata.py`: JSON-able
scalars, bounded, checked here at start; `ImageDataset.metadata`).

A label is an integer id or a class name (sorted names give ids, as an ImageFolder does:
`labels.LabelTable`), or a list of them (multi-label: a JSON array; in a CSV cell also names or
ids separated by `|`), which makes the dataset's labels an [N, K] table (`label_rows`).
Relative paths are relative to the manifest's folder (on an object store: keys beside it). A
row may not leave the manifest's own root unless `allow_outside_root` (pipeline-server
--allow-outside-root): a local manifest's rows stay in its folder (no absolute path, no '..'
out, no bucket URL), a bucket manifest's rows stay under its prefix (a URL there is a key of
it; another prefix or bucket is outside). A row read from elsewhere would be read with the
server's own credentials, which the manifest's author may not hold. A malformed row (a NUL in a
path among them) is an error naming the file and line.

Rows are kept compact (a million-row manifest is common): paths in one buffer
(`packed.PackedStrings`), labels in arrays (`labels.LabelTable`), metadata msgpacked in one
buffer, and the manifest read line by line from its bytes, never copied whole as text.
"""

from __future__ import annotations

import codecs
import csv
import json
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from batchwire.pipeline.image_dataset import ImageDataset, dataset_root
from batchwire.pipeline.listfile import confined_path
from batchwire.pipeline.sources.labels import LabelError, LabelTable, parse_labels
from batchwire.pipeline.sources.locate import Located, is_url
from batchwire.pipeline.sources.metadata import MetadataError, PackedMetadata, check_metadata
from batchwire.pipeline.sources.packed import PackedStrings
from batchwire.pipeline.storage import LocalStore, Store, redact_url

PATH_COLUMNS = ("path", "file", "filename", "image", "image_path", "url")
LABEL_COLUMNS = ("label", "class", "cls", "category", "target")
#: Largest manifest read (about 1 KB a row for 64 M rows: far beyond any image dataset's).
MAX_MANIFEST_BYTES = 1 << 30


class ManifestError(ValueError):
    """A manifest row that makes no sense; the message names the file and line."""


@dataclass(slots=True)
class _Row:
    line: int
    path: str
    label: object
    meta: dict[str, object] | None = None


def _pick(names: list[str], wanted: tuple[str, ...]) -> int | None:
    low = [n.strip().lower() for n in names]
    return next((low.index(w) for w in wanted if w in low), None)


def _check_header(row: list[str], columns: tuple[int, int], where: str) -> None:
    """ManifestError when the header names its path or label column twice: which one holds
    the label would be a guess."""
    low = [n.strip().lower() for n in row]
    for c in columns:
        if low.count(low[c]) > 1:
            raise ManifestError(f"{where}: header {row!r} names column {low[c]!r} twice")


def _check_width(row: list[str], width: int, whose: str, where: str) -> None:
    """ManifestError for a row with more (non-empty) fields than the header (or, without
    one, the first row): a path holding an unquoted comma splits into a path and a wrong
    label, whose real one would be dropped in silence. Empty trailing fields (some
    spreadsheet exports write them) are fine; `whose` says what `width` is."""
    if len(row) > width and any(field.strip() for field in row[width:]):
        raise ManifestError(
            f"{where}: {len(row)} fields, {whose} {width}: {row!r} (a comma in a path? quote "
            'the field: "a,b.jpg")'
        )


def _lines(data: bytes, where: str) -> Iterator[str]:
    """`data`'s lines (each with its newline), decoded one at a time: the whole manifest as
    one str (and `io.StringIO`'s copy of it, four bytes a character) is never made."""
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    end_of_data, lineno = len(data), 0
    while start < end_of_data:
        end = data.find(b"\n", start)
        end = end_of_data if end < 0 else end + 1
        lineno += 1
        try:
            yield data[start:end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError(f"{where}: not UTF-8 text (line {lineno}: {exc})") from None
        start = end


def _csv_rows(data: bytes, where: str, delimiter: str) -> Iterator[_Row]:
    reader = csv.reader(_lines(data, where), delimiter=delimiter)
    path_col, label_col, first = 0, 1, True
    names: list[str] = []
    extra: list[tuple[int, str]] = []  # metadata columns: (index, name)
    width: int | None = None  # fields a row may have (the header's, else the first row's)
    whose = ""
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
                    _check_header(row, (p, lab), f"{where}:{reader.line_num}")
                    path_col, label_col = p, lab
                    names = [n.strip() for n in row]
                    extra = [(c, n) for c, n in enumerate(names) if c not in (p, lab) and n]
                    width, whose = len(names), "the header has"
                    continue
            if len(row) <= max(path_col, label_col):
                raise ManifestError(
                    f"{where}:{reader.line_num}: expected a path and a label, got {row!r}"
                )
            if width is None:  # no header: the first row's fields are every row's
                width = max(c for c, field in enumerate(row) if field.strip()) + 1
                whose = "the first row has"
            _check_width(row, width, whose, f"{where}:{reader.line_num}")
            meta = {n: row[c] for c, n in extra if c < len(row)} if extra else None
            yield _Row(reader.line_num, row[path_col].strip(), row[label_col], meta or None)
    except csv.Error as exc:
        raise ManifestError(f"{where}:{reader.line_num}: not CSV ({exc})") from None


def _list_rows(data: bytes, where: str) -> Iterator[_Row]:
    """A list file's `path label` lines whose labels are class names (`namedlist`)."""
    for lineno, raw in enumerate(_lines(data, where), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2:
            raise ManifestError(f"{where}:{lineno}: expected 'path label', got {raw.rstrip()!r}")
        yield _Row(lineno, parts[0].strip(), parts[1])


def _jsonl_rows(data: bytes, where: str) -> Iterator[_Row]:
    for lineno, raw in enumerate(_lines(data, where), start=1):
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


class StoreReader:
    """`read(i)` for samples that are whole objects of stores (a bucket manifest's rows, URL
    rows): sample i is object `paths[i][cuts[s]:]` of store `s = store_of[i]` (each store's
    root is cut off the path shown), so the keys cost nothing beyond the paths."""

    def __init__(
        self, stores: list[Store], cuts: list[int], store_of: array, paths: Sequence[str]
    ) -> None:
        self.stores, self.cuts, self.store_of, self.paths = stores, cuts, store_of, paths

    def key(self, i: int) -> tuple[Store, str]:
        s = self.store_of[i]
        return self.stores[s], self.paths[i][self.cuts[s] :]

    def __call__(self, i: int) -> bytes:
        store, key = self.key(i)
        return store.read(key)

    def read_many(self, indices: Sequence[int]) -> list[bytes | OSError]:
        """Several samples, one `Store.read_many` per store (requests kept in flight)."""
        out: list[bytes | OSError] = [b""] * len(indices)
        by_store: dict[int, tuple[list[int], list[str]]] = {}
        for slot, i in enumerate(indices):
            s = self.store_of[i]
            slots, keys = by_store.setdefault(s, ([], []))
            slots.append(slot)
            keys.append(self.paths[i][self.cuts[s] :])
        for store, (slots, keys) in by_store.items():
            got = self.stores[store].read_many(keys)
            for slot, data in zip(slots, got, strict=True):
                out[slot] = data
        return out


def _bytes_of(located: Located) -> bytes:
    key = located.keys[0]
    info = located.store.head(key)
    if info.size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{located.name(key)}: {info.size} bytes, too large for a manifest")
    return located.store.read(key)


def _local_path(base: Path, entry: str, where: str, allow_outside_root: bool) -> str:
    path = confined_path(base, entry, allow_outside_root)
    if path is None:
        raise ManifestError(
            f"{where}: {entry!r} is outside the manifest's folder {base} (absolute, or "
            "climbing out with '..'); move the manifest next to the images, or allow it "
            "explicitly (pipeline-server --allow-outside-root)"
        )
    return path


def _url_root(url: str) -> tuple[str, str]:
    """(`scheme://bucket`, the key under it) of a URL row."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return f"{scheme}://{bucket}", key


class _Places:
    """Where each row's sample is: the manifest's own store (index 0; a local manifest's
    rows are files), or the bucket a URL row names (one store per `scheme://bucket`, only
    with `allow_outside_root`)."""

    def __init__(self, located: Located, allow_outside_root: bool) -> None:
        self.located = located
        self.allow = allow_outside_root
        self.local = isinstance(located.store, LocalStore)
        self.root = located.store.display.rstrip("/")  # the manifest's own root
        self.base = Path(located.store.display) if self.local else None
        self.folder = located.keys[0].rpartition("/")[0]
        own = located.name("x")[:-1]  # root + "/"
        self.paths = PackedStrings(own)
        self.store_of = array("i")
        self.stores: list[Store] = [located.store]
        self.cuts = [len(own)]
        self.by_root: dict[str, int] = {}
        self.first_key: dict[int, tuple[str, str]] = {}  # store -> (its first row's key, where)

    def add(self, entry: str, at: str) -> None:
        if is_url(entry):
            own = self._own_key(entry)
            if own is not None:
                self._add_own(own, entry, at)
            else:
                self._add_url(entry, at)
        elif self.local:
            assert self.base is not None
            self.paths.append(_local_path(self.base, entry, at, self.allow))
            self.store_of.append(0)
        else:
            self._add_own(entry, entry, at, in_folder=True)

    def _own_key(self, url: str) -> str | None:
        """The key of a URL row under a bucket manifest's own prefix, else None."""
        if self.local or not url.startswith(self.root + "/"):
            return None
        return url[len(self.root) + 1 :]

    def _add_own(self, key: str, entry: str, at: str, in_folder: bool = False) -> None:
        joined = f"{self.folder}/{key}" if in_folder and self.folder else key
        norm = os.path.normpath(joined)
        if norm == ".." or norm.startswith("../") or os.path.isabs(key) or norm == ".":
            raise ManifestError(
                f"{at}: {redact_url(entry)!r} climbs out of the manifest's prefix {self.root}"
            )
        self.paths.append(self.located.name(norm))
        self.store_of.append(0)

    def _add_url(self, url: str, at: str) -> None:
        if not self.allow:
            where = f"folder {self.root}" if self.local else f"prefix {self.root}"
            raise ManifestError(
                f"{at}: {redact_url(url)!r} is outside the manifest's {where} (another bucket "
                "or prefix, read with this server's credentials); put the manifest beside the "
                "images, or allow it explicitly (pipeline-server --allow-outside-root)"
            )
        root, key = _url_root(url)
        index = self.by_root.get(root)
        if index is None:
            index = len(self.stores)
            self.stores.append(_open_url_store(root))
            self.cuts.append(len(root) + 1)
            self.by_root[root] = index
            self.first_key[index] = (key, at)
        self.paths.append(url)
        self.store_of.append(index)

    def reader(self) -> StoreReader | None:
        """None for a local manifest of files only (read as files)."""
        if self.local and not self.by_root:
            return None
        if self.local:  # files beside URL rows: absolute paths, keys of the root folder
            self.stores[0] = LocalStore("/")
            self.cuts[0] = 1
        return StoreReader(self.stores, self.cuts, self.store_of, self.paths)

    def check_credentials(self) -> None:
        """Look up each URL row store's first object once: no credentials at all is a setup
        problem (exit 2 at start), not a failure retried at every read of the run. A missing
        or forbidden object is left to the reads (a bad sample)."""
        from batchwire.pipeline.storage.errors import CredentialsError
        from batchwire.pipeline.storage.listing import _open_error

        for index, (key, at) in self.first_key.items():
            store = self.stores[index]
            try:
                store.head(key)
            except CredentialsError as exc:
                raise _open_error(exc, f"{at}: {store.display}", "cannot read") from None
            except OSError:
                continue


def _open_url_store(root: str) -> Store:
    from batchwire.pipeline import storage

    open_store = getattr(storage, "open_store", None)
    if open_store is None:
        raise ManifestError(f"{root}: URLs need batchwire's object-store backend (open_store)")
    return open_store(root)


def _rows(located: Located, where: str) -> Iterator[_Row]:
    """The manifest's rows, parsed as they are read from its bytes."""
    data = _bytes_of(located)
    if located.kind == "jsonl":
        return _jsonl_rows(data, where)
    if located.kind == "namedlist":
        return _list_rows(data, where)
    return _csv_rows(data, where, "\t" if where.lower().endswith(".tsv") else ",")


def open_manifest(located: Located, *, allow_outside_root: bool = False) -> ImageDataset:
    """The samples a CSV / JSON-lines manifest names (see the module doc)."""
    where = located.name(located.keys[0])
    places = _Places(located, allow_outside_root)
    table = LabelTable()
    metadata = PackedMetadata()
    for row in _rows(located, where):
        at = f"{where}:{row.line}"
        if not row.path:
            raise ManifestError(f"{at}: empty path")
        if "\0" in row.path:
            raise ManifestError(f"{at}: the path holds a NUL byte ({redact_url(row.path)!r})")
        try:
            table.add(parse_labels(row.label, at), at)
            metadata.append(None if row.meta is None else check_metadata(row.meta, at))
        except (LabelError, MetadataError) as exc:
            raise ManifestError(str(exc)) from None
        places.add(row.path, at)
    if not len(places.paths):
        raise ManifestError(f"{where}: names no images")
    places.check_credentials()
    labels, label_rows, classes = table.resolve_rows()
    return ImageDataset(
        paths=places.paths,  # type: ignore[arg-type]  # a compact Sequence[str]
        labels=labels,
        classes=classes,
        root=dataset_root(where),
        kind="list" if located.kind == "namedlist" else located.kind,
        reader=places.reader(),
        label_rows=label_rows,
        metadata=metadata if metadata.any else None,
    )
