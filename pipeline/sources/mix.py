"""Mixtures: several sources served as one split, each part by weight, repeat or count.

Declared as ``mix:NAME=VALUE@SOURCE,NAME=VALUE@SOURCE[;labels=separate]`` (``--train``,
``--val``) or a TOML ``[train.mix]`` table (`parse_mix`); VALUE is a weight (``0.7``),
``repeat:R`` (epochs of the part per mix epoch) or ``choose:N`` (samples per mix epoch), the
same kind for every part. Each part is any source batchwire opens (`open_dataset`: folder, list
file, manifest, tar shards, Parquet, bucket), with its own checksum manifest.

The mix is one `ImageDataset` (`MixDataset`) whose indices are the parts' samples back to back,
each part in as many copies as one epoch may draw it (`pipeline.mix_order`: the layout, and
the order of an epoch, a pure function of (seed, epoch)). Reads, checksums and metadata go to
the part that owns an index; a bad sample's substitutes come from the same part and copy
(`substitute_range`). Labels: ``shared`` (default) maps every part's class names into their
union, sorted (numeric names first by value, then the others), so one name is one class in
every part; ``separate`` keeps each part's own label ids, and the sample's part tells which
space they are in. Either way each sample's metadata carries ``part`` (its part's name).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from batchwire.pipeline.checksums import Verdict
from batchwire.pipeline.image_dataset import ImageDataset
from batchwire.pipeline.mix_order import MixPlan
from batchwire.pipeline.sources.labels import NO_LABEL
from batchwire.pipeline.sources.metadata import (
    MAX_BATCH_METADATA_BYTES,
    MetadataError,
    PackedMetadata,
    Scalar,
    metadata_bytes,
)
from batchwire.pipeline.storage.urls import is_url, redact_url

PREFIX = "mix:"
LABEL_MODES = ("shared", "separate")
#: The metadata key naming a sample's part.
PART_KEY = "part"
_PACKED_KEY = bytes([0xA0 | len(PART_KEY)]) + PART_KEY.encode()  # msgpack's "part"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
# A part starts where a comma is followed by NAME=: sources may hold commas of their own
# (brace patterns {a,b}) as long as no element looks like NAME=.
_PART_SPLIT = re.compile(r",(?=\s*[A-Za-z0-9_][A-Za-z0-9_.-]*\s*=)")


@dataclass(frozen=True)
class MixPart:
    """One part as declared: its name, source, how it is drawn and a class-name prefix."""

    name: str
    source: str
    mode: str = "weight"  # `mix_order.MODES`
    value: float = 1.0
    prefix: str = ""  # put before the part's class names (shared labels), e.g. "web/"


@dataclass(frozen=True)
class MixSpec:
    parts: tuple[MixPart, ...]
    labels: str = "shared"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.parts)

    def plan(self, sizes: Sequence[int], train: bool, schedule: str | None = None) -> MixPlan:
        """The mix's `MixPlan` over parts of ``sizes``. Validation ignores weights: each part
        once, in order (``train=False``)."""
        if not train:
            return MixPlan(tuple(sizes), "repeat", (1.0,) * len(sizes))
        mode = self.parts[0].mode
        return MixPlan(
            tuple(sizes),
            mode,
            tuple(p.value for p in self.parts),
            parse_schedule(schedule, self) if schedule else (),
        )


def is_mix(value: object) -> bool:
    """Whether a --train/--val value (a string, or a TOML table) declares a mix."""
    if isinstance(value, dict):
        return "mix" in value
    return isinstance(value, str) and value.startswith(PREFIX)


def parse_mix(value: str | dict[str, Any], where: str = "mix") -> MixSpec:
    """A `MixSpec` from ``mix:...`` text or a TOML table ``{"mix": {...}}``; ValueError naming
    ``where`` and what is wrong."""
    try:
        spec = _from_table(value["mix"]) if isinstance(value, dict) else _from_text(value)
        _check(spec)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return spec


def _from_text(text: str) -> MixSpec:
    body = text[len(PREFIX) :] if text.startswith(PREFIX) else text
    body, _, options = body.partition(";")
    labels = "shared"
    for option in filter(None, (o.strip() for o in options.split(";"))):
        key, _, val = option.partition("=")
        if key.strip() != "labels":
            raise ValueError(f"unknown mix option {key.strip()!r} (known: labels)")
        labels = val.strip()
    parts = []
    for item in filter(None, (s.strip() for s in _PART_SPLIT.split(body))):
        head, at, source = item.partition("@")
        name, eq, value = head.partition("=")
        if not (eq and at and source.strip()):
            raise ValueError(f"{item!r} is not NAME=VALUE@SOURCE (e.g. web=0.7@/data/web)")
        mode, val = _value(value.strip())
        parts.append(MixPart(name.strip(), _local(source.strip()), mode, val))
    return MixSpec(tuple(parts), labels)


def _value(text: str) -> tuple[str, float]:
    mode, colon, number = text.partition(":")
    if not colon:
        mode, number = "weight", text
    if mode not in ("weight", "repeat", "choose"):
        raise ValueError(f"{text!r}: a weight (0.7), repeat:R or choose:N")
    try:
        return mode, float(number)
    except ValueError:
        raise ValueError(f"{text!r}: {number!r} is not a number") from None


def _from_table(table: object) -> MixSpec:
    if not isinstance(table, dict):
        raise ValueError("[train.mix] must be a table of parts")
    labels = table.get("labels", "shared")
    parts = []
    for name, part in table.items():
        if name == "labels":
            continue
        if not isinstance(part, dict):
            raise ValueError(f"{name!r}: a part is a table (source = ..., weight = ...)")
        unknown = set(part) - {"source", "weight", "repeat", "choose", "prefix"}
        if unknown:
            raise ValueError(f"part {name!r}: unknown keys {sorted(unknown)}")
        modes = [m for m in ("weight", "repeat", "choose") if m in part]
        if len(modes) > 1 or not isinstance(part.get("source"), str):
            raise ValueError(
                f"part {name!r} needs source = PATH and one of weight, repeat or choose"
            )
        mode = modes[0] if modes else "weight"
        value = part.get(mode, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"part {name!r}: {mode} must be a number, got {value!r}")
        prefix = part.get("prefix", "")
        if not isinstance(prefix, str):
            raise ValueError(f"part {name!r}: prefix must be a string")
        parts.append(MixPart(name, _local(part["source"]), mode, float(value), prefix))
    return MixSpec(tuple(parts), labels)


def _local(source: str) -> str:
    return source if is_url(source) else str(Path(source).expanduser())


def _check(spec: MixSpec) -> None:
    if not spec.parts:
        raise ValueError("a mix needs at least one part (NAME=VALUE@SOURCE)")
    if spec.labels not in LABEL_MODES:
        raise ValueError(f"labels must be one of {list(LABEL_MODES)}, got {spec.labels!r}")
    names = spec.names
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"part name {name!r}: 1 to 64 of letters, digits, _ . -")
    if len(set(names)) != len(names):
        raise ValueError(f"part names must differ, got {list(names)}")
    modes = {p.mode for p in spec.parts}
    if len(modes) > 1:
        raise ValueError(
            f"every part is drawn the same way (weight, repeat or choose), got {sorted(modes)}"
        )
    MixPlan((1,) * len(spec.parts), spec.parts[0].mode, tuple(p.value for p in spec.parts))


def parse_schedule(text: str, spec: MixSpec) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """``EPOCH:NAME=W,NAME=W;EPOCH:...`` -> (epoch, weights) entries; a part not named in an
    entry keeps its weight from before."""
    if spec.parts[0].mode != "weight":
        raise ValueError("--mix-schedule changes weights: the mix must give weights")
    index = {name: i for i, name in enumerate(spec.names)}
    current = [p.value for p in spec.parts]
    out = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        epoch, colon, rest = entry.partition(":")
        try:
            start = int(epoch)
        except ValueError:
            start = -1
        if not colon or start < 0:
            raise ValueError(f"--mix-schedule {entry!r}: EPOCH:NAME=WEIGHT,... (e.g. 5:web=0.5)")
        for item in filter(None, (s.strip() for s in rest.split(","))):
            name, _, weight = item.partition("=")
            if name.strip() not in index:
                raise ValueError(f"--mix-schedule: no part {name.strip()!r} in {list(index)}")
            current[index[name.strip()]] = _value(weight.strip())[1]
        out.append((start, tuple(current)))
    return tuple(out)


# ------------------------------------------------------------------------------ the dataset


def class_sort_key(name: str) -> tuple[int, int, str]:
    """Numeric class names (label ids of list files) first, by value; then the others."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


