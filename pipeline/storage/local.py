"""`LocalStore`: a folder on this host as a `Store` (regular files only)."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, TypeVar

from batchwire.pipeline.decode.files import open_regular, read_file
from batchwire.pipeline.storage.base import ObjectInfo
from batchwire.pipeline.storage.errors import ObjectChanged


class LocalStore:
    """Objects are the regular files under `root`; keys are '/'-separated relative paths.

    Reads go through `decode.files.read_file` (range reads through its same check), so a FIFO
    or device under the root is refused without being opened, as everywhere else the pipeline
    reads a file, and `list` leaves them out. Symlinks are followed (a folder of links to a
    shared copy is a dataset), a linked folder listed once: a link to an ancestor cannot loop."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self._pinned: dict[str, str] = {}  # key -> the version its ranged reads must find

    def pin_versions(self, versions: dict[str, str]) -> None:
        """Ranged reads of these files must find the versions given (size and modification
        time, as `head` said when a tar shard was indexed): a file rewritten since holds
        other bytes at the indexed offsets, so such a read is `ObjectChanged` (a bad sample),
        found from the descriptor's own stat at no cost."""
        self._pinned.update(versions)

    @property
    def display(self) -> str:
        return str(self.root)

    def path(self, key: str) -> str:
        """The absolute path of `key` (a key may not climb out of the root)."""
        path = os.path.normpath(os.path.join(self.root, key))
        if os.path.commonpath([path, str(self.root)]) != str(self.root):
            raise PermissionError(f"key {key!r} is outside {self.root}")
        return path

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        seen: set[tuple[int, int]] = set()  # (device, inode) of the folders walked
        for dirpath, dirs, files in os.walk(self.root, followlinks=True):
            try:
                here = os.stat(dirpath)
            except OSError:
                dirs[:] = []
                continue
            if (here.st_dev, here.st_ino) in seen:  # a symlink loop or a second link to it
                dirs[:] = []
                continue
            seen.add((here.st_dev, here.st_ino))
            for name in files:
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(full)
                except OSError:
                    continue  # vanished or a dangling link: not an object
                if stat.S_ISREG(st.st_mode):  # not a FIFO, device or socket
                    out.append(ObjectInfo(key, st.st_size, _version(st)))
        out.sort(key=lambda o: o.key)
        return out

    def head(self, key: str) -> ObjectInfo:
        st = os.stat(self.path(key))
        return ObjectInfo(key, st.st_size, _version(st))

    def read(self, key: str) -> bytes:
        return read_file(self.path(key))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """`Store.read_ranges`: opened as `read_file` opens (`decode.files.open_regular`: a FIFO
        would block the open for good), and each read is cut at the end of the file, so a range
        far past it (a corrupt member size) comes back short rather than allocating its length."""
        with open_regular(self.path(key)) as (fd, st):
            pinned = self._pinned.get(key)
            if pinned is not None and _version(st) != pinned:
                raise ObjectChanged(
                    f"{self.where(key)}: changed since it was opened (version {pinned}, now "
                    f"{_version(st)}): its samples are not read at the old offsets; restart "
                    "to serve the new file"
                )
            # end < start or start < 0 stay an OSError (EINVAL) from pread
            return [
                os.pread(fd, min(end, max(start, st.st_size)) - start, start)
                for start, end in ranges
            ]

    @property
    def namespace(self) -> str:
        """What tells these objects apart from another store's (for caches keyed by object)."""
        return f"file://{self.root}"

    def where(self, key: str) -> str:
        """The path of `key`, for messages."""
        return os.path.join(self.root, key)

    def read_ranges_many(
        self, requests: Sequence[tuple[str, Sequence[tuple[int, int]]]]
    ) -> list[list[bytes] | OSError]:
        out: list[list[bytes] | OSError] = []
        for key, ranges in requests:
            try:
                out.append(self.read_ranges(key, ranges))
            except OSError as exc:
                out.append(exc)
        return out

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> None:
        with self.open_writer(key) as w:
            w.write(data)
            w.commit()

    def open_writer(self, key: str) -> LocalWriter:
        """A hidden temporary beside `key`'s path (folders created), renamed into place by
        `commit`: the file appears whole or not at all."""
        return LocalWriter(self.path(key))

    def read_many(self, keys: Sequence[str]) -> list[bytes | OSError]:
        out: list[bytes | OSError] = []
        for key in keys:
            try:
                out.append(self.read(key))
            except OSError as exc:
                out.append(exc)
        return out


def _version(st: os.stat_result) -> str:
    """A file's version: its size and modification time (what a rewrite changes)."""
    return f"{st.st_size}-{st.st_mtime_ns}"


_W = TypeVar("_W", bound="AbortOnExit")


class AbortOnExit:
    """`ObjectWriter`'s context manager, for a writer class to inherit (`LocalWriter`, the
    object store's `UploadWriter`): leaving the block calls `abort`, whether by an exception
    or a clean exit without `commit`, so committing is always explicit and an unfinished
    object is never made visible. The writer's `abort` must be a no-op after `commit`."""

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self: _W) -> _W:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()  # a no-op after commit


class LocalWriter(AbortOnExit):
    """`Store.open_writer` of a `LocalStore`: `.NAME.PID.THREAD.tmp` in the target's folder
    (a dot name: a folder scan skips it), renamed onto the target by `commit`."""

    def __init__(self, path: str, fsync: bool = False) -> None:
        self.path = path
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        self.tmp = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        self._fsync = fsync
        self._file: BinaryIO | None = open(self.tmp, "wb")  # noqa: SIM115 (commit/abort close it)
        self._size = 0

    def write(self, data: bytes | memoryview) -> int:
        if self._file is None:
            raise ValueError(f"{self.path}: writer already committed or aborted")
        n = self._file.write(data)
        self._size += n
        return n

    def tell(self) -> int:
        return self._size

    def commit(self) -> int:
        if self._file is None:
            raise ValueError(f"{self.path}: writer already committed or aborted")
        f, self._file = self._file, None
        try:
            if self._fsync:
                f.flush()
                os.fsync(f.fileno())
            f.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            f.close()
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
            raise
        return self._size

    def abort(self) -> None:
        if self._file is None:
            return
        f, self._file = self._file, None
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)
