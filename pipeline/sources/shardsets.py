"""What a folder of tar shards holds: sets of shards, and files that are no shards at all.

A folder (or bucket prefix) given as a source is served whole, so it must hold one split. Shards
of one split are named alike but for their shard number (`train-000000.tar`, `train-000001.tar`):
a set. The shard number is the last run of digits that differs between names otherwise alike,
so its prefix is everything before it: `imagenet1k-train-000003.tar` is of set `imagenet1k-train-`,
`train-00003-of-00010.tar` of `train-` (the total is the same in every name), and `train-*.tar`
beside `val-*.tar` are two sets (a val split leaking into train). A name with no number is a set
of its own. `pipeline-prepare --shards` uses the same rule, so it never writes a folder that the
server would refuse.

Compressed tars (`.tar.gz`, `.tgz`, `.tar.zst`, ...) are not read: a sample is one ranged read
at its member's offset, which a compressed stream does not allow.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from batchwire.pipeline.sources.locate import (
    COMPRESSED_TAR_SUFFIXES,
    MAX_PATTERN_ITEMS,
    expand_braces,
)
from batchwire.pipeline.storage import LocalStore, Store

_RUN = re.compile(r"[0-9]+")
#: Names shown in an error before "and N more".
NAMES_SHOWN = 5


@dataclass(frozen=True)
class ShardSet:
    """Shards named alike but for their shard number, in shard-number order."""

    names: list[str]
    prefix: str  # the part before the shard number (a name without one: the whole name)
    pattern: str | None  # a brace pattern naming exactly `names`; None: their numbers have gaps

    def describe(self) -> str:
        """`train-* (10 shards: train-000000.tar .. train-000009.tar)`, `val-* (1 shard:
        val-000000.tar)`; a name without a number as it is."""
        if self.prefix == self.names[0]:
            return self.prefix
        if len(self.names) == 1:
            return f"{self.prefix}* (1 shard: {self.names[0]})"
        return f"{self.prefix}* ({len(self.names)} shards: {self.names[0]} .. {self.names[-1]})"


def _numbered(name: str, run: int) -> tuple[str, str, str]:
    """`name` cut around its `run`-th digit run: (head, digits, tail)."""
    m = list(_RUN.finditer(name))[run]
    return name[: m.start()], m.group(), name[m.end() :]


def _pattern(names: list[str], run: int) -> str | None:
    """A brace pattern naming exactly `names` (numbers a contiguous range), else None."""
    head, first, tail = _numbered(names[0], run)
    last = _numbered(names[-1], run)[1]
    if int(last) - int(first) + 1 != len(names) or len(names) > MAX_PATTERN_ITEMS:
        return None
    pattern = f"{head}{{{first}..{last}}}{tail}"
    return pattern if expand_braces(pattern) == names else None


def shard_sets(names: Sequence[str]) -> list[ShardSet]:
    """`names` (tar names in one folder) grouped into sets (see the module doc), in name order."""
    alike: dict[str, list[str]] = {}  # every digit run masked
    for name in sorted(names):
        alike.setdefault(_RUN.sub("#", name), []).append(name)
    sets: list[ShardSet] = []
    for group in alike.values():
        runs = [_RUN.findall(n) for n in group]
        varying = [k for k in range(len(runs[0])) if len({r[k] for r in runs}) > 1]
        if not varying:  # one name (equal runs and equal masks make equal names)
            if not runs[0]:
                sets.append(ShardSet(group, group[0], group[0]))
                continue
            varying = [len(runs[0]) - 1]  # its last number is its shard number
        run = varying[-1]
        by_prefix: dict[tuple[str, str], list[str]] = {}
        for name in group:
            head, _, tail = _numbered(name, run)
            by_prefix.setdefault((head, tail), []).append(name)
        for (head, _), members in by_prefix.items():
            members.sort(key=lambda n: int(_numbered(n, run)[1]))
            one = members[0] if len(members) == 1 else None
            sets.append(ShardSet(members, head, one or _pattern(members, run)))
    return sorted(sets, key=lambda s: s.names[0])


def top_level_names(store: Store) -> list[str]:
    """The visible object names directly in `store`'s root (not the subtree's): one directory
    read on a disk, one delimited listing on a bucket."""
    if isinstance(store, LocalStore):
        with os.scandir(store.root) as it:
            return sorted(e.name for e in it if not e.name.startswith(".") and e.is_file())
    list_top = getattr(store, "list_top", None)
    listed = list_top("")[1] if callable(list_top) else store.list("")
    return sorted(o.key for o in listed if "/" not in o.key and not o.key.startswith("."))


def compressed_tars(names: Sequence[str]) -> list[str]:
    return [n for n in names if n.lower().endswith(COMPRESSED_TAR_SUFFIXES)]


def shown(names: Sequence[str]) -> str:
    """Up to `NAMES_SHOWN` names, then how many more."""
    more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    return ", ".join(names[:NAMES_SHOWN]) + more
