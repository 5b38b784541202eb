"""Where a dataset's bytes live: a folder on this host or a bucket of an object store.

One small interface, `Store`, for every source kind (ImageFolder trees, list files, manifests,
WebDataset tar shards, Parquet): sources name objects by keys relative to the store's root and
read whole objects or byte ranges of them, several at once where the store can coalesce them,
and write whole objects atomically (`put`; `open_writer` streams a large one, visible only
once committed: `pipeline-prepare --shards` writes its shards so, to a folder or a bucket).
`LocalStore` reads a folder through `decode.files.read_file` (regular files only);
`ObjectStore` (objects.py, over obstore) reads `s3://`, `gs://` and `az://` buckets, and
`CachedStore` (cache.py) keeps what any store returned on local disk, bounded. `open_store`
(stores.py) picks by what it is given; `open_store_dataset` (listing.py) opens an ImageFolder
or list file held in a bucket as an `ImageDataset`.

Errors: an `OSError` whose errno is transient (`decode.files.is_transient`) says nothing about the
object (retried, never a bad sample); `FileNotFoundError` / `PermissionError` are the object's
(a counted, replaced bad sample). Messages never hold a credential (`urls.redact`).
"""

from __future__ import annotations

from batchwire.pipeline.storage.base import ObjectInfo, ObjectWriter, Store
from batchwire.pipeline.storage.listing import open_store_dataset
from batchwire.pipeline.storage.local import LocalStore
from batchwire.pipeline.storage.options import StoreOptions, default_options, set_default_options
from batchwire.pipeline.storage.stores import open_store
from batchwire.pipeline.storage.urls import is_url, parse_url, redact_url

__all__ = [
    "LocalStore",
    "ObjectInfo",
    "ObjectWriter",
    "Store",
    "StoreOptions",
    "default_options",
    "is_url",
    "open_store",
    "open_store_dataset",
    "parse_url",
    "redact_url",
    "set_default_options",
]
