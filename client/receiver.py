"""The client's engine: sessions with every server, credits, and the in-order reorder buffer.

Everything runs on the consumer's thread. ZeroMQ's own I/O thread already receives up to the
credited number of batches in the background; what is left for us is, for CUDA, one
``recv_into`` per frame (straight into the pinned slot the batch will be staged from) and
queueing the asynchronous device copy; for the CPU, taking the frames as they are (no copy, see
`staging.CpuStager`). Before blocking on the batch it needs next, `get` takes in every batch
that has already arrived, so copies are queued a step or more ahead of their use. A single
thread also means no socket is ever shared between threads and no error has to be ferried
across one.

Several servers: server ``i`` of ``n`` produces the rank's batches ``k`` with ``k % n == i``;
arrivals wait in a reorder buffer until their turn, so the loader yields the epoch in order,
each batch exactly once. Each server gets its own credit window (the rank's prefetch split
between them). A credit goes back as soon as a batch is handed to the consumer, so the server
can send the next while the step runs; the slot ring is sized for that: the windows, one batch
held by the consumer and one whose release event is still pending.

Next epoch: as soon as a server has delivered its last batch of the epoch (everything it owes
is received), it is sent the hello of the next epoch from batch 0 (``speculate``), so it
produces that epoch's first batches while the consumer finishes this one. The usual loop asks
for that epoch next; then `start` adopts the session and its first batches are already here. The
batches of such a session are kept as ZeroMQ frames (`ServerConnection.ahead`), outside the
reorder buffer, the slot ring and the credit windows of the current epoch, and take their slots
only when the epoch is adopted (at most one window per server, into an empty reorder buffer).
Any other `start` (another epoch, a resume mid-epoch, a replay) drops them and sends a new hello
whose session id makes the server's stale frames droppable. The loader's position (its
``state_dict``) never counts them: it only moves when a batch is handed to the consumer.

Reconnects: a server that drops the TCP connection (killed, restarted) or says ``shutdown`` gets
a new hello, with a new session id, from the next batch still needed from it, as soon as it is
reachable again; a server that stays silent for a heartbeat while it owes us a batch is sent one
too (the interval adapts to how long batches take, so a slow server is not restarted in a loop).
Frames of an old session are dropped. A wait longer than ``timeout`` raises.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
from batchwire import wire
from batchwire.client.connection import ServerConnection
from batchwire.client.errors import ProtocolError, ServerError, ServerUnavailable
from batchwire.client.staging import Staged

log = logging.getLogger(__name__)

_POLL_MS = 100  # longest single poll; bounds how late a reconnect or timeout is noticed
# The same error reply this many times in a row (with no batch between) is the server's answer,
# not a hiccup: it is raised as ServerError. Before that, each retry waits twice as long.
ERRORS_BEFORE_RAISING = 3
_ERROR_BACKOFF_S = 0.25
# A next-epoch session we have not spoken to for this long may have been dropped by the server
# (its --client-timeout, 60 s by default, counts our silence): it is replaced, not adopted,
# so a long validation between epochs costs a plain restart, never a heartbeat's stall.
AHEAD_MAX_AGE_S = 30.0


@dataclass(eq=False)
class Arrived:
    """A batch in the reorder buffer."""

    header: wire.BatchHeader
    staged: Staged
    source: int  # index of the connection it came from


class BatchReceiver:
    """Receives one rank's batches of one split from one or more servers, in epoch order.

    ``make_stager(welcome)`` is called once, with the first welcome, to build the object that
    turns received bytes into tensors (see `staging`); it must offer ``slots_needed`` slots.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        split: str,
        rank: int,
        world_size: int,
        prefetch: int,
        timeout: float,
        heartbeat: float,
        make_stager: Callable[[wire.Welcome, int], object],
        stats: Callable[[], dict | None],
        speculate: bool = True,
    ) -> None:
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.heartbeat = float(heartbeat)
        self.speculate = bool(speculate)
        n = len(endpoints)
        #: Credits per server: the rank's prefetch split between its servers.
        self.window = max(1, -(-prefetch // n))
        self.slots_needed = self.window * n + 2
        self._make_stager = make_stager
        self._stats = stats
        self._ctx = zmq.Context()
        self.conns: list[ServerConnection] = []
        try:
            for i, ep in enumerate(endpoints):
                self.conns.append(ServerConnection(self._ctx, ep, (i, n)))
        except BaseException:
            for c in self.conns:
                c.close()
            self._ctx.term()
            raise
        self._heartbeats = [self.heartbeat] * n
        self._sessions = itertools.count(random.SystemRandom().randrange(1, 1 << 30))
        self._poller = zmq.Poller()
        for c in self.conns:
            self._poller.register(c.socket, zmq.POLLIN)
            self._poller.register(c.monitor, zmq.POLLIN)
        self.welcome: wire.Welcome | None = None
        self.stager = None
        self.epoch = -1
        self.cursor = 0  # next batch index to hand out
        self.held: dict[int, Arrived] = {}
        self.dropped = 0  # batches received but not needed (stale, duplicate)
        self.adopted = 0  # batches of a next-epoch session that the epoch then used
        self.ahead_max_age = AHEAD_MAX_AGE_S
        self._no_speculation_in = -1  # an epoch in which a next-epoch hello was refused
        self._closed = False

    # ------------------------------------------------------------------ public

    @property
    def num_batches(self) -> int | None:
        return None if self.welcome is None else self.welcome.num_batches

    def start(self, epoch: int, cursor: int) -> None:
        """(Re)start every server's stream at ``(epoch, cursor)``; a no-op if already there."""
        if epoch == self.epoch and cursor == self.cursor and self.conns[0].stream.session >= 0:
            return
        self.epoch, self.cursor = epoch, cursor
        for arrived in self.held.values():
            self.stager.discard(arrived.staged)
        self.held.clear()
        for c in self.conns:
            if self._matches(c, epoch, cursor):
                self._adopt(c)
            else:
                c.mark_lost()
        self._heartbeats = [self.heartbeat] * len(self.conns)
        self._service()

    def wait_welcome(self) -> wire.Welcome:
        """Block until every server has welcomed the current session (a server that already
        moved on to the next epoch's session welcomed this one before it did)."""
        self._wait(lambda: all(c.stream.welcomed or self._is_ahead(c) for c in self.conns), None)
        assert self.welcome is not None
        return self.welcome

    def get(self, k: int) -> Arrived:
        """Block until batch ``k`` (the cursor) arrives; hand it over and re-credit its server."""
        if k != self.cursor:
            raise RuntimeError(f"batches are handed out in order: asked {k}, next is {self.cursor}")
        src = k % len(self.conns)
        self._service()
        self._wait(lambda: k in self.held, src)
        arrived = self.held.pop(k)
        self.cursor = k + 1
        self._top_up(self.conns[src])
        return arrived

    @property
    def depth(self) -> int:
        """Batches received ahead of the consumer."""
        return len(self.held)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.stager is not None:
                for arrived in self.held.values():
                    self.stager.discard(arrived.staged)
                self.stager.close()
        finally:
            self.held.clear()
            for c in self.conns:
                c.close()
            self._ctx.term()

    # ------------------------------------------------------------------ credits and hellos

    def _share(self, c: ServerConnection) -> tuple[int, int]:
        """(batches this server still owes us in the epoch, batches of it we hold)."""
        i, n = c.shard
        held = sum(1 for a in self.held.values() if a.source == i)
        total = self.num_batches
        if total is None:
            return self.window, held
        first = self.cursor + ((i - self.cursor) % n)
        remaining = len(range(first, total, n)) - held
        return remaining, held

    def _first(self, c: ServerConnection, cursor: int) -> int:
        """The first batch at or after ``cursor`` that ``c`` produces."""
        i, n = c.shard
        return cursor + ((i - cursor) % n)

    def _is_ahead(self, c: ServerConnection) -> bool:
        """Does ``c``'s session serve a later epoch than the one being iterated?"""
        return c.hello_sent and c.stream.epoch != self.epoch

    def _matches(self, c: ServerConnection, epoch: int, cursor: int) -> bool:
        """Is ``c``'s live session exactly the stream ``(epoch, cursor)`` needs from it?

        Only a session none of whose batches were used or dropped qualifies (every batch it
        sent is still in ``c.ahead``), and only if we spoke to the server recently enough for
        it to still know the session: anything else is restarted with a new hello.
        """
        s = c.stream
        return (
            c.hello_sent
            and s.epoch == epoch
            and s.start_batch == self._first(c, cursor)
            and s.received == len(c.ahead)
            and time.monotonic() - c.last_sent <= self.ahead_max_age
        )

    def _adopt(self, c: ServerConnection) -> None:
        """Make ``c``'s next-epoch session the current one: its frames join the reorder buffer."""
        ahead, c.ahead = c.ahead, []
        if not ahead:
            return
        assert self.stager is not None
        for h, images, labels in ahead:
            staged = self.stager.stage_frames(h, images, labels)
            self.held[h.batch_index] = Arrived(h, staged, c.shard[0])
        self.adopted += len(ahead)
        log.debug("%s: %d batch(es) of epoch %d here already", c.endpoint, len(ahead), self.epoch)

    def _target(self, c: ServerConnection) -> int:
        """How many batches this server should have in flight right now."""
        remaining, held = self._share(c)
        return max(0, min(self.window - held, remaining))

    def _send_hello(self, c: ServerConnection) -> None:
        """Start a new session with ``c`` from the next batch it owes, with a full window.

        Batches of ``c`` already held are dropped and asked for again: the server grants a
        session exactly its hello's ``prefetch`` in flight, so this keeps our credit count and
        the slot ring exact; reconnects are rare enough for the re-send not to matter.
        """
        need_welcome = self.welcome is None or not c.stream.welcomed
        remaining, _ = self._share(c)
        if remaining == 0 and not need_welcome:
            # Everything it owes this epoch is here: no session needed for it, but maybe one
            # for the next epoch.
            self._speculate(c)
            return
        i = c.shard[0]
        for k in [k for k, a in self.held.items() if a.source == i]:
            self.stager.discard(self.held.pop(k).staged)
        self._hello(c, max(self.epoch, 0), self._first(c, self.cursor))

    def _hello(self, c: ServerConnection, epoch: int, start_batch: int) -> None:
        hello = wire.Hello(
            split=self.split,
            rank=self.rank,
            world_size=self.world_size,
            epoch=epoch,
            start_batch=start_batch,
            prefetch=self.window,
            shard=c.shard,
            session=next(self._sessions),
        )
        if c.send_hello(hello):
            log.debug("hello to %s: %s", c.endpoint, hello)

    def _speculate(self, c: ServerConnection) -> None:
        """Start ``c`` on the next epoch once it owes nothing more in this one.

        The server's stream of this epoch is complete, so replacing it loses nothing; the
        hello's ``prefetch`` credits let it send that many batches, which wait in ``c.ahead``.
        """
        if (
            not self.speculate
            or self.welcome is None
            or self.epoch < 0
            or self._no_speculation_in == self.epoch
            or self._is_ahead(c)
            or (c.hello_sent and not c.stream.welcomed)
            or c.wait_reconnect
            or self._share(c)[0] != 0
        ):
            return
        if self._first(c, 0) >= self.welcome.num_batches:
            return  # it owes nothing in the next epoch either
        self._hello(c, self.epoch + 1, self._first(c, 0))

    def _top_up(self, c: ServerConnection) -> None:
        if not c.hello_sent or self._is_ahead(c):
            return  # a next-epoch session has its hello's window and needs no more yet
        grant = self._target(c) - c.stream.outstanding
        if grant > 0:
            c.send_credit(grant, self._stats())

    def _service(self) -> None:
        """Apply connection events and (re)send hellos where a session is missing."""
        for c in self.conns:
            c.drain_events()
            if c.may_send_hello:
                self._send_hello(c)
            else:  # e.g. a next-epoch hello that found no connection when first tried
                self._speculate(c)

    # ------------------------------------------------------------------ waiting

    def _wait(self, done: Callable[[], bool], src: int | None) -> None:
        """Receive until ``done()``; ``src`` is the connection the wait depends on (None: all)."""
        start = time.monotonic()
        deadline = start + self.timeout
        while True:
            self._receive_ready()
            if done():
                return
            now = time.monotonic()
            if now > deadline:
                raise self._unavailable(src, now)
            self._service()
            self._check_silence(src, start, now)
            self._poller.poll(min(_POLL_MS, max(1, int((deadline - now) * 1000))))

    def _check_silence(self, src: int | None, start: float, now: float) -> None:
        for i in range(len(self.conns)) if src is None else (src,):
            c = self.conns[i]
            if (
                not c.hello_sent
                or not c.connected
                or c.stream.outstanding <= 0
                or self._is_ahead(c)  # owes nothing to this epoch; checked once adopted
            ):
                continue
            quiet = now - max(c.last_heard, c.last_sent, start)
            if quiet > self._heartbeats[i]:
                log.info(
                    "no message from %s for %.1f s while it owes batches; re-sending hello",
                    c.endpoint,
                    quiet,
                )
                self._heartbeats[i] = min(2 * self._heartbeats[i], max(self.timeout / 2, 1.0))
                c.mark_lost()

    def _unavailable(self, src: int | None, now: float) -> ServerUnavailable:
        conns = self.conns if src is None else [self.conns[src]]
        c = next((c for c in conns if not c.stream.welcomed), conns[0])
        t = f"{self.timeout:g}"
        if not c.ever_connected:
            msg = (
                f"no pipeline-server answered at {c.endpoint} within {t} s "
                f"(is it running? start one with `pipeline-server --bind {c.endpoint}`)"
            )
        elif not c.connected:
            msg = (
                f"pipeline-server at {c.endpoint} went away (last heard "
                f"{now - c.last_heard:.1f} s ago) and did not come back within {t} s"
            )
        elif not c.stream.welcomed:
            msg = (
                f"pipeline-server at {c.endpoint} is connected but did not answer the hello "
                f"within {t} s (is it a pipeline-server speaking protocol "
                f"v{wire.PROTOCOL_VERSION}?)"
            )
        else:
            msg = (
                f"pipeline-server at {c.endpoint} is connected but sent no batch for {t} s "
                f"(waiting for batch {self.cursor} of epoch {self.epoch}, split {self.split!r})"
            )
        if c.last_error:
            msg += f"; its last error: {c.last_error}"
        return ServerUnavailable(c.endpoint, msg)

    # ------------------------------------------------------------------ receiving

    def _receive_ready(self) -> None:
        for c in self.conns:
            while c.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._receive_one(c)

    def _receive_one(self, c: ServerConnection) -> None:
        try:
            msg, more = c.recv_control()
        except ProtocolError as exc:
            exc.args = (f"pipeline-server at {c.endpoint}: {exc.args[0]}",)
            raise
        if isinstance(msg, wire.BatchHeader):
            self._receive_batch(c, msg, more)
            return
        if more:
            c.discard_rest()
        if isinstance(msg, wire.Welcome):
            if msg.session == c.stream.session and c.hello_sent:
                self._accept_welcome(c, msg)
        elif isinstance(msg, wire.ErrorReply):
            self._on_error(c, msg.message)
        elif isinstance(msg, wire.Shutdown):
            log.warning("pipeline-server at %s is shutting down; waiting for it", c.endpoint)
            c.mark_lost(wait_reconnect=True)

    def _on_error(self, c: ServerConnection, message: str) -> None:
        if self._is_ahead(c):
            # A next-epoch hello refused: nothing of this epoch is at stake. Stop guessing for
            # the rest of it; if the server really refuses that epoch, the hello sent when it
            # starts raises then.
            log.info("pipeline-server at %s refused the next epoch early: %s", c.endpoint, message)
            self._no_speculation_in = self.epoch
            c.mark_lost()
            return
        if not c.stream.welcomed:  # the answer to our hello: the server will not serve us
            raise ServerError(c.endpoint, message)
        # After a welcome, an error can only concern a later message; start a clean session,
        # backing off, and give up with the server's own words if it keeps saying the same.
        c.error_streak = c.error_streak + 1 if message == c.last_error else 1
        c.last_error = message
        if c.error_streak >= ERRORS_BEFORE_RAISING:
            raise ServerError(c.endpoint, f"{message} (said {c.error_streak} times in a row)")
        delay = _ERROR_BACKOFF_S * 2 ** (c.error_streak - 1)
        log.warning(
            "pipeline-server at %s: %s; re-sending hello in %.2f s", c.endpoint, message, delay
        )
        c.retry_at = time.monotonic() + delay
        c.mark_lost()

    def _accept_welcome(self, c: ServerConnection, w: wire.Welcome) -> None:
        if self.welcome is None:
            # The stager first: if it refuses this server's batches (e.g. normalize_on_device on
            # a float wire), the loader stays unwelcomed and says so again, not something else.
            self.stager = self._make_stager(w, self.slots_needed)
            self.welcome = w
        else:
            mine, theirs = _welcome_key(self.welcome), _welcome_key(w)
            if mine != theirs:
                raise ProtocolError(
                    f"pipeline-server at {c.endpoint} serves batches unlike the first server "
                    f"it talked to: {theirs} vs {mine}; all servers of one loader must be "
                    "started with the same data and options"
                )
        c.stream.welcomed = True
        self._top_up(c)

    def _receive_batch(self, c: ServerConnection, h: wire.BatchHeader, more: bool) -> None:
        s = c.stream
        if h.session != s.session or not c.hello_sent or not s.welcomed:
            c.discard_rest()  # a stale session's frames
            return
        s.received += 1
        if s.received > s.granted:
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint} sent more batches than credited "
                f"({s.received} > {s.granted})"
            )
        if self._is_ahead(c):
            self._receive_ahead(c, h, more)
            return
        i, n = c.shard
        assert self.welcome is not None
        total = self.welcome.num_batches
        wanted = (
            h.epoch == self.epoch
            and h.split == self.split
            and h.batch_index % n == i
            and self.cursor <= h.batch_index < total
            and h.batch_index not in self.held
        )
        if not wanted:  # e.g. resent after a reconnect; costs a credit, so grant it back
            c.discard_rest()
            self.dropped += 1
            self._top_up(c)
            return
        self._check_shape(c, h, more)
        if self.stager.wants_frames:
            staged = self.stager.stage_frames(h, *self._recv_frames(c, h))
        else:
            staged = self._recv_into_slot(c, h)
        self.held[h.batch_index] = Arrived(h, staged, i)
        c.error_streak = 0  # progress: an error after this is a new one
        # How long this batch took to come (since we last heard or asked): the silence check
        # waits a few times that, so a server that is merely slow is not restarted in a loop.
        gap = c.last_heard - max(c.last_sent, c.prev_heard)
        self._heartbeats[i] = max(self.heartbeat, min(self._heartbeats[i], 4 * gap))
        self._speculate(c)

    def _recv_into_slot(self, c: ServerConnection, h: wire.BatchHeader) -> Staged:
        """Receive the data frames straight into a (pinned) slot of the stager's ring."""
        slot = self.stager.acquire(h)
        size, more = c.recv_into(slot.images_buffer(h.nbytes))
        if size != h.nbytes or not more:
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint}: batch {h.batch_index} images frame has "
                f"{size} bytes{'' if more else ' and no labels frame'}; its header says "
                f"{h.nbytes}"
            )
        size, more = c.recv_into(slot.labels_buffer(h.batch_size))
        if size != h.labels_nbytes or more:
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint}: batch {h.batch_index} labels frame has "
                f"{size} bytes, expected {h.labels_nbytes}{' and then more frames' if more else ''}"
            )
        return self.stager.stage(slot, h)

    def _receive_ahead(self, c: ServerConnection, h: wire.BatchHeader, more: bool) -> None:
        """Keep a next-epoch batch as frames; it takes a slot only if its epoch is adopted."""
        s = c.stream
        expected = s.start_batch + c.shard[1] * len(c.ahead)  # a stream is sent in order
        if h.epoch != s.epoch or h.split != self.split or h.batch_index != expected:
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint} sent {h.split!r} batch {h.batch_index} of "
                f"epoch {h.epoch} where its session promised batch {expected} of epoch {s.epoch}"
            )
        self._check_shape(c, h, more)
        c.ahead.append((h, *self._recv_frames(c, h)))

    def _recv_frames(self, c: ServerConnection, h: wire.BatchHeader) -> tuple[zmq.Frame, zmq.Frame]:
        """Receive the images and labels frames as they are (no copy), checking their sizes."""
        images, more = c.recv_frame()
        if len(images) != h.nbytes or not more:
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint}: batch {h.batch_index} images frame has "
                f"{len(images)} bytes{'' if more else ' and no labels frame'}; its header says "
                f"{h.nbytes}"
            )
        labels, more = c.recv_frame()
        if len(labels) != h.labels_nbytes or more:
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint}: batch {h.batch_index} labels frame has "
                f"{len(labels)} bytes, expected {h.labels_nbytes}"
                f"{' and then more frames' if more else ''}"
            )
        return images, labels

    def _check_shape(self, c: ServerConnection, h: wire.BatchHeader, more: bool) -> None:
        w = self.welcome
        assert w is not None
        ok = (
            more
            and h.dtype == w.dtype
            and h.layout == w.layout
            and h.shape[1:] == w.shape[1:]
            and h.shape[0] <= w.shape[0]
        )
        if not ok:
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint}: batch {h.batch_index} is "
                f"{h.shape} {h.dtype} {h.layout}, but its welcome promised "
                f"{w.shape} {w.dtype} {w.layout}{'' if more else ' (and it has no data frames)'}"
            )


def _welcome_key(w: wire.Welcome) -> tuple:
    return (w.num_batches, w.num_samples, tuple(w.shape), w.dtype, w.layout, w.num_classes)
