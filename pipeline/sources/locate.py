"""What a `--train`/`--val` argument names: the kind of source and where its objects are.

A source is given as a path, a URL (`s3://bucket/prefix/...`), a brace pattern over either
(`dir/train-{000000..000146}.tar`, as WebDataset writes them), or a list of those. The kind is
picked from what the objects are, cheapest test first: the name's extension, then the first
bytes (a tar's `ustar` magic, Parquet's `PAR1`), then the first line of a text file (a list
file's `path label`, a CSV's commas, a JSON line's brace, a bare list of shard names). So a tar
given to `--train` is read as shards, not as a list file that "is not UTF-8 text".

Kinds: "folder" and "list" (the classic two, opened by `folder.py`), "csv", "jsonl"
and "namedlist" (manifests; the last a list file whose labels are class names), "tar"
(WebDataset shards), "parquet" (Hugging Face datasets layout).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from batchwire.pipeline.index_cache import named_few
from batchwire.pipeline.listfile import refuse_an_image
from batchwire.pipeline.storage import LocalStore, Store
from batchwire.pipeline.storage.urls import redact

log = logging.getLogger(__name__)

TAR_SUFFIXES = (".tar",)
#: Tars a shard folder may not hold (a sample is one read at its offset, which they do not allow):
#: a folder of them is taken for shards, so that opening it names them (`shardsets`).
COMPRESSED_TAR_SUFFIXES = (
    ".tar.gz",
    ".tgz",
    ".tar.zst",
    ".tar.zstd",
    ".tzst",
    ".tar.bz2",
    ".tbz2",
    ".tar.xz",
    ".txz",
    ".tar.lz4",
    ".tar.lzma",
)
PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv", ".tsv")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_SNIFF_BYTES = 4096
#: Most objects a brace pattern may expand to (a typo like {0..99999999} must not eat memory).
MAX_PATTERN_ITEMS = 1_000_000
#: Most digits a range bound may have (more cannot be a shard number; int() refuses ~4300).
_MAX_RANGE_DIGITS = 18
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"([0-9]+)\.\.([0-9]+)")  # ASCII digits: str.isdigit() also takes '²'


@dataclass(frozen=True)
class Located:
    """A source's objects: `keys` in `store`, in the order given, and its kind."""

    kind: str
    store: Store
    keys: list[str]
    display: str  # what logs and errors show: the argument as given (never a credential)

    def name(self, key: str) -> str:
        """How one object is shown: a path, or the URL."""
        root = self.store.display.rstrip("/")
        return f"{root}/{key}" if key else root


def is_url(text: str) -> bool:
    return "://" in text


def expand_braces(pattern: str) -> list[str]:
    """`a-{000..003}.tar` -> a-000.tar .. a-003.tar (zero padding kept, as in WebDataset and
    bash: a bound written with a leading zero pads every number to the wider bound's width),
    `{a,b}` alternatives, several groups; ValueError for a malformed or huge one, naming the
    whole pattern (without a URL's credentials). The count is checked before any name is made."""
    shown = redact(pattern)
    groups = [_brace_group(m.group(1), shown) for m in _BRACE.finditer(pattern)]
    literals = _BRACE.split(pattern)[::2]  # the text between the groups
    if any("{" in text or "}" in text for text in literals):
        raise ValueError(f"{shown!r}: unbalanced or nested braces")
    if math.prod(len(g) for g in groups) > MAX_PATTERN_ITEMS:
        raise ValueError(f"{shown!r}: expands to more than {MAX_PATTERN_ITEMS} names")
    parts: list[Iterable[str]] = [[literals[0]]]
    for group, text in zip(groups, literals[1:], strict=True):
        parts += [group, [text]]
    return ["".join(chosen) for chosen in itertools.product(*parts)]


@dataclass(frozen=True)
class _Numbers:
    """A brace range's names, made when iterated (its length is checked first)."""

    values: range
    width: int

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[str]:
        return (str(v).zfill(self.width) for v in self.values)


def _brace_group(body: str, shown: str) -> list[str] | _Numbers:
    """One `{...}`'s names: `LOW..HIGH` (ASCII digits) or comma-separated alternatives."""
    if ".." not in body:
        return body.split(",")
    m = _RANGE.fullmatch(body)
    if m is None:
        raise ValueError(f"{shown!r}: a range must be {{LOW..HIGH}} with digits")
    lo_s, hi_s = m.groups()
    if max(len(lo_s), len(hi_s)) > _MAX_RANGE_DIGITS:
        raise ValueError(f"{shown!r}: a range bound of more than {_MAX_RANGE_DIGITS} digits")
    lo, hi = int(lo_s), int(hi_s)
    if hi < lo or hi - lo + 1 > MAX_PATTERN_ITEMS:
        raise ValueError(f"{shown!r}: empty or too large range {{{body}}}")
    padded = any(len(s) > 1 and s.startswith("0") for s in (lo_s, hi_s))
    return _Numbers(range(lo, hi + 1), max(len(lo_s), len(hi_s)) if padded else 0)


