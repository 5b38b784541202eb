"""`pipeline-prepare --checksums-only SRC` for datasets whose samples are not local files: tar
shards, Parquet, and ImageFolders or list files in a bucket (local or `s3://...`).

Every sample is read as the server reads it (a tar member's data by its offset, a Parquet row's
image bytes, an object), checksummed (XXH3-64, `pipeline.checksums`) and judged by the strict
full decode (`intact`, as for files: `prepare.job`); the records, named per sample ("SHARD:
MEMBER", "FILE#ROW", the object's key, with the shard's size and the member's offset), go in
one manifest written atomically beside the data through the dataset's store (the folder or
prefix holding the shards: a bucket too) or, with `--manifest-dir DIR`, in DIR under
`pipeline.checksums.keyed_name` of that folder. Records of the same manifest for samples this
run does not name (the val shards beside the train shards) are kept.

Exit status: 0 every sample checksummed; 1 corrupt JPEGs found (listed, checksummed, not
intact); 2 the command cannot run (SRC unreadable as a dataset, --manifest-dir not usable);
3 some samples could not be read (listed; rerun to finish), or the manifest not written.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TextIO

from batchwire.pipeline.checksums import (
    CHECKSUMS_MANIFEST,
    MAX_BYTES_FLOOR,
    SampleKeys,
    checksum,
    keyed_name,
)
from batchwire.pipeline.dataset import ImageDataset
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS
from batchwire.pipeline.storage import LocalStore, Store
from batchwire.pipeline.storage.cache import uncached
from batchwire.pipeline.storage.urls import redact_url
from batchwire.prepare.checksum_manifest import CHECKSUMMED
from batchwire.prepare.job import _checksummed
from batchwire.prepare.source import UsageError

#: Samples read and judged per task (a task is one `read_many`: requests in flight together).
CHUNK = 32


@dataclass
class SampleSumsSummary:
    src: str
    manifest: str
    samples: int = 0
    intact: int = 0
    kept: int = 0  # records of other samples already in the manifest, kept
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_status(self) -> int:
        return 3 if self.unreadable else 1 if self.corrupt else 0

    def text(self) -> str:
        lines = [
            f"pipeline-prepare --checksums-only: {self.samples} samples of {self.src} "
            f"checksummed ({self.intact} intact JPEGs, {len(self.corrupt)} corrupt, "
            f"{len(self.unreadable)} unreadable) in {self.manifest}, {self.seconds:.1f} s"
        ]
        for what, items in (("corrupt", self.corrupt), ("unreadable", self.unreadable)):
            for name, why in items[:20]:
                lines.append(f"  {what}: {name}: {why}")
            if len(items) > 20:
                lines.append(f"  ... {len(items) - 20} more {what} samples")
        return "\n".join(lines)


def _records(
    dataset: ImageDataset, keys: SampleKeys, jobs: int, max_pixels: int | None
) -> Iterator[tuple[int, dict | OSError, str]]:
    """(index, record or read error, corrupt-JPEG reason) per sample, in index order."""

    def task(start: int) -> list[tuple[int, dict | OSError, str]]:
        idx = list(range(start, min(start + CHUNK, len(dataset))))
        got = dataset.read_many(idx)
        if got is None:
            got = []
            for i in idx:
                try:
                    got.append(dataset.read_bytes(i))
                except OSError as exc:
                    got.append(exc)
        out: list[tuple[int, dict | OSError, str]] = []
        for i, data in zip(idx, got, strict=True):
            if isinstance(data, OSError):
                out.append((i, data, ""))
                continue
            intact, error = _checksummed(data, max_pixels)
            record = {"path": keys.keys[i], "size": len(data), "checksum": checksum(data)}
            record.update(outcome=CHECKSUMMED, intact=intact)
            if keys.object_sizes[i] >= 0:
                record["object_size"] = int(keys.object_sizes[i])
            if keys.offsets[i] >= 0:
                record["offset"] = int(keys.offsets[i])
            out.append((i, record, error))
        return out

    with ThreadPoolExecutor(max(1, jobs), thread_name_prefix="batchwire-sums") as pool:
        starts = range(0, len(dataset), CHUNK)
        window = max(1, jobs) * 2
        for w in range(0, len(starts), window):
            for chunk in pool.map(task, starts[w : w + window]):
                yield from chunk


def record_line(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode(
        "utf-8", "surrogateescape"
    )


def write_checksum_manifest(
    store: Store, key: str, source: str, kept: Iterable[str], spool: IO[bytes]
) -> None:
    """A manifest at `key` of `store`, streamed and atomic (`Store.open_writer`): a header
    line, the `kept` lines of other samples, this run's records from `spool` (JSON lines on
    local disk), a `finished` line. OSError naming the manifest when it cannot be written."""
    with store.open_writer(key) as out:
        out.write(record_line({"source": source}))
        for line in kept:
            out.write(line.encode("utf-8", "surrogateescape") + b"\n")
        spool.seek(0)
        while chunk := spool.read(1 << 20):
            out.write(chunk)
        out.write(record_line({"finished": True}))
        out.commit()


def previous_records(text: bytes) -> dict[str, str]:
    """path -> line of an existing manifest's checksummed records (to keep others')."""
    out: dict[str, str] = {}
    for line in text.decode("utf-8", "surrogateescape").splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("path"), str) and "checksum" in data:
            out[data["path"]] = line
    return out


def checksum_samples(
    src: str,
    *,
    manifest_dir: str | None = None,
    jobs: int = 8,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    progress: TextIO | None = None,
    report: str | None = None,
) -> SampleSumsSummary:
    """Write the checksum manifest of SRC's samples (see the module doc); `report`: also the
    summary as JSON in that file."""
    from batchwire.pipeline.dataset import open_dataset

    started = time.monotonic()
    try:
        dataset = open_dataset(src, verify_checksums="off")
    except (OSError, ValueError) as exc:
        raise UsageError(f"SRC {redact_url(src)}: {exc}") from None
    make_keys = getattr(dataset.reader, "sample_keys", None)
    if not callable(make_keys):
        raise UsageError(
            f"SRC {redact_url(src)}: a {dataset.kind} dataset: --checksums-only takes an "
            "ImageFolder, a list file, tar shards or Parquet (local or in a bucket)"
        )
    keys: SampleKeys = make_keys()
    store = uncached(keys.store)
    folder = store.display.rstrip("/")
    if manifest_dir is None:
        target, shown = None, f"{folder}/{CHECKSUMS_MANIFEST}"
        try:
            old = store.read(CHECKSUMS_MANIFEST)
        except FileNotFoundError:
            old = b""
        except OSError as exc:
            raise UsageError(f"cannot read the manifest {shown}: {exc.strerror or exc}") from None
    else:
        place = Path(manifest_dir).expanduser().resolve()
        if isinstance(store, LocalStore) and place.is_relative_to(store.root):
            raise UsageError(
                f"--manifest-dir {place} is inside SRC's folder {store.root}: choose a folder "
                "outside it, or leave it out to write the manifest beside the data"
            )
        try:
            place.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create --manifest-dir {place}: {exc.strerror}") from None
        target = LocalStore(place)
        shown = str(place / keyed_name(folder))
        try:
            old = (place / keyed_name(folder)).read_bytes()
        except FileNotFoundError:
            old = b""
    kept = previous_records(old[: max(MAX_BYTES_FLOOR, 4096 * len(dataset))])
    summary = SampleSumsSummary(redact_url(src), shown)
    with tempfile.TemporaryFile() as spool:  # records on local disk, not in memory
        for i, got, error in _records(dataset, keys, jobs, max_pixels):
            if isinstance(got, OSError):
                summary.unreadable.append((dataset.paths[i], got.strerror or str(got)))
                continue
            kept.pop(got["path"], None)
            spool.write(record_line(got))
            summary.samples += 1
            summary.intact += bool(got["intact"])
            if error:
                summary.corrupt.append((dataset.paths[i], error))
            if progress is not None and summary.samples % 10000 == 0:
                print(f"{summary.samples} of {len(dataset)} samples", file=progress, flush=True)
        summary.kept = len(kept)
        source = f"{dataset.kind}:{folder}"
        if target is None:
            write_checksum_manifest(store, CHECKSUMS_MANIFEST, source, kept.values(), spool)
        else:
            write_checksum_manifest(target, keyed_name(folder), source, kept.values(), spool)
    summary.seconds = time.monotonic() - started
    if report is not None:
        doc = {**asdict(summary), "exit_status": summary.exit_status}
        try:
            Path(report).expanduser().write_text(json.dumps(doc, indent=1) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write --report {report}: {exc.strerror or exc}") from None
    return summary


__all__ = ["SampleSumsSummary", "checksum_samples"]
