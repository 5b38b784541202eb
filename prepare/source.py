"""What pipeline-prepare copies: the files of SRC (a folder tree or a list file) and where they go.

A folder is mirrored whole: every file at its relative path, every folder (empty ones too: an
empty class folder still takes a label id in an ImageFolder scan, so leaving it out would shift
every later class's label). A folder need not be an ImageFolder (a flat folder of JPEGs is
prepared like any other). Symlinks are followed, to files and to folders (symlink farms are a
common way to build subsets), with each folder visited once.

A list file (`path label` per line, see `pipeline.sources.folder.read_list_file`) is parsed with the
server's own parser, so a path escaping the list file's folder is refused here as the server
would refuse it, before any work. Its listed files go to the same relative paths under DST and
the list file itself beside them.

Names starting with `.batchwire-prepare` (a manifest, report, lock or temporary of an earlier
prepare, when SRC is itself a prepared tree) are never taken from SRC.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from batchwire.pipeline.sources.folder import read_list_file

RESERVED_PREFIX = ".batchwire-prepare"


class UsageError(Exception):
    """The command cannot run as given (exit status 2); the message says why."""


@dataclass
class Source:
    """The files to prepare, as '/'-separated paths relative to `root`.

    `kind`: "tree" or "list"; `list_name`: the list file's name (in `root`) for a list;
    `dirs`: folders to create under DST (relative, "" excluded); `unreadable`: entries that are
    not regular files or folders, or folders that could not be listed, with the reason;
    `has_classes`: whether a tree has a visible sub-folder (an ImageFolder needs one per class).
    """

    kind: str
    root: Path
    files: list[str]
    dirs: list[str] = field(default_factory=list)
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    list_name: str | None = None
    has_classes: bool = True


def _reserved(name: str) -> bool:
    return name.startswith(RESERVED_PREFIX)


def walk_tree(root: Path) -> Source:
    """Every file and folder under `root` (sorted), following symlinks, each folder's files
    once (a folder linked twice is listed, empty, under its second name)."""
    files: list[str] = []
    dirs: list[str] = []
    unreadable: list[tuple[str, str]] = []
    seen: set[tuple[int, int]] = set()
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        full = os.path.join(root, rel_dir) if rel_dir else str(root)
        try:
            st = os.stat(full)
            if (st.st_dev, st.st_ino) in seen:
                # A symlink loop or a second link to a folder already mirrored: its files once,
                # but the folder itself kept (empty), as the server's scan keeps it: a second
                # link at the top is still a class, so DST keeps SRC's classes and label ids.
                if rel_dir:
                    dirs.append(rel_dir)
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(full) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            unreadable.append((rel_dir or ".", f"cannot list the folder: {exc.strerror or exc}"))
            continue
        if rel_dir:
            dirs.append(rel_dir)
        subdirs = []
        for entry in entries:
            if _reserved(entry.name):
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                if entry.is_dir():
                    subdirs.append(rel)
                elif entry.is_file():
                    files.append(rel)
                else:
                    kind = "a broken symlink" if entry.is_symlink() else "not a regular file"
                    unreadable.append((rel, kind))
            except OSError as exc:
                unreadable.append((rel, exc.strerror or str(exc)))
        stack.extend(reversed(subdirs))
    has_classes = any(not d.startswith(".") and "/" not in d for d in dirs)
    files.sort()
    dirs.sort()
    return Source("tree", root, files, dirs, unreadable, has_classes=has_classes)


def read_list(list_path: Path) -> Source:
    """The files a list file names (each once, in list order); UsageError for a malformed
    list or a path that escapes its folder."""
    try:
        paths, _labels = read_list_file(list_path)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    root = list_path.resolve().parent
    files: list[str] = []
    seen: set[str] = set()
    for path in paths:
        rel = Path(os.path.relpath(path, root)).as_posix()
        if rel in seen:
            continue
        seen.add(rel)
        if any(_reserved(part) for part in rel.split("/")):
            raise UsageError(f"{list_path}: {rel!r} uses a name reserved for pipeline-prepare")
        files.append(rel)
    dirs = sorted({str(Path(rel).parent.as_posix()) for rel in files} - {"."})
    all_dirs = sorted({p for d in dirs for p in _ancestors(d)})
    return Source("list", root, files, all_dirs, list_name=list_path.name)


def _ancestors(rel_dir: str) -> list[str]:
    parts = rel_dir.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


#: What the copy mode cannot rewrite, as users name it (`pipeline.sources.source_kind`'s kinds).
_OTHER_KINDS = {
    "tar": "tar shards",
    "parquet": "Parquet",
    "csv": "a CSV manifest",
    "jsonl": "a JSON-lines manifest",
}


def _other_kind(src: str | os.PathLike[str]) -> str | None:
    """What SRC is when it is not a local folder tree or list file (None when it is one, or
    missing): the copy mode rewrites files, not members of shards or cells of Parquet."""
    from batchwire.pipeline.sources import is_classic, source_kind
    from batchwire.pipeline.storage.urls import is_url

    if is_classic(src):
        return None
    if is_url(os.fspath(src)):
        return "a bucket URL"
    try:
        return _OTHER_KINDS.get(source_kind(src), "not a folder tree or a list file")
    except (OSError, ValueError):
        return "not a folder tree or a list file"


def discover(src: str | os.PathLike[str]) -> Source:
    """The Source for SRC (a folder or a list file); UsageError when it cannot be used (another
    source kind is named, with the modes that take it)."""
    from batchwire.pipeline.storage.urls import redact_url

    other = _other_kind(src)
    if other is not None:
        raise UsageError(
            f"SRC {redact_url(os.fspath(src))} is {other}: pipeline-prepare SRC DST rewrites the "
            "JPEGs of a local folder tree or list file; `pipeline-prepare SRC DST --shards SIZE` "
            "writes shards from it, `pipeline-prepare --checksums-only SRC` its checksums"
        )
    path = Path(src).expanduser()
    if not path.exists():
        raise UsageError(f"SRC does not exist: {path}")
    if path.is_dir():
        return walk_tree(path.resolve())
    if path.is_file():
        return read_list(path)
    raise UsageError(f"SRC is neither a folder nor a list file: {path}")


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_destination(source: Source, dst: str | os.PathLike[str]) -> Path:
    """DST as an absolute path, refused (UsageError) when it is, or is inside, SRC's folder,
    when SRC's folder is inside it (symlinks resolved), or when it is not a folder."""
    target = Path(os.path.realpath(Path(dst).expanduser()))
    root = Path(os.path.realpath(source.root))
    what = "SRC" if source.kind == "tree" else "the list file's folder"
    if target == root:
        raise UsageError(f"DST is {what} ({root}): choose a new folder")
    if _inside(target, root):
        raise UsageError(f"DST {target} is inside {what} {root}: choose a folder outside it")
    if _inside(root, target):
        raise UsageError(f"{what} {root} is inside DST {target}: choose a folder outside it")
    if target.exists() and not target.is_dir():
        raise UsageError(f"DST exists and is not a folder: {target}")
    return target


def check_report(source: Source, report: str | os.PathLike[str]) -> None:
    """UsageError when the --report file would land inside SRC's folder (never modified)."""
    target = Path(os.path.realpath(Path(report).expanduser()))
    if _inside(target, Path(os.path.realpath(source.root))):
        raise UsageError(f"--report {target} is inside SRC's folder, which is never modified")


def check_manifest_dir(source: Source, folder: str | os.PathLike[str]) -> None:
    """UsageError when --manifest-dir is inside SRC's folder: its files would be taken for
    the dataset's (only the manifest's default place, SRC's top, has a reserved name)."""
    target = Path(os.path.realpath(Path(folder).expanduser()))
    if _inside(target, Path(os.path.realpath(source.root))):
        raise UsageError(
            f"--manifest-dir {target} is inside SRC's folder: leave it out to write the "
            "manifest at SRC's top, or choose a folder outside SRC"
        )
