"""A rerun makes DST mirror SRC: what earlier runs wrote for files SRC no longer has is removed,
what pipeline-prepare never wrote is kept and reported.

Without this, deleting or renaming files in SRC and rerunning left the old copies in DST, and
DST stopped being the same dataset (more files; an old class folder still taking a label id).
The manifest knows what earlier runs wrote (`prepare.checksum_manifest`: a record per file, the
folders in each run's header), so only that is ever removed, and only:
- when the manifest comes from the same source (a folder, or the same list file: two lists
  prepared into one DST each keep their files; a manifest older than headers counts as a
  folder's);
- when the file is still what was written (size, and checksum where recorded): a file changed
  in DST since is someone else's now, kept and reported;
- folders only once empty (a folder holding files prepare never wrote stays, and so do they);
- never outside DST: a manifest row edited to "../x" or "/x", or naming a file under a folder
  of DST since replaced by a symlink, is kept and reported.
Removal comes before any file is prepared, so a file that became a folder (or the reverse) in
SRC is not in the way. Everything in DST that the current source does not account for, and that
prepare did not just remove, is listed (`foreign`), never touched. Names of prepare's own files
(the reserved prefix) are neither.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from batchwire.pipeline.checksums import checksum
from batchwire.pipeline.decode.files import read_file
from batchwire.prepare.checksum_manifest import Previous, Record
from batchwire.prepare.source import RESERVED_PREFIX, Source


@dataclass
class Mirror:
    """What making DST mirror SRC did: files and folders removed (relative paths), earlier
    outputs kept although SRC no longer has them (path, why), and entries of DST that prepare
    never wrote for this source (folders end in "/")."""

    removed: list[str] = field(default_factory=list)
    removed_dirs: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


def source_id(source: Source) -> str:
    """What a manifest header says a run prepared: "tree", or "list:" and the list's name."""
    return "tree" if source.kind == "tree" else f"list:{source.list_name}"


def _accounted(source: Source) -> tuple[set[str], set[str]]:
    """(files, folders) that SRC has now, unreadable entries included: never removed."""
    files = set(source.files) | {rel for rel, _ in source.unreadable}
    if source.list_name:
        files.add(source.list_name)
    dirs = set(source.dirs) | {rel for rel, _ in source.unreadable}
    return files, dirs


def remove_gone(dst: Path, previous: Previous, source: Source, mirror: Mirror) -> None:
    """Removes what earlier runs wrote for files and folders SRC no longer has (see the
    module doc), recording it in `mirror`."""
    files, dirs = _accounted(source)
    root = Path(os.path.realpath(dst))  # once: every path removed must lie under it
    gone = []
    for rel in sorted(rel for rel in previous.records if rel not in files):
        if _under(root, rel):
            gone.append(rel)
        else:
            mirror.kept.append((rel, OUTSIDE))
    same = previous.source == source_id(source) or (
        previous.source is None and source.kind == "tree"
    )
    if not same:
        why = f"DST was last prepared from another source ({previous.source or 'unknown'})"
        mirror.kept += [(rel, why) for rel in gone if (dst / rel).exists()]
        return
    emptied: set[str] = set()
    for rel in gone:
        why = _remove_file(dst / rel, previous.records[rel])
        if why is None:
            mirror.removed.append(rel)
            emptied.update(_parents(rel))
        elif why:
            mirror.kept.append((rel, why))
    candidates = {d for d in (previous.dirs | emptied) - dirs if _under(root, d)}
    for rel in sorted(candidates, key=lambda d: (-d.count("/"), d)):
        with contextlib.suppress(OSError):  # not empty (someone else's files), or gone
            os.rmdir(dst / rel)
            mirror.removed_dirs.append(rel)


OUTSIDE = "outside DST (an absolute or '..' path, or a folder symlinked elsewhere): never removed"


def _under(root: Path, rel: str) -> bool:
    """Whether a manifest's path names a place inside DST (``root``, its real path): a plain
    relative path whose folder, symlinks resolved, is DST or under it. A row edited by hand
    ("../x", "/etc/x") or a folder of DST replaced by a symlink must never make a rerun remove
    anything outside DST."""
    parts = rel.split("/")
    if rel.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return False
    folder = Path(os.path.realpath(root.joinpath(*parts[:-1])))
    return folder == root or root in folder.parents


def _parents(rel: str) -> list[str]:
    parts = rel.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _remove_file(path: Path, record: Record) -> str | None:
    """Deletes `path` if it is still what `record` says was written: None when removed, ""
    when there was nothing to remove, else why it was kept."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot look at it: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file now: not what pipeline-prepare wrote"
    changed = "changed since pipeline-prepare wrote it"
    if st.st_size != record.bytes_out:
        return changed
    if record.checksum:
        try:
            if checksum(read_file(path)) != record.checksum:
                return changed
        except OSError as exc:
            return f"cannot read it: {exc.strerror or exc}"
    try:
        os.unlink(path)
    except OSError as exc:
        return f"cannot remove it: {exc.strerror or exc}"
    return None


def find_foreign(dst: Path, source: Source) -> list[str]:
    """Entries under DST that the source does not account for (folders once, ending in "/",
    not looked into), prepare's own files left out; sorted."""
    files, dirs = _accounted(source)
    out: list[str] = []
    for folder, subdirs, names in os.walk(dst):
        rel_folder = Path(folder).relative_to(dst).as_posix()
        prefix = "" if rel_folder == "." else f"{rel_folder}/"
        keep = []
        for name in sorted(subdirs):
            rel = prefix + name
            if name.startswith(RESERVED_PREFIX):
                continue
            if rel in dirs:
                keep.append(name)
            else:
                out.append(f"{rel}/")
        subdirs[:] = keep
        out += [
            prefix + name
            for name in names
            if not name.startswith(RESERVED_PREFIX) and prefix + name not in files
        ]
    return sorted(out)
