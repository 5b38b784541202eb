"""Per-client session state: which batches a client gets, what is produced, queued and sent.

A `ClientSession` is what one hello opened (its ``hello.session`` number travels in every reply
about it); the next hello of the same client replaces it. Owned by the core (`core.py`) and
changed on the loop thread only; producer threads never see it, a stats scrape reads its row
(its send-rate `meter` is the one object with a lock). Its life is a transition table
(`TRANSITIONS`: open until dropped, then it takes no event). The invariants that bound memory
live here:

- work-ahead: ``in_production + ready <= prefetch_depth`` (`has_room`): the server's
  --prefetch-depth, whatever the client asks for, so a client that asks for much and reads
  nothing costs at most that many buffers here;
- in flight: only batches the client asked for (each is one credit), and never more than the
  limit the core passes (--prefetch-depth minus what ZeroMQ still holds for that peer);
- order: batches go out in the order asked even when producers finish them out of order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np
from batchwire.common.rates import RateMeter
from batchwire.pipeline.sampler import ShardSampler
from batchwire.server.peer_names import shown
from batchwire.wire import MAX_PREFETCH, ClientRow, Hello, LoaderReport, show

if TYPE_CHECKING:
    from batchwire.server.bufpool import Slot
    from batchwire.wire import BatchSpec

# The per-client figure of the stats row: as the server's own throughput, over a few seconds.
CLIENT_RATE_WINDOW_S = 5.0


class SessionState(IntEnum):
    """Where a session is in its life: ``OPEN`` from its welcome, ``CLOSED`` once dropped (a
    bye, a new hello, its peer gone, silent or stalled, a drain, shutdown)."""

    OPEN = 0
    CLOSED = 1


class SessionEvent(IntEnum):
    """What happens to a session (the method that makes it happen)."""

    ASK = 0  # `ask`: batches asked for (a hello's, a credit's)
    TAKE = 1  # `take_next`: its next batch goes into production (or joins one)
    COMPLETE = 2  # `completed`: a batch of it is ready
    ABANDON = 3  # `abandoned`: a producer gave up on one
    SEND = 4  # `pop_sendable`: a ready batch goes out
    CLOSE = 5  # `drain`: dropped


#: The session's state machine (h11's `_state.py` is the model): state -> event -> next state.
#: An event missing here is a bug of the core's: `next_state` raises on it. A closed
#: session takes no event (the core forgets it as it closes it).
TRANSITIONS: dict[SessionState, dict[SessionEvent, SessionState]] = {
    SessionState.OPEN: {
        SessionEvent.ASK: SessionState.OPEN,
        SessionEvent.TAKE: SessionState.OPEN,
        SessionEvent.COMPLETE: SessionState.OPEN,
        SessionEvent.ABANDON: SessionState.OPEN,
        SessionEvent.SEND: SessionState.OPEN,
        SessionEvent.CLOSE: SessionState.CLOSED,
    },
    SessionState.CLOSED: {},
}


_OPEN = SessionState.OPEN  # `has_room` runs per session per loop turn: one global read


class IllegalSessionEvent(RuntimeError):
    """An event the session's state does not take (`TRANSITIONS`)."""


def next_state(state: SessionState, event: SessionEvent) -> SessionState:
    """The state after ``event`` in ``state``; raises `IllegalSessionEvent` where the table
    has no such transition."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise IllegalSessionEvent(f"{event.name} in state {state.name}") from None


@dataclass(frozen=True)
class Produced:
    """What a production made, set once when it finished (`sharing.Production.output`): the
    buffer slot and what every header of the batch says, whichever session it is sent to."""

    slot: Slot  # released by whoever drops or sends the last reference to it
    labels: np.ndarray  # int64 [B]
    indices: list[int]  # -1 for padding
    replaced: int
    produce_s: float
    done_at: float


@dataclass
class ReadyBatch:
    """A finished batch waiting to be sent: a session's batch ``batch_index`` is production
    ``production``'s ``output`` (the slot may be shared with other sessions)."""

    batch_index: int
    output: Produced
    production: int = 0