def _suffix_kind(name: str) -> str | None:
    low = name.lower()
    for kind, suffixes in (
        ("tar", TAR_SUFFIXES),
        ("parquet", PARQUET_SUFFIXES),
        ("csv", CSV_SUFFIXES),
        ("jsonl", JSONL_SUFFIXES),
    ):
        if low.endswith(suffixes):
            return kind
    return None


def sniff_bytes(head: bytes) -> str | None:
    """The kind the first bytes of a file say: "tar", "parquet", or None (text or unknown)."""
    if head.startswith(b"PAR1"):
        return "parquet"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def sniff_text(head: bytes) -> str:
    """The kind a text file's first content line says: "list" (`path label`, today's list
    file, also for anything unrecognised: its parser gives the precise error), "csv", "jsonl",
    or "shardlist" (bare names of .tar / .parquet objects)."""
    text = head.decode("utf-8", "replace")
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            return "jsonl"
        parts = line.rsplit(None, 1)
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            return "list"
        if "," in line:
            return "csv"
        if len(parts) == 1 and _suffix_kind(line) in ("tar", "parquet"):
            return "shardlist"
        if len(parts) == 2:
            return "namedlist"  # `path classname`: a list file labelled by class names
        return "list"
    return "list"


def _read_head(path: Path) -> bytes:
    from batchwire.pipeline.decode.files import NotARegularFile

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(f"not a regular file: {path}")
        return os.read(fd, _SNIFF_BYTES)
    finally:
        os.close(fd)


def _folder_kind(path: Path) -> str:
    """ "folder" for an ImageFolder (any visible sub-folder, or nothing recognisable: today's
    errors), "tar" / "parquet" for a flat folder of shards or Parquet files."""
    found: set[str] = set()
    with os.scandir(path) as it:
        for e in it:
            if e.name.startswith("."):
                continue
            if e.is_dir():
                return "folder"
            kind = _suffix_kind(e.name)
            if kind in ("tar", "parquet"):
                found.add(kind)
            elif e.name.lower().endswith(COMPRESSED_TAR_SUFFIXES):
                found.add("tar")
    if len(found) == 1:
        return found.pop()
    return "folder"


def local_kind(path: Path) -> str:
    """The kind of one existing local path (see the module doc)."""
    if path.is_dir():
        return _folder_kind(path)
    by_name = _suffix_kind(path.name)
    if by_name is not None:
        return by_name
    head = _read_head(path)
    return sniff_bytes(head) or sniff_text(head)


def is_classic(spec: object) -> bool:
    """Whether `spec` is one of today's two kinds (ImageFolder tree, list file) or a missing
    local path: `folder.open_folder_or_list` opens (or refuses) those, nothing is sniffed."""
    if not isinstance(spec, (str, os.PathLike)):
        return False
    text = os.fspath(spec)
    if is_url(text) or _BRACE.search(text):
        return False
    p = Path(text).expanduser()
    if not p.exists():
        return True
    try:
        return local_kind(p.resolve()) in ("folder", "list")
    except OSError:
        return True  # let today's code say what is wrong with it


def _common_local(paths: list[Path]) -> tuple[LocalStore, list[str]]:
    root = Path(os.path.commonpath([str(p.parent) for p in paths]))
    return LocalStore(root), [p.relative_to(root).as_posix() for p in paths]


def _common_url(urls: list[str]) -> tuple[Store, list[str]]:
    from batchwire.pipeline import storage

    open_store = getattr(storage, "open_store", None)
    if open_store is None:
        raise ValueError(
            f"{redact(urls[0])}: reading object storage needs batchwire's object-store backend "
            "(pipeline.storage.open_store), which this installation lacks"
        )
    parents = {u.rsplit("/", 1)[0] for u in urls}
    if len(parents) == 1:
        root = parents.pop()
    else:
        split = [u.rsplit("/", 1)[0].split("/") for u in urls]
        common = split[0]
        for parts in split[1:]:
            n = 0
            while n < min(len(common), len(parts)) and common[n] == parts[n]:
                n += 1
            common = common[:n]
        root = "/".join(common)
    if "://" not in root or root.endswith(":/"):
        raise ValueError(f"{redact(urls[0])}: objects of one source must be in one bucket")
    store = open_store(root)
    return store, [u[len(root) + 1 :] for u in urls]


