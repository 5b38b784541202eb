"""Wire protocol v1 between `pipeline-server` (ROUTER) and its clients (DEALER).

Shared by the server and `batchwire.client`, so both sides agree on one definition of every
message. Control frames are msgpack maps carrying ``"v"`` (the protocol version) and
``"type"``; batch payloads travel as raw frames after a header. Everything that arrives from the
network goes through `unpack_frame` (hard size limits, no extension types, string map keys only)
and a schema check that raises `ProtocolError` naming the offending field: a peer can never make
us allocate without bound, execute anything (nothing is ever unpickled), or see a half-valid
message.

Public API (stable; the client imports it):

- `PROTOCOL_VERSION`, size limits, `DTYPES`, `LAYOUTS`.
- Message dataclasses: `Hello`, `Credit`, `Bye`, `StatsRequest` (client -> server); `Welcome`,
  `ErrorReply`, `Shutdown`, `BatchHeader`, `StatsReply` (server -> client).
  Each has ``pack() -> bytes``.
- `decode_client_message(frame)` / `decode_server_message(frame)`: bytes -> dataclass, or
  `ProtocolError` (`VersionMismatch` for a version mismatch, with both versions in the message).
- `torch_dtype(name)`, `numpy_dtype(name)`, `dtype_name(torch_dtype)`, `itemsize(name)`,
  `images_nbytes(shape, dtype)`, `labels_to_frame(labels)`, `labels_from_frame(buf, batch_size)`.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

PROTOCOL_VERSION = 1

#: Largest control frame accepted from a client (hello, credit with loader stats, bye, stats).
MAX_CLIENT_FRAME_BYTES = 64 * 1024
#: Largest msgpack frame accepted from a server (batch header with indices, stats with clients).
MAX_SERVER_FRAME_BYTES = 8 * 1024 * 1024
#: Largest array (indices of one batch, clients in a stats reply) inside a control frame.
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 256
MAX_STR_LEN = 64 * 1024
#: Largest batch size and per-client prefetch the protocol allows; keeps memory per client bounded.
MAX_BATCH_SIZE = 65536
MAX_PREFETCH = 256

LAYOUTS = ("nchw", "nhwc")
#: Wire dtype names -> (numpy dtype name or None when numpy has none, bytes per element).
DTYPES: dict[str, tuple[str | None, int]] = {
    "uint8": ("uint8", 1),
    "float16": ("float16", 2),
    "bfloat16": (None, 2),
    "float32": ("float32", 4),
}
#: Labels travel as raw little-endian int64, whatever the host order.
LABELS_DTYPE = np.dtype("<i8")


class ProtocolError(ValueError):
    """A frame that is not a valid v1 message; the text says what is wrong and where."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""

    def __init__(self, peer_version: object, own_version: int = PROTOCOL_VERSION) -> None:
        self.peer_version = peer_version
        self.own_version = own_version
        super().__init__(
            f"protocol version mismatch: peer speaks v{show(peer_version)}, "
            f"this side speaks v{own_version}"
        )


_SHOWN = reprlib.Repr()  # attributes, not keywords: Python 3.11 has no Repr(**limits)
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxdict = 8
_SHOWN.maxlevel = 3
_SHOWN.maxlong = 40


def show(value: object) -> str:
    """A peer's value as an error message may quote it: short whatever the peer sent (a frame
    of 64 KiB must not come back as a reply several times larger)."""
    return _SHOWN.repr(value)


# --------------------------------------------------------------------------- packing


def pack(msg: Mapping[str, Any]) -> bytes:
    """msgpack a control map (the caller includes ``v`` and ``type``)."""
    return msgpack.packb(msg, use_bin_type=True)


