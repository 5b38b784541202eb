"""Integrity checksums: the bytes a sample loader reads are the bytes that were recorded.

A bit flip in a JPEG's entropy data usually still decodes, to wrong pixels, and no decoder can
tell. `pipeline-prepare` therefore records a checksum of every file it writes in its manifest
(DST/.batchwire-prepare.jsonl), and `pipeline-prepare --checksums-only SRC` records one for
every file of a dataset it does not rewrite (SRC/.batchwire-prepare-checksums.jsonl, or a file
in a folder given). At dataset open the manifest becomes arrays aligned with the dataset's
indices (`Checksums`), and the sample loader checks each file's bytes right after reading them:
a mismatch makes the sample bad (logged, counted, replaced) like a corrupt file.

One checksum per file is enough: the loader always reads a whole file (`decode.read_file`)
before anything decodes it, even on the restart path that then decodes only a few intervals.
Each record also says whether the file was `intact` (passed the strict full decode) when it
was recorded; bytes that match such a record are known intact (`Verdict.intact`), which is what
lets decoders read less than the whole file (the restart path, the region path without its
tail check, GPU decodes without a CPU check): see the chain in `pipeline.decode.contract`.

The checksum is xxHash's XXH3 (64 bits): about 5 us for a 110 KB photo on this machine (22 GB/s,
0.5 % of a 1 ms decode), against 9 us for CRC-32C (google-crc32c) and 18 us for zlib's CRC-32.
It guards against accidents (bit rot, torn copies), not against an attacker who can write the
manifest too. It is stored as "xxh3_64:" and 16 hex digits.

Where a manifest is looked for (`checksum_manifest_paths`): in the dataset's folder (an
ImageFolder's root, a list file's folder), both names; and in each extra folder given, a file
named after the dataset (`keyed_name`). Where several apply, the newer manifest wins for a path
they share. A list file kept apart from its images (`pipeline-prepare SRC DST`, then a list
elsewhere naming DST's files) also reads the manifests of the folder all its files lie in
(`shared_folder`), their names relative to that folder; a record found beside the list wins
over one found there.
A manifest that cannot be read, or lines of it that make no sense, are never fatal with
`verify="auto"` (a warning, those lines skipped); with `verify="on"` no usable manifest at all
is an error (`ChecksumManifestError`).

Samples that are not whole files (`SampleKeys`, from the dataset's reader): a tar shard's
member is recorded as "SHARD:MEMBER" (`train-000003.tar:000000042.jpg`), a Parquet row as
"FILE#ROW" (`train-00000.parquet#17`), an object of a bucket ImageFolder or list file by its key;
SHARD and FILE are keys relative to the folder or prefix holding them, and the checksum is over
the image bytes as the reader returns them (the member's data, the row's `bytes`). The
manifests live in that folder or prefix (the same two names, read and written through the
dataset's `pipeline.storage.Store`, so `s3://` too) or in a `--checksum-dir` folder under
`keyed_name(folder)`. A record also keeps the size of the shard or file it was read from and
the member's offset: a shard rewritten since (another size, the member elsewhere) no longer
matches its records, which are then dropped (its samples read unchecked, logged once per
shard) rather than calling every sample of a re-made shard damaged. Damage in place (a flipped
bit, bytes overwritten) changes neither, so it is caught, which a version check (mtime, ETag:
changed by the damage too) could not do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

if TYPE_CHECKING:
    from batchwire.pipeline.storage.base import Store

log = logging.getLogger("batchwire.pipeline")

ALGORITHM = "xxh3_64"
PREPARE_MANIFEST = ".batchwire-prepare.jsonl"  # written by `pipeline-prepare SRC DST` in DST
CHECKSUMS_MANIFEST = ".batchwire-prepare-checksums.jsonl"  # by `--checksums-only`, beside SRC
KEYED_SUFFIX = ".batchwire-checksums.jsonl"  # by `--checksums-only --manifest-dir DIR`
VERIFY_MODES = ("auto", "on", "off")
# A manifest line is about 150 bytes; one far larger than the dataset could need is not read.
MAX_BYTES_PER_FILE = 4096
MAX_BYTES_FLOOR = 16 << 20
_HEX_DIGITS = 16


class ChecksumManifestError(ValueError):
    """`verify="on"` and no usable checksum manifest was found for the dataset."""


def checksum(data: bytes) -> str:
    """The manifest's text for `data`'s checksum: "xxh3_64:" and 16 lowercase hex digits."""
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(data)}"


def parse_checksum(text: object) -> int | None:
    """The 64-bit value of a manifest checksum, or None when it is not one we know."""
    if not isinstance(text, str):
        return None
    algorithm, _, digits = text.partition(":")
    if algorithm != ALGORITHM or len(digits) != _HEX_DIGITS:
        return None
    try:
        return int(digits, 16)
    except ValueError:
        return None


def dataset_folder(root: Path, kind: str) -> Path:
    """The folder a dataset's relative paths start from: the tree's root, the list's folder."""
    return root if kind == "folder" else root.parent


