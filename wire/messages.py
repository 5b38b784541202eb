"""The messages between `pipeline-server` (ROUTER) and its clients (DEALER), protocol v2.

Control frames are msgpack maps carrying ``"v"`` (the protocol version) and ``"type"``; batch
payloads travel as raw frames after a `BatchHeader`. Each message is a frozen dataclass with
``pack() -> bytes``; ``from_map`` validates every field of an unpacked map and raises
`ProtocolError` naming the offending one, so neither side ever sees a half-valid message.

Client -> server: `Hello`, `Credit`, `Bye`, `StatsRequest`.
Server -> client: `Welcome`, `ErrorReply`, `Shutdown`, `BatchHeader`, `StatsReply`.
To add a message: a dataclass here with its ``TYPE`` and ``from_map``, an entry in
``_CLIENT_TYPES`` or ``_SERVER_TYPES``, and a handler on the receiving side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from batchwire.wire.batch_spec import (
    DTYPES,
    LAYOUTS,
    MAX_BATCH_SIZE,
    MAX_VIEWS,
    BatchSpec,
)
from batchwire.wire.errors import PROTOCOL_VERSION, ProtocolError, show
from batchwire.wire.frames import (
    LABELS_DTYPE,
    MAX_CLIENT_FRAME_BYTES,
    MAX_LABEL_WIDTH,
    MAX_SERVER_FRAME_BYTES,
    pack,
    unpack_frame,
)
from batchwire.wire.stats import ServerStats

#: Largest credit window (batches listed and not yet received) a client may ask of a server;
#: the server's own --prefetch-depth bounds what it produces and holds for a client.
MAX_PREFETCH = 256
#: Largest output side a hello may ask for (`Hello.image_size`), and a welcome or batch header
#: may announce (`shape`, every view).
MAX_IMAGE_SIDE = 16384
#: Largest images frame a welcome or batch header may announce (all views): the loader sizes
#: its slots from the welcome (pinned host memory on CUDA), so a hostile or broken server must
#: not make it ask for terabytes. A batch of 256 images of 3 x 1024 x 1024 float32 is 3 GiB.
MAX_BATCH_NBYTES = 16 << 30
#: Longest job name in a hello.
MAX_JOB_LEN = 256
#: Longest `Welcome.mix_fingerprint` (the server sends 16 hex digits).
MAX_MIX_FINGERPRINT_LEN = 64
#: Bounds of `Welcome.classes` (ImageNet-21k's 21,841 names fit; a welcome stays well under the
#: server frame limit): a longer class list is not sent (`welcome_classes`), nor accepted.
MAX_CLASSES = 65536
MAX_CLASS_NAME_LEN = 256
MAX_CLASS_NAMES_CHARS = 2 << 20
#: The classes of `ErrorReply.reason` (an unknown one from a newer peer reads as "refused", so
#: an older client takes "busy" as the refusal it was before the reason existed).
ERROR_REASONS = ("refused", "bad-request", "transient", "failed", "busy")


# --------------------------------------------------------------------------- field checks


def _int(d: Mapping[str, Any], key: str, lo: int | None = None, hi: int | None = None) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"field {key!r} must be an integer, got {show(value)}")
    if lo is not None and value < lo:
        raise ProtocolError(f"field {key!r} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ProtocolError(f"field {key!r} must be <= {hi}, got {value}")
    return value


def _str(d: Mapping[str, Any], key: str, choices: tuple[str, ...] | None = None) -> str:
    value = d.get(key)
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"field {key!r} must be a non-empty string, got {show(value)}")
    if choices is not None and value not in choices:
        raise ProtocolError(f"field {key!r} must be one of {list(choices)}, got {show(value)}")
    return value


def _int_list(d: Mapping[str, Any], key: str, length: int | None = None) -> list[int]:
    value = d.get(key)
    if not isinstance(value, list) or any(
        isinstance(x, bool) or not isinstance(x, int) for x in value
    ):
        raise ProtocolError(f"field {key!r} must be a list of integers")
    if length is not None and len(value) != length:
        raise ProtocolError(f"field {key!r} must have {length} items, got {len(value)}")
    return value


def _float_list(d: Mapping[str, Any], key: str, length: int) -> list[float]:
    value = d.get(key)
    if (
        not isinstance(value, list)
        or len(value) != length
        or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in value)
    ):
        raise ProtocolError(f"field {key!r} must be a list of {length} numbers, got {show(value)}")
    return [float(x) for x in value]


def _map_or_none(d: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    value = d.get(key)
    if value is not None and not isinstance(value, dict):
        raise ProtocolError(f"field {key!r} must be a map or nil, got {type(value).__name__}")
    return value


def _batch_list(d: Mapping[str, Any]) -> tuple[int, ...]:
    """A hello's or credit's ``batches``: at most MAX_PREFETCH distinct indices >= 0."""
    value = d.get("batches")
    if (
        not isinstance(value, list)
        or len(value) > MAX_PREFETCH
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in value)
    ):
        raise ProtocolError(
            f"field 'batches' must be a list of at most {MAX_PREFETCH} batch indices >= 0, "
            f"got {show(value)}"
        )
    if len(set(value)) != len(value):
        raise ProtocolError(f"field 'batches' lists a batch twice: {show(value)}")
    return tuple(value)


def _shape(d: Mapping[str, Any]) -> list[int]:
    shape = _int_list(d, "shape", 4)
    b, c, h, w = shape
    if not (
        1 <= b <= MAX_BATCH_SIZE
        and c == 3
        and 1 <= h <= MAX_IMAGE_SIDE
        and 1 <= w <= MAX_IMAGE_SIDE
    ):
        raise ProtocolError(
            f"field 'shape' must be [B, 3, H, W] with B in 1..{MAX_BATCH_SIZE} and H, W in "
            f"1..{MAX_IMAGE_SIDE}, got {shape}"
        )
    return shape


def _bounded_spec(shape: list[int], dtype: str, layout: str, views: list[list[int]]) -> BatchSpec:
    """The spec a welcome or header announces, refused past `MAX_BATCH_NBYTES` (the loader
    allocates its slots from it)."""
    spec = BatchSpec.from_shape(shape, dtype, layout, views)
    if spec.nbytes > MAX_BATCH_NBYTES:
        raise ProtocolError(
            f"a batch of {spec.nbytes} bytes ({shape}, {len(views) or 1} view(s) of {dtype}) "
            f"exceeds the protocol's {MAX_BATCH_NBYTES}"
        )
    return spec


def _views(d: Mapping[str, Any], shape: list[int]) -> list[list[int]]:
    """A welcome's or header's ``views`` (absent: a single-view batch): every view's [H, W],
    the first being ``shape``'s."""
    value = d.get("views", [])
    if (
        not isinstance(value, list)
        or len(value) > MAX_VIEWS
        or any(
            not isinstance(v, list)
            or len(v) != 2
            or any(
                isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= MAX_IMAGE_SIDE
                for x in v
            )
            for v in value
        )
    ):
        raise ProtocolError(
            f"field 'views' must be a list of at most {MAX_VIEWS} [H, W] pairs in "
            f"1..{MAX_IMAGE_SIDE}, got {show(value)}"
        )
    if value and value[0] != shape[2:]:
        raise ProtocolError(f"field 'views' starts with {value[0]}, 'shape' says {shape[2:]}")
    return [list(v) for v in value]