def unpack_frame(frame: bytes | memoryview, max_bytes: int) -> dict[str, Any]:
    """Unpack one control frame with strict limits and return the map.

    Checks size first (a huge frame is rejected before msgpack looks at it), then that it is a map
    with a string ``type`` and the version we speak.
    """
    size = len(frame)
    if size > max_bytes:
        raise ProtocolError(f"control frame of {size} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            max_str_len=MAX_STR_LEN,
            max_bin_len=MAX_STR_LEN,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
            strict_map_key=True,
        )
    except Exception as exc:  # hostile input raises ValueError, TypeError, StackError, ...
        raise ProtocolError(f"not a valid msgpack frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"control frame must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        if version is None:
            raise ProtocolError("control frame has no protocol version field 'v'")
        raise VersionMismatch(version)
    if not isinstance(obj.get("type"), str):
        raise ProtocolError("control frame has no string field 'type'")
    return obj


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


def _shape(d: Mapping[str, Any]) -> list[int]:
    shape = _int_list(d, "shape", 4)
    b, c, h, w = shape
    if not (1 <= b <= MAX_BATCH_SIZE and c == 3 and h >= 1 and w >= 1):
        raise ProtocolError(f"field 'shape' must be [B, 3, H, W] with B, H, W >= 1, got {shape}")
    return shape


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
    """Start or restart this client's stream of (split, epoch, rank, world_size) batches.

    The server produces batch k iff ``k % shard[1] == shard[0]`` and ``k >= start_batch``.
    ``session`` is chosen by the client and echoed on every batch so stale frames can be dropped.
    The hello itself grants ``prefetch`` credits; each `Credit` adds ``n`` more. The server never
    holds more than ``prefetch`` unused credits for a client (extra ones are ignored).
    """

    TYPE: ClassVar[str] = "hello"
    split: str
    rank: int
    world_size: int
    epoch: int
    start_batch: int
    prefetch: int
    shard: tuple[int, int]
    session: int

    def to_map(self) -> dict[str, Any]:
        m = super().to_map()
        m["shard"] = list(self.shard)
        return m

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> Hello:
        world_size = _int(d, "world_size", 1)
        rank = _int(d, "rank", 0)
        if rank >= world_size:
            raise ProtocolError(f"field 'rank' ({rank}) must be < world_size ({world_size})")
        shard = _int_list(d, "shard", 2)
        if not (shard[1] >= 1 and 0 <= shard[0] < shard[1]):
            raise ProtocolError(f"field 'shard' must be [i, n] with 0 <= i < n, got {shard}")
        return cls(
            split=_str(d, "split"),
            rank=rank,
            world_size=world_size,
            epoch=_int(d, "epoch", 0),
            start_batch=_int(d, "start_batch", 0),
            prefetch=_int(d, "prefetch", 1, MAX_PREFETCH),
            shard=(shard[0], shard[1]),
            session=_int(d, "session"),
        )


@dataclass(frozen=True)
class Credit(_Message):
    """``n`` more batches may be sent; ``stats`` is the loader's `LoaderStats.as_dict()` or None.

    A credit from a client the server does not know (after a server restart, or once it dropped
    a silent client) is ignored: the client's re-sent hello starts a new stream.
    """

    TYPE: ClassVar[str] = "credit"
    n: int
    stats: dict[str, Any] | None = None

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> Credit:
        return cls(n=_int(d, "n", 0, MAX_PREFETCH), stats=_map_or_none(d, "stats"))


@dataclass(frozen=True)
class Bye(_Message):
    """The client leaves; its stream and queued batches are dropped."""

    TYPE: ClassVar[str] = "bye"


@dataclass(frozen=True)
class StatsRequest(_Message):
    """Ask for the server's stats snapshot; needs no hello."""

    TYPE: ClassVar[str] = "stats"


@dataclass(frozen=True)
class Welcome(_Message):
    """The server accepted a hello: what the stream's batches will look like."""

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

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> Welcome:
        return cls(
            session=_int(d, "session"),
            num_batches=_int(d, "num_batches", 0),
            num_samples=_int(d, "num_samples", 0),
            batch_size=_int(d, "batch_size", 1, MAX_BATCH_SIZE),
            shape=_shape(d),
            dtype=_str(d, "dtype", tuple(DTYPES)),
            layout=_str(d, "layout", LAYOUTS),
            mean=_float_list(d, "mean", 3),
            std=_float_list(d, "std", 3),
            num_classes=_int(d, "num_classes", 0),
        )


@dataclass(frozen=True)
class ErrorReply(_Message):
    """The server refused a request; ``message`` says why in words a user can act on."""

    TYPE: ClassVar[str] = "error"
    message: str

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> ErrorReply:
        return cls(message=_str(d, "message"))


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

    @property
    def batch_size(self) -> int:
        return self.shape[0]

    @property
    def labels_nbytes(self) -> int:
        return self.shape[0] * LABELS_DTYPE.itemsize

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> BatchHeader:
        shape = _shape(d)
        dtype = _str(d, "dtype", tuple(DTYPES))
        nbytes = _int(d, "nbytes", 0)
        if nbytes != images_nbytes(shape, dtype):
            raise ProtocolError(
                f"field 'nbytes' ({nbytes}) does not match shape {shape} of {dtype} "
                f"({images_nbytes(shape, dtype)})"
            )
        indices = _int_list(d, "indices", shape[0])
        return cls(
            session=_int(d, "session"),
            split=_str(d, "split"),
            epoch=_int(d, "epoch", 0),
            batch_index=_int(d, "batch_index", 0),
            shape=shape,
            dtype=dtype,
            layout=_str(d, "layout", LAYOUTS),
            indices=indices,
            replaced=_int(d, "replaced", 0),
            nbytes=nbytes,
        )


@dataclass(frozen=True)
class StatsReply(_Message):
    """Answer to `StatsRequest`: the Stats schema of ARCHITECTURE.md."""

    TYPE: ClassVar[str] = "stats"
    stats: dict[str, Any]

    @classmethod
    def from_map(cls, d: Mapping[str, Any]) -> StatsReply:
        stats = _map_or_none(d, "stats")
        if stats is None:
            raise ProtocolError("field 'stats' must be a map")
        return cls(stats=stats)


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


# --------------------------------------------------------------------------- dtypes and frames


def _dtype_entry(name: str) -> tuple[str | None, int]:
    if name not in DTYPES:
        raise ProtocolError(f"unknown dtype {name!r}; expected one of {list(DTYPES)}")
    return DTYPES[name]


def torch_dtype(name: str):  # -> torch.dtype; torch imported lazily to keep this module light
    """The torch dtype for a wire dtype name."""
    import torch

    _dtype_entry(name)
    return getattr(torch, name)


def dtype_name(dtype: Any) -> str:
    """The wire name of a torch (or numpy) dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ProtocolError(f"dtype {dtype} cannot travel on the wire; use one of {list(DTYPES)}")
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a wire dtype name (bfloat16 has none: use `torch_dtype`)."""
    np_name = _dtype_entry(name)[0]
    if np_name is None:
        raise ProtocolError(f"numpy has no {name}; view the bytes with torch_dtype({name!r})")
    return np.dtype(np_name)


def itemsize(name: str) -> int:
    """Bytes per element of a wire dtype."""
    return _dtype_entry(name)[1]


def images_nbytes(shape: list[int] | tuple[int, ...], dtype: str) -> int:
    """Size of the images frame for a batch of ``shape`` in ``dtype``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n * itemsize(dtype)


def labels_to_frame(labels: np.ndarray) -> np.ndarray:
    """Labels as the little-endian int64 array whose buffer is the labels frame."""
    return np.ascontiguousarray(labels, dtype=LABELS_DTYPE)


def labels_from_frame(buf: bytes | memoryview, batch_size: int) -> np.ndarray:
    """Read a labels frame of ``batch_size`` int64 values (native-order copy not needed on LE)."""
    expected = batch_size * LABELS_DTYPE.itemsize
    if len(buf) != expected:
        raise ProtocolError(f"labels frame has {len(buf)} bytes, expected {expected}")
    return np.frombuffer(buf, dtype=LABELS_DTYPE).astype(np.int64, copy=False)