class ClientSession:
    """One client's current session: the batches of (split, epoch, rank, world_size) it asked
    for, in the order asked (its hello's list, then each credit's).

    ``serial`` names the session inside the server (producer jobs carry it, not the object).
    """

    def __init__(
        self,
        identity: bytes,
        hello: Hello,
        sampler: ShardSampler,
        prefetch_depth: int,
        now: float,
        serial: int = 0,
    ) -> None:
        self.identity = identity
        self.hello = hello
        self.sampler = sampler
        # What this session's batches are (set by the core at admission: the server's spec, or
        # the output size the hello asked for).
        self.spec: BatchSpec | None = None
        self.num_batches = sampler.num_batches
        self.prefetch_depth = prefetch_depth
        self.serial = serial
        self.batches: list[int] = []  # batch indices asked for, in order
        self._asked: set[int] = set()
        self.next_pos = 0  # position in `batches` of the next batch to produce
        self.send_pos = 0  # position of the next batch to send
        self.in_production = 0
        self.sent = 0
        self._finished: dict[int, ReadyBatch] = {}  # position -> batch, out of order
        self.state = SessionState.OPEN
        self.loader_stats: LoaderReport | None = None  # its last credit's, as the server read it
        self.opened_at = now
        self.last_seen = now  # any message
        # Last sign of progress: a batch asked for, sent or taken by the peer. Messages that ask
        # for nothing (an empty credit) are no progress: they keep a session from being reaped
        # for silence, never a world size held (see `core.ServerCore._world_size_holder`).
        self.progress_at: float | None = None
        # When this client (this peer, over its sessions) last took a batch it was sent: a client
        # that never did is lent one buffer at a time while buffers are contended.
        self.taken_at: float | None = None
        # Images sent to this client; the loop thread adds (``meter.add(images, now)``), a stats
        # request or a Prometheus scrape reads, and the window's lock keeps the two apart.
        self.meter = RateMeter(CLIENT_RATE_WINDOW_S)
        # Its last batch's production (core.py, "Sharing"): "off" (--share-window 0), "solo"
        # (produced for it alone so far), "shared" (one buffer with another session's batch),
        # "lagging" (produced again: it asked after the window let the batch go).
        self.sharing = "off"

    @property
    def peer_hex(self) -> str:
        """The peer's name (the stats row's ``id``; `peer_names.shown`: its ZeroMQ identity in
        hex, or a keyed hash of libzmq's own): not the session id, which is ``hello.session``."""
        return shown(self.identity)

    @property
    def closed(self) -> bool:
        return self.state is SessionState.CLOSED

    @property
    def ready(self) -> int:
        """Produced batches not yet sent (in order or waiting for an earlier one)."""
        return len(self._finished)

    @property
    def done(self) -> bool:
        """Every batch asked for has been sent (the client may still ask for more)."""
        return self.send_pos >= len(self.batches)

    @property
    def owed(self) -> int:
        """Batches asked for and not sent yet: each asked-for batch is one credit."""
        return len(self.batches) - self.send_pos

    credits = owed

    def ask(self, batches: tuple[int, ...] | list[int], now: float) -> str | None:
        """Add asked-for batches (one credit each); why not, or None when they were added.

        Out-of-range or repeated indices, or more owed than the client may ask at once
        (`wire.MAX_PREFETCH`), are refused whole: a correct client never sends them.
        """
        self.state = next_state(self.state, SessionEvent.ASK)
        bad = [k for k in batches if not 0 <= k < self.num_batches or k in self._asked]
        if bad:
            return (
                f"batches {show(bad)} are out of range (this session has {self.num_batches}) or "
                "were asked for already in this session"
            )
        if self.owed + len(batches) > MAX_PREFETCH:
            return f"more than {MAX_PREFETCH} batches asked for and not yet sent"
        self.batches.extend(batches)
        self._asked.update(batches)
        if batches:
            self.progress_at = now
        return None

    def has_room(self) -> bool:
        """May the scheduler start another batch for this session?"""
        return (
            self.state is _OPEN
            and self.next_pos < len(self.batches)
            and self.in_production + self.ready < self.prefetch_depth
        )

    def take_next(self) -> tuple[int, int]:
        """Reserve the next batch to produce: returns (position, batch_index)."""
        self.state = next_state(self.state, SessionEvent.TAKE)
        pos = self.next_pos
        self.next_pos += 1
        self.in_production += 1
        return pos, self.batches[pos]

    def completed(self, pos: int, batch: ReadyBatch) -> None:
        """A producer finished position ``pos`` (the caller checked the session is open)."""
        self.state = next_state(self.state, SessionEvent.COMPLETE)
        self.in_production -= 1
        self._finished[pos] = batch

    def abandoned(self) -> None:
        """A producer gave up on a batch of this session (error or shutdown)."""
        self.state = next_state(self.state, SessionEvent.ABANDON)
        self.in_production -= 1

    def pop_sendable(self, limit: int) -> Iterator[ReadyBatch]:
        """Yield the batches finished in the order asked, at most ``limit``."""
        while limit > 0 and self.send_pos in self._finished:
            limit -= 1
            self.state = next_state(self.state, SessionEvent.SEND)
            batch = self._finished.pop(self.send_pos)
            self.send_pos += 1
            self.sent += 1
            yield batch

    def drain(self) -> list[ReadyBatch]:
        """Close the session and return its queued batches so their buffers can be released."""
        self.state = next_state(self.state, SessionEvent.CLOSE)
        out = list(self._finished.values())
        self._finished.clear()
        return out

    def row(self, now: float, in_flight: int) -> ClientRow:
        """This client's entry in the stats ``clients`` list; ``in_flight``: the sent batches
        ZeroMQ still holds for this peer (the server counts them per peer, across sessions)."""
        h = self.hello
        return ClientRow(
            id=self.peer_hex,
            split=h.split,
            rank=h.rank,
            world_size=h.world_size,
            epoch=h.epoch,
            credits=self.credits,
            ready=self.ready,
            ready_capacity=self.prefetch_depth,
            in_flight=in_flight,
            sent=self.sent,
            images_per_s=self.meter.rate(now),
            last_seen_s=now - self.last_seen,
            loader=self.loader_stats,
            job=h.job,
            sharing=self.sharing,
        )