def keyed_name(dataset_path: str | os.PathLike[str]) -> str:
    """A manifest's name in a shared folder: the dataset's name and a hash of its absolute,
    resolved path (an ImageFolder root or a list file; a URL as it is written), so one folder
    holds many datasets'."""
    text = os.fspath(dataset_path)
    resolved = text.rstrip("/") if "://" in text else os.path.realpath(text)
    key = hashlib.sha256(resolved.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{resolved.rpartition('/')[2] or 'root'}-{key}{KEYED_SUFFIX}"


def checksum_manifest_paths(
    root: Path, kind: str, manifest_dirs: Sequence[str | os.PathLike[str]] = ()
) -> list[Path]:
    """Every manifest that exists for the dataset at `root`, oldest first (later ones win)."""
    return _existing(_looked_for(root, kind, manifest_dirs))


@dataclass(frozen=True)
class Entry:
    """One file's recorded size and checksum value, and whether the file passed the strict
    full decode when it was recorded (`"intact": true`; absent, as in older manifests: not
    known, so False). A sample inside a shard or Parquet file also records that object's size
    and the member's offset (-1: not recorded)."""

    size: int
    value: int
    intact: bool = False
    object_size: int = -1
    offset: int = -1


@dataclass(frozen=True)
class SampleKeys:
    """How a dataset whose samples are not local files names them in a manifest (the module
    doc): `keys[i]` is sample i's record path, `object_sizes[i]` the size now of the shard or
    file holding it and `offsets[i]` where in it (-1: a whole object). Manifests are looked for
    at `store`'s root (`display`: how it is shown)."""

    store: Store
    keys: list[str]
    object_sizes: np.ndarray  # int64
    offsets: np.ndarray  # int64


@dataclass(frozen=True)
class Verdict:
    """What the manifest says of bytes read for a file: `problem`, why they are not the
    recorded ones (None when they are, or nothing was recorded); `intact`, they are the
    recorded bytes of a file recorded as passing the strict full decode."""

    problem: str | None
    intact: bool = False


@dataclass
class ChecksumManifestRead:
    """What one manifest holds: path -> entry, and how many lines were skipped as senseless."""

    entries: dict[str, Entry]
    skipped: int = 0


def read_checksum_manifest(path: Path, max_bytes: int) -> ChecksumManifestRead:
    """The checksummed files of one manifest (JSON lines with "path", "bytes_out" or "size",
    and "checksum"; other lines ignored, as are records without a checksum). A later line
    for a path wins (the manifest is appended to as files finish). OSError when it cannot be
    read (`NotARegularFile` for a FIFO or device: never opened, so never blocking), ValueError
    when it is larger than `max_bytes`."""
    from batchwire.pipeline.decode.files import read_file  # keeps `dataset` import-light

    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"{size} bytes, more than {max_bytes} for this dataset")
    raw = read_file(path)
    if len(raw) > max_bytes:  # grew since
        raise ValueError(f"more than {max_bytes} bytes for this dataset")
    return parse_checksum_manifest(raw)


def parse_checksum_manifest(raw: bytes) -> ChecksumManifestRead:
    """`read_checksum_manifest` of bytes already read (a manifest in an object store)."""
    entries: dict[str, Entry] = {}
    skipped = 0
    for line in raw.decode("utf-8", "surrogateescape").splitlines():
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError:
            skipped += 1  # e.g. the last line of a killed run
            continue
        if not isinstance(data, dict) or "path" not in data or "checksum" not in data:
            continue  # a header, the `finished` line, a record from before checksums
        entry = _entry(data)
        if entry is None:
            skipped += 1
            continue
        entries[data["path"]] = entry
    return ChecksumManifestRead(entries, skipped)


