"""Control frames in and out: msgpack with hard limits, and the raw labels frame.

Everything that arrives from the network goes through `unpack_frame` (size checked before
msgpack looks at it, no extension types, string map keys only), so a peer can never make us
allocate without bound or execute anything: nothing is ever unpickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
from batchwire.wire.batch_spec import PADDING_LABEL
from batchwire.wire.errors import PROTOCOL_VERSION, ProtocolError, VersionMismatch

#: Largest control frame accepted from a client (hello, credit with loader stats, bye, stats).
MAX_CLIENT_FRAME_BYTES = 64 * 1024
#: Largest msgpack frame accepted from a server (batch header with indices, stats with clients).
MAX_SERVER_FRAME_BYTES = 8 * 1024 * 1024
#: Largest array (indices of one batch, clients in a stats reply) inside a control frame.
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 256
MAX_STR_LEN = 64 * 1024
#: Labels travel as raw little-endian int64, whatever the host order.
LABELS_DTYPE = np.dtype("<i8")
#: Most labels per sample of a multi-label stream (`Welcome.label_width`, K of [B, K]).
MAX_LABEL_WIDTH = 1024


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


def labels_to_frame(labels: np.ndarray) -> np.ndarray:
    """Labels as the little-endian int64 array whose buffer is the labels frame."""
    return np.ascontiguousarray(labels, dtype=LABELS_DTYPE)


def labels_from_frame(
    buf: bytes | memoryview,
    batch_size: int,
    out: np.ndarray | None = None,
    width: int = 0,
    num_classes: int = 0,
) -> np.ndarray:
    """The labels frame (``batch_size`` little-endian int64) as native-order int64 labels.

    ``width`` K > 0 (a multi-label stream, `Welcome.label_width`): the frame holds
    ``batch_size x K`` int64, returned as [B, K] (each row the sample's ids, then -1; a padded
    slot's row all PADDING_LABEL); ``out`` is then flat (``batch_size * K``) or [B, K].

    The one decoder of the labels frame, for every receiver. `out` None: a new, writable array
    of its own (the frame's memory may go). `out` given (``batch_size`` int64, possibly the very
    memory the frame was received into with ``recv_into``): the labels are written there and
    `out` is returned; received in place on a little-endian host, nothing is copied. A frame of
    the wrong size is a `ProtocolError`; so is, with ``num_classes`` > 0 (the welcome's), a
    label that is neither a class id below it nor padding (`check_labels`).
    """
    view = memoryview(buf)
    expected = batch_size * max(width, 1) * LABELS_DTYPE.itemsize
    if view.nbytes != expected:
        raise ProtocolError(f"labels frame has {view.nbytes} bytes, expected {expected}")
    raw = np.frombuffer(view.cast("B"), dtype=LABELS_DTYPE)
    if width:
        raw = raw.reshape(batch_size, width)
        if out is not None:
            out = out.reshape(batch_size, width)  # a view of a flat out (contiguous)
    if num_classes:
        check_labels(raw, num_classes, width)
    if out is None:
        return raw.astype(np.int64)
    if out.ctypes.data != raw.ctypes.data or out.dtype != raw.dtype:  # not already in place
        np.copyto(out, raw)  # numpy copes with the overlap: a swap in place on big-endian hosts
    return out


def check_labels(labels: np.ndarray, num_classes: int, width: int = 0) -> None:
    """`ProtocolError` unless every label is a class id in [0, num_classes), a padded slot's
    `PADDING_LABEL` or, in a multi-label row (``width`` > 0), the -1 after its ids: a broken or
    hostile server's label 10**12 must not become a target that trains on garbage (or trips a
    CUDA assert in the loss, far from its cause). Two passes over B x K int64: microseconds."""
    if not labels.size:
        return
    negative = labels < 0
    allowed = (labels == PADDING_LABEL) | ((labels == -1) if width else False)
    bad = (labels >= num_classes) | (negative & ~allowed)
    if bad.any():
        raise ProtocolError(
            f"label {int(labels[bad].flat[0])} is neither a class id below num_classes="
            f"{num_classes} nor padding ({PADDING_LABEL}{', -1' if width else ''})"
        )
