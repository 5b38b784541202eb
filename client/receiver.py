"""The client's engine: sessions with every server, who produces which batch, and the in-order
reorder buffer.

Everything runs on the consumer's thread. ZeroMQ's own I/O thread already receives the batches
asked for in the background; what is left for us is, for CUDA, one ``recv_into`` per frame
(straight into the pinned slot the batch will be staged from) and queueing the asynchronous
device copy; for the CPU, taking the frames as they are (no copy, see `staging.CpuStager`).
Before blocking on the batch it needs next, `get` takes in every batch that has already
arrived, so copies are queued a step or more ahead of their use. A single thread also means no
socket is ever shared between threads and no error has to be ferried across one.

Who produces what: any server can produce any batch, so nothing is split up front. The loader
keeps at most ``budget`` batches asked for or waiting in the reorder buffer, and whenever one
is free it asks the server with the fewest batches outstanding for the lowest batch nobody has
been asked for (`BatchPool`): a fast server comes back for more sooner and so produces more, a
slow one gets fewer, and a server that is lost (its connection closed, it said ``shutdown``,
or it stayed silent for a heartbeat while owing batches) has its outstanding batches taken
back and handed to the others. It gets a new session when it is reachable again, and
batches again once it has answered that session's welcome. Arrivals wait in the reorder buffer
until their turn, so the loader yields the epoch in order, each batch exactly once. Frames of
an old session are dropped (each hello has a new session id).

Next epoch: once every batch of the epoch has been asked for, a server with nothing left to do
is sent the next epoch's hello with a few of its batches (``speculate``), so it produces them
while the consumer finishes this epoch. The usual loop asks for that epoch next; then `start`
adopts those sessions and their batches are already here. Such batches are kept as ZeroMQ
frames (`ServerConnection.ahead`), outside the reorder buffer, the slot ring and the budget, and
take their slots only when the epoch is adopted (at most ``share`` per server). Any other
`start` (another epoch, a resume mid-epoch, a replay) drops them and starts afresh. The
loader's position (its ``state_dict``) never counts them: it only moves when a batch is handed
to the consumer.

A wait longer than ``timeout`` for the batch the consumer needs raises `ServerUnavailable`; the
same error reply a few times in a row raises `ServerError`.
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
from batchwire.client.batch_pool import BatchPool
from batchwire.client.connection import ServerConnection
from batchwire.client.errors import ProtocolError, ServerError, ServerUnavailable
from batchwire.client.staging import Staged
from batchwire.wire.keys import ClientKeys

log = logging.getLogger(__name__)

_POLL_MS = 100  # longest single poll; bounds how late a reconnect or timeout is noticed
# A next-epoch session we have not spoken to for this long may have been dropped by the server
# (its --client-timeout, 60 s by default, counts our silence): its batches already here are
# used, but it is replaced rather than trusted to send the rest.
AHEAD_MAX_AGE_S = 30.0
# The same error reply this many times in a row (with no batch between) is the server's answer,
# not a hiccup: it is raised as ServerError. Before that, each retry waits twice as long.
ERRORS_BEFORE_RAISING = 3
_ERROR_BACKOFF_S = 0.25
_TRANSIENT_BACKOFF_MAX_S = 4.0
_PER_SERVER = 4  # the least budget per server when a loader has several


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
        job: str = "",
        keys: ClientKeys | None = None,
    ) -> None:
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.timeout = float(timeout)
        self.heartbeat = float(heartbeat)
        self.speculate = bool(speculate)
        n = len(endpoints)
        #: Batches asked for and not yet handed out (in flight or in the reorder buffer). With
        #: several servers at least 4 each: a server with fewer outstanding idles its producers
        #: while a slower one holds the batch the consumer waits for (bench_fleet: 0.75 of the
        #: two servers' summed rate with 2 each, 0.97 with 4 each).
        self.budget = prefetch if n == 1 else max(prefetch, _PER_SERVER * n)
        #: Next-epoch batches one server may be asked for ahead of time.
        self.share = max(1, self.budget // n)
        # The budget, the batch the consumer holds and one whose release event is pending.
        self.slots_needed = self.budget + 2
        self._make_stager = make_stager
        self._stats = stats
        self._ctx = zmq.Context()
        self.conns: list[ServerConnection] = []
        try:
            for i, ep in enumerate(endpoints):
                self.conns.append(ServerConnection(self._ctx, ep, i, keys))
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
        self.pool = BatchPool()  # this epoch's batches nobody was asked for
        self.next_pool = BatchPool()  # the next epoch's, for early sessions
        self.held: dict[int, Arrived] = {}
        self.dropped = 0  # batches received but not needed (stale, duplicate)
        self.adopted = 0  # batches of a next-epoch session that the epoch then used
        self.ahead_max_age = AHEAD_MAX_AGE_S
        self._no_speculation_in = -1  # an epoch in which a next-epoch hello was refused
        self._started = False
        self._turn = 0  # the server first in line when several have as few outstanding
        self._closed = False

    # ------------------------------------------------------------------ public

    @property
    def num_batches(self) -> int | None:
        return None if self.welcome is None else self.welcome.num_batches

    def start(self, epoch: int, cursor: int) -> None:
        """(Re)start the stream at ``(epoch, cursor)``; a no-op if already there."""
        if self._started and epoch == self.epoch and cursor == self.cursor:
            return
        adopt = cursor == 0 and epoch == self.epoch + 1 and self.welcome is not None
        for arrived in self.held.values():
            self.stager.discard(arrived.staged)
        self.held.clear()
        if adopt:
            self.pool, self.next_pool = self.next_pool, BatchPool()
        else:
            for c in self.conns:  # their sessions serve another epoch or position
                self._end_session(c)
            self.pool.reset(cursor, self.num_batches)
        self.next_pool.reset(0, self.num_batches)
        self.epoch, self.cursor, self._started = epoch, cursor, True
        if adopt:
            for c in self.conns:
                if c.hello_sent and c.stream.epoch == epoch:  # the early session of this epoch
                    self._adopt(c)
                else:
                    self._end_session(c)
        self._heartbeats = [self.heartbeat] * len(self.conns)
        self._service()

    def wait_welcome(self) -> wire.Welcome:
        """Block until a server has welcomed this loader (the epoch's length is known then)."""
        self._wait(lambda: self.welcome is not None)
        assert self.welcome is not None
        return self.welcome

    def get(self, k: int) -> Arrived:
        """Block until batch ``k`` (the cursor) arrives; hand it over and ask for another."""
        if k != self.cursor:
            raise RuntimeError(f"batches are handed out in order: asked {k}, next is {self.cursor}")
        self._service()
        self._wait(lambda: k in self.held)
        arrived = self.held.pop(k)
        self.cursor = k + 1
        self._refill()
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

    # ------------------------------------------------------------------ who produces what

    def _is_ahead(self, c: ServerConnection) -> bool:
        """Does ``c``'s session serve a later epoch than the one being iterated?"""
        return c.hello_sent and c.stream.epoch != self.epoch

    def _in_use(self) -> int:
        """Batches of this epoch asked for or held: what the budget bounds."""
        pending = sum(c.stream.outstanding for c in self.conns if not self._is_ahead(c))
        return len(self.held) + pending

    def _takers(self) -> list[ServerConnection]:
        """Servers that may be asked for this epoch's batches now."""
        return [
            c
            for c in self.conns
            if c.hello_sent and c.connected and c.stream.welcomed and not self._is_ahead(c)
        ]

    def _refill(self) -> None:
        """Ask for the lowest unasked batches while the budget allows, fewest-outstanding first.

        Every asked-for batch is one credit, so the stats of the loader ride on these credits.
        """
        free = self.budget - self._in_use()
        takers = self._takers()
        if self.pool and not takers:
            # Lost batches came back, but every live server is busy with the next epoch.
            for c in self.conns:
                if self._is_ahead(c) and c.connected:
                    self._end_session(c)
            return
        asks: dict[int, list[int]] = {}
        n = len(self.conns)
        while free > 0 and self.pool and takers:
            # Fewest outstanding first; ties go round the servers, so a consumer slower than
            # its servers still spreads the epoch over all of them.
            c = min(
                takers,
                key=lambda c: (
                    c.stream.outstanding + len(asks.get(c.index, ())),
                    (c.index - self._turn) % n,
                ),
            )
            self._turn = c.index + 1
            asks.setdefault(c.index, []).append(self.pool.take())
            free -= 1
        for i, batches in asks.items():
            c = self.conns[i]
            if not c.send_credit(batches, self._stats()):
                self.pool.give_back(batches)
        if not self.pool:
            for c in self.conns:
                self._speculate(c)

    def _end_session(self, c: ServerConnection) -> None:
        """Forget ``c``'s session; the batches it owes go back to the pool they came from."""
        if c.hello_sent:
            c.mark_lost()
        self._reclaim(c)

    def _reclaim(self, c: ServerConnection) -> None:
        """Take back what a lost session was asked for (and next-epoch frames never adopted)."""
        s = c.stream
        owed = list(s.pending) + [h.batch_index for h, _, _ in c.ahead]
        s.pending.clear()
        c.ahead.clear()
        if not owed:
            return
        if s.epoch == self.epoch:
            self.pool.give_back(owed)
        elif s.epoch == self.epoch + 1:
            self.next_pool.give_back(owed)
        log.debug("%s: %d batch(es) of epoch %d taken back", c.endpoint, len(owed), s.epoch)

    def _adopt(self, c: ServerConnection) -> None:
        """Make ``c``'s next-epoch session the current one: its frames join the reorder buffer.

        A session we have not spoken to for long may have been dropped by the server: its
        frames are used, the rest of what it owes is taken back.
        """
        ahead, c.ahead = c.ahead, []
        assert self.stager is not None
        for h, images, labels in ahead:
            staged = self.stager.stage_frames(h, images, labels)
            self.held[h.batch_index] = Arrived(h, staged, c.index)
        self.adopted += len(ahead)
        if ahead:
            log.debug(
                "%s: %d batch(es) of epoch %d here already", c.endpoint, len(ahead), self.epoch
            )
        if time.monotonic() - c.last_sent > self.ahead_max_age:
            self._end_session(c)

    def _hello(self, c: ServerConnection, epoch: int, batches: list[int]) -> bool:
        hello = wire.Hello(
            split=self.split,
            rank=self.rank,
            world_size=self.world_size,
            epoch=epoch,
            batches=tuple(batches),
            session=next(self._sessions),
            job=self.job,
        )
        if not c.send_hello(hello):
            return False
        log.debug("hello to %s: %s", c.endpoint, hello)
        return True

    def _speculate(self, c: ServerConnection) -> None:
        """Start ``c`` on the next epoch once nothing of this one is left to ask for.

        Its session of this epoch owes nothing, so replacing it loses nothing; the next
        epoch's batches it is asked for wait in ``c.ahead``.
        """
        if (
            not self.speculate
            or self.welcome is None
            or self.epoch < 0
            or self._no_speculation_in == self.epoch
            or self.pool
            or not self.next_pool
            or self._is_ahead(c)
            or not c.connected
            or (c.hello_sent and (not c.stream.welcomed or c.stream.outstanding))
            or c.wait_reconnect
            or time.monotonic() < c.retry_at
        ):
            return
        batches = [self.next_pool.take() for _ in range(self.share) if self.next_pool]
        if not self._hello(c, self.epoch + 1, batches):
            self.next_pool.give_back(batches)

    def _service(self) -> None:
        """Apply connection events, take back what lost sessions owed, (re)send hellos."""
        for c in self.conns:
            c.drain_events()
            if c.handshake_error is not None:
                raise ServerError(c.endpoint, c.handshake_error)
            if not c.hello_sent and (c.stream.pending or c.ahead):
                self._reclaim(c)
            if c.may_send_hello and self._started:
                if not self.pool and self.welcome is not None:
                    self._speculate(c)  # nothing of this epoch left to ask for
                if not c.hello_sent:
                    # An empty hello: batches follow its welcome, so a server that is not
                    # really there (stopped, hung) never sits on any.
                    self._hello(c, max(self.epoch, 0), [])
        self._refill()

    # ------------------------------------------------------------------ waiting

    def _wait(self, done: Callable[[], bool]) -> None:
        """Receive until ``done()``; `ServerUnavailable` after ``timeout`` seconds."""
        start = time.monotonic()
        deadline = start + self.timeout
        while True:
            self._receive_ready()
            if done():
                return
            now = time.monotonic()
            if now > deadline:
                raise self._unavailable(now)
            self._service()
            self._check_silence(start, now)
            self._poller.poll(min(_POLL_MS, max(1, int((deadline - now) * 1000))))

    def _check_silence(self, start: float, now: float) -> None:
        for i, c in enumerate(self.conns):
            if not c.hello_sent or not c.connected or self._is_ahead(c):
                continue
            if c.stream.welcomed and c.stream.outstanding <= 0:
                continue
            quiet = now - max(c.last_heard, c.last_sent, start)
            if quiet > self._heartbeats[i]:
                log.info(
                    "no message from %s for %.1f s while it owes %s; its batches go to the "
                    "other servers and it gets a new hello",
                    c.endpoint,
                    quiet,
                    "batches" if c.stream.welcomed else "a welcome",
                )
                self._heartbeats[i] = min(2 * self._heartbeats[i], max(self.timeout / 2, 1.0))
                self._end_session(c)

    def _unavailable(self, now: float) -> ServerUnavailable:
        c = next((c for c in self.conns if not c.stream.welcomed), self.conns[0])
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
        others = [o.endpoint for o in self.conns if o is not c]
        if others:
            msg += f"; nor did {', '.join(others)} deliver it"
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
            self._on_error(c, msg.message, msg.reason)
        elif isinstance(msg, wire.Shutdown):
            log.warning("pipeline-server at %s is shutting down; waiting for it", c.endpoint)
            c.mark_lost(wait_reconnect=True)
            self._reclaim(c)

    def _on_error(self, c: ServerConnection, message: str, reason: str = "refused") -> None:
        if self._is_ahead(c):
            # A next-epoch hello refused: nothing of this epoch is at stake. Stop guessing for
            # the rest of it; if the server really refuses that epoch, the hello sent when it
            # starts raises then.
            log.info("pipeline-server at %s refused the next epoch early: %s", c.endpoint, message)
            self._no_speculation_in = self.epoch
            self._end_session(c)
            return
        if not c.stream.welcomed:  # the answer to our hello: the server will not serve us
            raise ServerError(c.endpoint, message)
        if reason == "transient":
            # It may pass (say, the server ran out of file descriptors): ask again, backing
            # off, for as long as the loader's timeout allows; ServerUnavailable quotes it.
            c.transient_streak += 1
            c.last_error = message
            delay = min(_TRANSIENT_BACKOFF_MAX_S, _ERROR_BACKOFF_S * 2 ** (c.transient_streak - 1))
            log.warning(
                "pipeline-server at %s: %s; asking again in %.2f s", c.endpoint, message, delay
            )
            c.retry_at = time.monotonic() + delay
            self._end_session(c)
            return
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
        self._end_session(c)

    def _accept_welcome(self, c: ServerConnection, w: wire.Welcome) -> None:
        if self.welcome is None:
            # The stager first: if it refuses this server's batches (e.g. normalize_on_device on
            # a float wire), the loader stays unwelcomed and says so again, not something else.
            self.stager = self._make_stager(w, self.slots_needed)
            self.welcome = w
            self.pool.set_total(w.num_batches)
            self.next_pool.set_total(w.num_batches)
        else:
            mine, theirs = _welcome_key(self.welcome), _welcome_key(w)
            if mine != theirs:
                raise ProtocolError(
                    f"pipeline-server at {c.endpoint} serves batches unlike the first server "
                    f"it talked to: {theirs} vs {mine}; all servers of one loader must be "
                    "started with the same data and options"
                )
        c.stream.welcomed = True
        if self._is_ahead(c):
            return
        self._refill()

    def _receive_batch(self, c: ServerConnection, h: wire.BatchHeader, more: bool) -> None:
        s = c.stream
        if h.session != s.session or not c.hello_sent or not s.welcomed:
            c.discard_rest()  # a stale session's frames
            return
        if not s.pending or h.batch_index != s.pending[0]:
            c.discard_rest()
            expected = s.pending[0] if s.pending else "nothing"
            raise ProtocolError(
                f"pipeline-server at {c.endpoint} sent batch {h.batch_index} where its session "
                f"was to send {expected}"
            )
        s.pending.popleft()
        if h.epoch != s.epoch or h.split != self.split:
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint} sent {h.split!r} batch {h.batch_index} of "
                f"epoch {h.epoch} in a session of {self.split!r} epoch {s.epoch}"
            )
        self._check_shape(c, h, more)
        if self._is_ahead(c):
            c.ahead.append((h, *self._recv_frames(c, h)))
            return
        assert self.welcome is not None
        if (
            not self.cursor <= h.batch_index < self.welcome.num_batches
            or h.batch_index in self.held
        ):
            c.discard_rest()  # e.g. asked again after a reconnect and delivered twice
            self.dropped += 1
            self._refill()
            return
        if self.stager.wants_frames:
            staged = self.stager.stage_frames(h, *self._recv_frames(c, h))
        else:
            staged = self._recv_into_slot(c, h)
        self.held[h.batch_index] = Arrived(h, staged, c.index)
        c.error_streak = c.transient_streak = 0  # progress: an error after this is a new one
        # How long this batch took to come (since we last heard or asked): the silence check
        # waits a few times that, so a server that is merely slow is not restarted in a loop.
        gap = c.last_heard - max(c.last_sent, c.prev_heard)
        self._heartbeats[c.index] = max(self.heartbeat, min(self._heartbeats[c.index], 4 * gap))
        if not self.pool:
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
