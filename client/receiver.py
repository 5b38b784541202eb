"""The client's I/O shell: the sockets, one checked receive per frame, and the reorder buffer.

Every decision (which server gets which batch, sessions, next-epoch speculation, back-off,
silence, errors) is `fleet.Fleet`'s, the sans-I/O core: this module tells it what happened
(monitor events, messages, batch headers, the time) and carries out what it answers (send a
hello or a credit, adopt or drop next-epoch batches received ahead).

Everything runs on the consumer's thread. ZeroMQ's own I/O thread already receives the batches
asked for in the background; what is left for us is, for CUDA, one ``recv_into`` per frame
(straight into the pinned slot the batch will be staged from) and queueing the asynchronous
device copy; for the CPU, taking the frames as they are (no copy, see `staging.CpuStager`).
Before blocking on the batch it needs next, `get` takes in every batch that has already
arrived, so copies are queued a step or more ahead of their use. A single thread also means no
socket is ever shared between threads and no error has to be ferried across one.

Arrivals wait in the reorder buffer (``held``) until their turn, so the loader yields the
epoch in order, each batch exactly once. Next-epoch batches received ahead are kept as ZeroMQ
frames (``_early``), outside the reorder buffer, the slot ring and the budget, until the core
adopts them (they then take their slots) or drops them. The loader's position (its
``state_dict``) never counts them: it only moves when a batch is handed to the consumer.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import zmq
from batchwire import wire
from batchwire.client import fleet as core
from batchwire.client.connection import ConnectionEvent, ServerConnection
from batchwire.client.discovery import Discovery, Resolve
from batchwire.client.errors import ProtocolError, ServerError
from batchwire.client.staging import CpuStager, CudaStager, Staged
from batchwire.wire.keys import ClientKeys

log = logging.getLogger(__name__)

_POLL_MS = 100  # longest single poll; bounds how late a reconnect or timeout is noticed
#: Messages taken from one server before the loader looks at its clock and the others again: a
#: server that floods it faster than it can read must not keep it from its timeout for ever.
MAX_RECV_PER_TURN = 256
# While the consumer waits this long or longer for a batch, the loader says so (and again each
# time this much more has passed): address, seconds waited, and what the server is doing.
WAIT_SAY_S = 5.0

Stager = CpuStager | CudaStager
#: A next-epoch batch received ahead: (header, images frame, labels frame).
EarlyFrames = tuple[wire.BatchHeader, zmq.Frame, zmq.Frame]


@dataclass(eq=False)
class Arrived:
    """A batch in the reorder buffer."""

    header: wire.BatchHeader
    staged: Staged
    source: int  # index of the server it came from


class BatchReceiver:
    """Receives one rank's batches of one split from one or more servers, in epoch order.

    ``make_stager(welcome, slots)`` is called once, with the first welcome, to build the object
    that turns received bytes into tensors (see `staging`); it must offer ``slots`` slots.
    ``clock`` is the time source handed to the core (monotonic seconds).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        config: core.FleetConfig,
        *,
        make_stager: Callable[[wire.Welcome, int], Stager],
        keys: ClientKeys | None = None,
        clock: Callable[[], float] = time.monotonic,
        resolve: Resolve | None = None,
    ) -> None:
        self._clock = clock
        # dns+tcp:// names stand for every server they resolve to (a ServerUnavailable naming
        # DNS if one has none now); re-resolved on a thread, the changes go to the core.
        self._discovery: Discovery | None = None
        if any(e.startswith("dns+tcp://") for e in endpoints):
            self._discovery = Discovery(endpoints, resolve=resolve)
            endpoints = self._discovery.initial()
        self._keys = keys
        self.fleet = core.Fleet(
            endpoints,
            config,
            now=clock(),
            first_session=random.SystemRandom().randrange(1, 1 << 30),
        )
        # The budget, the batch the consumer holds and one whose release event is pending.
        self.slots_needed = self.fleet.budget + 2
        self._make_stager = make_stager
        #: The loader's latest report (`wire.LoaderReport`'s map), put on every credit: handed
        #: in with each `get`, as data (None until the first).
        self._report: dict | None = None
        self._ctx = zmq.Context()
        #: One connection per server of the core, by its index; None once it left the fleet.
        self.conns: list[ServerConnection | None] = []
        self._poller = zmq.Poller()
        try:
            for i, ep in enumerate(endpoints):
                self._open(i, ep)
        except BaseException:
            for c in self.conns:
                if c is not None:
                    c.close()
            self._ctx.term()
            raise
        if self._discovery is not None:
            self._discovery.start()
        self.stager: Stager | None = None
        self.held: dict[int, Arrived] = {}
        self._early: dict[int, list[EarlyFrames]] = {}
        self._closed = False

    # ------------------------------------------------------------------ public

    @property
    def welcome(self) -> wire.Welcome | None:
        return self.fleet.welcome

    @property
    def num_batches(self) -> int | None:
        return self.fleet.num_batches

    @property
    def image_size(self) -> tuple[int, int] | None:
        """The output size the current sessions ask for (None: the servers')."""
        return self.fleet.image_size

    @property
    def depth(self) -> int:
        """Batches received ahead of the consumer."""
        return len(self.held)

    def start(
        self,
        epoch: int,
        cursor: int,
        resume: tuple[int, int] = (0, 0),
        image_size: tuple[int, int] | None = None,
    ) -> None:
        """(Re)start at ``(epoch, cursor)`` of the pass ``resume`` (`fleet.Fleet.start`) at
        output size ``image_size`` (None: the servers'); a no-op if already there.

        Another output size than the last start's (progressive resizing) ends every session
        and builds the stager again from the next welcome (its slots and outputs have the
        batch's size); the loader has released every batch it handed out by then."""
        resize = image_size != self.fleet.image_size
        self.fleet.ask_image_size(image_size)
        if self.fleet.is_at(epoch, cursor, resume) and not resize:
            return
        self._discard_held()
        if resize and self.stager is not None:
            self.stager.close()
            self.stager = None
        self._carry_out(self.fleet.start(epoch, cursor, self._clock(), resume))
        self._service()

    def ask_image_size(self, image_size: tuple[int, int] | None) -> None:
        """The next `start` asks for ``image_size``; nothing is asked ahead at another."""
        self.fleet.ask_image_size(image_size)

    def ask_batch_size(self, batch_size: int | None) -> None:
        """Hellos from now on ask for batches of ``batch_size`` (None: the servers')."""
        self.fleet.ask_batch_size(batch_size)

    def ask_ahead(self, enabled: bool) -> None:
        """Whether the next epoch is asked for early from now on (`Fleet.ask_ahead`)."""
        self.fleet.ask_ahead(enabled)

    def wait_welcome(self) -> wire.Welcome:
        """Block until a server has welcomed this loader (the epoch's length is known then)."""
        self._wait(lambda: self.fleet.welcome is not None)
        assert self.fleet.welcome is not None
        return self.fleet.welcome

    def get(self, k: int, report: dict | None = None) -> Arrived:
        """Block until batch ``k`` (the cursor) arrives; hand it over and ask for another.

        ``report``: the loader's stats (`wire.LoaderReport`'s map), put on the credits sent
        from now on."""
        if k != self.fleet.cursor:
            raise RuntimeError(
                f"batches are handed out in order: asked {k}, next is {self.fleet.cursor}"
            )
        self._report = report
        self._service()
        self._wait(lambda: k in self.held)
        arrived = self.held.pop(k)
        self._carry_out(self.fleet.on_handed_out(k, self._clock()))
        return arrived

    def hand_out(self, arrived: Arrived, cuda_stream: torch.cuda.Stream | None = None) -> None:
        """Make ``arrived`` ready for the consumer: CUDA: ``cuda_stream`` (default: the current
        stream) waits for its copy; CPU: normalised now if asked."""
        assert self.stager is not None
        self.stager.hand_out(arrived.staged, cuda_stream)

    def release(self, staged: Staged) -> None:
        """The consumer is done with a batch handed out: its slot may be reused."""
        if self.stager is not None:
            self.stager.release(staged)

    def consumer_stream(self, cuda_stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        """The CUDA stream batches are handed to (``cuda_stream``, else the current one)."""
        assert isinstance(self.stager, CudaStager)
        return self.stager.consumer_stream(cuda_stream)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._discovery is not None:
                self._discovery.close()
            self._discard_held()
            if self.stager is not None:
                self.stager.close()
        finally:
            self._early.clear()
            for i, c in enumerate(self.conns):
                if c is None:
                    continue
                peer = self.fleet.peers[i]
                c.close(say_bye=peer.connected and self.fleet.has_session(i))
            self._ctx.term()

    # ------------------------------------------------------------------ connections

    def _open(self, server: int, endpoint: str) -> None:
        """Connect to server ``server`` (its index in the core) at ``endpoint``."""
        assert server == len(self.conns), "servers are connected in the core's order"
        c = ServerConnection(self._ctx, endpoint, self._keys)
        self.conns.append(c)
        self._poller.register(c.socket, zmq.POLLIN)
        self._poller.register(c.monitor, zmq.POLLIN)

    def _close_one(self, server: int, bye: bool) -> None:
        """Close server ``server``'s connection for good (it left the fleet)."""
        c = self.conns[server]
        if c is None:
            return
        self.conns[server] = None
        self._poller.unregister(c.socket)
        self._poller.unregister(c.monitor)
        c.close(say_bye=bye)

    def _conn(self, server: int) -> ServerConnection:
        c = self.conns[server]
        assert c is not None, f"server {server} left the fleet: the core sends it nothing"
        return c

    # ------------------------------------------------------------------ carrying out the core

    def _carry_out(self, actions: list[core.Action]) -> None:
        for action in actions:
            if isinstance(action, core.SendHello):
                if not self._conn(action.server).send(action.hello.pack()):
                    self._carry_out(self.fleet.on_send_failed(action))
            elif isinstance(action, core.SendCredit):
                # Every asked-for batch is one credit, so the loader's stats ride on credits.
                credit = wire.Credit(batches=action.batches, stats=self._report)
                if not self._conn(action.server).send(credit.pack()):
                    self._carry_out(self.fleet.on_send_failed(action))
            elif isinstance(action, core.AdoptEarly):
                assert self.stager is not None
                endpoint = self.fleet.peers[action.server].endpoint
                for h, images, labels in self._early.pop(action.server, []):
                    with _named(endpoint, h):
                        staged = self.stager.stage_frames(h, images, labels)
                    self.held[h.batch_index] = Arrived(h, staged, action.server)
            elif isinstance(action, core.DropEarly):
                self._early.pop(action.server, None)
            elif isinstance(action, core.Connect):
                self._open(action.server, action.endpoint)
            elif isinstance(action, core.Disconnect):
                self._early.pop(action.server, None)
                self._close_one(action.server, action.bye)

    def _discard_held(self) -> None:
        for arrived in self.held.values():
            if self.stager is not None:
                self.stager.discard(arrived.staged)
        self.held.clear()

    def _service(self, waiting_since: float | None = None) -> None:
        """Connection events and the fleet's changes (DNS) to the core, then its tick."""
        for i, c in enumerate(self.conns):
            if c is None:
                continue
            for event in c.drain_events():
                if event is ConnectionEvent.CONNECTED:
                    self._carry_out(self.fleet.on_connected(i))
                elif event is ConnectionEvent.CONNECT_FAILED:
                    self.fleet.on_connect_failed(i)
                else:
                    self._carry_out(self.fleet.on_disconnected(i))
                    if self._discovery is not None:
                        self._discovery.kick()  # replaced at another address, perhaps
            if c.handshake_error is not None:
                raise ServerError(c.endpoint, c.handshake_error)
        if self._discovery is not None and (endpoints := self._discovery.take()) is not None:
            self._carry_out(self.fleet.on_endpoints(endpoints, self._clock()))
        self._carry_out(self.fleet.tick(self._clock(), waiting_since))

    def _wait(self, done: Callable[[], bool]) -> None:
        """Receive until ``done()``; the core raises `ServerUnavailable` after the timeout."""
        start = self._clock()
        deadline = start + self.fleet.config.timeout
        say_at = start + WAIT_SAY_S
        while True:
            self._receive_ready()
            if done():
                return
            self._service(waiting_since=start)
            if (now := self._clock()) >= say_at:
                log.warning("%s", self.fleet.waiting_note(now, start))
                say_at = now + WAIT_SAY_S
            left_ms = int((deadline - self._clock()) * 1000)
            self._poller.poll(min(_POLL_MS, max(1, left_ms)))

    # ------------------------------------------------------------------ receiving

    def _receive_ready(self) -> None:
        for i, c in enumerate(self.conns):
            # The list may grow, or a server leave, while its batches are carried out.
            for _ in range(MAX_RECV_PER_TURN):
                if c is None or self.conns[i] is not c:
                    break
                if not c.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                self._receive_one(i, c)

    def _receive_one(self, i: int, c: ServerConnection) -> None:
        try:
            msg, more = c.recv_control()
        except ProtocolError as exc:
            exc.args = (f"pipeline-server at {c.endpoint}: {exc.args[0]}",)
            raise
        now = self._clock()
        if isinstance(msg, wire.BatchHeader):
            self._receive_batch(i, c, msg, more, now)
            return
        if more:
            c.discard_rest()
        if (
            isinstance(msg, wire.Welcome)
            and self.stager is None
            and self.fleet.is_current(i, msg.session)
        ):
            # The stager first: if it refuses this server's batches (e.g. normalize_on_device
            # on a float wire), the loader stays unwelcomed and says so again, not something
            # else. Its slots bound the budget from now on, however many servers join.
            self.slots_needed = self.fleet.budget + 2
            self.stager = self._make_stager(msg, self.slots_needed)
            if isinstance(self.stager, CudaStager):
                self.fleet.cap_budget()
        self._carry_out(self.fleet.on_message(i, msg, now))

    def _receive_batch(
        self, i: int, c: ServerConnection, h: wire.BatchHeader, more: bool, now: float
    ) -> None:
        try:
            verdict, actions = self.fleet.on_batch(i, h, more, now)
        except ProtocolError:
            c.discard_rest()
            raise
        if verdict is core.Verdict.DROP:
            c.discard_rest()
        elif verdict is core.Verdict.KEEP_EARLY:
            self._early.setdefault(i, []).append((h, *self._recv_frames(c, h)))
        else:
            assert self.stager is not None
            if isinstance(self.stager, CpuStager):
                frames = self._recv_frames(c, h)
                with _named(c.endpoint, h):
                    staged = self.stager.stage_frames(h, *frames)
            else:
                staged = self._recv_into_slot(self.stager, c, h)
            self.held[h.batch_index] = Arrived(h, staged, i)
        self._carry_out(actions)

    def _recv_into_slot(
        self, stager: CudaStager, c: ServerConnection, h: wire.BatchHeader
    ) -> Staged:
        """Receive the data frames straight into a (pinned) slot of the stager's ring."""
        slot = stager.acquire(h)
        size, more = c.recv_into(slot.images_buffer(h.nbytes))
        self._check_frames(c, h, size, more, "images")
        size, more = c.recv_into(slot.labels_buffer(h.labels_nbytes // 8))
        self._check_frames(c, h, size, more, "labels")
        with _named(c.endpoint, h):
            return stager.stage(slot, h)

    def _recv_frames(self, c: ServerConnection, h: wire.BatchHeader) -> tuple[zmq.Frame, zmq.Frame]:
        """Receive the images and labels frames as they are (no copy), checking their sizes."""
        images, more = c.recv_frame()
        self._check_frames(c, h, len(images), more, "images")
        labels, more = c.recv_frame()
        self._check_frames(c, h, len(labels), more, "labels")
        return images, labels

    @staticmethod
    def _check_frames(
        c: ServerConnection, h: wire.BatchHeader, size: int, more: bool, which: str
    ) -> None:
        """The images frame must have the header's size and a labels frame after it; the labels
        frame, one int64 per sample and nothing after it."""
        if which == "images" and (size != h.nbytes or not more):
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint}: batch {h.batch_index} images frame has "
                f"{size} bytes{'' if more else ' and no labels frame'}; its header says "
                f"{h.nbytes}"
            )
        if which == "labels" and (size != h.labels_nbytes or more):
            c.discard_rest()
            raise ProtocolError(
                f"pipeline-server at {c.endpoint}: batch {h.batch_index} labels frame has "
                f"{size} bytes, expected {h.labels_nbytes}{' and then more frames' if more else ''}"
            )


@contextlib.contextmanager
def _named(endpoint: str, h: wire.BatchHeader) -> Iterator[None]:
    """A staged batch's `ProtocolError` (a label the welcome rules out: `wire.check_labels`)
    names the server that sent it and the batch, as the frame checks do."""
    try:
        yield
    except ProtocolError as exc:
        raise ProtocolError(
            f"pipeline-server at {endpoint}: batch {h.batch_index}: {exc}"
        ) from None
