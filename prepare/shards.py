"""`pipeline-prepare SRC DST --shards SIZE`: write a dataset as WebDataset tar shards.

Any source kind batchwire reads (ImageFolder, list file, CSV / JSON-lines manifest, tar shards,
Parquet: `pipeline.sources`) goes out as `DST/PREFIX-000000.tar`, `PREFIX-000001.tar`, ...,
one split per DST (a server serves a folder whole: a DST holding shards of another prefix is
refused, by the rule with which the server refuses such a folder, `pipeline.sources.shardsets`),
each at most SIZE bytes (a sample larger than SIZE gets a shard of its own). Sample i of SRC
is members `KEY.EXT` (its bytes exactly as read, EXT from its format: jpg, png, webp, ...) and
`KEY.cls` (its label id), KEY being i in 9 digits: the WebDataset convention, so the
`webdataset` library reads them, and batchwire serves them with the same indices, labels and
so the same batches as SRC. Class names, when SRC has names (folders, a manifest's names,
Parquet's ClassLabel), go in `DST/classes.txt`, one per line in id order: batchwire's tar
source reads it back.

DST is a folder or an object-store prefix (`s3://bucket/prefix`, credentials from the
environment as for reading): shards go out through `pipeline.storage` (`Store.open_writer`),
streamed (a multipart upload on a bucket, parts uploaded while the next are written).

Deterministic: samples in SRC's index order, every tar header fixed (mtime 0, uid/gid 0, mode
0444, ustar), so the same SRC gives the same bytes, in a folder or a bucket. A shard is visible
only when complete (a folder: a hidden temporary renamed into place; a bucket: the upload
completes at once or not at all), so DST never holds a torn shard under a final name. Bytes are not
rewritten (`pipeline-prepare SRC DST` first, then `--shards` on DST, gives shards of
restart-marked JPEGs). An unreadable sample is left out, counted and named (exit status 3),
and so is one whose bytes no longer match SRC's checksum manifest (damaged since recorded).

Checksums: every image member written is recorded in `DST/.batchwire-prepare-checksums.jsonl`
(`pipeline.checksums`: "SHARD:MEMBER", its size, XXH3-64, the shard's size and the member's
offset; records of other prefixes' shards already there are kept), so a server checks every
member it reads against the bytes written. A member is recorded `intact` when SRC's manifest
said so of its bytes (shards of a `pipeline-prepare`d tree keep the restart-interval crops);
`pipeline-prepare --checksums-only DST` judges them all afresh.
"""

from __future__ import annotations

import io
import re
import tarfile
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from batchwire.pipeline.checksums import CHECKSUMS_MANIFEST, checksum
from batchwire.pipeline.dataset import ImageDataset
from batchwire.pipeline.sources.shardsets import shard_sets, top_level_names
from batchwire.pipeline.storage import LocalStore, ObjectWriter, Store, StoreOptions, open_store
from batchwire.pipeline.storage.urls import is_url, redact_url
from batchwire.prepare.samplesums import previous_records, record_line, write_checksum_manifest
from batchwire.prepare.source import UsageError

CLASSES_NAME = "classes.txt"
KEY_DIGITS = 9
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1e3,
    "KB": 1e3,
    "M": 1e6,
    "MB": 1e6,
    "G": 1e9,
    "GB": 1e9,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
MIN_SHARD_BYTES = 64 << 10
_PREFIX = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def parse_size(text: str) -> int:
    """`1GB`, `500MB`, `64MiB`, `1e9` -> bytes (decimal units, as WebDataset's `maxsize`)."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise UsageError(f"--shards takes a size such as 1GB, 500MB or 64MiB, not {text!r}")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size < MIN_SHARD_BYTES:
        raise UsageError(f"--shards {text}: at least {MIN_SHARD_BYTES} bytes per shard")
    return size


def image_ext(data: bytes, name: str) -> str:
    """The member extension of an image's bytes: by its magic, else its name's extension."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:2] == b"BM":
        return "bmp"
    if data[:4] in (b"II*\0", b"MM\0*"):
        return "tiff"
    ext = name.rpartition(".")[2].lower()
    return ext if ext.isalnum() and ext != name.lower() else "jpg"


