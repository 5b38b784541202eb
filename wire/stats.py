"""The Stats schema: what a server says about itself, as typed records.

One schema for every reader and writer: `server.telemetry` builds a `ServerStats`, the ``stats``
reply carries its map (`StatsReply`), Prometheus and ``pipeline-monitor`` read its fields, and
the trainer's figures that ride on each credit are a `LoaderReport`. Adding a metric means a
field here and the code that measures it; the maps, their checks and ``--json`` follow.

``to_map`` and ``from_map`` are derived from each record's field types (int, float, str, a
record, a tuple of records, or ``X | None``), so they cannot drift from the fields:

- ``from_map`` checks every field and raises `ProtocolError` naming its path
  (``stats.clients[3].rank``): a server's reply cannot hand a monitor a value it would crash on
  (a string for a count, NaN or infinity for a rate). Keys it does not know are ignored, so an
  older monitor reads a newer server's stats.
- A field typed ``X | None`` may be missing or nil. One whose default is None is an optional
  section (a server may not report it): ``to_map`` leaves it out when None. One without a
  default (``ClientRow.loader``) always travels, as nil when absent.

``"v"`` is the schema's version (`STATS_VERSION`), not the protocol's.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from batchwire.wire.errors import ProtocolError, show

#: The version of this schema, the ``"v"`` of a stats map.
STATS_VERSION = 1
#: A loader report keeps at most this many figures, under names of at most this many characters:
#: a credit is small, and 256 listed clients' reports must fit a stats reply.
MAX_LOADER_FIGURES = 32
MAX_FIGURE_NAME = 64
# Counts travel as msgpack integers: nothing above uint64 is a count a peer could send.
_MAX_COUNT = 2**64 - 1

R = TypeVar("R", bound="Record")


class Record:
    """Base of the schema's frozen dataclasses: maps in and out, from the fields' types."""

    #: How an error names a record checked on its own (``ClientRow.from_map(row)``).
    WHERE: ClassVar[str] = "stats"

    def to_map(self) -> dict[str, Any]:
        """The record as plain msgpack/JSON values: records become maps, tuples lists."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue  # an optional section the server did not report
            out[f.name] = _to_plain(value)
        return out

    @classmethod
    def from_map(cls: type[R], d: object, where: str | None = None) -> R:
        """Check ``d`` field by field; `ProtocolError` names the first wrong one."""
        where = cls.WHERE if where is None else where
        if not isinstance(d, Mapping):
            raise ProtocolError(f"{where} must be a map, got {show(d)}")
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            path = f"{where}.{f.name}"
            if f.name not in d:
                if not _optional(hints[f.name]):
                    raise ProtocolError(f"{path} is missing")
                if f.default is MISSING:
                    values[f.name] = None
                continue
            values[f.name] = _check(hints[f.name], d[f.name], path)
        return cls(**values)


# --------------------------------------------------------------------------- the records


@dataclass(frozen=True)
class StageStats(Record):
    """One pipeline stage: batches in it or queued for it, its bound, recent ms per batch."""

    WHERE: ClassVar[str] = "stage"
    name: str
    depth: int
    capacity: int
    latency_ms: float


@dataclass(frozen=True)
class Throughput(Record):
    """Sent over the last few seconds; bytes are images plus labels."""

    WHERE: ClassVar[str] = "throughput"
    images_per_s: float
    batches_per_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class Counters(Record):
    """Totals since the server started (ARCHITECTURE.md says what each one counts)."""

    WHERE: ClassVar[str] = "counters"
    images_total: int
    batches_total: int
    bytes_total: int
    replaced_total: int
    bad_total: int
    errors_total: int
    malformed_total: int
    #: Images a GPU decoder handed to the CPU decoder (not a plain JPEG, over the GPU bound,
    #: refused by the strict check or the library): a user sees when "GPU decoding" is the CPU.
    #: Optional so that an older server's stats still read; a server always reports it.
    decode_fallbacks_total: int | None = None
    #: Batches produced (decoded and augmented), and sends of a batch already sent to another
    #: session (shared production, --share-window): batches_total / batches_produced_total is
    #: the share ratio. Optional so that an older server's stats still read.
    batches_produced_total: int | None = None
    batches_shared_total: int | None = None
    #: Samples a user transform (--transform/--val-transform) raised on or returned the wrong
    #: shape for, each replaced by a substitute (0 without transforms). Optional: an older
    #: server's stats still read.
    transform_errors_total: int | None = None
    #: Samples copied from the server's sample window into a batch of another batch size
    #: instead of produced again (sweeps mixing batch sizes). Optional: an older server's
    #: stats still read.
    samples_reused_total: int | None = None
    #: Samples decoded and augmented (the produced batches' samples less those reused).
    samples_produced_total: int | None = None


