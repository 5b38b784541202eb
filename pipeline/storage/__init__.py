"""Where a dataset's bytes live: a folder on this host or a bucket of an object store.

One small interface, `Store`, for every source kind (ImageFolder trees, list files, manifests,
WebDataset tar shards, Parquet): sources name objects by keys relative to the store's root and
read whole objects or byte ranges of them, several at once where the store can coalesce them.
`LocalStore` reads a folder through `decode.files.read_file` (regular files only); object stores
(`s3://`, `gs://`, `az://`) are opened by `open_store`, which the object-store module registers.

Errors: an `OSError` whose errno is transient (`decode.files.is_transient`) says nothing about the
object (retried, never a bad sample); `FileNotFoundError` / `PermissionError` are the object's
(a counted, replaced bad sample).
"""

from batchwire.pipeline.storage.base import ObjectInfo, Store
from batchwire.pipeline.storage.local import LocalStore

__all__ = ["LocalStore", "ObjectInfo", "Store"]
