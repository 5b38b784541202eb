"""Pieces of the `path label` list-file syntax shared by every reader of it.

A local list file (`dataset.read_list_file`), a list file in a bucket
(`storage.listing.parse_list_text`) and a manifest (`sources.manifest`) must accept the same
lines and confine entries the same way; each reader keeps its own error type and wording.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Largest label id (4 M classes), for every source (`sources.labels` takes it from here:
#: `pipeline.sources` imports this module, not the other way). Ids index a list of class names
#: built from them (a list file's classes are the names "0" .. its largest label), so a stray
#: huge id must be an error naming its line, not millions of class names (or an OverflowError
#: naming nothing, beyond int64).
MAX_LABEL = (1 << 22) - 1


#: The first bytes of the image files a split's path may name by mistake (a single photo given
#: where a folder or a list file goes).
_IMAGE_MAGIC = {b"\xff\xd8\xff": "a JPEG image", b"\x89PNG\r\n\x1a\n": "a PNG image"}


def refuse_an_image(head: bytes, shown: str) -> None:
    """A ValueError naming ``shown`` when its first bytes are an image's: one photo given
    where a split's folder, list file or manifest goes."""
    what = next((name for magic, name in _IMAGE_MAGIC.items() if head.startswith(magic)), None)
    if what is not None:
        raise ValueError(
            f"{shown} is {what}, not a dataset: a split takes a folder (ImageFolder), a list "
            "file, a manifest, tar shards, Parquet or a bucket URL"
        )


def decode_list_text(data: bytes, shown: str) -> str:
    """A list file's bytes as text; a ValueError naming ``shown`` when they are not UTF-8
    (`refuse_an_image` first: a photo is not a list file with a bad byte). A leading byte-order
    mark (Windows editors save one) is dropped: it is not part of the first path."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        refuse_an_image(data, shown)
        raise ValueError(f"{shown}: list file is not UTF-8 text ({exc})") from None


def parse_list_line(
    raw: str, where: str, *, no_label: str = "no label field"
) -> tuple[str, int] | None:
    """One `path label` line -> (path, label), or None for a blank line or a `#` comment.

    The label is the last whitespace-separated field, so paths may contain spaces. `where`
    (`file:line`) starts the ValueError raised for a missing, non-integer or negative label;
    `no_label` is the note the missing-label error ends with.
    """
    line = raw.strip()
    if not line or line.startswith("#"):
        return None
    parts = line.rsplit(None, 1)
    if len(parts) != 2:
        raise ValueError(f"{where}: expected 'path label', got {raw!r} ({no_label})")
    rel, label_s = parts[0].strip(), parts[1]
    try:
        label = int(label_s)
    except ValueError:
        raise ValueError(f"{where}: label must be an integer, got {label_s!r} in {raw!r}") from None
    if label < 0:
        raise ValueError(f"{where}: label must be >= 0, got {label}")
    if label > MAX_LABEL:
        raise ValueError(f"{where}: label must be 0 to {MAX_LABEL}, got {label}")
    return rel, label


def confined_path(base: Path, entry: str, allow_outside_root: bool) -> str | None:
    """`entry` resolved against `base` (normalized), or None when it escapes `base`.

    An entry escapes when it is absolute or climbs out with '..'; `allow_outside_root`
    accepts both. Symlinks are not resolved: links inside the folder may point anywhere.
    """
    path = os.path.normpath(entry if os.path.isabs(entry) else os.path.join(base, entry))
    if not allow_outside_root and (
        os.path.isabs(entry) or os.path.commonpath([path, str(base)]) != str(base)
    ):
        return None
    return path