@dataclass(frozen=True)
class LoaderReport(Record):
    """What a trainer's loader says about itself on each credit (client/loader_stats.py).

    The four figures a `RemoteLoader` sends are typed fields, each None when a client did not
    send it; any other finite number a (newer) client sends is kept in ``extra`` under its
    name, so it reaches ``pipeline-monitor --json`` through a server that does not know it.
    A report comes from a trainer, not a server: `clean` is the server's lenient reading of
    one (drops what is unusable), `from_map` the strict reading of what a server passed on.
    """

    WHERE: ClassVar[str] = "loader"
    prefetch_depth: int | None = None
    wait_s_per_batch: float | None = None
    data_wait_fraction: float | None = None
    images_per_s: float | None = None
    extra: Mapping[str, float] = field(default_factory=dict)

    def to_map(self) -> dict[str, Any]:
        out = {k: v for k, v in _known_figures(self).items() if v is not None}
        out.update(self.extra)
        return out

    @classmethod
    def from_map(cls, d: object, where: str | None = None) -> LoaderReport:
        where = cls.WHERE if where is None else where
        if not isinstance(d, Mapping):
            raise ProtocolError(f"{where} must be a map, got {show(d)}")
        hints = _hints(cls)
        known: dict[str, Any] = {}
        extra: dict[str, float] = {}
        for key, value in d.items():
            if key in _FIGURES:
                known[key] = _check(hints[key], value, f"{where}.{key}")
            elif isinstance(key, str) and _is_number(value) and math.isfinite(value):
                extra[key] = value
            # anything else is a newer peer's business: ignored
        return cls(**known, extra=extra)

    @classmethod
    def clean(cls, raw: object) -> LoaderReport | None:
        """The server's reading of a credit's ``stats``: keep the first `MAX_LOADER_FIGURES`
        finite numbers, names cut to `MAX_FIGURE_NAME` characters; drop the rest, never raise
        (a trainer's odd figure must not cost it its stream). None for no report."""
        if not isinstance(raw, Mapping):
            return None
        known: dict[str, Any] = {}
        extra: dict[str, float] = {}
        for key, value in list(raw.items())[:MAX_LOADER_FIGURES]:
            if not _is_number(value) or not math.isfinite(value):
                continue
            name = str(key)[:MAX_FIGURE_NAME]
            if name == "prefetch_depth":
                if float(value).is_integer() and 0 <= value <= _MAX_COUNT:
                    known[name] = int(value)
            elif name in _FIGURES:
                known[name] = float(value)
            else:
                extra[name] = value
        return cls(**known, extra=extra)


_FIGURES = ("prefetch_depth", "wait_s_per_batch", "data_wait_fraction", "images_per_s")


def _known_figures(report: LoaderReport) -> dict[str, Any]:
    return {name: getattr(report, name) for name in _FIGURES}


@dataclass(frozen=True)
class ClientRow(Record):
    """One client's session (server/sessions.py ``ClientSession.row``); ``loader``: its last
    credit's report, None if it sent none."""

    WHERE: ClassVar[str] = "client"
    id: str
    split: str
    rank: int
    world_size: int
    epoch: int
    credits: int
    ready: int
    ready_capacity: int
    in_flight: int
    sent: int
    images_per_s: float
    last_seen_s: float
    loader: LoaderReport | None
    #: The hello's job (torchrun's run id, BATCHWIRE_JOB...): with split and rank, the client's
    #: stable name (Prometheus labels), where ``id`` changes with every connection. Optional so
    #: that an older server's stats still read.
    job: str | None = None
    #: Shared production of its last batch: "off", "solo", "shared" or "lagging" (it asked
    #: after the share window let the batch go, so it was produced again). Optional.
    sharing: str | None = None


