"""Datasets in object storage: an ImageFolder under a prefix, or a list file in the bucket.

`open_store_dataset("s3://bucket/prefix")` gives the `ImageDataset` that `open_dataset` gives
for the same images in a local folder, sample for sample (same order, labels and class
names), so batches are identical whichever the images come from:

- a prefix is an ImageFolder: the first path component under it is the class (sorted names
  give the ids), image files (`IMAGE_EXTENSIONS`) anywhere below it are its samples, sorted by
  key; components starting with '.' are skipped, as the folder walk skips hidden entries;
- an object (`s3://bucket/data/train.txt`) is a list file: `key label` per line, keys
  relative to the list file's folder, the same syntax as a local list file. A key cannot
  climb out of that folder (`..`, or an absolute path).

Listing a bucket costs one request per 1,000 objects (ImageNet: 1,300 requests, a minute at
S3's list latency), so the listing of a prefix is cached like a folder's (`index_cache`), under
`<cache_dir>/index/store-<hash of URL and endpoint>.npz` with the object sizes and ETags, and
reused for `StoreOptions.listing_ttl_s` (default an hour; 0 lists every time). A bucket has no
directory mtimes to check, so a changed prefix is seen when the TTL runs out or with
`--listing-ttl 0`. Every server of a fleet must see the same listing (batches are a function
of the dataset's order): a list file pins it for good.

Open-time problems are errors naming the URL (no credentials) and what to do: the server
exits 2 with them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from batchwire.pipeline import paths as _paths
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.pipeline.index_cache import (
    IMAGE_EXTENSIONS,
    pack_strings,
    read_npz,
    unpack_strings,
)
from batchwire.pipeline.listfile import decode_list_text, parse_list_line
from batchwire.pipeline.storage.base import ObjectInfo, Store
from batchwire.pipeline.storage.errors import CredentialsError
from batchwire.pipeline.storage.options import StoreOptions, default_options
from batchwire.pipeline.storage.stores import open_store
from batchwire.pipeline.storage.urls import OBJECT_SCHEMES, StoreURL, is_url, parse_url

log = logging.getLogger("batchwire.pipeline")

_FORMAT_VERSION = 1
_ENC, _ERRORS = "utf-8", "surrogateescape"
LIST_FILE_MAX_BYTES = 1 << 30  # a list file of 10 M lines is ~500 MB


@dataclass
class StoreListing:
    """An ImageFolder under a prefix: `keys[i]` (relative to the prefix) has label `labels[i]`,
    the position of its class in `classes`; `versions[i]` is its ETag."""

    classes: list[str]
    keys: list[str]
    labels: np.ndarray
    versions: list[str]
    listed_at: float


def _hidden(key: str) -> bool:
    return any(part.startswith(".") for part in key.split("/"))


def listing_from_objects(objects: list[ObjectInfo]) -> StoreListing:
    """Classes and samples from a prefix's objects (sorted by key), as `scan_image_folder`
    finds them in a folder with the same files."""
    classes: set[str] = set()
    samples: dict[str, list[ObjectInfo]] = {}
    for obj in objects:
        if "/" not in obj.key or _hidden(obj.key):
            continue  # a file directly under the prefix is no class's
        cls = obj.key.split("/", 1)[0]
        classes.add(cls)  # a folder marker ("cls/") or any object makes the class exist
        if os.path.splitext(obj.key)[1].lower() in IMAGE_EXTENSIONS and not obj.key.endswith("/"):
            samples.setdefault(cls, []).append(obj)
    ordered = sorted(classes)
    keys: list[str] = []
    versions: list[str] = []
    counts: list[int] = []
    for cls in ordered:
        found = sorted(samples.get(cls, []), key=lambda o: o.key)
        keys.extend(o.key for o in found)
        versions.extend(o.version for o in found)
        counts.append(len(found))
    labels = np.repeat(np.arange(len(ordered), dtype=np.int64), np.asarray(counts, np.int64))
    return StoreListing(ordered, keys, labels, versions, time.time())


# -- the listing cache ----------------------------------------------------------------------


def listing_file(namespace: str, cache_dir: str | os.PathLike[str]) -> Path:
    key = hashlib.sha256(namespace.encode(_ENC, _ERRORS)).hexdigest()[:32]
    return Path(cache_dir) / "index" / f"store-{key}.npz"


def save_listing(listing: StoreListing, namespace: str, cache_dir: str | os.PathLike[str]) -> None:
    """Write atomically (temp file + rename); a failure costs a warning."""
    target = listing_file(namespace, cache_dir)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".tmp", dir=target.parent)
    except OSError as exc:
        log.warning("could not write the listing cache %s: %s", target, exc)
        return
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f,
                version=np.array([_FORMAT_VERSION], dtype=np.int64),
                namespace=pack_strings([namespace]),
                listed_at=np.array([listing.listed_at], dtype=np.float64),
                classes=pack_strings(listing.classes),
                num_classes=np.array([len(listing.classes)], dtype=np.int64),
                keys=pack_strings(listing.keys),
                versions=pack_strings(listing.versions),
                labels=listing.labels,
            )
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        log.warning("could not write the listing cache %s: %s", target, exc)


def load_listing(
    namespace: str, cache_dir: str | os.PathLike[str], ttl_s: float
) -> StoreListing | None:
    """The cached listing of `namespace` if one is younger than `ttl_s`."""
    if ttl_s <= 0:
        return None
    path = listing_file(namespace, cache_dir)
    try:
        z = read_npz(path)
        if int(z["version"][0]) != _FORMAT_VERSION:
            return None
        if unpack_strings(z["namespace"], 1)[0] != namespace:
            return None
        listed_at = float(z["listed_at"][0])
        if not 0 <= time.time() - listed_at < ttl_s:
            return None
        labels = z["labels"]
        return StoreListing(
            classes=unpack_strings(z["classes"], int(z["num_classes"][0])),
            keys=unpack_strings(z["keys"], len(labels)),
            labels=labels,
            versions=unpack_strings(z["versions"], len(labels)),
            listed_at=listed_at,
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        log.warning("ignoring unreadable listing cache %s: %s", path, exc)
        return None


# -- list files -----------------------------------------------------------------------------


def parse_list_text(text: str, where: str) -> tuple[list[str], np.ndarray]:
    """`key label` lines (blank lines and `#` comments skipped; the label is the last field,
    so keys may contain spaces) -> keys relative to the list file's folder, labels."""
    keys: list[str] = []
    labels: list[int] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        parsed = parse_list_line(raw, f"{where}:{lineno}", no_label="no label")
        if parsed is None:
            continue
        rel, label = parsed
        key = os.path.normpath(rel).replace(os.sep, "/") if rel else rel
        if rel.startswith("/") or key == ".." or key.startswith("../") or key in ("", "."):
            raise ValueError(
                f"{where}:{lineno}: {rel!r} is outside the list file's folder (absolute, or "
                "climbing out with '..'); keys are relative to the list file's folder"
            )
        keys.append(key)
        labels.append(label)
    return keys, np.asarray(labels, dtype=np.int64)


