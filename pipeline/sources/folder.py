"""The two classic sources, on a local disk: an ImageFolder directory and a list file.

- a directory is an ImageFolder: one sub-folder per class, sorted names give label ids, image
  files found recursively inside each class folder (listing cached, see `index_cache`);
- a file is a list file: `path label` per line, relative paths resolved against the list
  file's folder, blank lines and `#` comments ignored. The label is the last whitespace-separated
  field, so paths may contain spaces.

File contents are not checked here: a 1.3 M-file dataset must open in seconds, and unreadable
files (FIFOs and devices named in a list file included) are the sample loader's business
(logged, counted, replaced). The same two kinds in a bucket: `pipeline.storage.listing`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from batchwire.pipeline import paths as _paths
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.pipeline.index_cache import IMAGE_EXTENSIONS, cached_folder_index
from batchwire.pipeline.listfile import confined_path, decode_list_text, parse_list_line

__all__ = ["open_folder_or_list", "read_list_file"]


def read_list_file(
    list_path: str | os.PathLike[str], *, allow_outside_root: bool = False
) -> tuple[list[str], np.ndarray]:
    """Parse a list file into absolute paths and labels; a bad line is an error naming it.

    Entries are confined to the list file's folder: an absolute path, or one that climbs out
    with ``..``, is an error unless ``allow_outside_root`` (a list file may come from
    elsewhere, and a server often runs as root: it must not read /etc/shadow because a line
    says so). Symlinks inside the folder are followed wherever they point: whoever placed them
    owns the dataset (symlink farms are a common way to build subsets).
    """
    list_path = Path(list_path).resolve()
    base = list_path.parent
    out_paths: list[str] = []
    out_labels: list[int] = []
    text = decode_list_text(list_path.read_bytes(), str(list_path))
    for lineno, raw in enumerate(text.splitlines(), start=1):
        parsed = parse_list_line(raw, f"{list_path}:{lineno}")
        if parsed is None:
            continue
        p, label = parsed
        path = confined_path(base, p, allow_outside_root)
        if path is None:
            raise ValueError(
                f"{list_path}:{lineno}: {p!r} is outside the list file's folder {base} "
                "(absolute, or climbing out with '..'); move the list file next to the "
                "images, or allow it explicitly (pipeline-server --allow-outside-root, "
                "open_dataset(..., allow_outside_root=True))"
            )
        out_paths.append(path)
        out_labels.append(label)
    return out_paths, np.asarray(out_labels, dtype=np.int64)


def open_folder_or_list(
    path: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None,
    allow_outside_root: bool,
) -> ImageDataset:
    """The samples of a local ImageFolder directory or list file (see the module doc), without
    checksums. FileNotFoundError for a missing path, ValueError for an empty one."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"dataset path does not exist: {p}")
    p = p.resolve()
    if p.is_dir():
        index, from_cache = cached_folder_index(p, cache_dir or _paths.cache_dir())
        if not index.classes:
            raise ValueError(
                f"no class folders in {p}: an ImageFolder dataset needs one sub-folder per class "
                "(or pass a list file)"
            )
        if not index.rel_paths:
            raise ValueError(
                f"no image files in {p} ({len(index.classes)} class folders; extensions looked "
                f"for: {', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
        root_s = str(p)
        sep = os.sep
        if sep != "/":
            abs_paths = [root_s + sep + r.replace("/", sep) for r in index.rel_paths]
        else:
            abs_paths = [root_s + sep + r for r in index.rel_paths]
        return ImageDataset(
            paths=abs_paths,
            labels=index.labels,
            classes=list(index.classes),
            root=p,
            kind="folder",
            from_cache=from_cache,
        )

    file_paths, labels = read_list_file(p, allow_outside_root=allow_outside_root)
    if not file_paths:
        raise ValueError(f"list file {p} names no images")
    num_classes = int(labels.max()) + 1
    return ImageDataset(
        paths=file_paths,
        labels=labels,
        classes=[str(c) for c in range(num_classes)],
        root=p,
        kind="list",
    )