@dataclass(frozen=True)
class UnlistedClients(Record):
    """The clients beyond the listed ones (the least recently heard from), summed."""

    WHERE: ClassVar[str] = "clients_unlisted"
    count: int
    credits: int
    ready: int
    in_flight: int
    sent: int
    images_per_s: float


@dataclass(frozen=True)
class BufferStats(Record):
    """The batch buffer pool: in use, allocated, the --max-buffers bound, bytes per buffer."""

    WHERE: ClassVar[str] = "buffers"
    held: int
    allocated: int
    max: int
    batch_bytes: int
    #: Bytes of batch buffers kept only for sharing (the share window's idle ones). Optional.
    window_bytes: int | None = None


@dataclass(frozen=True)
class MixPartStats(Record):
    """One part of a mixture split (``--train mix:NAME=VALUE@SOURCE,...``): its planned share
    and the samples of it sent (valid slots only, every client's sends counted)."""

    WHERE: ClassVar[str] = "part"
    name: str
    #: The part's planned share of ``MixStats.epoch``, 0 to 1 over the parts: its weight
    #: normalised (the --mix-schedule's in force then), or for repeat/choose its draws' share.
    weight: float
    served_total: int
    #: Sent of ``MixStats.epoch``; None (absent) before any batch of the split was sent.
    served_this_epoch: int | None = None


@dataclass(frozen=True)
class MixStats(Record):
    """A mixture split's parts, each one's samples served against its weight."""

    WHERE: ClassVar[str] = "mix"
    split: str
    parts: tuple[MixPartStats, ...]
    #: The epoch of the split's most recently sent batch (what ``served_this_epoch`` counts);
    #: None before any was sent.
    epoch: int | None = None


@dataclass(frozen=True)
class ServerStats(Record):
    """A server's snapshot: the ``stats`` reply and every Prometheus gauge come from one.

    ``clients_unlisted``, ``buffers`` and ``connections`` are None when the server did not
    report them (a snapshot without the server's own state, e.g. during its shutdown);
    ``mixes`` (one per mixture split) is None for a server serving no mixture, and from an
    older server.
    """

    WHERE: ClassVar[str] = "stats"
    v: int
    uptime_s: float
    time: float
    stages: tuple[StageStats, ...]
    throughput: Throughput
    counters: Counters
    clients: tuple[ClientRow, ...]
    clients_unlisted: UnlistedClients | None = None
    buffers: BufferStats | None = None
    connections: int | None = None
    mixes: tuple[MixStats, ...] | None = None

    def stage(self, name: str) -> StageStats | None:
        """The stage of that name, if the server reports it."""
        return next((s for s in self.stages if s.name == name), None)


# --------------------------------------------------------------------------- checks


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The fields' resolved types (annotations are strings here), once per record class."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _optional(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(hint: Any, value: object, path: str) -> Any:
    """``value`` as the type ``hint`` says, or `ProtocolError` naming ``path``."""
    if _optional(hint):
        if value is None:
            return None
        (hint,) = (h for h in typing.get_args(hint) if h is not type(None))
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_COUNT:
            raise ProtocolError(f"{path} must be an integer >= 0, got {show(value)}")
        return value
    if hint is float:
        if not _is_number(value) or not math.isfinite(value):  # type: ignore[arg-type]
            raise ProtocolError(f"{path} must be a finite number, got {show(value)}")
        return float(value)  # type: ignore[arg-type]
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{path} must be a string, got {show(value)}")
        return value
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{path} must be a list, got {show(value)}")
        return tuple(_check(item, x, f"{path}[{i}]") for i, x in enumerate(value))
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_map(value, path)
    raise TypeError(f"the stats schema has a field of a type it cannot check: {hint!r}")


def _to_plain(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_map()
    if isinstance(value, tuple):
        return [_to_plain(x) for x in value]
    return value