def _entry(data: dict) -> Entry | None:
    """The entry a record gives, or None when it is not a well-formed checksummed record."""
    if not isinstance(data.get("path"), str):
        return None
    value = parse_checksum(data["checksum"])
    written = data.get("bytes_out", data.get("size"))
    if value is None or not _count(written):
        return None
    where = [data.get(name, -1) for name in ("object_size", "offset")]
    if not all(v == -1 or _count(v) for v in where):
        return None
    return Entry(written, value, data.get("intact") is True, int(where[0]), int(where[1]))


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Checksums:
    """Recorded sizes, checksums and intact verdicts aligned with a dataset's indices;
    `known[i]` False where the manifest has nothing for file i (it is then read unchecked)."""

    def __init__(
        self,
        sizes: np.ndarray,
        values: np.ndarray,
        manifests_read: list[str],
        intact: np.ndarray | None = None,
    ) -> None:
        self.sizes = sizes  # int64, -1 where unknown
        self.values = values  # uint64
        self.manifests_read = manifests_read  # the manifests read, for messages
        # bool: recorded as passing the strict full decode (False where unknown)
        self.intact = np.zeros(len(sizes), dtype=bool) if intact is None else intact

    @property
    def known(self) -> np.ndarray:
        return self.sizes >= 0

    @property
    def count(self) -> int:
        return int(self.known.sum())

    def over(self, other: Checksums) -> Checksums:
        """These records, and `other`'s for the files these have none for (same indices)."""
        take = ~self.known & other.known
        manifests_read = list(dict.fromkeys(self.manifests_read + other.manifests_read))
        return Checksums(
            np.where(take, other.sizes, self.sizes),
            np.where(take, other.values, self.values),
            manifests_read,
            np.where(take, other.intact, self.intact),
        )

    def problem(self, index: int, data: bytes) -> str | None:
        """Why `data` is not the recorded contents of file `index`, or None when it is (or
        nothing was recorded for it)."""
        return self.verdict(index, data).problem

    def verdict(self, index: int, data: bytes) -> Verdict:
        """`data` judged against file `index`'s record (one checksum computed)."""
        size = int(self.sizes[index])
        if size < 0:
            return Verdict(None)
        if len(data) != size:
            return Verdict(
                f"checksum mismatch: {len(data)} bytes read, {size} recorded in "
                f"{self._where()} (changed or damaged since it was recorded)"
            )
        if xxhash.xxh3_64_intdigest(data) != int(self.values[index]):
            return Verdict(
                f"checksum mismatch: its bytes differ from those recorded in {self._where()} "
                "(damaged since it was recorded)"
            )
        return Verdict(None, bool(self.intact[index]))

    def _where(self) -> str:
        return " and ".join(self.manifests_read)