class _Blocks:
    """Index -> (part, sample of the part) over the plan's blocks (`MixPlan.blocks`)."""

    def __init__(self, plan: MixPlan) -> None:
        self.starts = [at for at, _, _ in plan.blocks]
        self.owners = [p for _, p, _ in plan.blocks]
        self.sizes = plan.sizes
        self.total = plan.num_indices

    def _block(self, i: int) -> int:
        return bisect.bisect_right(self.starts, int(i) % self.total) - 1

    def locate(self, i: int) -> tuple[int, int]:
        b = self._block(i)
        return self.owners[b], int(i) % self.total - self.starts[b]

    def block(self, i: int) -> tuple[int, int]:
        b = self._block(i)
        return self.starts[b], self.starts[b] + self.sizes[self.owners[b]]


class _PartItems(Sequence):
    """A per-sample sequence of the mix read through its parts' (paths or metadata)."""

    def __init__(self, blocks: _Blocks, get: Callable[[int, int], Any]) -> None:
        self._blocks, self._get = blocks, get

    def __len__(self) -> int:
        return self._blocks.total

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= int(i) < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} samples")
        return self._get(*self._blocks.locate(i))


@dataclass(repr=False)
class MixDataset(ImageDataset):
    """The parts of a mix as one dataset (module doc); `plan` orders its train epochs."""

    parts: tuple[ImageDataset, ...] = ()
    names: tuple[str, ...] = ()
    plan: MixPlan | None = None
    label_mode: str = "shared"
    prefixes: tuple[str, ...] = ()  # each part's class-name prefix (`MixPart.prefix`)
    _blocks: _Blocks | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        shown = ", ".join(f"{n}: {len(p)}" for n, p in zip(self.names, self.parts, strict=True))
        return f"MixDataset({shown}; {self.num_classes} classes, labels {self.label_mode})"

    @property
    def fingerprint(self) -> str:
        """A short hash of what makes this mix's batches: each part's name, size and prefix,
        the labels mode, how parts are drawn (weights, repeat or choose values) and the
        schedule. A fleet's servers must agree on it (the welcome's ``mix_fingerprint``):
        equal counts of batches and classes do not make two mixes equal. Where a part is read
        from is left out, as a plain dataset's location is: one server may read a bucket,
        another a local copy of it (and no URL, so no credential, goes into it)."""
        assert self.plan is not None
        canonical = {
            "parts": [
                [name, size, prefix]
                for name, size, prefix in zip(
                    self.names,
                    self.plan.sizes,
                    self.prefixes or ("",) * len(self.names),
                    strict=True,
                )
            ],
            "labels": self.label_mode,
            "mode": self.plan.mode,
            "values": list(self.plan.values),
            "schedule": [[start, list(values)] for start, values in self.plan.schedule],
        }
        text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def part_of(self, i: int) -> tuple[int, int]:
        """(part, sample of that part) of mix index ``i``."""
        assert self._blocks is not None
        return self._blocks.locate(i)

    def substitute_range(self, i: int) -> tuple[int, int]:
        """The copy block of ``i``'s part: a bad sample's substitutes come from there."""
        assert self._blocks is not None
        return self._blocks.block(i)

    def read_bytes(self, i: int) -> bytes:
        p, k = self.part_of(i)
        return self.parts[p].read_bytes(k)

    def read_many(self, indices: Sequence[int]) -> list[bytes | OSError | None] | None:
        """Batched reads part by part; None entries for the parts that read one sample at a
        time (local files: read on the decoder's threads as alone), None when no part has
        batched reads."""
        located = [self.part_of(i) for i in indices]
        out: list[bytes | OSError | None] = [None] * len(located)
        batched = False
        for p, part in enumerate(self.parts):
            slots = [s for s, (q, _) in enumerate(located) if q == p]
            got = part.read_many([located[s][1] for s in slots]) if slots else None
            if got is not None:
                batched = True
                for s, g in zip(slots, got, strict=True):
                    out[s] = g
        return out if batched else None

    def checksum_problem(self, i: int, data: bytes) -> str | None:
        p, k = self.part_of(i)
        return self.parts[p].checksum_problem(k, data)

    def checksum_verdict(self, i: int, data: bytes) -> Verdict:
        p, k = self.part_of(i)
        return self.parts[p].checksum_verdict(k, data)

    def check_metadata(self, batch_size: int, where: str) -> None:
        """`check_batch_metadata` for the mix, from its parts' sizes (no pass over every
        index): the largest ``batch_size`` samples of any part, each with its part key."""
        worst = 0
        for name, part in zip(self.names, self.parts, strict=True):
            extra = metadata_bytes({PART_KEY: name}) + 2  # the key, and a grown map header
            meta = part.metadata
            if meta is None:
                sizes = [1] * min(batch_size, len(part))
            elif isinstance(meta, PackedMetadata):
                sizes = sorted((meta.nbytes(i) for i in range(len(meta))), reverse=True)
            else:
                sizes = sorted((metadata_bytes(m) for m in meta), reverse=True)
            worst = max(worst, sum(sizes[:batch_size]) + extra * min(batch_size, len(sizes)))
        if worst > MAX_BATCH_METADATA_BYTES:
            raise MetadataError(
                f"{where}: a batch of {batch_size} could carry {worst} bytes of metadata, more "
                f"than {MAX_BATCH_METADATA_BYTES}; drop metadata columns or use a smaller batch"
            )


