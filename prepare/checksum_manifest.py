"""What earlier runs finished, so that a rerun skips it: DST/.batchwire-prepare.jsonl.

One JSON line per finished file (its relative path, the source's size and mtime_ns when it was
read, the outcome, bytes in and out, the restart interval, the error if any, the checksum of the
bytes written: `pipeline.checksums`, which the server checks every read against, and `intact`:
whether those bytes pass the strict full decode, which lets the server's decoders read less
than the whole file; see `pipeline.decode.contract`),
appended and flushed as each file finishes, so a run killed at any point loses at most the
files in flight. Each run first appends a header line naming its source ("tree", or "list:"
and the list file's name) and the folders it mirrors: what a later run needs to remove what
this one wrote once SRC no longer has it (`prepare.mirror`).
A line cut short by the kill is ignored on reading, and a newline is added before appending.
A completed run rewrites the manifest compactly (one line per file of the current source) and
ends it with a `finished` line; a manifest that does not end so tells the next run that
temporaries may be lying in DST, and only then is DST walked to remove them.

`pipeline-prepare --checksums-only` keeps the same kind of manifest (outcome "checksummed",
nothing written but the manifest) beside SRC, or in a folder given (`pipeline.checksums`).

Every name starts with a dot: the server's ImageFolder scan skips hidden entries, so neither
the manifest nor a temporary is ever taken for an image or a class.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from batchwire.pipeline.checksums import CHECKSUMS_MANIFEST, PREPARE_MANIFEST
from batchwire.prepare.source import RESERVED_PREFIX, UsageError

MANIFEST_NAME = PREPARE_MANIFEST  # the server finds it there: same name by construction
CHECKSUMS_NAME = CHECKSUMS_MANIFEST
REPORT_NAME = f"{RESERVED_PREFIX}-report.json"
LOCK_NAME = f"{RESERVED_PREFIX}.lock"
TMP_PREFIX = f"{RESERVED_PREFIX}-tmp."

# Outcomes kept in the manifest (the file is in DST); "failed" (read or write error) is not.
REWRITTEN = "rewritten"  # a JPEG rewritten with restart markers and verified
COPIED = "copied"  # not a JPEG: copied byte for byte
UNVERIFIED = "unverified"  # a JPEG that could not be rewritten and verified: copied as it was
CORRUPT = "corrupt"  # a JPEG that does not decode strictly: copied as it was
TOO_LARGE = "too_large"  # more pixels than the cap (the server's): copied as it was
CHECKSUMMED = "checksummed"  # --checksums-only: read and checksummed, nothing written
FAILED = "failed"  # could not be read or written: not in DST
DONE_OUTCOMES = (REWRITTEN, COPIED, UNVERIFIED, CORRUPT, TOO_LARGE, CHECKSUMMED)


@dataclass(frozen=True)
class Record:
    """The outcome for one file; `size` and `mtime_ns` are the source's when it was read."""

    path: str
    size: int
    mtime_ns: int
    outcome: str
    bytes_in: int
    bytes_out: int
    restart_interval: int
    error: str = ""
    checksum: str = ""  # of the bytes in DST (`pipeline.checksums.checksum`)
    # Those bytes are a JPEG that passed the strict full decode (None: not judged, as in
    # manifests from before this field; the server takes that as not intact).
    intact: bool | None = None

    def to_line(self) -> str:
        data = asdict(self)
        for optional in ("error", "checksum"):
            if not data[optional]:
                del data[optional]
        if data["intact"] is None:
            del data["intact"]
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


@dataclass(frozen=True)
class Header:
    """A run's header line: its source ("tree" or "list:NAME") and the folders it mirrors."""

    source: str
    dirs: tuple[str, ...] = ()

    def to_line(self) -> str:
        data = {"source": self.source, "dirs": list(self.dirs)}
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


def _parse(line: str) -> Record | Header | dict | None:
    try:
        data = json.loads(line)
    except ValueError:
        return None  # cut short by a kill
    if not isinstance(data, dict):
        return None
    if "finished" in data:
        return data
    if "source" in data and "path" not in data:
        source, dirs = data.get("source"), data.get("dirs", [])
        if not isinstance(source, str) or not isinstance(dirs, list):
            return None
        return Header(source, tuple(d for d in dirs if isinstance(d, str)))
    try:
        record = Record(**data)
    except TypeError:
        return None
    ok = isinstance(record.path, str) and bool(record.path) and isinstance(record.bytes_out, int)
    return record if ok else None


@dataclass
class Previous:
    """What the manifest says: the last record per path, whether the last run finished, the
    last header's source (None for a manifest older than headers) and every folder a header
    named."""

    records: dict[str, Record]
    finished: bool
    exists: bool
    source: str | None = None
    dirs: set[str] = field(default_factory=set)


def load(path: Path) -> Previous:
    """The manifest at `path` (absent: an empty Previous); lines that make no sense are
    skipped (a line cut short by a kill, or edited by hand)."""
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        return Previous({}, finished=False, exists=False)
    previous = Previous({}, finished=False, exists=True)
    for line in text.splitlines():
        parsed = _parse(line)
        if parsed is None:
            continue
        if isinstance(parsed, Record):
            previous.records[parsed.path] = parsed
            previous.finished = False
        elif isinstance(parsed, Header):
            previous.source = parsed.source
            previous.dirs.update(parsed.dirs)
            previous.finished = False
        else:
            previous.finished = True
    return previous


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Holds a run's lock file (DST's, or beside a checksums manifest): two runs into one
    DST would remove each other's temporaries and interleave their manifests. UsageError when
    another run holds it."""
    dst = lock_path.parent
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another pipeline-prepare is writing to {dst}") from None
        yield
    finally:
        os.close(fd)


def remove_temporaries(dst: Path, recursive: bool = True) -> int:
    """Deletes the temporaries a killed run left anywhere under DST (only in DST itself when
    not `recursive`); returns how many."""
    removed = 0
    for folder, dirs, names in os.walk(dst):
        if not recursive:
            dirs.clear()
        for name in names:
            if name.startswith(TMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
                    removed += 1
    return removed


class Writer:
    """Appends records to the manifest, one flushed line each (main thread only), after the
    run's header line."""

    def __init__(self, path: Path, header: Header) -> None:
        self.path = path
        self.header = header
        cut_short = False
        with contextlib.suppress(OSError), open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)  # OSError for an empty file: nothing to mend
            cut_short = f.read(1) != b"\n"
        self._file: IO[str] = open(  # noqa: SIM115
            self.path, "a", encoding="utf-8", errors="surrogateescape"
        )
        if cut_short:  # the last line was cut short by a kill: start a new one
            self._file.write("\n")
        self._file.write(header.to_line())
        self._file.flush()

    def append(self, record: Record) -> None:
        self._file.write(record.to_line())
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def finish(self, records: Iterable[Record]) -> None:
        """Replaces the manifest by `records` (one line each) and a `finished` line."""
        self.close()
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
                f.write(self.header.to_line())
                f.writelines(r.to_line() for r in records)
                f.write(json.dumps({"finished": True}) + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
