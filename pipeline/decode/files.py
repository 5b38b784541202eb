"""Reading an encoded image file: the one place the pipeline turns a path into bytes.

Kept apart so that how files are read (buffered today; direct I/O or a cache later) is changed in
one function, not at every caller. Errors are not translated into decode errors: an OSError
reaches the sample loader, which tells two kinds apart (`is_transient`, the one place that
decides, by errno alone):
- transient ones (`TRANSIENT_ERRNOS`: out of descriptors or memory, EIO, EAGAIN, EINTR; and
  MemoryError) say nothing about the file: the loader retries them and never remembers the
  file as bad. A transient error that never clears stalls the batches that need the file, so
  the list stays short: object stores map only their own transient answers (5xx, 408, 429,
  no answer, credentials not fetched for now) onto EIO (`storage.errors`, its table);
- every other one (missing, no permission, not a regular file; an object store's 401, 403,
  404 or other refusal) is the file's: it is counted as unreadable and replaced.

Only regular files are read. A FIFO named in a list file would block `open` (and a read) until
a writer comes, stalling a decode thread for good; a device may block or have side effects on
open; a directory has no image. So the path is `stat`ed first (following symlinks, which keep
working) and refused unless it is a regular file, and the open itself is non-blocking with the
type checked again on the descriptor, so a file swapped for a FIFO in between cannot block
either. Neither costs measurably next to the read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

# errno values that describe the machine's state at the time, not the file.
TRANSIENT_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENOMEM}
)

_FILE_TYPES = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotARegularFile(OSError):
    """The path names a FIFO, device, socket or directory: never opened for reading (a
    property of the file, so a bad file like an unreadable one)."""


def is_transient(exc: BaseException) -> bool:
    """True for an error that says nothing about the file: MemoryError, or an OSError whose
    errno is in `TRANSIENT_ERRNOS` (whatever its class: a `storage.errors.CredentialsError`
    is transient with EIO, the sample's with EACCES)."""
    if isinstance(exc, MemoryError):
        return True
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def _check_regular(mode: int, path: str | os.PathLike[str]) -> None:
    if stat.S_ISREG(mode):
        return
    what = next((name for test, name in _FILE_TYPES if test(mode)), "not a regular file")
    raise NotARegularFile(f"not a regular file ({what}): {os.fspath(path)}")


@contextlib.contextmanager
def open_regular(path: str | os.PathLike[str]) -> Iterator[tuple[int, os.stat_result]]:
    """A read-only descriptor of the regular file ``path`` and its stat as opened, closed on
    exit. `NotARegularFile` for anything else, checked before the open (a FIFO's or a device's
    open can block or act) and again on the descriptor (the path may have changed between)."""
    _check_regular(os.stat(path).st_mode, path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        _check_regular(st.st_mode, path)
        yield fd, st  # a regular file ignores O_NONBLOCK
    finally:
        os.close(fd)


def read_file(path: str | os.PathLike[str]) -> bytes:
    """The whole contents of the regular file `path` (OSError propagates; `NotARegularFile`
    for anything else, without opening it)."""
    return read_file_and_stat(path)[0]


def read_file_and_stat(path: str | os.PathLike[str]) -> tuple[bytes, os.stat_result]:
    """`read_file`, with the file's stat as it was opened (pipeline-prepare's manifest keeps
    its size and mtime)."""
    with open_regular(path) as (fd, st):
        # Plain reads (no buffered file object: this runs for every sample) of the size fstat
        # gave, then until EOF in case the file grew.
        parts = []
        while chunk := os.read(fd, max(st.st_size, 65536)):
            parts.append(chunk)
        return b"".join(parts), st