def _image_size(d: Mapping[str, Any]) -> tuple[int, int] | None:
    """A hello's ``image_size``: absent/nil, or [H, W] of integers in 1..MAX_IMAGE_SIDE."""
    value = d.get("image_size")
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 2
        or any(
            isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= MAX_IMAGE_SIDE
            for x in value
        )
    ):
        raise ProtocolError(
            f"field 'image_size' must be [H, W] integers in 1..{MAX_IMAGE_SIDE}, got {show(value)}"
        )
    return (value[0], value[1])


def _drop_single_label(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("label_width"):  # one label per sample: the map older peers know
        m.pop("label_width", None)
    if "metadata" in m and m["metadata"] is None:  # a header without (not asked for)
        del m["metadata"]
    return m


def _metadata(d: Mapping[str, Any], batch_size: int) -> list[dict[str, Any] | None] | None:
    """A header's per-sample metadata: None (not sent), or one flat map of JSON-able scalars
    (or None) per sample."""
    value = d.get("metadata")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != batch_size:
        raise ProtocolError(f"field 'metadata' must be a list of {batch_size} maps or nulls")
    for row in value:
        if row is not None and (
            not isinstance(row, dict)
            or any(
                v is not None and not isinstance(v, (str, int, float, bool)) for v in row.values()
            )
        ):
            raise ProtocolError("field 'metadata' holds a value that is not a flat map of scalars")
    return value


def _label_width(d: Mapping[str, Any]) -> int:
    return _int(d, "label_width", 0, MAX_LABEL_WIDTH) if "label_width" in d else 0


def _drop_single_view(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("views"):  # a single-view batch: the map older peers know
        m.pop("views", None)
    return m


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class _Message:
    TYPE: ClassVar[str] = ""

    def to_map(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "type": self.TYPE, **asdict(self)}

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> _Message:
        """Build the message from an unpacked map (messages with fields override this)."""
        return cls()

    def pack(self) -> bytes:
        return pack(self.to_map())


@dataclass(frozen=True)
class Hello(_Message):
    """Start or restart this client's session of (split, epoch, rank, world_size) batches.

    ``batches`` lists the batch indices the server should produce and send, in that order (it
    may be empty: the welcome alone tells the client the epoch's length); each `Credit` appends
    more. Each listed batch is one credit: the client lists only what it has room for, so it
    can hand any batch to any of its servers and take back a lost server's batches. ``job``
    names the training job (torchrun's run id): world sizes must agree within a job only.
    ``session`` is chosen by the client and echoed on every batch so stale frames can be dropped.

    ``start_sample`` > 0: a resumed pass (elastic trainers: a checkpoint of another world size):
    its batches take slots ``[start_sample, stop)`` of the epoch order, where ``stop`` is the
    end of the epoch's samples at ``epoch_world_size`` (0: ``world_size``), split over this
    hello's ranks (`ShardSampler.resumed`). Absent (0) on the wire otherwise.

    ``image_size`` ([H, W]): produce this session's batches at that output size instead of the
    server's --image-size (progressive resizing; the server refuses a size beyond its
    --max-image-size). Absent (None) on the wire otherwise.

    ``batch_size``: images per batch of this session instead of the server's --batch-size
    (jobs of a sweep with different batch sizes on one server; the server refuses more than
    its --max-batch-size). Absent (None) on the wire otherwise.
    """

    TYPE: ClassVar[str] = "hello"
    split: str
    rank: int
    world_size: int
    epoch: int
    batches: tuple[int, ...]
    session: int
    job: str = ""
    start_sample: int = 0
    epoch_world_size: int = 0
    image_size: tuple[int, int] | None = None
    metadata: bool = False  # batch headers carry the samples' metadata (`with_metadata`)
    batch_size: int | None = None

    def to_map(self) -> dict[str, Any]:
        m = super().to_map()
        m["batches"] = list(self.batches)
        if self.batch_size is None:
            del m["batch_size"]
        if not self.start_sample:  # the usual pass: the map older servers know
            del m["start_sample"], m["epoch_world_size"]
        if not self.metadata:  # absent unless asked: the map older servers know
            del m["metadata"]
        if self.image_size is None:
            del m["image_size"]
        else:
            m["image_size"] = list(self.image_size)
        return m

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> Hello:
        world_size = _int(d, "world_size", 1)
        rank = _int(d, "rank", 0)
        if rank >= world_size:
            raise ProtocolError(f"field 'rank' ({rank}) must be < world_size ({world_size})")
        job = d.get("job", "")
        if not isinstance(job, str) or len(job) > MAX_JOB_LEN:
            raise ProtocolError(f"field 'job' must be a string of <= {MAX_JOB_LEN} characters")
        return cls(
            split=_str(d, "split"),
            rank=rank,
            world_size=world_size,
            epoch=_int(d, "epoch", 0),
            batches=_batch_list(d),
            session=_int(d, "session"),
            job=job,
            start_sample=_int(d, "start_sample", 0) if "start_sample" in d else 0,
            epoch_world_size=_int(d, "epoch_world_size", 0) if "epoch_world_size" in d else 0,
            image_size=_image_size(d),
            metadata=d.get("metadata", False) is True,
            batch_size=(
                None if d.get("batch_size") is None else _int(d, "batch_size", 1, MAX_BATCH_SIZE)
            ),
        )


@dataclass(frozen=True)
class Credit(_Message):
    """Append ``batches`` to the session (one credit each); ``stats`` is the loader's
    `LoaderStats.as_dict()` or None (it may travel alone, with no batches).

    A credit from a client the server does not know (after a server restart, or once it dropped
    a silent client) is ignored: the client's re-sent hello starts a new session.
    """

    TYPE: ClassVar[str] = "credit"
    batches: tuple[int, ...] = ()
    stats: dict[str, Any] | None = None

    def to_map(self) -> dict[str, Any]:
        m = super().to_map()
        m["batches"] = list(self.batches)
        return m

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> Credit:
        return cls(batches=_batch_list(d), stats=_map_or_none(d, "stats"))


@dataclass(frozen=True)
class Bye(_Message):
    """The client leaves; its session and queued batches are dropped."""

    TYPE: ClassVar[str] = "bye"


@dataclass(frozen=True)
class StatsRequest(_Message):
    """Ask for the server's stats snapshot; needs no hello."""

    TYPE: ClassVar[str] = "stats"


@dataclass(frozen=True)
class Welcome(_Message):
    """The server accepted a hello: what the session's batches will look like."""

    TYPE: ClassVar[str] = "welcome"
    session: int
    num_batches: int
    num_samples: int
    batch_size: int
    shape: list[int]
    dtype: str
    layout: str
    mean: list[float]
    std: list[float]
    num_classes: int
    # Class names, label id order (torchvision's `classes`); empty from older servers, and for
    # lists beyond the bounds above (`welcome_classes`).
    classes: list[str] = field(default_factory=list)
    # Multi-view batches: every view's [H, W] in order (`BatchSpec.views`); [] for one view.
    views: list[list[int]] = field(default_factory=list)
    # Multi-label datasets: K of the [B, K] label batches (ids, -1 padded); 0 (absent on the
    # wire): one label per sample, [B].
    label_width: int = 0
    # Shared production (sweeps): the server's --share-window in batches, as it applies it; 0
    # (absent on the wire): each batch is produced for its session alone.
    share_window: int = 0
    # A mixture split (`mix:...`): a short hash of the mix (parts, sizes, how each is drawn,
    # labels mode, schedule), which a fleet's servers must agree on; "" (absent on the wire):
    # not a mix.
    mix_fingerprint: str = ""

    def to_map(self) -> dict[str, Any]:
        m = _drop_single_label(_drop_single_view(super().to_map()))
        if not m["share_window"]:  # sharing off: the map older peers know
            del m["share_window"]
        if not m["mix_fingerprint"]:  # not a mix: the map older peers know
            del m["mix_fingerprint"]
        return m

    @property
    def spec(self) -> BatchSpec:
        """What a full batch of this session is."""
        return BatchSpec.from_shape(self.shape, self.dtype, self.layout, self.views)

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> Welcome:
        classes = _classes(d)
        if classes and len(classes) != d.get("num_classes"):
            raise ProtocolError(
                f"field 'classes' names {len(classes)} classes, 'num_classes' says "
                f"{show(d.get('num_classes'))}"
            )
        shape = _shape(d)
        dtype, layout, views = (
            _str(d, "dtype", tuple(DTYPES)),
            _str(d, "layout", LAYOUTS),
            _views(d, shape),
        )
        _bounded_spec(shape, dtype, layout, views)
        return cls(
            session=_int(d, "session"),
            num_batches=_int(d, "num_batches", 0),
            num_samples=_int(d, "num_samples", 0),
            batch_size=_int(d, "batch_size", 1, MAX_BATCH_SIZE),
            shape=shape,
            dtype=dtype,
            layout=layout,
            mean=_float_list(d, "mean", 3),
            std=_float_list(d, "std", 3),
            num_classes=_int(d, "num_classes", 0),
            classes=classes,
            views=views,
            label_width=_label_width(d),
            share_window=_int(d, "share_window", 0) if "share_window" in d else 0,
            mix_fingerprint=_mix_fingerprint(d),
        )


def _mix_fingerprint(d: Mapping[str, Any]) -> str:
    value = d.get("mix_fingerprint", "")
    if not isinstance(value, str) or len(value) > MAX_MIX_FINGERPRINT_LEN:
        raise ProtocolError(
            f"field 'mix_fingerprint' must be a string of <= {MAX_MIX_FINGERPRINT_LEN} "
            f"characters, got {show(value)}"
        )
    return value


def welcome_classes(names: list[str]) -> list[str]:
    """`names` if a welcome may carry them (count, length and total within the bounds), else
    [] (the trainer then knows the number of classes only)."""
    ok = (
        len(names) <= MAX_CLASSES
        and all(isinstance(n, str) and len(n) <= MAX_CLASS_NAME_LEN for n in names)
        and sum(map(len, names)) <= MAX_CLASS_NAMES_CHARS
    )
    return list(names) if ok else []


def _classes(d: Mapping[str, Any]) -> list[str]:
    value = d.get("classes", [])
    if (
        not isinstance(value, list)
        or len(value) > MAX_CLASSES
        or any(not isinstance(n, str) or len(n) > MAX_CLASS_NAME_LEN for n in value)
        or sum(map(len, value)) > MAX_CLASS_NAMES_CHARS
    ):
        raise ProtocolError(
            f"field 'classes' must be a list of at most {MAX_CLASSES} strings of at most "
            f"{MAX_CLASS_NAME_LEN} characters ({MAX_CLASS_NAMES_CHARS} in all)"
        )
    return value


@dataclass(frozen=True)
class ErrorReply(_Message):
    """The server refused a request; ``message`` says why in words a user can act on.

    ``reason`` is the class of the refusal, which decides what a client does next:
    ``refused`` (this hello cannot be served: unknown split, a session the server cannot serve),
    ``busy`` (this hello cannot be served now, for a reason that clears by itself: another world
    size held by a live session of the split, which is dropped once it leaves or falls silent;
    --max-clients reached: ask again, backing off, until the loader's timeout),
    ``bad-request`` (a malformed or impossible message), ``transient`` (producing a batch
    failed for a reason that may pass, e.g. too many open files: ask again later), ``failed``
    (producing a batch failed otherwise). Messages name batch and sample indices,
    never a server path or file content: those stay in the server's log.

    ``session`` is the session of the hello or session the error concerns (None for one that
    concerns no session, e.g. a malformed frame or a credit with no session): a client that has
    since sent a new hello drops an error about an older session instead of taking it as a
    refusal of the new one.
    """

    TYPE: ClassVar[str] = "error"
    message: str
    reason: str = "refused"
    session: int | None = None

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> ErrorReply:
        reason = d.get("reason", "refused")
        session = d.get("session")
        return cls(
            message=_str(d, "message"),
            reason=reason if reason in ERROR_REASONS else "refused",
            session=None if session is None else _int(d, "session"),
        )


@dataclass(frozen=True)
class Shutdown(_Message):
    """The server is exiting gracefully; reconnect to it (or another) later."""

    TYPE: ClassVar[str] = "shutdown"


@dataclass(frozen=True)
class BatchHeader(_Message):
    """First frame of a batch; then the images frame (``nbytes``) and the labels frame (8*B)."""

    TYPE: ClassVar[str] = "batch"
    session: int
    split: str
    epoch: int
    batch_index: int
    shape: list[int]
    dtype: str
    layout: str
    indices: list[int] = field(default_factory=list)
    replaced: int = 0
    nbytes: int = 0
    views: list[list[int]] = field(default_factory=list)  # as `Welcome.views`
    label_width: int = 0  # as `Welcome.label_width`: the labels frame is [B, K] when > 0
    # Per-sample metadata (a manifest's other columns), only for hellos that asked for it.
    metadata: list[dict[str, Any] | None] | None = None
    # Produced once for this session and another client's (a sweep's shared production), as far
    # as the server knows when it sends it; False (absent on the wire): this session's alone.
    shared: bool = False

    def to_map(self) -> dict[str, Any]:
        m = _drop_single_label(_drop_single_view(super().to_map()))
        if not m["shared"]:  # the map older peers know
            del m["shared"]
        return m

    @property
    def batch_size(self) -> int:
        return self.shape[0]

    @property
    def labels_nbytes(self) -> int:
        return self.shape[0] * max(self.label_width, 1) * LABELS_DTYPE.itemsize

    @property
    def spec(self) -> BatchSpec:
        """This batch's format (its batch size may be below the session's)."""
        return BatchSpec.from_shape(self.shape, self.dtype, self.layout, self.views)

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> BatchHeader:
        shape = _shape(d)
        dtype = _str(d, "dtype", tuple(DTYPES))
        nbytes = _int(d, "nbytes", 0)
        views = _views(d, shape)
        layout = _str(d, "layout", LAYOUTS)
        want = _bounded_spec(shape, dtype, layout, views).nbytes
        if nbytes != want:
            what = f"views {views}" if views else f"shape {shape}"
            raise ProtocolError(
                f"field 'nbytes' ({nbytes}) does not match {what} of {dtype} ({want})"
            )
        indices = _int_list(d, "indices", shape[0])
        return cls(
            session=_int(d, "session"),
            split=_str(d, "split"),
            epoch=_int(d, "epoch", 0),
            batch_index=_int(d, "batch_index", 0),
            shape=shape,
            dtype=dtype,
            layout=layout,
            indices=indices,
            replaced=_int(d, "replaced", 0),
            nbytes=nbytes,
            views=views,
            label_width=_label_width(d),
            metadata=_metadata(d, shape[0]),
            shared=d.get("shared", False) is True,
        )


@dataclass(frozen=True)
class StatsReply(_Message):
    """Answer to `StatsRequest`: the server's `ServerStats` (wire/stats.py), checked field by
    field on arrival, so a reader never meets a value of the wrong type."""

    TYPE: ClassVar[str] = "stats"
    stats: ServerStats

    def to_map(self) -> dict[str, Any]:
        return {"v": PROTOCOL_VERSION, "type": self.TYPE, "stats": self.stats.to_map()}

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> StatsReply:
        return cls(stats=ServerStats.from_map(d.get("stats")))


ClientMessage = Hello | Credit | Bye | StatsRequest
ServerMessage = Welcome | ErrorReply | Shutdown | BatchHeader | StatsReply

_CLIENT_TYPES: dict[str, type] = {m.TYPE: m for m in (Hello, Credit, Bye, StatsRequest)}
_SERVER_TYPES: dict[str, type] = {
    m.TYPE: m for m in (Welcome, ErrorReply, Shutdown, BatchHeader, StatsReply)
}


def _decode(frame: bytes | memoryview, max_bytes: int, types: Mapping[str, type]) -> Any:
    d = unpack_frame(frame, max_bytes)
    cls = types.get(d["type"])
    if cls is None:
        raise ProtocolError(f"unknown message type {d['type']!r}")
    return cls.from_map(d)


def decode_client_message(frame: bytes | memoryview) -> ClientMessage:
    """Parse a client -> server control frame; `ProtocolError` if it is anything else."""
    return _decode(frame, MAX_CLIENT_FRAME_BYTES, _CLIENT_TYPES)


def decode_server_message(frame: bytes | memoryview) -> ServerMessage:
    """Parse a server -> client control frame; `ProtocolError` if it is anything else."""
    return _decode(frame, MAX_SERVER_FRAME_BYTES, _SERVER_TYPES)
