"""Listing an ImageFolder tree once, and reusing that listing while the tree is unchanged.

Walking 1.3 M files takes minutes on a network file system and tens of seconds on a local disk;
every rank and every server restart would pay it. A directory's mtime changes whenever an entry
is added, removed or renamed in it, so recording the mtime of every directory visited (taken
*before* listing it, so a change during the walk invalidates the result) lets a later open check
a few thousand `stat`s instead of re-reading a million directory entries.

Timestamps are coarse (a kernel tick locally, the server's clock on NFS), so a file added in the
same tick as the walk could leave a directory's mtime unchanged. As git does with its "racily
clean" index entries, a listing is only cached when every directory's mtime is at least
RACY_WINDOW_S older than the start of the walk; a tree still being written is re-walked next time.

Cache file: `<cache_dir>/index/<sha256(abs root)[:32]>.npz` holding the root, the class names,
the directories with their mtimes, and the relative file paths as one NUL-separated blob (file
names cannot contain NUL), labels as int64. Written atomically (temp file + rename), so racing
writers are harmless: the last rename wins and every version is complete.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})
_FORMAT_VERSION = 1
_ENC = "utf-8"
_ERRORS = "surrogateescape"  # round-trips file names that are not valid UTF-8
RACY_WINDOW_S = 2.0


@dataclass
class FolderIndex:
    """An ImageFolder listing: `rel_paths[i]` (relative to the root, '/'-separated) has label
    `labels[i]`, the position of its class in the sorted `classes`."""

    root: str
    classes: list[str]
    rel_paths: list[str]
    labels: np.ndarray  # int64
    dirs: list[str]  # relative directory paths visited ("" is the root)
    dir_mtimes: np.ndarray  # int64 ns, aligned with dirs
    scanned_at_ns: int = 0  # wall clock when the walk started (0: unknown)

    def is_racy(self, window_s: float = RACY_WINDOW_S) -> bool:
        """Whether some directory changed too close to the walk for its mtime to be trusted."""
        if not self.dir_mtimes.size:
            return False
        return int(self.dir_mtimes.max()) >= self.scanned_at_ns - int(window_s * 1e9)


def _visible(name: str) -> bool:
    # Hidden entries (.ipynb_checkpoints, .DS_Store, ._foo.jpg) are never data.
    return not name.startswith(".")


#: Links that can never be followed (a loop, a path through a file): left out, named in a
#: warning, as dangling ones are. Any other OSError (EACCES, EIO, ESTALE: a permission or a
#: passing fault) fails the scan as it always did: a class folder left out would move every
#: later class's label, and the cached listing would keep that after the fault is gone.
_BROKEN_LINK = frozenset({errno.ELOOP, errno.ENOTDIR})


def _follows(check: Callable[[], bool]) -> bool:
    """``check()`` (a `DirEntry`'s ``is_dir`` or ``is_file``), False for a link that cannot be
    followed (`_BROKEN_LINK`); any other OSError is raised."""
    try:
        return check()
    except OSError as exc:
        if exc.errno not in _BROKEN_LINK:
            raise
        return False


def named_few(names: Sequence[str], most: int = 5) -> str:
    """The first ``most`` of ``names`` for a log line, ", ..." after them when there are more."""
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def scan_image_folder(root: str | os.PathLike[str]) -> FolderIndex:
    """Walk `root`: each visible sub-folder is a class (sorted names give label ids); its image
    files, recursively, sorted by relative path, are its samples."""
    root_s = os.path.abspath(os.fspath(root))
    started = time.time_ns()
    dirs: list[str] = [""]
    mtimes: list[int] = [os.stat(root_s).st_mtime_ns]
    with os.scandir(root_s) as it:
        entries = [e for e in it if _visible(e.name)]
    classes = sorted(e.name for e in entries if _follows(e.is_dir))
    broken = sorted(
        e.name
        for e in entries
        if e.is_symlink() and not _follows(e.is_dir) and not _follows(e.is_file)
    )
    if broken:  # a class folder whose link broke: its images and its label id, not lost unsaid
        log.warning(
            "%s: %d link(s) left out, not class folders (dangling, a loop): %s; the class ids "
            "are the sorted names of the folders left",
            root_s,
            len(broken),
            named_few(broken),
        )

    rel_paths: list[str] = []
    counts: list[int] = []
    left_out: list[str] = []  # image names that are not regular files (FIFO, dangling link...)
    seen: set[tuple[int, int]] = set()  # (device, inode): symlinked folders must not loop
    for cls in classes:
        found: list[str] = []
        stack = [cls]
        while stack:
            rel_dir = stack.pop()
            full = os.path.join(root_s, rel_dir)
            st = os.stat(full)
            if (st.st_dev, st.st_ino) in seen:
                log.warning("skipping %s: a folder already listed (symlink loop or alias)", full)
                continue
            seen.add((st.st_dev, st.st_ino))
            dirs.append(rel_dir)
            mtimes.append(st.st_mtime_ns)
            with os.scandir(full) as it:
                for e in it:
                    if not _visible(e.name):
                        continue
                    rel = f"{rel_dir}/{e.name}"
                    if _follows(e.is_dir):
                        stack.append(rel)
                    elif os.path.splitext(e.name)[1].lower() in IMAGE_EXTENSIONS:
                        (found if _follows(e.is_file) else left_out).append(rel)
        found.sort()
        if not found:
            log.warning("class folder %s has no image files", os.path.join(root_s, cls))
        rel_paths.extend(found)
        counts.append(len(found))

    if left_out:  # never opened (a FIFO could block a read), but never lost without a word
        log.warning(
            "%s: %d image name(s) left out, not regular files (a FIFO, a device, a dangling "
            "link): %s",
            root_s,
            len(left_out),
            named_few(left_out),
        )
    labels = np.repeat(np.arange(len(classes), dtype=np.int64), np.asarray(counts, dtype=np.int64))
    return FolderIndex(
        root=root_s,
        classes=classes,
        rel_paths=rel_paths,
        labels=labels,
        dirs=dirs,
        dir_mtimes=np.asarray(mtimes, dtype=np.int64),
        scanned_at_ns=started,
    )


def index_file(root: str | os.PathLike[str], cache_dir: str | os.PathLike[str]) -> Path:
    """Where the listing of `root` is cached."""
    key = hashlib.sha256(os.fsencode(os.path.abspath(os.fspath(root)))).hexdigest()[:32]
    return Path(cache_dir) / "index" / f"{key}.npz"


def pack_strings(strings: list[str]) -> np.ndarray:
    """NUL-joined UTF-8 (surrogateescape) bytes of `strings`, as a uint8 array for np.savez.

    Shared by every .npz cache (folder index, shard index, store listing) so the string
    tables all round-trip non-UTF-8 names the same way.
    """
    data = "\0".join(strings).encode(_ENC, _ERRORS)
    return np.frombuffer(data, dtype=np.uint8)


#: Held while numpy parses an .npz member's header. numpy parses it with `ast.literal_eval`, and
#: CPython 3.11 keeps the AST constructor's recursion depth per interpreter, not per thread: two
#: threads building ASTs at once (the GIL can change hands inside, when a garbage collection runs
#: a finalizer) fail with "SystemError: AST constructor recursion depth mismatch"
#: (python/cpython#106905). Caches are read from a pool (a tar dataset's shard indexes), so every
#: read of one goes through `read_npz`.
_NPZ_READ = threading.Lock()


def read_npz(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every array of the .npz cache file at `path`, read at once (no pickles).

    Raises what np.load raises (FileNotFoundError, OSError, ValueError, zipfile.BadZipFile).
    """
    with _NPZ_READ, np.load(path, allow_pickle=False) as z:
        return {name: z[name] for name in z.files}


def unpack_strings(arr: np.ndarray, count: int) -> list[str]:
    """Inverse of `pack_strings`; ValueError when the table does not hold `count` strings."""
    if count == 0:
        return []
    out = arr.tobytes().decode(_ENC, _ERRORS).split("\0")
    if len(out) != count:
        raise ValueError(f"corrupt string table: {len(out)} entries, expected {count}")
    return out


def save_index(index: FolderIndex, cache_dir: str | os.PathLike[str]) -> Path:
    """Write the listing atomically; returns the cache file."""
    target = index_file(index.root, cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f,
                version=np.array([_FORMAT_VERSION], dtype=np.int64),
                root=pack_strings([index.root]),
                classes=pack_strings(index.classes),
                num_classes=np.array([len(index.classes)], dtype=np.int64),
                dirs=pack_strings(index.dirs),
                dir_mtimes=index.dir_mtimes,
                paths=pack_strings(index.rel_paths),
                labels=index.labels,
            )
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _still_valid(index: FolderIndex) -> bool:
    for rel_dir, mtime in zip(index.dirs, index.dir_mtimes.tolist(), strict=True):
        try:
            if os.stat(os.path.join(index.root, rel_dir)).st_mtime_ns != mtime:
                return False
        except OSError:
            return False
    return True


def load_index(
    root: str | os.PathLike[str], cache_dir: str | os.PathLike[str]
) -> FolderIndex | None:
    """The cached listing of `root` if there is one and no directory in it changed since."""
    path = index_file(root, cache_dir)
    root_s = os.path.abspath(os.fspath(root))
    try:
        z = read_npz(path)
        if int(z["version"][0]) != _FORMAT_VERSION:
            return None
        if unpack_strings(z["root"], 1)[0] != root_s:
            return None  # hash collision or a moved cache: never trust it
        dirs_arr, mtimes = z["dirs"], z["dir_mtimes"]
        dirs = unpack_strings(dirs_arr, len(mtimes))
        index = FolderIndex(
            root=root_s,
            classes=unpack_strings(z["classes"], int(z["num_classes"][0])),
            rel_paths=[],
            labels=z["labels"],
            dirs=dirs,
            dir_mtimes=mtimes,
        )
        if not _still_valid(index):
            return None
        index.rel_paths = unpack_strings(z["paths"], len(index.labels))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        log.warning("ignoring unreadable index cache %s: %s", path, exc)
        return None
    return index


def cached_folder_index(
    root: str | os.PathLike[str], cache_dir: str | os.PathLike[str]
) -> tuple[FolderIndex, bool]:
    """The listing of `root` and whether it came from the cache (scanning and saving if not).

    A cache that cannot be written (read-only disk, full disk) costs a warning, not the run.
    """
    index = load_index(root, cache_dir)
    if index is not None:
        return index, True
    index = scan_image_folder(root)
    if index.is_racy():
        log.info("not caching the listing of %s: it changed within the last seconds", index.root)
        return index, False
    try:
        save_index(index, cache_dir)
    except OSError as exc:
        log.warning("could not write the index cache for %s: %s", index.root, exc)
    return index, False
