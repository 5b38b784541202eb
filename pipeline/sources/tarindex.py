"""One WebDataset shard's sample index: for each sample, its key, image member (offset, size,
extension) and label as written; built once from the tar headers and cached.

The WebDataset convention: a member `dir/KEY.EXT` belongs to sample `dir/KEY` (the key ends at
the first dot of the file name, the rest is the extension, lower-cased); a sample's members are
consecutive. Images are `.jpg`, `.jpeg`, `.png`, `.webp` (and `.bmp`, `.tif`, `.tiff`, which
the decoders read too); the label is `.cls` (an integer in
text) or `.json` with a `label` (or `cls`) entry: an integer or a class name.

Structural faults are found here, once, and the samples they spoil are skipped (the dataset's
length and indices stay stable, so batches stay a pure function of the seed and resume stays
exact): a member with no extension, a duplicate key (a sample's extension twice, or a key seen
before), a sample with no image or no label, an image over `MAX_MEMBER_BYTES`, a truncated or
damaged tar (the members before the damage are kept). Each is named in `problems` (the caller
logs them once and counts them). Bytes that are not an image are found at read time, as for
files: a bad sample, logged, counted, replaced.

Cache: `<cache_dir>/index/shards/<sha256(store display, key, version)[:32]>.npz`, beside the
folder listings of `index_cache`; the object's version (size and mtime, or the store's ETag) is
in the name, so a changed shard is re-indexed. Written atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from batchwire.pipeline.index_cache import pack_strings, read_npz, unpack_strings
from batchwire.pipeline.sources.labels import LabelError, parse_label
from batchwire.pipeline.sources.tarheaders import BLOCK, Listing, Member, ReadAt, list_members
from batchwire.pipeline.storage import LocalStore, ObjectInfo, Store

log = logging.getLogger("batchwire.pipeline")

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff")
LABEL_EXTS = ("cls", "json")
#: Largest image member served (a 64 MiB JPEG is not a photo anyone trains on at this scale).
MAX_MEMBER_BYTES = 64 << 20
MAX_LABEL_BYTES = 1 << 16
_FORMAT_VERSION = 1
_ENC, _ERRORS = "utf-8", "surrogateescape"
#: Read-ahead of the header scan: small on a local disk (headers and labels only), large on
#: an object store, where one request costs 10-50 ms and the shard is read through once.
LOCAL_BLOCK = 64 << 10
REMOTE_BLOCK = 16 << 20


@dataclass
class ShardIndex:
    """Samples of one shard; `label_text[i]` as written, `label_is_name[i]` when it is a class
    name; `problems`: what was skipped and why, one line each."""

    keys: list[str]
    exts: list[str]
    offsets: np.ndarray  # int64, of the image data in the shard
    sizes: np.ndarray  # int64
    label_text: list[str]
    label_is_name: np.ndarray  # bool
    problems: list[str]

    def __len__(self) -> int:
        return len(self.keys)


class _Blocks:
    """`read_at(offset, n)` over a store object through aligned read-ahead blocks."""

    def __init__(self, store: Store, key: str, size: int, block: int) -> None:
        self.store, self.key, self.size, self.block = store, key, size, block
        self._start, self._data = -1, b""

    def read_at(self, offset: int, n: int) -> bytes:
        end = min(offset + n, self.size)
        if offset >= end:
            return b""
        if self._start <= offset and end <= self._start + len(self._data):
            return self._data[offset - self._start : end - self._start]
        if n > self.block:  # a large label or header: read directly
            return self.store.read_ranges(self.key, [(offset, end)])[0]
        start = offset - offset % BLOCK
        self._start = start
        stop = min(start + self.block, self.size)
        self._data = self.store.read_ranges(self.key, [(start, stop)])[0]
        return self._data[offset - start : end - start]


def _split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) per the WebDataset convention, None when the file name has no dot."""
    folder, _, base = name.rpartition("/")
    dot = base.find(".")
    if dot <= 0:
        return None
    key = f"{folder}/{base[:dot]}" if folder else base[:dot]
    return key, base[dot + 1 :].lower()


def _label_of(ext: str, data: bytes, where: str) -> int | str:
    text = data.decode("utf-8", "replace")
    if ext == "cls":
        return parse_label(text, where)
    try:
        doc = json.loads(text)
    except ValueError:
        raise LabelError(f"{where}: not JSON") from None
    if not isinstance(doc, dict):
        raise LabelError(f"{where}: JSON is not an object")
    for name in ("label", "cls"):
        if name in doc:
            return parse_label(doc[name], where)
    raise LabelError(f"{where}: JSON has no 'label' entry")