def _names_of(spec: str | os.PathLike[str] | Sequence[str]) -> list[str]:
    if isinstance(spec, (str, os.PathLike)):
        return expand_braces(os.fspath(spec))
    out: list[str] = []
    for item in spec:
        out.extend(expand_braces(os.fspath(item)))
    if not out:
        raise ValueError("an empty list of shards")
    return out


def _read_shard_list(path: Path) -> list[str]:
    """A text file naming one shard (path or URL) per line; relative to its folder."""
    from batchwire.pipeline.decode.files import read_file

    text = read_file(path).decode("utf-8", "replace")
    out: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        out.append(line if is_url(line) or os.path.isabs(line) else str(path.parent / line))
    return out


def _single_url(url: str, display: str) -> Located | None:
    """A manifest URL, or a prefix holding only shards or only Parquet files (listed once);
    None for a URL naming one shard or Parquet file (handled with lists)."""
    kind = _suffix_kind(PurePosixPath(url).name)
    if kind in ("tar", "parquet"):
        return None
    if kind in ("csv", "jsonl"):
        store, keys = _common_url([url])
        return Located(kind, store, keys, display)
    store, _ = _common_url([url.rstrip("/") + "/x"])
    kinds: dict[str, list[str]] = {}
    for info in store.list(""):
        if "/" not in info.key:
            k = _suffix_kind(info.key)
            if k in ("tar", "parquet"):
                kinds.setdefault(k, []).append(info.key)
    if len(kinds) == 1:
        kind, keys = kinds.popitem()
        return Located(kind, store, sorted(keys), display)
    return Located("folder", store, [], display)


def _beside(path: Path) -> Path:
    """`path` made absolute with its folder resolved but not its name: a shard that is a symlink
    (into a content-addressed cache, say) keeps its own name and folder, so that it is shown,
    and `classes.txt` beside it is found, as when its folder is given."""
    return path.expanduser().absolute().parent.resolve() / path.name


def _shards_in(folder: Path, kind: str) -> list[str]:
    """The visible regular files of ``kind`` in ``folder``, sorted. One named as a shard but not
    a regular file (a FIFO, a device, a folder, a dangling link) is left out with a warning: the
    dataset is then smaller than its names say."""
    named = [
        e for e in os.scandir(folder) if not e.name.startswith(".") and _suffix_kind(e.name) == kind
    ]
    left_out = sorted(e.name for e in named if not e.is_file())
    if left_out:
        log.warning(
            "%s: %d name(s) of %s shards left out, not regular files: %s",
            folder,
            len(left_out),
            kind,
            named_few(left_out),
        )
    return sorted(e.name for e in named if e.is_file())


def locate(spec: str | os.PathLike[str] | Sequence[str]) -> Located:
    """The kind and objects of a non-classic source (see `is_classic`).

    FileNotFoundError for a missing local object; ValueError for a mix of kinds or places.
    Neither errors nor `Located.display` repeat a URL's user info or query string."""
    display = redact(
        os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else ", ".join(map(str, spec[:3]))
    )
    names = _names_of(spec)
    if len(names) == 1 and not is_url(names[0]):
        p = Path(names[0]).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"dataset path does not exist: {p}")
        if p.is_file():
            refuse_an_image(_read_head(p.resolve()), str(p))
        kind = local_kind(p.resolve())
        if p.is_dir():
            p = p.resolve()
            return Located(kind, LocalStore(p), _shards_in(p, kind), display)
        if kind == "shardlist":
            names = _read_shard_list(p.resolve())
        else:
            p = _beside(p) if kind in ("tar", "parquet") else p.resolve()
            return Located(kind, LocalStore(p.parent), [p.name], display)
    if len(names) == 1 and is_url(names[0]):
        located = _single_url(names[0], display)
        if located is not None:
            return located
    kinds = set()
    for name in names:
        kind = _suffix_kind(PurePosixPath(name).name)
        if kind not in ("tar", "parquet"):
            raise ValueError(
                f"{redact(name)}: a pattern or list of objects must name .tar shards or .parquet "
                "files"
            )
        kinds.add(kind)
    if len(kinds) != 1:
        raise ValueError(f"{display}: mixes tar shards and Parquet files")
    kind = kinds.pop()
    urls = [n for n in names if is_url(n)]
    if urls and len(urls) != len(names):
        raise ValueError(f"{display}: mixes local paths and URLs")
    if urls:
        store, keys = _common_url(names)
        return Located(kind, store, keys, display)
    paths = [_beside(Path(n)) for n in names]
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(
            f"{display}: {len(missing)} of {len(paths)} files do not exist, e.g. {missing[0]}"
        )
    store, keys = _common_local(paths)
    return Located(kind, store, keys, display)
