"""Per-client session state: which batches a client gets, what is produced, queued and sent.

A `ClientSession` is what one hello opened (its ``hello.session`` number travels in every reply
about it); the next hello of the same client replaces it. Owned by the core (`core.py`), on
the loop thread only (no locks); producer threads never see it. The invariants that bound
memory live here:

- work-ahead: ``in_production + ready <= prefetch_depth`` (`has_room`): the server's
  --prefetch-depth, whatever the client asks for, so a client that asks for much and reads
  nothing costs at most that many buffers here;
- in flight: only batches the client asked for (each is one credit), and never more than the
  limit the core passes (--prefetch-depth minus what ZeroMQ still holds for that peer);
- order: batches go out in the order asked even when producers finish them out of order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

import numpy as np
from batchwire.common.rates import RateWindow
from batchwire.pipeline.sampler import ShardSampler
from batchwire.wire import MAX_PREFETCH, ClientRow, Hello, LoaderReport, show

if TYPE_CHECKING:
    from batchwire.server.bufpool import Slot
    from batchwire.wire import BatchSpec

# The per-client figure of the stats row: as the server's own throughput, over a few seconds.
CLIENT_RATE_WINDOW_S = 5.0


@dataclass
class ReadyBatch:
    """A finished batch waiting to be sent: the buffer slot and what the header needs."""

    batch_index: int
    slot: Slot  # released by whoever drops or sends the batch
    labels: np.ndarray  # int64 [B]
    indices: list[int]  # -1 for padding
    replaced: int
    produce_s: float
    done_at: float
    production: int = 0  # the core's `sharing.Production`: the slot may be shared


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
        # What this stream's batches are (set by the core at admission: the server's spec, or
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
        self.closed = False
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
        self.meter = RateWindow(CLIENT_RATE_WINDOW_S)
        # Its last batch's production (core.py, "Sharing"): "off" (--share-window 0), "solo"
        # (produced for it alone so far), "shared" (one buffer with another session's batch),
        # "lagging" (produced again: it asked after the window let the batch go).
        self.sharing = "off"
        # Its place in the scheduler's order (`Scheduler.next`): 0 for a client in good
        # standing, else its debt (server/peers.py); set by the core before it schedules.
        self.rank = 0

    @property
    def id(self) -> str:
        return self.identity.hex()

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
        bad = [k for k in batches if not 0 <= k < self.num_batches or k in self._asked]
        if bad:
            return (
                f"batches {show(bad)} are out of range (this stream has {self.num_batches}) or "
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
            not self.closed
            and self.next_pos < len(self.batches)
            and self.in_production + self.ready < self.prefetch_depth
        )

    def take_next(self) -> tuple[int, int]:
        """Reserve the next batch to produce: returns (position, batch_index)."""
        pos = self.next_pos
        self.next_pos += 1
        self.in_production += 1
        return pos, self.batches[pos]

    def completed(self, pos: int, batch: ReadyBatch) -> None:
        """A producer finished position ``pos`` (the caller checked the session is open)."""
        self.in_production -= 1
        self._finished[pos] = batch

    def abandoned(self) -> None:
        """A producer gave up on a batch of this session (error or shutdown)."""
        self.in_production -= 1

    def pop_sendable(self, limit: int) -> Iterator[ReadyBatch]:
        """Yield the batches finished in the order asked, at most ``limit``."""
        while limit > 0 and self.send_pos in self._finished:
            limit -= 1
            batch = self._finished.pop(self.send_pos)
            self.send_pos += 1
            self.sent += 1
            yield batch

    def drain(self) -> list[ReadyBatch]:
        """Close the session and return its queued batches so their buffers can be released."""
        self.closed = True
        out = list(self._finished.values())
        self._finished.clear()
        return out

    def row(self, now: float, in_flight: int) -> ClientRow:
        """This client's entry in the stats ``clients`` list; ``in_flight``: the sent batches
        ZeroMQ still holds for this peer (the server counts them per peer, across sessions)."""
        h = self.hello
        return ClientRow(
            id=self.id,
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


class Scheduler:
    """Round-robin over sessions with room, so every client gets its share of the producers;
    the lower ``rank`` first (the core sets it: a client's debt, server/peers.py).

    It calls nothing of the core: the core asks `next` for the session it would serve, checks
    that session may start a batch (the buffer budget), and either says `served` or asks again
    with that session among those to ``skip``.
    """

    def __init__(self) -> None:
        self._order: deque[bytes] = deque()
        self._offered_at = -1  # `next`'s answer's place in the order, for `served`
        self._offered_rank = 0

    def add(self, identity: bytes) -> None:
        if identity not in self._order:
            self._order.append(identity)

    def remove(self, identity: bytes) -> None:
        if identity in self._order:
            self._order.remove(identity)
            self._offered_at = -1

    def next(
        self, sessions: dict[bytes, ClientSession], skip: Container[bytes] = ()
    ) -> ClientSession | None:
        """The session to serve next, or None: of the sessions with room and not in ``skip``
        (those the core found may not start a batch now), the lowest rank, and of one rank the
        first after the last one served.

        Asked again after a refusal (no `served` between), it goes on from the refused one
        rather than from the start: one pass over the order per rank, not per refusal.
        """
        if self._offered_at < 0:
            found = self._scan(sessions, skip, 0, None)
        else:  # the refused one's rank after it first, then the next rank up
            rank = self._offered_rank
            found = self._scan(sessions, skip, self._offered_at + 1, rank, only=True)
            if found is None:
                found = self._scan(sessions, skip, 0, rank)
        if found is None:
            self._offered_at = -1
            return None
        self._offered_at, self._offered_rank = found[1], found[0].rank
        return found[0]

    def _scan(
        self,
        sessions: dict[bytes, ClientSession],
        skip: Container[bytes],
        start: int,
        rank: int | None,
        only: bool = False,
    ) -> tuple[ClientSession, int] | None:
        """From ``start``: the first session of ``rank`` (``only``), or the first of the
        lowest rank above ``rank`` (None: of any rank)."""
        best: ClientSession | None = None
        best_rank = best_at = 0
        for at, identity in enumerate(islice(self._order, start, None), start):
            session = sessions.get(identity)
            if session is None or identity in skip or not session.has_room():
                continue
            r = session.rank
            if only:
                if r == rank:
                    return session, at
                continue
            if rank is not None and r <= rank:
                continue
            if best is None or r < best_rank:
                best, best_rank, best_at = session, r, at
                if r <= 0:
                    break
        return None if best is None else (best, best_at)

    def served(self) -> None:
        """The session `next` offered starts a batch: it, and those passed over before it, go
        to the back of the order."""
        if self._offered_at >= 0:
            self._order.rotate(-(self._offered_at + 1))
            self._offered_at = -1
