"""What the server's core answers its events with: the actions its shell carries out, in order.

`ServerCore` (core.py) returns these and does nothing else; `ServerApp` (app.py) sends, lends,
queues, cancels, releases and trims as they say, and records the figures they carry in its
telemetry. Plain data, no behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from batchwire.server.bufpool import Slot
    from batchwire.server.jobs import BatchOrder
    from batchwire.wire import BatchHeader, ServerMessage

__all__ = [
    "Action",
    "Cancel",
    "Release",
    "Reply",
    "ReplyStats",
    "SendBatch",
    "Submit",
    "TrimBuffers",
]


@dataclass(frozen=True)
class Reply:
    """Send ``message`` to ``identity`` (dropped if the peer's queue is full); ``counts``: the
    telemetry counter it adds one to ("errors_total", "malformed_total"), or ""."""

    identity: bytes
    message: ServerMessage
    counts: str = ""


@dataclass(frozen=True)
class ReplyStats:
    """Answer a stats request with the shell's snapshot (it has the threads' figures)."""

    identity: bytes


@dataclass(frozen=True)
class Submit:
    """Lend a buffer from the pool and queue ``order`` for the producers."""

    order: BatchOrder


@dataclass(frozen=True)
class SendBatch:
    """Send a batch zero-copy; report ``ticket`` to `ServerCore.on_sent` once ZeroMQ lets go.

    What the shell records of it (`Telemetry.sent_batch`, before the hand-off): ``images``
    and ``nbytes`` (payload, labels included), the header's ``replaced``, ``resent`` (its
    buffer went out before: a shared production's later sends) and ``ready_s`` (how long it
    waited ready)."""

    identity: bytes
    header: BatchHeader
    slot: Slot
    labels: np.ndarray
    ticket: int
    images: int = 0
    nbytes: int = 0
    resent: bool = False
    ready_s: float = 0.0


@dataclass(frozen=True)
class Cancel:
    """Skip the job of ``production`` if no producer has started it: nobody waits for it
    (the shell sets the flag the producers read, `BatchOrder.cancelled`)."""

    production: int


@dataclass(frozen=True)
class Release:
    """Return a buffer to the pool."""

    slot: Slot


@dataclass(frozen=True)
class TrimBuffers:
    """Free chunks of idle buffers while at least ``keep`` stay allocated."""

    keep: int


Action = Reply | ReplyStats | Submit | SendBatch | Release | TrimBuffers | Cancel