def load_checksums(
    paths: Sequence[str],
    root: Path | str,
    kind: str,
    *,
    verify: str = "auto",
    manifest_dirs: Sequence[str | os.PathLike[str]] = (),
    sample_keys: SampleKeys | None = None,
) -> Checksums | None:
    """The checksums of the dataset whose absolute file paths are `paths` (see the module
    doc), or None when there are none to check (`verify` "off", or "auto" and none found).
    `sample_keys`: the dataset's samples are not local files (tar members, Parquet rows,
    objects): their manifests are found through its store (`load_sample_checksums`).
    Raises ChecksumManifestError for `verify="on"` without a usable manifest."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
    if verify == "off":
        return None
    if sample_keys is not None:
        return load_sample_checksums(sample_keys, verify=verify, manifest_dirs=manifest_dirs)
    if not isinstance(root, Path):  # a URL with no sample keys (a manifest naming URLs)
        if verify == "on":
            raise ChecksumManifestError(
                f"{root}: checksum manifests are not supported for this kind of dataset"
            )
        return None
    max_bytes = max(MAX_BYTES_FLOOR, MAX_BYTES_PER_FILE * len(paths))
    manifests_read: list[str] = []
    beside_data = data_manifest_folder(paths) if kind == "list" else None
    if beside_data == dataset_folder(root, kind):
        beside_data = None  # the list sits with its files: its folder is read below
    data_entries = (
        _read_checksum_manifests(
            _existing(_folder_checksum_manifests(beside_data)), max_bytes, manifests_read
        )
        if beside_data is not None
        else {}
    )
    if data_entries and not _aligned(paths, beside_data, data_entries, []).count:
        # Found up to MANIFEST_LEVELS_UP folders above the files, recording none of them: another
        # dataset's; --verify-checksums on must not pass on it with nothing checked.
        log.info("%s: records none of %s's files: not used", " and ".join(manifests_read), root)
        data_entries, manifests_read[:] = {}, []
    merged = _read_checksum_manifests(
        checksum_manifest_paths(root, kind, manifest_dirs), max_bytes, manifests_read
    )
    if not merged and not data_entries:
        if verify == "on":
            looked = _looked_for(root, kind, manifest_dirs)
            if beside_data is not None:
                looked = _folder_checksum_manifests(beside_data) + looked
            raise ChecksumManifestError(
                f"no usable checksum manifest for {root} (looked for "
                f"{', '.join(str(p) for p in looked)}); "
                "write one with `pipeline-prepare --checksums-only`"
            )
        return None
    checksums = _aligned(paths, dataset_folder(root, kind), merged, manifests_read)
    if data_entries:
        checksums = checksums.over(_aligned(paths, beside_data, data_entries, manifests_read))
    log.info(
        "%s: checking %d of %d files against the checksums in %s",
        root,
        checksums.count,
        len(paths),
        " and ".join(manifests_read),
    )
    if checksums.count < len(paths):
        log.info(
            "%s: %d files have no recorded checksum (added since the manifest was written?): "
            "read unchecked",
            root,
            len(paths) - checksums.count,
        )
    return checksums


def _aligned(
    paths: Sequence[str], folder: Path, entries: dict[str, Entry], manifests_read: list[str]
) -> Checksums:
    sizes = np.full(len(paths), -1, dtype=np.int64)
    values = np.zeros(len(paths), dtype=np.uint64)
    intact = np.zeros(len(paths), dtype=bool)
    prefix = str(folder) + os.sep
    for i, path in enumerate(paths):
        rel = path[len(prefix) :] if path.startswith(prefix) else os.path.relpath(path, folder)
        if os.sep != "/":
            rel = rel.replace(os.sep, "/")
        entry = entries.get(rel)
        if entry is not None:
            sizes[i] = entry.size
            values[i] = entry.value
            intact[i] = entry.intact
    return Checksums(sizes, values, manifests_read, intact)


def _looked_for(
    root: Path, kind: str, manifest_dirs: Sequence[str | os.PathLike[str]]
) -> list[Path]:
    return _folder_checksum_manifests(dataset_folder(root, kind)) + [
        Path(d).expanduser() / keyed_name(root) for d in manifest_dirs
    ]


def _folder_checksum_manifests(folder: Path) -> list[Path]:
    """The two manifests a folder of data may hold (pipeline-prepare's, --checksums-only's)."""
    return [folder / PREPARE_MANIFEST, folder / CHECKSUMS_MANIFEST]


def _existing(paths: list[Path]) -> list[Path]:
    """`paths` that exist, oldest first (a later one wins), as `checksum_manifest_paths`
    orders them."""
    found: list[tuple[int, Path]] = []
    for path in paths:
        try:
            found.append((path.stat().st_mtime_ns, path))
        except OSError:
            continue
    return [path for _, path in sorted(found, key=lambda f: f[0])]


def shared_folder(paths: Sequence[str]) -> Path | None:
    """The deepest folder every one of `paths` (absolute file paths) lies in, or None (no
    paths, or only the filesystem's root in common: no manifest is looked for there). The
    common prefix of the smallest and largest path is every path's, so this costs two passes
    over the names, not a split of each."""
    if not paths:
        return None
    # A string prefix, cut back to its last separator: a folder every path lies in.
    prefix = os.path.commonprefix([min(paths), max(paths)])  # noqa: RUF071
    folder = prefix[: prefix.rfind(os.sep)] if os.sep in prefix else ""
    if not folder or not os.path.isabs(folder):
        return None
    return Path(folder)


#: How far above a list's files `data_manifest_folder` looks for a manifest: DST/imgs/CLASS/...
#: sits two folders below a prepared list dataset's DST.
MANIFEST_LEVELS_UP = 3


def data_manifest_folder(paths: Sequence[str]) -> Path | None:
    """The folder whose manifests apply to a list's files: the deepest one holding a manifest
    among the folder they all lie in (`shared_folder`) and the folders above it, so that a list
    naming a prepared list dataset's DST/imgs/... finds DST's manifest; that folder itself when
    none holds one (None without a shared folder). The records' names are relative to it. At
    most `MANIFEST_LEVELS_UP` folders up: a manifest far above belongs to another dataset."""
    start = shared_folder(paths)
    folder = start
    for _ in range(MANIFEST_LEVELS_UP + 1):
        if folder is None:
            break
        if _existing(_folder_checksum_manifests(folder)):
            return folder
        folder = folder.parent if folder.parent != folder else None
    return start


def _read_checksum_manifests(
    paths: list[Path], max_bytes: int, manifests_read: list[str]
) -> dict[str, Entry]:
    """The records of the manifests at `paths`, a later one's over an earlier one's; each one
    that gave records is named in `manifests_read`, one that cannot be read is logged and
    skipped."""
    merged: dict[str, Entry] = {}
    for path in paths:
        try:
            got = read_checksum_manifest(path, max_bytes)
        except (OSError, ValueError) as exc:
            log.warning("checksum manifest %s not used: %s", path, _reason(exc))
            continue
        _merge_checksum_manifest(got, str(path), merged, manifests_read)
    return merged


def _merge_checksum_manifest(
    got: ChecksumManifestRead, shown: str, merged: dict[str, Entry], manifests_read: list[str]
) -> None:
    """Add one manifest's records (read from `shown`) to `merged`, over those of manifests
    read before it (a later manifest wins), and name it in `manifests_read` if it gave any; lines
    that are not checksummed records are logged. Shared by local datasets and samples read
    through a store, so both treat a manifest the same way."""
    if got.skipped:
        log.warning(
            "checksum manifest %s: %d lines that are not checksummed records skipped",
            shown,
            got.skipped,
        )
    if got.entries:
        merged.update(got.entries)
        manifests_read.append(shown)


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


# -- samples that are not local files (tar members, Parquet rows, objects) ----------------


def sample_checksum_manifests(
    sample_keys: SampleKeys, manifest_dirs: Sequence[str | os.PathLike[str]] = ()
) -> list[tuple[str, Store | None, str]]:
    """Where a manifest of these samples may be, in the order read (later ones win):
    (shown as, store or None for a local path, key or path)."""
    from batchwire.pipeline.storage.cache import uncached

    store = uncached(sample_keys.store)  # a manifest is read fresh, never from a local cache
    root = store.display.rstrip("/")
    out: list[tuple[str, Store | None, str]] = [
        (f"{root}/{name}", store, name) for name in (PREPARE_MANIFEST, CHECKSUMS_MANIFEST)
    ]
    for d in manifest_dirs:
        path = Path(d).expanduser() / keyed_name(root)
        out.append((str(path), None, str(path)))
    return out


def load_sample_checksums(
    sample_keys: SampleKeys,
    *,
    verify: str = "auto",
    manifest_dirs: Sequence[str | os.PathLike[str]] = (),
) -> Checksums | None:
    """`load_checksums` for samples named by `SampleKeys` (the module doc): manifests at the
    store's root (read through it: a bucket too) and in `manifest_dirs`; records of a shard or
    file whose size or member offset changed since are dropped (logged once per object)."""
    n = len(sample_keys.keys)
    max_bytes = max(MAX_BYTES_FLOOR, MAX_BYTES_PER_FILE * n)
    merged: dict[str, Entry] = {}
    manifests_read: list[str] = []
    for shown, store, key in sample_checksum_manifests(sample_keys, manifest_dirs):
        try:
            if store is None:
                got = read_checksum_manifest(Path(key), max_bytes)
            else:
                size = store.head(key).size
                if size > max_bytes:
                    raise ValueError(f"{size} bytes, more than {max_bytes} for this dataset")
                got = parse_checksum_manifest(store.read(key))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            log.warning("checksum manifest %s not used: %s", shown, _reason(exc))
            continue
        _merge_checksum_manifest(got, shown, merged, manifests_read)
    display = sample_keys.store.display
    if not merged:
        if verify == "on":
            looked = ", ".join(
                s for s, _, _ in sample_checksum_manifests(sample_keys, manifest_dirs)
            )
            raise ChecksumManifestError(
                f"no usable checksum manifest for {display} (looked for {looked}); write one "
                "with `pipeline-prepare --checksums-only`"
            )
        return None
    sizes = np.full(n, -1, dtype=np.int64)
    values = np.zeros(n, dtype=np.uint64)
    intact = np.zeros(n, dtype=bool)
    changed: dict[str, int] = {}
    for i, key in enumerate(sample_keys.keys):
        entry = merged.get(key)
        if entry is None:
            continue
        moved = (entry.object_size >= 0 and entry.object_size != sample_keys.object_sizes[i]) or (
            entry.offset >= 0 and entry.offset != sample_keys.offsets[i]
        )
        if moved:
            holder = key.rpartition(":")[0] or key.rpartition("#")[0] or key
            changed[holder] = changed.get(holder, 0) + 1
            continue
        sizes[i], values[i], intact[i] = entry.size, entry.value, entry.intact
    for holder, count in changed.items():
        log.warning(
            "%s/%s changed since its checksums were recorded (another size, or members "
            "moved): its %d recorded samples are read unchecked; rerun `pipeline-prepare "
            "--checksums-only` if it was rewritten on purpose",
            display.rstrip("/"),
            holder,
            count,
        )
    checksums = Checksums(sizes, values, manifests_read, intact)
    log.info(
        "%s: checking %d of %d samples against the checksums in %s",
        display,
        checksums.count,
        n,
        " and ".join(manifests_read),
    )
    return checksums