# -- opening --------------------------------------------------------------------------------


# What to set, by scheme: (its credentials, its address) as each client reads them.
_SETTINGS = {
    "s3": ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
           "AWS_ENDPOINT_URL and AWS_REGION; AWS_ALLOW_HTTP=true for a store over plain http"),
    "gs": ("GOOGLE_SERVICE_ACCOUNT (a key file's path) or GOOGLE_SERVICE_ACCOUNT_KEY",
           "GOOGLE_BASE_URL; GOOGLE_ALLOW_HTTP=true for an emulator over plain http"),
    "az": ("AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, a SAS or a token",
           "the account; AZURE_STORAGE_USE_EMULATOR=true and AZURITE_BLOB_STORAGE_URL for Azurite"),
}  # fmt: skip


def _settings(url: str) -> tuple[str, str]:
    scheme = url.partition("://")[0].lower()
    return _SETTINGS["az" if scheme in ("az", "abfs", "abfss", "azure") else
                     scheme if scheme in _SETTINGS else "s3"]  # fmt: skip


def _open_error(exc: OSError, url: str, doing: str) -> ValueError | OSError:
    """An open-time store error as a message saying what to do (the variables of its scheme)."""
    detail = getattr(exc, "store_detail", None) or exc.strerror or str(exc)
    credentials, address = _settings(url)
    if isinstance(exc, CredentialsError):
        return PermissionError(
            f"{url}: {doing}: no credentials found. Export {credentials}, or run where an "
            f"instance role provides them (the store's address: {address})"
        )
    if isinstance(exc, PermissionError):
        return PermissionError(
            f"{url}: {doing}: access denied ({detail}). Check the credentials ({credentials}) "
            "and that they may list and read this bucket and prefix"
        )
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(
            f"{url}: {doing}: not found ({detail}). Check the bucket name and the store's "
            f"address ({address})"
        )
    return OSError(
        exc.errno,
        f"{url}: {doing}: {detail}. Check the store's address ({address}) and that it is reachable",
    )


