"""`open_store`: which `Store` a location is (a folder here, or a bucket, maybe cached).

Its own module, below the package's `__init__`, so that the modules building on stores
(`listing`, the sources) import it from here rather than from the package that imports them.
"""

from __future__ import annotations

import os

from batchwire.pipeline.storage.base import Store
from batchwire.pipeline.storage.local import LocalStore
from batchwire.pipeline.storage.options import StoreOptions, default_options
from batchwire.pipeline.storage.urls import is_url, parse_url

__all__ = ["open_store"]


def open_store(location: str | os.PathLike[str], options: StoreOptions | None = None) -> Store:
    """The store at `location`: `s3://bucket/prefix`, `gs://...`, `az://...` (an
    `ObjectStore`), `file:///path` or a plain path (a `LocalStore`). `options` default to the
    process's (`set_default_options`); with a cache directory and size in them, an object
    store's reads go through a `CachedStore`. ValueError for a URL that cannot be opened
    (unknown scheme, credentials in it)."""
    text = os.fspath(location)
    if not is_url(text):
        return LocalStore(text)
    if text.lower().startswith("file://"):
        return LocalStore(_file_url_path(text[len("file://") :]))
    parse_url(text)  # ValueError first, naming the problem
    from batchwire.pipeline.storage.objects import ObjectStore

    options = options or default_options()
    store: Store = ObjectStore(text, options)
    if options.cache_dir is not None and options.cache_size is not None:
        from batchwire.pipeline.storage.cache import CachedStore

        store = CachedStore(store, options.cache_dir, options.cache_size)
    return store


def _file_url_path(rest: str) -> str:
    """The path of a `file://` URL (what follows the scheme): `file:///data` and, as RFC 8089
    writes the same place, `file://localhost/data` are `/data`; anything else is taken as it is
    written (a relative `file://data` stays the relative path `data`, as it always has)."""
    if rest.lower().startswith("localhost/"):
        return rest[len("localhost") :]
    return rest
