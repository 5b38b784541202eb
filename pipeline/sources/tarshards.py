"""WebDataset tar shards as a dataset: sample i is one image member, read by its (offset,
size) in its shard through one ranged read, so any sample is reachable in any order and the
exact global shuffle (and an exact resume) works on shards as on files.

Class names: labels that are class names (`.json`) are sorted into ids; integer labels take
their names from a `classes.txt` beside the first shard (one name per line in id order, as
`pipeline-prepare --shards` writes it) when it names every id, else "0".."N-1".

A folder (or bucket prefix) of shards is served whole, so it is refused at open when it holds
shards of more than one prefix (another split's beside this one's) or compressed tars, which are
not read (`shardsets`); shards named one by one (a brace pattern, a list) are taken as named.

Samples are numbered shard by shard in the order given (a brace pattern's order), members in
tar order within a shard: the same shards give the same indices on every server.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from batchwire.pipeline.checksums import SampleKeys
from batchwire.pipeline.image_dataset import ImageDataset, dataset_root
from batchwire.pipeline.sources.labels import LabelTable
from batchwire.pipeline.sources.locate import TAR_SUFFIXES, Located, is_url
from batchwire.pipeline.sources.shardsets import (
    compressed_tars,
    shard_sets,
    shown,
    top_level_names,
)
from batchwire.pipeline.sources.tarindex import ShardIndex, cached_index
from batchwire.pipeline.storage import ObjectInfo
from batchwire.pipeline.storage.cache import pin_versions
from batchwire.pipeline.storage.errors import ObjectChanged
from batchwire.pipeline.storage.objects import ObjectStore
from batchwire.pipeline.storage.readahead import Claim, ReadAhead

log = logging.getLogger("batchwire.pipeline")
#: Problems named one by one in the log; the rest are counted.
PROBLEMS_SHOWN = 20
_INDEX_THREADS = 8
CLASSES_NAME = "classes.txt"
MAX_CLASSES_BYTES = 16 << 20
_BACKGROUND_LOCK = threading.Lock()


class MemberCutShort(ObjectChanged):
    """A member read back shorter than its index says: the shard changed or was cut since it
    was indexed (where its store could not tell by the version: `pin_versions`). The sample's
    fault (a bad sample, replaced), not a transient error."""


@dataclass
class TarReader:
    """`read(i)`: the image bytes of sample i (an `ImageDataset.reader`)."""

    located: Located
    shard_of: np.ndarray  # int32 per sample
    offsets: np.ndarray  # int64
    sizes: np.ndarray  # int64
    members: list[str] | None = None  # per sample: its image member's name in its shard
    shard_sizes: np.ndarray | None = None  # int64 per shard, as indexed
    # Members read for upcoming batches (`storage.readahead`): shards in a bucket only (a
    # local read costs no request, so it reads nothing ahead).
    ahead: ReadAhead | None = None
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    @property
    def ahead_batches(self) -> int:
        """How many upcoming batches a read is to be handed (0: it reads none ahead)."""
        return 0 if self.ahead is None else self.ahead.wants

    @property
    def ahead_bytes(self) -> int:
        """The most bytes of members `ahead` holds and reads at once (0: none)."""
        return 0 if self.ahead is None else self.ahead.budget

    def sample_keys(self) -> SampleKeys:
        """Checksum-manifest names ("SHARD:MEMBER"), with each shard's size and the member's
        offset (`pipeline.checksums`: what tells a rewritten shard from a damaged one)."""
        assert self.members is not None and self.shard_sizes is not None
        keys = self.located.keys
        return SampleKeys(
            self.located.store,
            [f"{keys[s]}:{m}" for s, m in zip(self.shard_of.tolist(), self.members, strict=True)],
            self.shard_sizes[self.shard_of],
            self.offsets,
        )

    def __call__(self, i: int) -> bytes:
        got = self.read_many([i])[0]
        if isinstance(got, OSError):
            raise got
        return got

    def read_many(
        self,
        indices: Sequence[int],
        epoch: int | None = None,
        upcoming: Sequence[Sequence[int]] = (),
    ) -> list[bytes | OSError]:
        """Several samples (`_read`); with ``epoch`` and ``upcoming`` (the next batches'
        samples, batch by batch) where this reader reads ahead, the members already read for
        this batch are taken from `ahead` (or awaited there), a read takes along the upcoming
        members that lie in the shards it reads, in the same coalesced requests, and the next
        window is read in the background (`storage.readahead`)."""
        if self.ahead is None or epoch is None:
            return self._read(indices)
        claim = self.ahead.claim(epoch, indices, upcoming, self._size, self._in_shards_of)
        got: dict[int, bytes | OSError] = dict(claim.taken)
        fetched = self._read_claimed(claim, claim.fetch + claim.along)
        if claim.later is not None:
            self._read_later(claim.later)
        got.update((i, fetched[i]) for i in claim.fetch)
        got.update(self.ahead.await_claimed(claim))
        rest = [i for i in dict.fromkeys(int(i) for i in indices) if i not in got]
        if rest:  # awaited members whose read-along failed as a whole
            got.update(zip(rest, self._read(rest), strict=True))
        return [got[int(i)] for i in indices]

    def _read_claimed(self, claim: Claim, wanted: list[int]) -> dict[int, bytes | OSError]:
        """``wanted``'s bytes, ``claim``'s read-along settled whatever happens."""
        fetched: dict[int, bytes | OSError] = {}
        try:
            if wanted:
                fetched = dict(zip(wanted, self._read(wanted), strict=True))
        finally:
            assert self.ahead is not None
            self.ahead.settle(claim, fetched)
        return fetched

    def _read_later(self, later: Claim) -> None:
        """``later``'s window read on the background thread; settled empty (its batches read
        their members themselves) when it cannot start (the interpreter is exiting)."""
        try:
            self._background().submit(self._read_claimed, later, later.along)
        except RuntimeError:
            assert self.ahead is not None
            self.ahead.settle(later, {})

    def _background(self) -> ThreadPoolExecutor:
        """The one thread that reads windows ahead (made on first use)."""
        with _BACKGROUND_LOCK:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="read-ahead")
            return self._pool

    def _size(self, i: int) -> int:
        return int(self.sizes[i])

    def _in_shards_of(self, indices: Sequence[int]) -> Callable[[int], bool]:
        """Whether a sample lies in one of the shards of ``indices``."""
        shards = set(self.shard_of[np.asarray(indices, dtype=np.int64)].tolist())
        return lambda i: int(self.shard_of[i]) in shards

    def _read(self, indices: Sequence[int]) -> list[bytes | OSError]:
        """Several samples, their ranges grouped by shard: one `read_ranges` per shard, all
        shards at once where the store has `read_ranges_many` (an object store keeps them in
        flight together); a failed shard read is the error of each of its samples, a short
        member a `MemberCutShort`."""
        store = self.located.store
        out: list[bytes | OSError] = [b""] * len(indices)
        by_shard: dict[int, list[int]] = {}
        for slot, i in enumerate(indices):
            by_shard.setdefault(int(self.shard_of[i]), []).append(slot)
        requests = []
        for shard, slots in by_shard.items():
            starts = [int(self.offsets[indices[s]]) for s in slots]
            ranges = [
                (a, a + int(self.sizes[indices[s]])) for a, s in zip(starts, slots, strict=True)
            ]
            requests.append((self.located.keys[shard], ranges))
        many = getattr(store, "read_ranges_many", None)
        if callable(many):
            results = many(requests)
        else:
            results = []
            for key, ranges in requests:
                try:
                    results.append(store.read_ranges(key, ranges))
                except OSError as exc:
                    results.append(exc)
        for slots, (key, ranges), got in zip(by_shard.values(), requests, results, strict=True):
            for n, (s, (start, end)) in enumerate(zip(slots, ranges, strict=True)):
                if isinstance(got, OSError):
                    out[s] = got
                elif len(got[n]) != end - start:
                    out[s] = MemberCutShort(
                        f"{self.located.name(key)}: member at byte {start} read {len(got[n])} "
                        f"of {end - start} bytes (the shard changed since it was indexed)"
                    )
                else:
                    out[s] = got[n]
        return out


def _infos(located: Located) -> list[ObjectInfo]:
    """Each shard's size and version, pinned in its store: every read of a shard is checked
    against the version indexed (one rewritten since is a bad sample, not other bytes at the
    indexed offsets) and a local cache in front of a bucket keys its entries by them."""
    with ThreadPoolExecutor(min(_INDEX_THREADS, len(located.keys))) as pool:
        infos = list(pool.map(located.store.head, located.keys))
    pin_versions(located.store, {info.key: info.version for info in infos})
    return infos


def _report(located: Located, indexes: list[ShardIndex], built: int) -> int:
    problems = [p for ix in indexes for p in ix.problems]
    for p in problems[:PROBLEMS_SHOWN]:
        log.warning("skipped: %s", p)
    if len(problems) > PROBLEMS_SHOWN:
        log.warning("%s: %d more problems", located.display, len(problems) - PROBLEMS_SHOWN)
    if problems:
        log.warning(
            "%s: skipped: %d problems in %d shards (samples of a truncated tar, members with no "
            "extension, duplicate keys, samples with no image or label, images over the size "
            "cap); the rest is served",
            located.display,
            len(problems),
            sum(bool(ix.problems) for ix in indexes),
        )
    log.info(
        "%s: %d shards (%d indexed now, %d from the index cache), %d samples, %d skipped",
        located.display,
        len(indexes),
        built,
        len(indexes) - built,
        sum(len(ix) for ix in indexes),
        len(problems),
    )
    return len(problems)


def _class_names(located: Located) -> list[str] | None:
    """The names in `classes.txt` beside the first shard, if it is there and readable."""
    folder = located.keys[0].rpartition("/")[0]
    key = f"{folder}/{CLASSES_NAME}" if folder else CLASSES_NAME
    try:
        if located.store.head(key).size > MAX_CLASSES_BYTES:
            return None
        text = located.store.read(key).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    names = [line.strip() for line in text.splitlines()]
    while names and not names[-1]:
        names.pop()
    return names if names and all(names) else None


def _is_folder(located: Located) -> bool:
    """Whether `located` is a folder's (or bucket prefix's) listing, served whole, rather than
    shards named one by one (a brace pattern, a `.tar`, a list or a list file)."""
    spec = located.display
    if "{" in spec or spec.lower().endswith(TAR_SUFFIXES):
        return False
    return is_url(spec) or Path(spec).expanduser().is_dir()


def check_folder(located: Located) -> None:
    """ValueError for a folder of shards that cannot be served as one split: compressed tars in
    it (they are not read: the folder would be served short of them), or shards of more than
    one prefix (another split's would be served as this one's)."""
    if not _is_folder(located):
        return
    packed = compressed_tars(top_level_names(located.store))
    if packed:
        raise ValueError(
            f"{located.display}: {shown(packed)}: compressed tars are not read (a sample is one "
            "read at its member's offset, which a compressed stream does not allow): decompress "
            "them in place (gunzip, zstd -d, xz -d, ...) or move them out of the folder"
        )
    sets = shard_sets(located.keys)
    if len(sets) > 1:
        folder = located.display.rstrip("/")
        patterns = [f"'{folder}/{s.pattern}'" for s in sets if s.pattern is not None]
        raise ValueError(
            f"{located.display}: holds shards of {len(sets)} prefixes (the name before the shard "
            f"number): {'; '.join(s.describe() for s in sets[:5])}"
            f"{f'; and {len(sets) - 5} more' if len(sets) > 5 else ''}. A folder is served "
            "whole, so they would all be one split (val shards served as train). Keep each "
            "split's shards in a folder of its own, or name the shards of one prefix"
            + (f": {' or '.join(patterns[:5])}" if patterns else " in a list file")
        )


def open_tar(located: Located, cache_dir: str | os.PathLike[str]) -> ImageDataset:
    """The samples of every shard of `located` (see the module doc)."""
    check_folder(located)  # first: a folder of only compressed tars is named as such
    if not located.keys:
        raise ValueError(f"{located.display}: no tar shards")
    infos = _infos(located)

    def index(k: int) -> tuple[ShardIndex, bool]:
        return cached_index(located.store, infos[k], located.name(located.keys[k]), cache_dir)

    with ThreadPoolExecutor(min(_INDEX_THREADS, len(infos))) as pool:
        got = list(pool.map(index, range(len(infos))))
    indexes = [ix for ix, _ in got]
    skipped = _report(located, indexes, sum(not cached for _, cached in got))
    table = LabelTable()
    names: list[str] = []
    members: list[str] = []
    for k, ix in enumerate(indexes):
        shard = located.name(located.keys[k])
        for key, ext, text, is_name in zip(
            ix.keys, ix.exts, ix.label_text, ix.label_is_name.tolist(), strict=True
        ):
            where = f"{shard}:{key}"
            table.add(text if is_name else int(text), where)
            names.append(f"{where}.{ext}")
            members.append(f"{key}.{ext}")
    if not names:
        raise ValueError(
            f"{located.display}: no usable samples in {len(indexes)} shards ({skipped} skipped; "
            "see the log): a sample needs an image member (.jpg/.jpeg/.png/.webp) and a "
            ".cls or .json label"
        )
    labels, classes = table.resolve(_class_names(located))
    reader = TarReader(
        located,
        np.concatenate([np.full(len(ix), k, np.int32) for k, ix in enumerate(indexes)]),
        np.concatenate([ix.offsets for ix in indexes]),
        np.concatenate([ix.sizes for ix in indexes]),
        members,
        np.asarray([info.size for info in infos], dtype=np.int64),
        ahead=ReadAhead() if isinstance(located.store, ObjectStore) else None,
    )
    return ImageDataset(
        paths=names,
        labels=labels,
        classes=classes,
        root=dataset_root(located.name(located.keys[0])),
        kind="tar",
        reader=reader,
    )