def open_store_listing(
    store: Store, cache_dir: str | os.PathLike[str] | None, ttl_s: float
) -> tuple[StoreListing, bool]:
    """The ImageFolder listing of `store`'s root and whether it came from the cache."""
    namespace = str(getattr(store, "namespace", store.display))
    if cache_dir is not None:
        cached = load_listing(namespace, cache_dir, ttl_s)
        if cached is not None:
            return cached, True
    try:
        objects = store.list()
    except OSError as exc:
        raise _open_error(exc, store.display, "cannot list the prefix") from None
    listing = listing_from_objects(objects)
    if cache_dir is not None and listing.keys:
        save_listing(listing, namespace, cache_dir)
    return listing, False


def _is_object(store: Store, name: str) -> bool:
    """Whether `name` is an object of `store` (a list file) rather than a prefix."""
    try:
        store.head(name)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        if isinstance(exc, PermissionError) and not isinstance(exc, CredentialsError):
            return False  # may list but not head: treat as a prefix, listing will tell
        raise _open_error(exc, f"{store.display}/{name}", "cannot look it up") from None


class ObjectReader:
    """`ImageDataset.reader` of a bucket dataset: `reader(i)` reads sample i's object,
    `reader.read_many(indices)` a batch's objects with many requests in flight (what
    `ImageDataset.read_many` and so the sample loader use)."""

    def __init__(self, store: Store, keys: list[str]) -> None:
        self.store = store
        self.keys = keys

    def __call__(self, i: int) -> bytes:
        return self.store.read(self.keys[i])

    def sample_keys(self) -> Any:  # pipeline.checksums.SampleKeys
        """Checksum-manifest names: the objects' keys (whole objects: no offsets)."""
        from batchwire.pipeline.checksums import SampleKeys

        n = len(self.keys)
        return SampleKeys(
            self.store, list(self.keys), np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        )

    def read_many(self, indices: Sequence[int]) -> list[bytes | OSError]:
        return self.store.read_many([self.keys[int(i)] for i in indices])


# Names that are another source kind's (`pipeline.sources`): shards, Parquet, manifests.
_OTHER_SUFFIXES = (".tar", ".parquet", ".pq", ".csv", ".tsv", ".jsonl", ".ndjson")


def open_bucket_dataset(
    spec: object,
    cache_dir: str | os.PathLike[str] | None = None,
    options: StoreOptions | None = None,
) -> ImageDataset | None:
    """`open_store_dataset` for a URL that is an ImageFolder prefix or a list file in a
    bucket; None for anything else (a local path, a brace pattern or list, a shard, Parquet
    or manifest URL, a prefix holding only shards or Parquet files: `pipeline.sources`).

    What `open_dataset` asks first for every source that is not a local folder or list
    file; it costs one listing request of the prefix's top level (plus one HEAD for a URL
    that may name a list file)."""
    if not (isinstance(spec, str) and is_url(spec)) or "{" in spec or "}" in spec:
        return None
    if spec.split("://", 1)[0].lower() not in OBJECT_SCHEMES:
        return None
    where = parse_url(spec)
    if where.prefix.rpartition("/")[2].lower().endswith(_OTHER_SUFFIXES):
        return None
    return open_store_dataset(spec, cache_dir, options, only_mine=True)