def open_mix(
    spec: MixSpec,
    open_part: Callable[[str], ImageDataset],
    *,
    train: bool,
    schedule: str | None = None,
) -> MixDataset:
    """Open every part with ``open_part`` (`open_dataset` with the server's checksum and root
    settings) and build the mix; ValueError naming the part on a problem."""
    parts = []
    for part in spec.parts:
        try:
            parts.append(open_part(part.source))
        except (OSError, ValueError) as exc:
            raise type(exc)(f"mix part {part.name!r} ({redact_url(part.source)}): {exc}") from None
    plan = spec.plan([len(p) for p in parts], train, schedule)
    blocks = _Blocks(plan)
    classes, maps = _label_spaces(spec, parts)
    labels = np.concatenate([maps[p][parts[p].labels] for _, p, _ in plan.blocks])
    root = "mix:" + ",".join(
        f"{p.name}@{redact_url(str(d.root))}" for p, d in zip(spec.parts, parts, strict=True)
    )
    names = spec.names
    for name, d in zip(names, parts, strict=True):
        _check_part_key(name, d)
    return MixDataset(
        paths=_PartItems(blocks, lambda p, k: parts[p].paths[k]),
        labels=labels,
        classes=classes,
        root=root,
        kind="mix",
        label_rows=_label_rows(parts, maps, plan),
        metadata=_PartItems(blocks, lambda p, k: _with_part(parts[p].metadata, k, names[p])),
        parts=tuple(parts),
        names=names,
        plan=plan,
        label_mode=spec.labels,
        prefixes=tuple(p.prefix for p in spec.parts),
        _blocks=blocks,
    )


