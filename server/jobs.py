"""What travels between the core and the producer threads: orders, jobs and their results.

The core (`core.py`) decides what to produce and hands everything a producer needs over with
the order: the split, the session's sampler (immutable but for its own locked cache, so safe
to share: planning runs on the producer, not the loop, because the first plan of an epoch
shuffles the whole split), the epoch and the batch index. The producer never looks at the
session; it reads one flag, ``cancelled``, a `threading.Event` the shell attaches to the order
when it queues the job (`BatchOrder.attach`) and sets when the core says `Cancel`: the core
itself touches no thread primitive. Results come back as plain data the core can take without
knowing the pipeline's types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
from batchwire.pipeline.sampler import ShardSampler

if TYPE_CHECKING:
    from batchwire.pipeline.stages import BatchStats
    from batchwire.server.bufpool import Slot
    from batchwire.wire import BatchSpec


class CancelFlag(Protocol):
    """What a producer reads of an order: the shell's `threading.Event`."""

    def is_set(self) -> bool: ...


class _NeverCancelled:
    """The flag of an order no shell queued (a test's own): it is never cancelled."""

    def is_set(self) -> bool:
        return False


NEVER_CANCELLED = _NeverCancelled()


@dataclass(frozen=True)
class BatchOrder:
    """Produce batch ``batch_index`` of ``epoch`` of ``split`` for session ``session_serial``
    (``pos``: its place in that session's asked-for list)."""

    split: str
    sampler: ShardSampler
    epoch: int
    batch_index: int
    session_serial: int
    pos: int
    # The shell's flag, set on the core's `Cancel` (attached as the shell queues the job).
    cancelled: CancelFlag = field(default=NEVER_CANCELLED, compare=False)
    # The core's `sharing.Production` (one per buffer: several sessions may wait for it; the
    # session above is the one that asked first).
    production: int = 0
    # What to write (the session's spec: the batch size and output size its hello asked for);
    # None: the server's own.
    spec: BatchSpec | None = None
    # Go through the producers' sample window where there is one (pipeline/sample_window.py:
    # a server taking several batch sizes): sharing is on. Every batch publishes its samples
    # then, since a job of another batch size may ask for them a moment later (its hello may
    # come after this batch was ordered).
    share_samples: bool = False

    def attach(self, cancelled: CancelFlag) -> None:
        """The shell's cancellation flag, attached once as it queues the job (before any
        producer sees the order; the core never reads it): no copy of the order per batch."""
        object.__setattr__(self, "cancelled", cancelled)


@dataclass(frozen=True)
class Job:
    """An order and the buffer the shell lent for it."""

    order: BatchOrder
    slot: Slot


@dataclass(frozen=True)
class JobResult:
    """A finished job: the batch's labels and indices, or why it failed.

    ``error`` is the full text, paths included, for the server's log only; ``reason`` is the
    failure's class as a client may see it: "transient" (may pass: ask again), "failed", or
    "cancelled" (the session was gone: nobody is told). ``public``, where the producer knows
    why in words that hold no path, URL or secret (most reads denied: credentials expired?),
    is shown to the clients too, so that a trainer's log says why and not only the error's type.
    ``stats``: the batch's figures (seconds per stats row, its decoder's fallback total), which
    the shell records (`ServerApp._record`); None where the producer reported none.
    """

    job: Job
    seconds: float
    labels: np.ndarray | None = None  # int64 [B], -100 for padding
    indices: tuple[int, ...] = ()  # -1 for padding
    replaced: int = 0
    error: str | None = None
    reason: str = "failed"
    public: str | None = None
    stats: BatchStats | None = None

    @property
    def ok(self) -> bool:
        return self.labels is not None
