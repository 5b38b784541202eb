"""One file of pipeline-prepare: read it, rewrite it if it is a JPEG, write it atomically.

Runs on worker threads: the transcoder releases the GIL, and so do file reads and writes, so the
threads use every core without processes (no pickling of file contents).

A JPEG is recognised by its first bytes (FF D8 FF), not its name. It is rewritten with restart
markers and verified (`batchwire.native.jpeg_transcode`), then given an interval index (an APP9
segment recording where each restart interval begins: `native.jpeg_roi.with_interval_index`) so
that the server's crops find their intervals without scanning the file; when it cannot be (corrupt,
unsupported, not verified) the original bytes are copied instead and the outcome says why, so
DST always holds every file. Writes go to a hidden temporary in the destination folder and are
renamed into place, so DST never holds a partial file under a real name.

A JPEG whose header claims more pixels than the server's cap (`max_pixels`, the server's
default) is copied as it was without transcoding: the server would refuse it anyway, and
transcoding it costs gigabytes (a 16000 x 16000 photo took 1.47 GB). Every record carries the
checksum of the bytes in DST, which the server checks each read against, and whether those
bytes are `intact`: a JPEG that passes the strict full decode (`native.jpeg_roi.check_jpeg`,
the reference every server decode path is held to). A rewritten file is (the transcoder read it
back strictly and compared it with the source); a JPEG copied as it was, or read by
`--checksums-only`, is judged by the strict check itself; anything else (not a JPEG, corrupt,
over the pixel cap) is not. Only intact files may be decoded by reading less than all of them
(see `pipeline.decode.contract`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from batchwire.native.jpeg_roi import (
    JpegRoiError,
    check_jpeg,
    has_interval_index,
    restart_layout,
    with_interval_index,
)
from batchwire.native.jpeg_transcode import (
    JpegCorruptError,
    JpegTranscodeError,
    transcode_restart,
)
from batchwire.pipeline.checksums import checksum
from batchwire.pipeline.decode import DEFAULT_MAX_PIXELS, DecodeError, read_header
from batchwire.pipeline.decode.backends import arithmetic_frame
from batchwire.pipeline.decode.files import NotARegularFile, read_file, read_file_and_stat
from batchwire.pipeline.decode.headers import ImageTooLarge, ImplausibleHeader
from batchwire.prepare.checksum_manifest import (
    CHECKSUMMED,
    COPIED,
    CORRUPT,
    FAILED,
    REWRITTEN,
    TMP_PREFIX,
    TOO_LARGE,
    UNVERIFIED,
    Record,
)
from batchwire.prepare.restarts import AUTO, AUTO_MOST

# Outcomes whose bytes may be a sound JPEG, judged by the strict check when it is not known.
_JUDGED = (REWRITTEN, UNVERIFIED, CHECKSUMMED)

JPEG_START = b"\xff\xd8\xff"
# Bytes of a rewritten file read on a rerun to find its interval index (the header up to the
# SOS; more only for a header larger than this, e.g. a big ICC profile).
HEADER_READ = 64 * 1024


@dataclass(frozen=True)
class Settings:
    """`max_pixels`: JPEGs claiming more are copied as they were (None: no cap);
    `checksums_only`: nothing is written, each file is only read and checksummed."""

    src_root: Path
    dst_root: Path
    restart_interval: int
    fsync: bool = False
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    checksums_only: bool = False


@dataclass(frozen=True)
class Result:
    """A job's record; `skipped`: an earlier run had finished it (nothing was done)."""

    record: Record
    skipped: bool = False


def write_atomically(dest: Path, data: bytes, mode: int, fsync: bool) -> None:
    """`data` at `dest` via a temporary in the same folder and a rename, with permission
    bits `mode` (mkstemp's 0600 would hide the files from a server running as another user)."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        dir_fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def already_done(
    previous: Record | None, src: Path, dest: Path, restart_interval: int, checksums_only: bool
) -> bool:
    """Whether an earlier run's record still holds: the source has the size and mtime it
    had, the destination file is there with the size written, and a JPEG was rewritten with
    this restart interval, with its interval index (a file rewritten before the index existed
    is rewritten again, from its source, so that every prepared file gets one). A file over the
    pixel cap is looked at again (the cap may have changed; it costs a header read and a
    copy)."""
    if previous is None or (previous.outcome == CHECKSUMMED) != checksums_only:
        return False
    try:
        st = os.stat(src)
        out = os.stat(dest)
    except OSError:
        return False
    same_source = st.st_size == previous.size and st.st_mtime_ns == previous.mtime_ns
    interval_ok = previous.outcome in (COPIED, CHECKSUMMED) or (
        previous.outcome != TOO_LARGE and previous.restart_interval == restart_interval
    )
    if not (same_source and interval_ok and out.st_size == previous.bytes_out):
        return False
    return previous.outcome != REWRITTEN or not lacks_index(dest)


def lacks_index(dest: Path) -> bool:
    """Whether a rewritten file could have an interval index but has none (written before the
    index existed). Reads its header; the whole file only when the header has no index (to see
    whether it has a restart layout to index: a fixed `--restart-interval` that does not divide
    the MCU rows gives none). An unreadable file is left to the size check's verdict."""
    try:
        with open(dest, "rb") as f:
            data = f.read(HEADER_READ)
        found = has_interval_index(data)
        if found is not True and len(data) == HEADER_READ:  # the file goes on: read it whole
            data = read_file(str(dest))
            found = has_interval_index(data)
    except OSError:
        return False
    return found is False and restart_layout(data)[0] is not None