def _label_spaces(
    spec: MixSpec, parts: Sequence[ImageDataset]
) -> tuple[list[str], list[np.ndarray]]:
    """The mix's class names, and per part the array mapping its label ids to the mix's."""
    if spec.labels == "separate":
        most = max(d.num_classes for d in parts)
        return [str(i) for i in range(most)], [np.arange(d.num_classes) for d in parts]
    named = [[p.prefix + c for c in d.classes] for p, d in zip(spec.parts, parts, strict=True)]
    classes = sorted({c for names in named for c in names}, key=class_sort_key)
    index = {c: i for i, c in enumerate(classes)}
    maps = [np.asarray([index[c] for c in names], dtype=np.int64) for names in named]
    return classes, maps


def _label_rows(
    parts: Sequence[ImageDataset], maps: Sequence[np.ndarray], plan: MixPlan
) -> np.ndarray | None:
    """Multi-label rows when some part is multi-label: every part's rows in the mix's ids,
    padded with NO_LABEL to the widest (a single-label part's row is its label)."""
    if all(d.label_rows is None for d in parts):
        return None
    width = max(max(d.label_width, 1) for d in parts)
    rows = []
    for d, m in zip(parts, maps, strict=True):
        mine = np.full((len(d), width), NO_LABEL, dtype=np.int64)
        if d.label_rows is None:
            mine[:, 0] = m[d.labels]
        else:
            own = d.label_rows
            mine[:, : own.shape[1]] = np.where(own >= 0, m[np.maximum(own, 0)], NO_LABEL)
        rows.append(mine)
    return np.concatenate([rows[p] for _, p, _ in plan.blocks])


def _with_part(
    metadata: Sequence[dict[str, Scalar] | None] | None, k: int, name: str
) -> dict[str, Scalar]:
    row = None if metadata is None else metadata[k]
    return {**(row or {}), PART_KEY: name}


def _check_part_key(name: str, dataset: ImageDataset) -> None:
    """A part whose own metadata has a ``part`` field would lose it: an error, not a silent
    overwrite (packed metadata is searched for the key's bytes, then confirmed row by row)."""
    meta = dataset.metadata
    if meta is None:
        return
    if isinstance(meta, PackedMetadata) and _PACKED_KEY not in bytes(meta._buf):
        return  # no row holds the key's msgpack bytes: no need to unpack a million rows
    if any(row is not None and PART_KEY in row for row in meta):
        raise ValueError(
            f"mix part {name!r}: its metadata has a {PART_KEY!r} field, which a mix sets to the "
            "part's name; rename that column"
        )