def group_samples(listing: Listing, read_at: ReadAt, shard: str) -> ShardIndex:
    """Group members into samples (see the module doc); `read_at` reads label members."""
    problems: list[str] = []
    if listing.problem:
        problems.append(f"{shard}: {listing.problem}")
    groups: list[tuple[str, list[tuple[str, Member]]]] = []
    seen: set[str] = set()
    for m in listing.members:
        base = m.name.rpartition("/")[2]
        if base.startswith(".") or base.startswith("__"):
            continue  # hidden files (._x.jpg from macOS) and WebDataset's __meta__ files
        split = _split_name(m.name)
        if split is None:
            problems.append(f"{shard}: member {m.name!r} has no extension (skipped)")
            continue
        key, ext = split
        if groups and groups[-1][0] == key:
            groups[-1][1].append((ext, m))
            continue
        groups.append((key, [(ext, m)]))
    empty = np.zeros(0, np.int64)
    out = ShardIndex([], [], empty, empty, [], np.zeros(0, bool), problems)
    offsets: list[int] = []
    sizes: list[int] = []
    is_name: list[bool] = []
    for key, members in groups:
        where = f"{shard}:{key}"
        if key in seen:
            problems.append(f"{where}: duplicate key (members not consecutive; sample skipped)")
            continue
        seen.add(key)
        exts = [e for e, _ in members]
        doubled = sorted({e for e in exts if exts.count(e) > 1})
        if doubled:
            problems.append(f"{where}: duplicate key: .{doubled[0]} twice (sample skipped)")
            continue
        found = dict(members)
        image_ext = next((e for e in exts if e in IMAGE_EXTS), None)
        label_ext = next((e for e in LABEL_EXTS if e in found), None)
        if image_ext is None:
            problems.append(
                f"{where}: no image member ({', '.join('.' + e for e in exts)}; sample skipped)"
            )
            continue
        image = found[image_ext]
        if image.size > MAX_MEMBER_BYTES:
            problems.append(
                f"{where}.{image_ext}: {image.size} bytes, over the {MAX_MEMBER_BYTES} byte cap "
                "(sample skipped)"
            )
            continue
        if label_ext is None:
            problems.append(f"{where}: no .cls or .json label (sample skipped)")
            continue
        lm = found[label_ext]
        try:
            if lm.size > MAX_LABEL_BYTES:
                raise LabelError(f"{where}.{label_ext}: {lm.size} bytes, too large for a label")
            data = read_at(lm.offset, lm.size)
            if len(data) != lm.size:
                raise LabelError(f"{where}.{label_ext}: cut short")
            label = _label_of(label_ext, data, f"{where}.{label_ext}")
        except LabelError as exc:
            problems.append(f"{exc} (sample skipped)")
            continue
        out.keys.append(key)
        out.exts.append(image_ext)
        offsets.append(image.offset)
        sizes.append(image.size)
        out.label_text.append(str(label))
        is_name.append(isinstance(label, str))
    out.offsets = np.asarray(offsets, dtype=np.int64)
    out.sizes = np.asarray(sizes, dtype=np.int64)
    out.label_is_name = np.asarray(is_name, dtype=bool)
    return out


def build_index(store: Store, info: ObjectInfo, shard: str) -> ShardIndex:
    """Scan one shard's headers (and label members) into its index."""
    block = LOCAL_BLOCK if isinstance(store, LocalStore) else REMOTE_BLOCK
    reader = _Blocks(store, info.key, info.size, block)
    return group_samples(list_members(reader.read_at, info.size), reader.read_at, shard)


# --------------------------------------------------------------------------- cache


def index_file(cache_dir: str | os.PathLike[str], store: Store, info: ObjectInfo) -> Path:
    ident = "\0".join((str(_FORMAT_VERSION), store.display, info.key, info.version, str(info.size)))
    digest = hashlib.sha256(ident.encode(_ENC, _ERRORS)).hexdigest()[:32]
    return Path(cache_dir) / "index" / "shards" / f"{digest}.npz"


def save(path: Path, index: ShardIndex) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f,
                counts=np.array([len(index), len(index.problems)], dtype=np.int64),
                keys=pack_strings(index.keys),
                exts=pack_strings(index.exts),
                offsets=index.offsets,
                sizes=index.sizes,
                label_text=pack_strings(index.label_text),
                label_is_name=index.label_is_name,
                problems=pack_strings(index.problems),
            )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path) -> ShardIndex | None:
    try:
        z = read_npz(path)
        n, p = (int(v) for v in z["counts"])
        index = ShardIndex(
            keys=unpack_strings(z["keys"], n),
            exts=unpack_strings(z["exts"], n),
            offsets=z["offsets"],
            sizes=z["sizes"],
            label_text=unpack_strings(z["label_text"], n),
            label_is_name=z["label_is_name"],
            problems=unpack_strings(z["problems"], p),
        )
        if not (len(index.offsets) == len(index.sizes) == len(index.label_is_name) == n):
            raise ValueError("arrays of different lengths")
        return index
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        log.warning("ignoring unreadable shard index %s: %s", path, exc)
        return None


def cached_index(
    store: Store, info: ObjectInfo, shard: str, cache_dir: str | os.PathLike[str]
) -> tuple[ShardIndex, bool]:
    """The shard's index and whether it came from the cache (built and saved if not; a cache
    that cannot be written costs a warning)."""
    path = index_file(cache_dir, store, info)
    index = load(path)
    if index is not None:
        return index, True
    index = build_index(store, info, shard)
    try:
        save(path, index)
    except OSError as exc:
        log.warning("could not write the shard index %s: %s", path, exc)
    return index, False
