"""Sources: where sample i's bytes and label come from, picked by what the path or URL is.

One concept, one home. Every source opens as a `pipeline.image_dataset.ImageDataset` (sample
names, int64 labels, class names), so the sampler, checksums, the sample loader, the server and
`LocalLoader` work on any of them unchanged; the kinds differ only in how `read_bytes(i)` gets
the bytes (`ImageDataset.reader`) and are built on a `pipeline.storage.Store`, so each works the
same on a local disk and on an object store.

Kinds (`locate.locate` picks one from the extension, the first bytes, the first line):
- ImageFolder tree and list file (`folder.py`; the same in a bucket: `pipeline.storage.listing`,
  which `pipeline.dataset.open_dataset` asks first);
- CSV / JSON-lines manifest (`manifest.py`): path or URL and label (id or class name) per row;
- WebDataset tar shards (`tarshards.py`, `tarindex.py`, `tarheaders.py`): one shard, a brace
  pattern, a folder of shards, a list of them or a text file naming them; random access
  through a cached per-shard member index;
- Parquet in the Hugging Face datasets layout (`parquet.py`), read by row group.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from batchwire.pipeline import paths as _paths
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.pipeline.sources.folder import open_folder_or_list
from batchwire.pipeline.sources.locate import expand_braces, is_classic, locate

__all__ = ["expand_braces", "is_classic", "open_source", "source_kind"]

Spec = str | os.PathLike[str] | Sequence[str]


def source_kind(spec: Spec) -> str:
    """ "folder", "list", "csv", "jsonl", "tar" or "parquet" (FileNotFoundError if missing)."""
    if is_classic(spec):
        from pathlib import Path

        from batchwire.pipeline.sources.locate import local_kind

        p = Path(os.fspath(spec)).expanduser()  # type: ignore[arg-type]
        if not p.exists():
            raise FileNotFoundError(f"dataset path does not exist: {p}")
        return local_kind(p.resolve())
    return locate(spec).kind


def open_source(
    spec: Spec,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    allow_outside_root: bool = False,
) -> ImageDataset:
    """The samples of any source kind, without checksums (`pipeline.dataset.open_dataset` is
    this plus the checksum manifest). FileNotFoundError for a missing path; ValueError for an
    empty or malformed source, naming the file (and line)."""
    if is_classic(spec):
        return open_folder_or_list(spec, cache_dir, allow_outside_root)  # type: ignore[arg-type]
    located = locate(spec)
    if located.kind in ("csv", "jsonl", "namedlist"):
        from batchwire.pipeline.sources.manifest import open_manifest

        return open_manifest(located, allow_outside_root=allow_outside_root)
    if located.kind == "tar":
        from batchwire.pipeline.sources.tarshards import open_tar

        return open_tar(located, cache_dir or _paths.cache_dir())
    if located.kind == "parquet":
        from batchwire.pipeline.sources.parquet import open_parquet

        return open_parquet(located)
    raise ValueError(
        f"{located.display}: an ImageFolder or list file on an object store needs the "
        "object-store backend's folder source"
    )