@dataclass
class ShardSummary:
    src: str
    dst: str
    samples: int = 0
    shards: list[str] = field(default_factory=list)
    bytes: int = 0
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_status(self) -> int:
        return 3 if self.unreadable else 0

    def text(self) -> str:
        lines = [
            f"pipeline-prepare --shards: {self.samples} samples from {self.src} in "
            f"{len(self.shards)} shards ({self.bytes / 1e6:.1f} MB) in {self.dst}, "
            f"{self.seconds:.1f} s"
        ]
        if self.shards:
            lines.append(f"  {self.shards[0]} .. {self.shards[-1]}")
        for name, why in self.unreadable[:20]:
            lines.append(f"  not written (unreadable): {name}: {why}")
        if len(self.unreadable) > 20:
            lines.append(f"  ... {len(self.unreadable) - 20} more unreadable samples")
        return "\n".join(lines)


def _member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


class _ShardWriter:
    """Size-bounded shards, each streamed to a `Store.open_writer` (visible when complete)."""

    def __init__(self, store: Store, prefix: str, max_bytes: int) -> None:
        self.store, self.prefix, self.max_bytes = store, prefix, max_bytes
        self.names: list[str] = []
        self._tar: tarfile.TarFile | None = None
        self._out: ObjectWriter | None = None
        self._size = 0
        self.total = 0
        # Checksum records of committed shards, as JSON lines on local disk (ImageNet: ~200
        # MB of them); those of the open shard wait for its size, known at commit.
        self.records: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (closed by the caller)
        self.recorded: set[str] = set()
        self._pending: list[dict] = []

    def add(self, key: str, members: list[tuple[str, bytes]], intact: bool = False) -> None:
        """Append one sample; its first member (the image) gets a checksum record."""
        need = sum(512 + (len(d) + 511) // 512 * 512 for _, d in members)
        if self._tar is not None and self._size + need + 1024 > self.max_bytes:
            self.close()
        if self._tar is None:
            name = f"{self.prefix}-{len(self.names):06d}.tar"
            self._out = self.store.open_writer(name)
            self._tar = tarfile.open(  # noqa: SIM115 (closed by close(), across add calls)
                fileobj=self._out, mode="w", format=tarfile.USTAR_FORMAT
            )
            self.names.append(name)
            self._size = 0
        for n, (ext, data) in enumerate(members):
            at = self._tar.offset + tarfile.BLOCKSIZE  # a ustar header is one block
            self._tar.addfile(*_member(f"{key}.{ext}", data))
            if n == 0:
                self._pending.append(
                    {
                        "path": f"{self.names[-1]}:{key}.{ext}",
                        "size": len(data),
                        "checksum": checksum(data),
                        "intact": intact,
                        "offset": at,
                    }
                )
        self._size += need

    def close(self, complete: bool = True) -> None:
        """Finish the open shard (committed under its final name), or drop it (`complete`
        False: the run failed part way, and a torn shard must not look like a whole one)."""
        if self._tar is None or self._out is None:
            return
        tar, out = self._tar, self._out
        self._tar, self._out = None, None
        pending, self._pending = self._pending, []
        try:
            if complete:
                tar.close()  # the end blocks, into the writer
                size = out.commit()
                self.total += size
                for r in pending:
                    self.records.write(record_line({**r, "object_size": size}))
                    self.recorded.add(r["path"])
        finally:
            if not complete:
                out.abort()
                self.names.pop()


def _reads(dataset: ImageDataset, jobs: int) -> Iterator[tuple[int, bytes | OSError]]:
    """Sample bytes in index order, read `jobs` at a time (bounded look-ahead)."""

    def read(i: int) -> bytes | OSError:
        try:
            return dataset.read_bytes(i)
        except OSError as exc:
            return exc

    window = max(1, jobs) * 4
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for start in range(0, len(dataset), window):
            idx = range(start, min(start + window, len(dataset)))
            yield from zip(idx, pool.map(read, idx), strict=True)


def write_shards(
    src: str,
    dst: str,
    max_bytes: int,
    *,
    prefix: str = "train",
    jobs: int = 8,
    allow_outside_root: bool = False,
    progress: TextIO | None = None,
) -> ShardSummary:
    """Write SRC as shards in the folder DST (see the module doc). UsageError when it cannot
    run (SRC unreadable as a dataset, DST holding shards of this or another prefix already)."""
    from batchwire.pipeline.dataset import open_dataset

    if not _PREFIX.match(prefix):
        raise UsageError(f"--shard-prefix {prefix!r}: letters, digits, '_', '-', '.' only")
    started = time.monotonic()
    try:
        # SRC's own checksums, when it has a manifest: damaged bytes are not copied on, and
        # the intact verdict of sound ones carries over to the members.
        dataset = open_dataset(src, allow_outside_root=allow_outside_root, verify_checksums="auto")
    except (OSError, ValueError) as exc:
        raise UsageError(f"SRC {redact_url(src)}: {exc}") from None
    store = _destination(dst)
    _check_destination(store, prefix)
    summary = ShardSummary(redact_url(src), store.display)
    writer = _ShardWriter(store, prefix, max_bytes)
    try:
        for i, got in _reads(dataset, jobs):
            if isinstance(got, OSError):
                summary.unreadable.append((dataset.paths[i], got.strerror or str(got)))
                continue
            verdict = dataset.checksum_verdict(i, got)
            if verdict.problem is not None:
                summary.unreadable.append((dataset.paths[i], verdict.problem))
                continue
            members = [
                (image_ext(got, dataset.paths[i]), got),
                ("cls", str(int(dataset.labels[i])).encode()),
            ]
            writer.add(f"{i:0{KEY_DIGITS}d}", members, verdict.intact)
            summary.samples += 1
            if progress is not None and summary.samples % 10000 == 0:
                print(f"{summary.samples} of {len(dataset)} samples", file=progress, flush=True)
    except BaseException:
        writer.close(complete=False)
        raise
    writer.close()
    if any(c != str(k) for k, c in enumerate(dataset.classes)):
        store.put(CLASSES_NAME, "".join(f"{c}\n" for c in dataset.classes).encode("utf-8"))
    try:
        _write_checksums(store, writer)
    finally:
        writer.records.close()
    summary.shards, summary.bytes = writer.names, writer.total
    summary.seconds = time.monotonic() - started
    return summary


def _destination(dst: str) -> Store:
    """DST's store: a folder (created) or an object-store prefix. UsageError for a URL that
    cannot be opened (credentials in it, an unknown scheme) or a folder that cannot be made."""
    if is_url(dst) and not dst.lower().startswith("file://"):
        try:
            # Plain reads and writes: no local cache in front of a destination.
            return open_store(dst, StoreOptions())
        except ValueError as exc:
            raise UsageError(f"DST {redact_url(dst)}: {exc}") from None
    path = Path(dst[len("file://") :] if dst.lower().startswith("file://") else dst)
    out = path.expanduser().resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"DST {out}: cannot create the folder: {exc.strerror or exc}") from None
    return LocalStore(out)