def rewrite(
    data: bytes, restart_interval: int, max_pixels: int | None = DEFAULT_MAX_PIXELS
) -> tuple[bytes, str, str]:
    """(bytes to write, outcome, error) for one file's contents."""
    if not data.startswith(JPEG_START):
        return data, COPIED, ""
    try:  # the server's own header check, before the transcoder allocates anything
        read_header(data, max_pixels=max_pixels)
    except ImageTooLarge as exc:
        return data, TOO_LARGE, str(exc)
    except ImplausibleHeader as exc:
        return data, CORRUPT, str(exc)
    except DecodeError:
        pass  # any other header problem: the strict transcoder judges the file
    if arithmetic_frame(data):
        # The server refuses arithmetic coding; a Huffman rewrite it would serve, so the
        # prepared tree would not serve the original's batches. Kept as it is: refused alike.
        return (
            data,
            UNVERIFIED,
            "arithmetic-coded JPEG (SOF9..SOF15): the server does not decode it",
        )
    try:
        if restart_interval == AUTO:
            out = transcode_restart(data, AUTO_MOST, fit_rows=True)
        else:
            out = transcode_restart(data, restart_interval)
    except JpegCorruptError as exc:
        return data, CORRUPT, str(exc)
    except JpegTranscodeError as exc:
        return data, UNVERIFIED, str(exc)
    return indexed(out), REWRITTEN, ""


def indexed(data: bytes) -> bytes:
    """A rewritten JPEG with its interval index, or as it is when its intervals do not tile the
    MCU rows (a fixed `--restart-interval` that does not divide them): no decoder enters those
    at their markers, so there is nothing to index. Only an APP9 segment is added (every JPEG
    reader skips it), so the transcoder's verification of the pixels still holds."""
    try:
        return with_interval_index(data)
    except ValueError:
        return data


def strict_problem(data: bytes, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> str | None:
    """Why `data` is not a JPEG that passes the strict full decode, or None when it is one.
    The server's header check comes first (it bounds what the check allocates): a JPEG over
    `max_pixels` is not judged, and not intact."""
    if not data.startswith(JPEG_START):
        return "not a JPEG"
    failure = _strict_failure(data, max_pixels)
    return None if failure is None else str(failure)


def _strict_failure(data: bytes, max_pixels: int | None) -> Exception | None:
    try:
        read_header(data, max_pixels=max_pixels)
        check_jpeg(data)
    except (DecodeError, JpegRoiError) as exc:
        return exc
    return None


def _checksummed(data: bytes, max_pixels: int | None) -> tuple[bool, str]:
    """--checksums-only: (intact, error) for a file's bytes; the error (reported as a corrupt
    JPEG) only for a JPEG that the strict check or the header check refuses, not for a JPEG over
    the pixel cap or a file that is no JPEG (neither is intact)."""
    if not data.startswith(JPEG_START):
        return False, ""
    failure = _strict_failure(data, max_pixels)
    if failure is None:
        return True, ""
    return False, "" if isinstance(failure, ImageTooLarge) else f"not intact: {failure}"


def prepare_file(rel: str, previous: Record | None, settings: Settings) -> Result:
    """Prepares SRC/rel into DST/rel (see the module doc); never raises for the file's own
    problems: an I/O error becomes a FAILED record."""
    src = settings.src_root / rel
    dest = src if settings.checksums_only else settings.dst_root / rel
    interval = 0 if settings.checksums_only else settings.restart_interval
    if already_done(previous, src, dest, interval, settings.checksums_only):
        assert previous is not None
        return _skipped(previous, dest, settings.max_pixels)
    try:
        data, st = read_file_and_stat(str(src))
    except OSError as exc:
        return Result(Record(rel, 0, 0, FAILED, 0, 0, interval, f"cannot read: {_why(exc)}"))
    if settings.checksums_only:
        size = len(data)
        intact, error = _checksummed(data, settings.max_pixels)
        record = Record(rel, st.st_size, st.st_mtime_ns, CHECKSUMMED, size, size, 0, error)
        return Result(replace(record, checksum=checksum(data), intact=intact))
    out, outcome, error = rewrite(data, interval, settings.max_pixels)
    try:
        write_atomically(dest, out, stat.S_IMODE(st.st_mode), settings.fsync)
    except OSError as exc:
        why = f"cannot write {dest}: {_why(exc)}"
        return Result(Record(rel, st.st_size, st.st_mtime_ns, FAILED, len(data), 0, interval, why))
    size, mtime = st.st_size, st.st_mtime_ns
    intact = outcome == REWRITTEN or (
        outcome == UNVERIFIED and strict_problem(out, settings.max_pixels) is None
    )
    record = Record(
        rel, size, mtime, outcome, len(data), len(out), interval, error, checksum(out), intact
    )
    return Result(record)


def _skipped(previous: Record, dest: Path, max_pixels: int | None) -> Result:
    """An earlier run's record, given what it lacks (a manifest from before checksums or before
    `intact`: reading and checking a file costs far less than rewriting it): the checksum of
    what it wrote, and the strict check's verdict on those bytes. Bytes that no longer match
    the recorded checksum are left for the server to refuse (intact stays unknown)."""
    if previous.checksum and previous.intact is not None:
        return Result(previous, skipped=True)
    try:
        data = read_file(str(dest))
    except OSError:
        return Result(previous, skipped=True)  # unreadable now: the server will say so
    sums = checksum(data)
    if len(data) != previous.bytes_out or previous.checksum not in ("", sums):
        return Result(previous, skipped=True)
    intact = previous.outcome in _JUDGED and strict_problem(data, max_pixels) is None
    return Result(replace(previous, checksum=sums, intact=intact), skipped=True)


def _why(exc: OSError) -> str:
    """The reason alone where the OS gives one (the path is in the record already)."""
    if isinstance(exc, NotARegularFile) or not exc.strerror:
        return str(exc)
    return exc.strerror