def open_store_dataset(
    url: str,
    cache_dir: str | os.PathLike[str] | None = None,
    options: StoreOptions | None = None,
    *,
    only_mine: bool = False,
) -> ImageDataset | None:
    """The `ImageDataset` of an ImageFolder under `url` or of the list file `url` names.

    `cache_dir` holds the cached listing (default `paths.cache_dir()`); `options` the store's
    read settings and the local object cache (default: the process's, `set_default_options`).
    Errors: ValueError (bad URL, malformed list file, no images) and OSError (store
    unreachable, no credentials, no bucket, access denied), each naming the URL and what to do.
    `only_mine`: return None for a prefix whose top level holds only tar shards or Parquet
    files (another source kind's)."""
    options = options or default_options()
    uncached = replace(options, cache_dir=None, cache_size=None)  # cached below, with versions
    where: StoreURL = parse_url(url)
    shown = where.root
    cache_dir = cache_dir if cache_dir is not None else _paths.cache_dir()
    kind = "folder"
    list_key = ""
    if where.prefix and not url.rstrip().endswith("/"):
        parent, name = where.parent()
        parent_store = open_store(parent.root, uncached)
        if _is_object(parent_store, name):
            kind, list_key, store = "list", name, parent_store
    if kind == "folder":
        store = open_store(shown, uncached)
        if only_mine and _holds_other_kind(store):
            return None
        listing, from_cache = open_store_listing(store, cache_dir, options.listing_ttl_s)
        if not listing.classes:
            raise ValueError(
                f"{shown}: no objects under this prefix (an ImageFolder needs "
                f"{shown}/CLASS/IMAGE.jpg; or name a list file: {shown}/train.txt). Check the "
                "prefix's spelling"
            )
        if not listing.keys:
            raise ValueError(
                f"no image files under {shown} ({len(listing.classes)} class prefixes; "
                f"extensions looked for: {', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
        keys, labels, classes = listing.keys, listing.labels, listing.classes
        versions = dict(zip(listing.keys, listing.versions, strict=True))
    else:
        try:
            text_bytes = store.read(list_key)
        except OSError as exc:
            raise _open_error(exc, shown, "cannot read the list file") from None
        if len(text_bytes) > LIST_FILE_MAX_BYTES:
            raise ValueError(f"{shown}: list file larger than {LIST_FILE_MAX_BYTES} bytes")
        text = decode_list_text(text_bytes, shown)
        keys, labels = parse_list_text(text, shown)
        if not keys:
            raise ValueError(f"list file {shown} names no images")
        classes = [str(c) for c in range(int(labels.max()) + 1)]
        versions, from_cache = {}, False
    store = _with_cache(store, options, versions)
    folder = store.display
    return ImageDataset(
        paths=[f"{folder}/{k}" for k in keys],
        labels=labels,
        classes=list(classes),
        root=shown,  # the URL as a string (a Path would show "s3:/b/p")
        kind=kind,
        from_cache=from_cache,
        reader=ObjectReader(store, list(keys)),
    )


def _holds_other_kind(store: Store) -> bool:
    """Whether the prefix's top level is only tar shards or Parquet files (no sub-prefix)."""
    list_top = getattr(store, "list_top", None)
    if list_top is None:
        return False
    try:
        prefixes, objects = list_top("")
    except OSError as exc:
        raise _open_error(exc, store.display, "cannot list the prefix") from None
    if prefixes:
        return False
    return any(o.key.lower().endswith(_OTHER_SUFFIXES[:3]) for o in objects)


def _with_cache(store: Store, options: StoreOptions, versions: dict[str, str]) -> Store:
    if options.cache_dir is None or options.cache_size is None:
        return store
    from batchwire.pipeline.storage.cache import CachedStore

    lookup = versions.get if versions else None
    return CachedStore(store, options.cache_dir, options.cache_size, versions=lookup)