def _check_destination(store: Store, prefix: str) -> None:
    """UsageError, before anything is written, when DST cannot take shards of `prefix`: it
    cannot be listed (no credentials, no bucket, access denied), it holds shards of `prefix`
    already, or shards of another prefix: each split's shards go in a folder of their own (a
    folder is served whole, and pipeline-server refuses one holding two prefixes:
    `pipeline.sources.shardsets`, the same rule)."""
    try:
        tars = [n for n in top_level_names(store) if n.lower().endswith(".tar")]
    except OSError as exc:
        raise UsageError(f"DST {store.display}: cannot list it: {exc.strerror or exc}") from None
    mine = re.compile(rf"^{re.escape(prefix)}-[0-9]+\.tar$")
    existing = [n for n in tars if mine.match(n)]
    if existing:
        raise UsageError(
            f"DST {store.display} already holds {len(existing)} shards named "
            f"{prefix}-NNNNNN.tar: remove them or choose another DST or --shard-prefix"
        )
    first = f"{prefix}-{0:06d}.tar"
    others = [s for s in shard_sets([*tars, first]) if first not in s.names]
    if others:
        sibling = f"{store.display.rstrip('/').rpartition('/')[0]}/{prefix}"
        raise UsageError(
            f"DST {store.display} holds shards of another prefix "
            f"({'; '.join(s.describe() for s in others[:5])}): each split's shards go in a "
            "folder of their own (pipeline-server serves a folder whole, and refuses one "
            "holding two prefixes): write these to another DST"
            + (f", e.g. {sibling}" if sibling != store.display.rstrip("/") else "")
        )


def _write_checksums(store: Store, writer: _ShardWriter) -> None:
    """The members' records in DST's checksum manifest, after those already there for other
    shards (another prefix's), written atomically through the store."""
    try:
        old = store.read(CHECKSUMS_MANIFEST)
    except FileNotFoundError:
        old = b""
    kept = previous_records(old)
    for path in writer.recorded:
        kept.pop(path, None)
    write_checksum_manifest(store, CHECKSUMS_MANIFEST, "shards", kept.values(), writer.records)
