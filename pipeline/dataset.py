"""`open_dataset`: any dataset path or URL to an `ImageDataset`, with its checksum manifest.

The one entry point above every source kind: an ImageFolder directory or a list file on this
host (`pipeline.sources.folder`), the same two in a bucket (`pipeline.storage.listing`), and
tar shards, Parquet and CSV / JSON-lines manifests (`pipeline.sources`), picked by what the path
is. `ImageDataset` itself, the record they all build, is `pipeline.image_dataset` (re-exported
here, as are `read_list_file` and `dataset_root`, where users have always imported them).

What is loaded here besides the samples is the checksum manifest, if the dataset has one
(`checksums`): the sample loader checks each file's bytes against it as it reads them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from batchwire.pipeline import sources
from batchwire.pipeline.checksums import load_checksums
from batchwire.pipeline.image_dataset import ImageDataset, dataset_root
from batchwire.pipeline.index_cache import IMAGE_EXTENSIONS
from batchwire.pipeline.sources.folder import read_list_file
from batchwire.pipeline.storage.listing import open_bucket_dataset

__all__ = ["IMAGE_EXTENSIONS", "ImageDataset", "dataset_root", "open_dataset", "read_list_file"]


def open_dataset(
    path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    allow_outside_root: bool = False,
    verify_checksums: str = "auto",
    checksum_dirs: Sequence[str | os.PathLike[str]] = (),
) -> ImageDataset:
    """Open an ImageFolder directory or a list file (`pipeline.sources.folder`), or any other
    source kind `pipeline.sources` knows (tar shards, Parquet, CSV / JSON lines, URLs).

    `cache_dir` is where ImageFolder listings are cached (default `paths.cache_dir()`).
    `allow_outside_root`: a list file may name files outside its folder (see `read_list_file`).
    `verify_checksums`: "auto" checks files against a checksum manifest when one is found
    (beside the data, or in one of `checksum_dirs`: `pipeline.checksums`; for tar shards,
    Parquet and bucket datasets, per sample through the dataset's store), "on" requires one
    (`ChecksumManifestError`, a ValueError, without), "off" never checks.
    Raises FileNotFoundError for a missing path and ValueError for an empty or malformed one.
    """
    dataset = _open_listing(path, cache_dir, allow_outside_root)
    keys = getattr(dataset.reader, "sample_keys", None)  # tar members, Parquet rows, objects
    dataset.checksums = load_checksums(
        dataset.paths,
        dataset.root,
        dataset.kind,
        verify=verify_checksums,
        manifest_dirs=checksum_dirs,
        sample_keys=keys() if callable(keys) and verify_checksums != "off" else None,
    )
    return dataset


def _open_listing(
    path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None,
    allow_outside_root: bool,
) -> ImageDataset:
    """The dataset's files and labels (`open_dataset` without the checksums): an ImageFolder or
    list file in a bucket, else whatever `pipeline.sources` finds (local folders and list files
    included)."""
    if not sources.is_classic(path):
        in_bucket = open_bucket_dataset(path, cache_dir)  # an ImageFolder or list file there
        if in_bucket is not None:
            return in_bucket
    return sources.open_source(path, cache_dir, allow_outside_root=allow_outside_root)
