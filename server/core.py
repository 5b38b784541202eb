"""The server's protocol core: every decision, no I/O (the h11 / wsproto pattern).

`ServerCore` takes events and returns actions; `app.py` owns the sockets, the producer threads
and the clock, feeds the events in and carries the actions out. Nothing here touches a socket,
a thread or the clock: every event carries ``now`` (monotonic seconds), so the unit tests drive
it with a fake clock and read the actions (tests/unit/test_server_core.py).

Events                                        Actions (returned, in order)
  on_frames(identity, frames, now)              Reply(identity, message)
  on_message(identity, message, now)            ReplyStats(identity)   (the shell's snapshot)
  on_result(result, now)   a producer finished  Submit(order)          (lend a buffer, produce)
  on_sent(ticket, now)     ZeroMQ let go        SendBatch(identity, header, slot, labels, ticket)
  on_peer_gone(identity, why, now)              Release(slot)          (a buffer comes back)
  tick(now)    after every turn of the loop     TrimBuffers(keep)      (free idle chunks)
  begin_drain(now) (SIGTERM: see "Draining")
  shutdown(now)

Draining (`begin_drain`, the shell's SIGTERM with --drain-timeout > 0): no hello is admitted
any more (a ``transient`` error: the client's fleet backs off, hands the batches it asked of
us to its other servers and never counts us as a server that refuses it for good); nothing
new is submitted; each session is sent what is already in production or ready, then told
`Shutdown` (the client takes back what it asked and was not sent and asks the other servers)
and dropped. A session whose peer does not read (`not_reading`) is told at once: its batches
move rather than wait. `drained` says when every session has been told and ZeroMQ holds no
batch for a peer that reads; the shell bounds the whole by --drain-timeout.

What lives here: admission (splits, --max-clients, world-size agreement per (split, job)),
each client's session (sessions.py), the buffer budget and fair share (budget.py), credit
limits, round-robin scheduling over the producers, what ZeroMQ still holds per peer
(delivery.py), what each peer was sent and never acknowledged across its hellos (peers.py:
the least indebted are scheduled first, so clients that re-send their hello and never read
cannot starve a trainer), shared production (sharing.py: one batch produced once for every
session asking for it, see "Sharing" below), and dropping clients that are gone, silent or
stalled.

Memory bounds, and what bounds them:

- buffers: never more than --max-buffers lent (`BufferBudget`), whatever the clients do;
- per client: --prefetch-depth in production or ready (the session) plus at most as many sent
  and still held by ZeroMQ (`_send_ready`);
- fair share (`share`, `may_lend`): while buffers are contended they are divided among the
  clients that read; one that never took a batch (a hello and gone, a client that never
  reads), or that asks again for batches it was sent (`in_good_standing`), is lent one buffer
  at a time,
  so such clients cannot starve a trainer that reads;
- a peer that takes nothing of what it was sent (a stopped process, a vanished host with a
  batch in flight) is lent nothing more after `NOT_READING_S` and leaves the fair share to the
  others; after `STALL_S` its session is dropped: its ready batches come back at once, its
  world size and its place among --max-clients are free. The frames ZeroMQ already holds for
  it (at most --prefetch-depth batches) can only come back when libzmq lets go of them: when
  the peer reads, or when its connection closes (ZMTP heartbeats do not help here, libzmq only
  pings between messages; for tcp:// the kernel closes a connection whose peer takes nothing
  for --stall-timeout, TCP_USER_TIMEOUT). Those buffers stay counted until then.

Sharing (`SharedBatches`, --share-window N > 0): a session's next batch is named by
(split, epoch, global batch); if that batch is in production it joins it, if it is done and
still referenced or in the window it gets the same buffer at once; otherwise it is produced
(a session behind the window, a lagging job, simply produces its own and joins again once its
batches are found). Each session gets its own `SendBatch` (its header, its ticket) of the one
slot, released when the last reference goes and the window lets it go. Charging, which keeps
fair share as it was: a session's holding (`_holding`) counts every buffer it references,
shared or not, so each job's work-ahead and share are what they would be alone; but only a
batch that needs a buffer (a new production, or an idle window buffer taken back) asks the
budget (`may_lend`), since joining a buffer already lent costs the cap nothing. The budget
counts each physical buffer once; idle window buffers are outside it and are freed first when
a loan would otherwise pass --max-buffers (`SharedBatches.make_room`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from batchwire import wire
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.sources.metadata import batch_metadata
from batchwire.server.budget import BufferBudget
from batchwire.server.config import ServerConfig
from batchwire.server.delivery import Deliveries
from batchwire.server.jobs import BatchOrder, JobResult
from batchwire.server.peers import PeerLedger
from batchwire.server.sessions import ClientSession, ReadyBatch, Scheduler
from batchwire.server.sharing import (
    BatchKey,
    Production,
    SharedBatches,
    sample_window_applies,
    window_batches,
)
from batchwire.wire import (
    BatchHeader,
    BatchSpec,
    Bye,
    ClientRow,
    Credit,
    ErrorReply,
    Hello,
    LoaderReport,
    ProtocolError,
    ServerMessage,
    StatsRequest,
    UnlistedClients,
    VersionMismatch,
    Welcome,
)
from batchwire.wire.messages import welcome_classes

if TYPE_CHECKING:
    from batchwire.pipeline.split import Split
    from batchwire.server.bufpool import Slot

log = logging.getLogger("batchwire.server")

# A session that owes nothing and has made no progress this long (a notebook done iterating)
# no longer holds its split's world size: a training loader asks for batches every step.
AGREEMENT_IDLE_S = 5.0
# A peer that has taken none of the batches ZeroMQ holds for it for this long is not reading:
# it is lent nothing more and the fair share is divided among the others.
NOT_READING_S = 1.0
# ... and after this long its session is dropped (as ZMTP heartbeats drop an idle dead peer).
STALL_S = 3.0
# While a client in good standing is busy, the clients in debt (server/peers.py: they asked
# again for batches they were sent, with no credit saying they took them) start one job this
# often between them, and only when no client in good standing may start one: enough for a
# loader in debt to take the batches whose credits pay it back, too little to slow a trainer.
DEBTOR_EVERY_S = 1.0
# Log lines about clients going into debt (a peer cycling in and out must not fill the log).
DEBTS_LOGGED = 20
# Drops for silence, stalls and buffer trims are looked at this often.
HOUSEKEEPING_S = 1.0
# A chunk of batch buffers nobody has needed for this long is freed even if clients remain.
BUFFERS_IDLE_S = 30.0
# Stats list this many clients in full, the most recently heard from first; the others are
# summed in "clients_unlisted", so a stats reply stays far below wire.MAX_SERVER_FRAME_BYTES
# (a row is at most ~4 KB: a 255-byte identity, a loader report of wire.stats.MAX_LOADER_FIGURES
# figures) whatever the client count.
STATS_CLIENTS_LISTED = 256
MALFORMED_LOGGED = 20
ERRORS_LOGGED = 100
MESSAGE_MAX = 1000  # characters of an error reply or log line about a peer's message


# ----------------------------------------------------------------------------- actions


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


@dataclass(frozen=True)
class SplitInfo:
    """What the core needs of a split: its sampler and what a `Welcome` says about it."""

    name: str
    num_samples: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    sampler: Callable[[int, int, int, int], ShardSampler]  # (batch, seed, rank, world_size)
    classes: tuple[str, ...] = ()  # names in label id order (the welcome's `classes`)
    label_width: int = 0  # K of a multi-label split's [B, K] labels (the welcome's), else 0
    #: Per-sample metadata of the split's dataset (a manifest's other columns), or None.
    metadata: Sequence[dict | None] | None = None
    mix_fingerprint: str = ""  # a mix's (`Split.mix_fingerprint`, the welcome's), else ""

    def batch_metadata(self, indices: Sequence[int]) -> list[dict | None]:
        """The metadata of a batch's samples by index (None for padding, -1)."""
        return batch_metadata(self.metadata, indices)

    @classmethod
    def of(cls, split: Split) -> SplitInfo:
        return cls(
            name=split.name,
            num_samples=split.samples_per_epoch,
            num_classes=split.dataset.num_classes,
            mean=tuple(split.augment.mean),
            std=tuple(split.augment.std),
            sampler=split.sampler,
            classes=tuple(split.dataset.classes),
            label_width=getattr(split.dataset, "label_width", 0),
            metadata=getattr(split.dataset, "metadata", None),
            mix_fingerprint=split.mix_fingerprint,
        )


@dataclass(frozen=True)
class Lending:
    """One turn's lending rule: ``share``, what a client that reads may hold of the shared
    buffers, and ``need``, what such clients still miss of their full work-ahead (clients
    that never took a batch may borrow only beyond it)."""

    share: int
    need: int


# ----------------------------------------------------------------------------- the core


class ServerCore:
    """Sessions, admission, buffers and scheduling of one server; see the module doc."""

    def __init__(
        self,
        config: ServerConfig,
        splits: Mapping[str, SplitInfo],
        spec: BatchSpec,
        budget: BufferBudget,
        now: float,
    ) -> None:
        self.config = config
        self.splits = dict(splits)
        self.spec = spec
        self.budget = budget
        self.sessions: dict[bytes, ClientSession] = {}
        self._by_serial: dict[int, ClientSession] = {}
        self._serial = 0
        self.scheduler = Scheduler()
        self.deliveries = Deliveries()
        # Each peer's sent and unacknowledged batches across its sessions (server/peers.py).
        self.peers = PeerLedger()
        self._debtor_started_at = -DEBTOR_EVERY_S  # the last job started for a client in debt
        self._debts_logged = 0
        self._served_from_window = False
        self.shared = SharedBatches(window_batches(config.share_window, budget.max_buffers))
        # Orders go through the producers' sample window: sharing is on and it applies.
        self._share_samples = self.shared.enabled and sample_window_applies(config)
        # Jobs submitted whose result has not come back: one in production and one queued per
        # producer at most, so a job never waits long behind others for a client that left.
        self.jobs_out = 0
        self.max_jobs = 2 * config.producers
        self._buffers_used_at = now  # last time a buffer was lent
        self._next_housekeeping = now + HOUSEKEEPING_S
        self._malformed_seen = 0
        self._errors_seen = 0
        self.draining = False  # begin_drain: admit nothing, finish what is under way
        self.drain_started = self.drain_deadline = float("inf")  # begin_drain: --drain-timeout

    # ------------------------------------------------------------------------- events

    def on_frames(
        self, identity: bytes, frames: Sequence[bytes | memoryview], now: float
    ) -> list[Action]:
        """A message's frames after the routing frame: checked and decoded, then handled."""
        if len(frames) != 1:
            return self._malformed(identity, f"expected 1 control frame, got {len(frames)}")
        try:
            msg = wire.decode_client_message(frames[0])
        except VersionMismatch as exc:
            return self._malformed(
                identity,
                f"protocol version mismatch: client speaks v{wire.show(exc.peer_version)}, "
                f"server speaks v{wire.PROTOCOL_VERSION}",
            )
        except ProtocolError as exc:
            return self._malformed(identity, str(exc))
        return self.on_message(identity, msg, now)

    def on_message(self, identity: bytes, msg: wire.ClientMessage, now: float) -> list[Action]:
        session = self.sessions.get(identity)
        if session is not None:
            session.last_seen = now
        self.peers.seen(identity, now)
        if isinstance(msg, Credit):
            if session is None:  # e.g. after a restart or a drop: the client will re-send hello
                log.debug("credit from unknown client %s ignored", identity.hex())
                return []
            session.loader_stats = LoaderReport.clean(msg.stats)
            refused = session.ask(msg.batches, now)
            if refused is not None:
                return self._error(
                    identity, f"credit refused: {refused}", session=session.hello.session
                )
            self.peers.acknowledged(identity, len(msg.batches), session.owed)
            return []
        if isinstance(msg, Hello):
            return self._on_hello(identity, msg, now)
        if isinstance(msg, Bye):
            if session is None:
                return []
            log.info("client %s said bye", identity.hex())
            return self._drop(identity)
        if isinstance(msg, StatsRequest):
            return [ReplyStats(identity)]
        return []

    def on_result(self, result: JobResult, now: float) -> list[Action]:
        """A producer finished (or gave up on) a job: every session waiting for it gets it."""
        self.jobs_out -= 1
        order, slot = result.job.order, result.job.slot
        p = self.shared.get(order.production)
        waiters = [] if p is None else list(p.waiters)
        if p is not None:
            p.waiters.clear()
        if result.labels is None or p is None:
            self.budget.returned()
            actions: list[Action] = [Release(slot)]
            if p is not None:
                self.shared.failed(p)
            for serial, _pos, k in waiters:
                session = self._by_serial.get(serial)
                if session is None:
                    continue
                session.abandoned()
                if result.reason == "cancelled":
                    continue
                actions += self._error(
                    session.identity,
                    _failure_text(session.hello.split, k, result),
                    result.reason,
                    session=session.hello.session,
                    detail=f": {result.error}",
                )
                actions += self._drop(session.identity)
            return actions
        self.shared.finished(p, slot)
        p.labels, p.indices = result.labels, list(result.indices)
        p.replaced, p.produce_s, p.done_at = int(result.replaced), result.seconds, now
        for serial, pos, k in waiters:
            session = self._by_serial.get(serial)
            if session is None or session.closed:
                continue
            p.refs += 1
            session.completed(pos, self._ready(p, k))
        if p.refs:
            return []
        self.budget.returned()  # nobody waits any more: windowed (idle) or released
        return [Release(s) for s in self.shared.settle(p)]

    def _ready(self, p: Production, k: int) -> ReadyBatch:
        """A session's ready batch of production ``p`` (its own batch index ``k``)."""
        assert p.slot is not None and p.labels is not None
        return ReadyBatch(
            batch_index=k,
            slot=p.slot,
            labels=p.labels,
            indices=p.indices,
            replaced=p.replaced,
            produce_s=p.produce_s,
            done_at=p.done_at,
            production=p.id,
        )

    def _unref(self, production: int) -> list[Action]:
        """A session let go of a shared buffer: back to the budget once nobody holds it."""
        returned, slots = self.shared.unref(production)
        if returned:
            self.budget.returned()
        return [Release(s) for s in slots]

    def on_sent(self, ticket: int, now: float) -> list[Action]:
        """ZeroMQ let go of a sent batch: the peer took it, or its connection closed."""
        sent = self.deliveries.done(ticket, now)
        if sent is None:
            return []
        session = self._by_serial.get(sent.session_serial)
        if session is not None:
            session.progress_at = now
        current = self.sessions.get(sent.identity)
        if current is not None:
            current.taken_at = now
        return self._unref(sent.production)

    def on_peer_gone(self, identity: bytes, why: str, now: float) -> list[Action]:
        """The peer's connection closed (or never answered a heartbeat)."""
        self.peers.forget(identity)
        session = self.sessions.get(identity)
        if session is not None:
            h = session.hello
            log.info(
                "client %s (%s rank %d/%d) %s: its stream and queued batches dropped",
                identity.hex(),
                h.split,
                h.rank,
                h.world_size,
                why,
            )
            return self._drop(identity)
        held = self.deliveries.held(identity)
        if held:
            log.info(
                "client %s %s: the %d sent batch(es) ZeroMQ held for it are freed",
                identity.hex(),
                why,
                held,
            )
        return []

    def tick(self, now: float) -> list[Action]:
        """After every turn of the loop: drops and trims when due, then send and schedule."""
        actions: list[Action] = []
        if now >= self._next_housekeeping:
            actions += self._housekeeping(now)
            self._next_housekeeping = now + HOUSEKEEPING_S
        actions += self._send_ready(now)
        if self.draining:
            actions += self._drain_step(now)
        else:
            actions += self._schedule(now)
            if self._served_from_window:  # batches ready at once: out this turn, not next
                self._served_from_window = False
                actions += self._send_ready(now)
        return actions

    def begin_drain(self, now: float) -> list[Action]:
        """Stop admitting and producing; sessions are told `Shutdown` once what they were
        promised (in production or ready) is sent (see "Draining" in the module doc)."""
        if not self.draining:
            self.draining = True
            self.drain_started = now
            self.drain_deadline = now + self.config.drain_timeout
            log.info(
                "draining: no new clients; finishing %d batch(es) in production and %d ready "
                "for %d client(s)",
                self.jobs_out,
                self.ready,
                len(self.sessions),
            )
        return self._send_ready(now) + self._drain_step(now)

    def drained(self, now: float) -> bool:
        """Draining and done: every session told, and ZeroMQ holds no sent batch for a peer
        that still reads (one that stopped reading is not waited for)."""
        if not self.draining or self.sessions:
            return False
        return all(
            self.deliveries.waiting(identity, now) > NOT_READING_S
            for identity in self.deliveries.held_by_peer()
        )

    def drain_over(self, now: float) -> str | None:
        """Is the drain over: "drained" (`drained`), "timed out" (--drain-timeout passed since
        `begin_drain`: the shell stops anyway, the clients ask other servers), or None."""
        if self.drained(now):
            return "drained"
        if self.draining and now >= self.drain_deadline:
            return "timed out"
        return None

    def _drain_step(self, now: float) -> list[Action]:
        """Tell each session whose promised batches are all sent (or whose peer does not
        read) that the server is going, and drop it."""
        actions: list[Action] = []
        for identity, session in list(self.sessions.items()):
            if session.in_production == 0 and (
                session.ready == 0 or self.not_reading(session, now)
            ):
                actions.append(Reply(identity, wire.Shutdown()))
                actions += self._drop(identity)
        return actions

    def shutdown(self, now: float) -> list[Action]:
        """Tell every client and drop every session."""
        actions: list[Action] = []
        for identity in list(self.sessions):
            actions.append(Reply(identity, wire.Shutdown()))
            actions += self._drop(identity)
        return actions

    # ------------------------------------------------------------------------- queries

    def has_session(self, identity: bytes) -> bool:
        return identity in self.sessions

    @property
    def ready(self) -> int:
        """Produced batches not yet sent, all clients."""
        return sum(s.ready for s in list(self.sessions.values()))

    def client_rows(self, now: float) -> tuple[list[ClientRow], UnlistedClients]:
        """The stats ``clients`` rows (most recently heard from first) and the sum of the rest
        (``clients_unlisted``); safe on another thread (Prometheus): it only reads copies."""
        sessions = list(self.sessions.values())
        held = self.deliveries.held_by_peer()
        sessions.sort(key=lambda s: s.last_seen, reverse=True)
        rows = [s.row(now, held.get(s.identity, 0)) for s in sessions[:STATS_CLIENTS_LISTED]]
        rest = sessions[STATS_CLIENTS_LISTED:]
        unlisted = UnlistedClients(
            count=len(rest),
            credits=sum(s.credits for s in rest),
            ready=sum(s.ready for s in rest),
            in_flight=sum(held.get(s.identity, 0) for s in rest),
            sent=sum(s.sent for s in rest),
            images_per_s=sum((s.meter.rate(now) for s in rest), 0.0),
        )
        return rows, unlisted

    # ------------------------------------------------------------------------- admission

    def _on_hello(self, identity: bytes, hello: Hello, now: float) -> list[Action]:
        session_no = hello.session
        if self.draining:
            # A new hello ends the peer's previous session (as below): it is not waited for.
            return self._drop(identity) + self._error(
                identity,
                "this server is draining (shutting down): ask the other servers; "
                "a replacement takes its place",
                "transient",
                session=session_no,
            )
        split = self.splits.get(hello.split)
        if split is None:
            return self._error(
                identity,
                f"unknown split {wire.show(hello.split)}: this server serves {sorted(self.splits)}",
                session=session_no,
            )
        # The two refusals that clear by themselves (a holder leaves or falls silent, a client
        # leaves) say "busy": a loader asks again until its timeout instead of failing.
        holder = self._world_size_holder(identity, hello, now)
        if holder is not None:
            return self._error(
                identity, self._world_size_conflict(hello, holder, now), "busy", session=session_no
            )
        limit = self.config.max_clients
        if identity not in self.sessions and len(self.sessions) >= limit:
            return self._error(
                identity,
                f"this server serves at most {limit} clients (--max-clients) and has "
                f"{len(self.sessions)}; try again when one leaves, or use another server",
                "busy",
                session=session_no,
            )
        # Next epoch, resume or reconnect: the new hello replaces the session.
        previous = self.sessions.get(identity)
        taken_at = None if previous is None else previous.taken_at
        actions = self._drop(identity)
        spec = self._spec_for(hello)
        if isinstance(spec, str):
            return actions + self._error(
                identity, f"cannot serve this hello: {spec}", session=session_no
            )
        try:  # e.g. more ranks x batch than the split has samples: this client's problem alone
            sampler = split.sampler(spec.batch_size, self.config.seed, hello.rank, hello.world_size)
            if hello.start_sample:  # the rest of an epoch resumed at another world size
                sampler = sampler.resumed(hello.start_sample, hello.epoch_world_size)
        except ValueError as exc:
            return actions + self._error(
                identity, f"cannot serve this hello: {exc}", session=session_no
            )
        self._serial += 1
        session = ClientSession(
            identity, hello, sampler, self.config.prefetch_depth, now, serial=self._serial
        )
        session.spec = spec
        session.taken_at = taken_at
        refused = session.ask(hello.batches, now)
        if refused is not None:
            return actions + self._error(
                identity, f"cannot serve this hello: {refused}", session=session_no
            )
        self.sessions[identity] = session
        self._by_serial[session.serial] = session
        self.scheduler.add(identity)
        if self.peers.opened(identity, hello, now):
            self._log_debt(session)
        asks = f"batch {hello.batches[0]}" if hello.batches else "nothing yet"
        log.info(
            "client %s%s: %s epoch %d rank %d/%d%s, asks for %s (%d asked, %d in the epoch)",
            identity.hex(),
            f" (job {wire.show(hello.job)})" if hello.job else "",
            hello.split,
            hello.epoch,
            hello.rank,
            hello.world_size,
            _stream_text(spec, self.spec),
            asks,
            len(hello.batches),
            sampler.num_batches,
        )
        welcome = Welcome(
            session=hello.session,
            num_batches=sampler.num_batches,
            num_samples=split.num_samples,
            batch_size=spec.batch_size,
            shape=spec.shape,
            dtype=spec.dtype,
            layout=spec.layout,
            mean=list(split.mean),
            std=list(split.std),
            num_classes=split.num_classes,
            classes=welcome_classes(list(split.classes)),
            views=[list(v) for v in spec.views],
            label_width=split.label_width,
            share_window=self.shared.window,
            mix_fingerprint=split.mix_fingerprint,
        )
        return [*actions, Reply(identity, welcome)]

    def _spec_for(self, hello: Hello) -> BatchSpec | str:
        """The spec of a hello's stream: the server's, or at the batch size and output size it
        asks for (a sweep's batch sizes, progressive resizing); a string says why that cannot
        be served."""
        batch = self.spec.batch_size if hello.batch_size is None else hello.batch_size
        most_batch = self.config.batch_size_cap
        if batch > most_batch:
            return (
                f"batch_size {batch} is larger than this server's --max-batch-size {most_batch} "
                "(its batch buffers are sized for that); restart it with a larger "
                "--max-batch-size, or ask for a smaller batch size"
            )
        size = hello.image_size
        if size is None or (size == (self.spec.height, self.spec.width) and not self.spec.views):
            if batch == self.spec.batch_size:
                return self.spec
            return dataclasses.replace(self.spec, batch_size=batch)
        h, w = size
        if self.spec.multi_view:
            return (
                f"image_size {h}x{w} asked, but this server serves multi-view batches "
                "(--views): their sizes are the views'"
            )
        transform = self.config.transform if hello.split == "train" else self.config.val_transform
        if transform is not None:
            return (
                f"image_size {h}x{w} asked, but this server's {hello.split} split runs a user "
                "transform (--transform): its output size is the transform's"
            )
        most = self.config.max_image_hw
        if h > most[0] or w > most[1]:
            return (
                f"image_size {h}x{w} is larger than this server's --max-image-size "
                f"{most[0]}x{most[1]} (its batch buffers are sized for that); restart it with "
                "a larger --max-image-size, or ask for a smaller size"
            )
        return BatchSpec(batch, h, w, self.spec.dtype, self.spec.layout)

    def _spec(self, session: ClientSession) -> BatchSpec:
        return session.spec if session.spec is not None else self.spec

    def _world_size_holder(self, identity: bytes, hello: Hello, now: float) -> ClientSession | None:
        """Another live session of the same split and job at another world size, if any."""
        for other in self.sessions.values():
            if (
                other.identity != identity
                and other.hello.split == hello.split
                and other.hello.job == hello.job
                and other.hello.world_size != hello.world_size
                and self.holds_world_size(other, now)
            ):
                return other
        return None

    def holds_world_size(self, session: ClientSession, now: float) -> bool:
        """Does this session keep others of its split and job from another world size?

        Only a session that has made progress holds it: one that asked for batches (and owes
        some), or that asked, was sent or took one in the last `AGREEMENT_IDLE_S`. A hello
        that asks for nothing, and empty credits, hold nothing: otherwise any anonymous peer
        could lock a split with one hello and a message now and then. A training loader asks
        for a batch every step and a next-epoch hello carries its batches, so an honest one
        between epochs or just started holds its world size as soon as it asks for anything.
        """
        if session.progress_at is None:
            return False
        return session.owed > 0 or now - session.progress_at < AGREEMENT_IDLE_S

    def _world_size_conflict(self, hello: Hello, other: ClientSession, now: float) -> str:
        """The refusal of a hello whose world size differs from a live session's: who holds
        the split, when it was last heard from and when it stops counting."""
        silent = now - other.last_seen
        timeout = self.config.client_timeout
        o = other.hello
        job = f" of job {wire.show(hello.job)}" if hello.job else ""
        return (
            f"world_size mismatch on split {hello.split!r}{job}: this client says "
            f"world_size={hello.world_size}, but client {other.id} (rank {o.rank} of "
            f"world_size={o.world_size}, epoch {o.epoch}) is streaming it, last heard from "
            f"{silent:.1f} s ago; it is dropped when it disconnects or says bye, else after "
            f"--client-timeout {timeout:g} s of silence, in {max(0.0, timeout - silent):.1f} s "
            "if it stays silent (a loader of another job, BATCHWIRE_JOB or torchrun's run id, "
            "is not refused)"
        )

    def _drop(self, identity: bytes) -> list[Action]:
        """Forget a client's session and release its queued batches (in-flight ones: when
        ZeroMQ lets go, `on_sent`; those in production: when they come back, `on_result`)."""
        session = self.sessions.pop(identity, None)
        self.scheduler.remove(identity)
        if session is None:
            return []
        self._by_serial.pop(session.serial, None)
        self.peers.closed(identity, finished=session.owed == 0)
        actions: list[Action] = []
        actions += [Cancel(pid) for pid in self.shared.forget_waiter(session.serial)]
        for batch in session.drain():
            actions += self._unref(batch.production)
        return actions

    # ------------------------------------------------------------------------- housekeeping

    def _housekeeping(self, now: float) -> list[Action]:
        actions: list[Action] = []
        timeout = self.config.client_timeout
        for identity, session in list(self.sessions.items()):
            waiting = self.deliveries.waiting(identity, now)
            if waiting > STALL_S:
                log.warning(
                    "client %s took none of its %d sent batch(es) for %.1f s (stopped, or its "
                    "host is gone): its session and %d queued batch(es) dropped; what ZeroMQ "
                    "holds for it comes back when it reads or its connection closes",
                    identity.hex(),
                    self.deliveries.held(identity),
                    waiting,
                    session.ready,
                )
                actions += self._drop(identity)
            elif now - session.last_seen > timeout:
                log.warning("client %s silent for %.0f s: dropped", identity.hex(), timeout)
                actions += self._drop(identity)
            elif self._idle_without_progress(session, now) > timeout:
                log.warning(
                    "client %s asked for no batch for %.0f s: dropped", identity.hex(), timeout
                )
                actions += self._drop(identity)
        self.peers.expire(now, timeout, self.sessions)
        if not self.sessions:  # nobody left to share with: the memory goes back now
            actions += [Release(s) for s in self.shared.flush()]
        actions.append(TrimBuffers(self._buffers_to_keep(now)))
        return actions

    def _idle_without_progress(self, session: ClientSession, now: float) -> float:
        """How long a session that owes nothing has made no progress (messages that ask for
        nothing keep a session from the silence reaper, not from this one)."""
        if session.owed or session.in_production or self.deliveries.held(session.identity):
            return 0.0
        since = session.opened_at if session.progress_at is None else session.progress_at
        return now - since

    def _buffers_to_keep(self, now: float) -> int:
        """Buffers the current clients may need: at most their full share each (2 x
        prefetch-depth) and the producers' jobs (2 x producers); none once nobody has taken a
        buffer for `BUFFERS_IDLE_S`, or no client is left. Only wholly free chunks go, so
        trimming never waits for anything."""
        n = len(self.sessions)
        if n == 0 or now - self._buffers_used_at > BUFFERS_IDLE_S:
            return 0
        need = 2 * self.config.producers + 2 * self.config.prefetch_depth * n
        return min(self.budget.max_buffers, need + self.shared.window)

    # ------------------------------------------------------------------------- batches

    def _holding(self, session: ClientSession) -> int:
        """Buffers a client holds: in production, ready, and sent but still with ZeroMQ."""
        return session.in_production + session.ready + self.deliveries.held(session.identity)

    def not_reading(self, session: ClientSession, now: float) -> bool:
        """Has the peer taken none of the batches ZeroMQ holds for it for `NOT_READING_S`?"""
        return self.deliveries.waiting(session.identity, now) > NOT_READING_S

    def reads(self, session: ClientSession, now: float) -> bool:
        """Does the client take its batches: it took one, is taking what it holds, and does
        not ask again for what it was sent (`in_good_standing`)?"""
        return (
            session.taken_at is not None
            and not self.not_reading(session, now)
            and self.in_good_standing(session)
        )

    def debt(self, session: ClientSession) -> int:
        """Batches its peer asked for again over its hellos, with no credit saying it took
        them (server/peers.py)."""
        return self.peers.debt(session.identity, session.owed)

    def in_good_standing(self, session: ClientSession) -> bool:
        """Does the client owe no more than a loader may have lost in flight (`debt`, at most
        `peers.SLACK`)? One that owes more is scheduled after the others, the least indebted
        first, and while a client in good standing is busy it gets a producer only when none
        of those may start a batch, one job every `DEBTOR_EVERY_S` between all such clients
        (`_debtors_wait`); it is lent buffers as a client that never took a batch."""
        return self.debt(session) <= self.peers.slack

    def _rank(self, session: ClientSession) -> int:
        """The scheduler's order (`ClientSession.rank`): clients in good standing first (0),
        then by debt."""
        debt = self.debt(session)
        return 0 if debt <= self.peers.slack else debt

    def _good_standing_busy(self, now: float) -> bool:
        """Is a client in good standing at work: producing, holding or owed a batch, or making
        progress in the last `DEBTOR_EVERY_S` (a trainer whose batches all went out is
        between two steps, not done: its next credit must not find the producers taken)?"""
        return any(
            self.in_good_standing(s)
            and (
                s.has_room()
                or self._holding(s)
                or (s.progress_at is not None and now - s.progress_at < DEBTOR_EVERY_S)
            )
            for s in self.sessions.values()
        )

    def share(self, now: float) -> int:
        """What each client that reads may hold of the shared buffers (`Lending.share`)."""
        return self.lending(now).share

    def lending(self, now: float) -> Lending:
        """This turn's fair share, and what the clients that read still need of it.

        The shared buffers are divided among the clients that read (`reads`) and hold or want
        buffers; buffers held by anyone else (clients that never took a batch, clients that
        stopped reading, batches ZeroMQ holds for peers whose session is gone) are not there
        to divide. So clients that do not read cannot shrink the share of those that do.
        """
        shared = self.budget.shared
        if self._uncontended():
            return Lending(shared, 0)
        sharing = [
            s
            for s in self.sessions.values()
            if (s.has_room() or self._holding(s)) and self.reads(s, now)
        ]
        others = self.budget.held - sum(self._holding(s) for s in sharing)
        share = self.budget.share(len(sharing), shared - max(0, others))
        # What each would hold if only readers shared (their full work-ahead at most): the
        # clients that never took a batch may borrow only beyond what the readers miss of it.
        full = min(self.budget.share(len(sharing)), 2 * self.config.prefetch_depth)
        need = sum(max(0, full - self._holding(s)) for s in sharing if s.has_room())
        return Lending(share, need)

    def _uncontended(self) -> bool:
        """Could every client have its full work-ahead (production and in flight) at once?"""
        return len(self.sessions) * 2 * self.config.prefetch_depth <= self.budget.shared

    def may_lend(self, session: ClientSession, lending: Lending, now: float) -> bool:
        """May this client take another buffer (the budget's rule, see budget.py)?

        A client that is not taking what it holds gets nothing more (it could not be sent
        it). While buffers are contended, one that never took a batch (a hello and gone, a
        client that never reads, or a new trainer until its first batch arrives) gets one at
        a time, and only what the clients that read do not need; once they miss nothing, it
        may take from the reserve, as any client holding none may.
        """
        if self.not_reading(session, now):
            return False
        holding = self._holding(session)
        untried = session.taken_at is None or not self.in_good_standing(session)
        if untried and not self._uncontended():
            if holding:
                return False
            if lending.need:  # only what the readers do not miss
                return self.budget.held + lending.need < self.budget.shared
        return self.budget.may_lend(holding, lending.share)

    def _key(self, session: ClientSession, k: int) -> BatchKey | None:
        h = session.hello
        if h.start_sample:  # a resumed pass (elastic): its batch k is not the epoch's: unshared
            return None
        spec = self._spec(session)
        size = None if spec is self.spec else (spec.batch_size, spec.height, spec.width)
        return self.shared.key(h.split, h.epoch, h.rank, h.world_size, k, size)

    def _next_production(self, session: ClientSession) -> Production | None:
        """The production the session's next batch would join (None: produce it anew)."""
        if not self.shared.enabled:
            return None
        return self.shared.find(self._key(session, session.batches[session.next_pos]))

    def _may_take(
        self, session: ClientSession, lending: Lending, debtors_limited: bool, now: float
    ) -> bool:
        """May the session start its next batch? Joining a buffer already lent costs the
        budget nothing (only the session's own work-ahead, `has_room`, bounds it); anything
        else needs a buffer: a producer slot too for a new production (for a client in debt,
        while ``debtors_limited``, not before its turn, `_debtors_wait`), and `may_lend`."""
        p = self._next_production(session)
        if not self.shared.costs_a_buffer(p):
            return not self.not_reading(session, now)
        if p is None and self.jobs_out >= self.max_jobs:
            return False
        if p is None and debtors_limited and self._debtors_wait(session, now):
            return False
        return not self.budget.full and self.may_lend(session, lending, now)

    def _debtors_wait(self, session: ClientSession, now: float) -> bool:
        """Must this session, if in debt, wait for its next job? Those in debt start one job
        every `DEBTOR_EVERY_S` between them (while a client in good standing is busy)."""
        if self.in_good_standing(session):
            return False
        return now - self._debtor_started_at < DEBTOR_EVERY_S

    def _schedule(self, now: float) -> list[Action]:
        lending = self.lending(now)
        debtors_limited = self._good_standing_busy(now)
        for s in self.sessions.values():  # what the scheduler ranks by, as data
            if s.has_room():
                s.rank = self._rank(s)
        actions: list[Action] = []
        refused: set[bytes] = set()  # may not start a batch now (asked again after a start)
        while True:
            session = self.scheduler.next(self.sessions, refused)
            if session is None:
                break
            if not self._may_take(session, lending, debtors_limited, now):
                refused.add(session.identity)
                continue
            self.scheduler.served()
            refused.clear()  # a start can let another join it, or change whose turn it is
            p = self._next_production(session)
            pos, batch_index = session.take_next()
            if p is not None:
                self._join(session, p, pos, batch_index, now)
                continue
            key = self._key(session, batch_index)
            room = self.shared.make_room(self.budget.held, self.budget.max_buffers)
            actions += [Release(s) for s in room]
            self.budget.lend()
            self.jobs_out += 1
            self._buffers_used_at = now
            p = self.shared.start(key, session.serial, pos, batch_index)
            p.peers.add(session.identity)
            if not self.in_good_standing(session):
                self._debtor_started_at = now
            if self.shared.enabled:
                session.sharing = "lagging" if self.shared.lagging(key) else "solo"
            h = session.hello
            order = BatchOrder(
                split=h.split,
                sampler=session.sampler,
                epoch=h.epoch,
                batch_index=batch_index,
                session_serial=session.serial,
                pos=pos,
                queued_at=now,
                production=p.id,
                spec=None if session.spec is self.spec else session.spec,
                share_samples=self._share_samples,
            )
            actions.append(Submit(order))
        return actions

    def _join(self, session: ClientSession, p: Production, pos: int, k: int, now: float) -> None:
        """The session's batch ``k`` is production ``p``'s: wait for it, or take it now."""
        session.sharing = "shared"
        p.peers.add(session.identity)
        leader = self._by_serial.get(p.leader)
        if leader is not None and leader is not session:
            leader.sharing = "shared"
        if not p.done:
            p.waiters.append((session.serial, pos, k))
            return
        if self.shared.join_done(p):  # an idle window buffer: lent again
            self.budget.lend()
            self._buffers_used_at = now
        session.completed(pos, self._ready(p, k))
        self._served_from_window = True

    def _send_ready(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for session in self.sessions.values():
            # At most --prefetch-depth batches of a peer in ZeroMQ's hands: a peer that asks
            # for many and reads none pins no more (memory is bounded by the server's setting).
            room = self.config.prefetch_depth - self.deliveries.held(session.identity)
            for batch in session.pop_sendable(room):
                actions.append(self._send(session, batch, now))
        return actions

    def _send(self, session: ClientSession, batch: ReadyBatch, now: float) -> SendBatch:
        h = session.hello
        spec = self._spec(session)
        p = self.shared.get(batch.production)
        header = BatchHeader(
            session=h.session,
            split=h.split,
            epoch=h.epoch,
            batch_index=batch.batch_index,
            shape=spec.shape,
            dtype=spec.dtype,
            layout=spec.layout,
            indices=batch.indices,
            replaced=batch.replaced,
            nbytes=spec.nbytes,
            views=[list(v) for v in spec.views],
            label_width=self.splits[h.split].label_width,
            metadata=self.splits[h.split].batch_metadata(batch.indices) if h.metadata else None,
            shared=self._shared_with_another(p, session),
        )
        resent = False
        if p is not None:
            p.sends += 1
            resent = p.sends > 1
        session.meter.add(spec.batch_size, now)
        session.progress_at = now
        self.peers.sent(session.identity)
        ticket = self.deliveries.sent(
            session.identity, batch.slot, session.serial, now, production=batch.production
        )
        return SendBatch(
            session.identity,
            header,
            batch.slot,
            batch.labels,
            ticket,
            spec.batch_size,
            spec.nbytes + header.labels_nbytes,
            resent,
            now - batch.done_at,
        )

    def _shared_with_another(self, p: Production | None, session: ClientSession) -> bool:
        """Is production ``p`` also another connected client's (`BatchHeader.shared`)? One
        that waited for it or joined it and still has a session: a loader's own earlier socket
        (a probe closed before its trainer connected, a restarted process) is gone and shares
        nothing with it. A client that asked first and was sent the batch before a later one
        joined it from the window is not told: what a trainer counts is a lower bound."""
        if p is None:
            return False
        return any(peer != session.identity and peer in self.sessions for peer in p.peers)

    def _log_debt(self, session: ClientSession) -> None:
        self._debts_logged += 1
        level = logging.WARNING if self._debts_logged <= DEBTS_LOGGED else logging.DEBUG
        log.log(
            level,
            "client %s asks again for %d batch(es) it was sent (a new hello of the same stream, "
            "no credit after them): while other clients are served, clients in debt get one "
            "batch every %g s, until their credits pay it back or they start another stream",
            session.id,
            self.peers.debt(session.identity, session.owed),
            DEBTOR_EVERY_S,
        )

    # ------------------------------------------------------------------------- replies

    def _error(
        self,
        identity: bytes,
        message: str,
        reason: str = "refused",
        *,
        session: int | None,
        detail: str = "",
    ) -> list[Action]:
        """Refuse with ``message`` (what the client sees: never a path or file content), about
        hello or session ``session``, and log ``detail`` beside it (paths, the exception: for
        the operator only)."""
        message = clip(message)
        self._errors_seen += 1
        # Refused hellos are rare from real trainers; a peer repeating one must not fill the log.
        level = logging.WARNING if self._errors_seen <= ERRORS_LOGGED else logging.DEBUG
        log.log(level, "client %s: %s%s", identity.hex(), message, clip(detail))
        return [Reply(identity, ErrorReply(message, reason, session=session), "errors_total")]

    def _malformed(self, identity: bytes, message: str) -> list[Action]:
        message = clip(message)
        self._malformed_seen += 1
        # A flood of garbage must not flood the log too: the counter in stats tells the rest.
        if self._malformed_seen <= MALFORMED_LOGGED:
            log.warning(
                "malformed message from %s: %s%s",
                identity.hex(),
                message,
                " (further ones are only counted)"
                if self._malformed_seen == MALFORMED_LOGGED
                else "",
            )
        else:
            log.debug("malformed message from %s: %s", identity.hex(), message)
        reply = ErrorReply(f"malformed message: {message}", "bad-request")
        return [Reply(identity, reply, "malformed_total")]


def _failure_text(split: str, k: int, result: JobResult) -> str:
    """What a client is told of its failed batch ``k``: the error's type and class, and why
    where the producer said it in words a client may see (`JobResult.public`); the error's own
    text names files, so it stays in the log."""
    kind = (result.error or "").split(":", 1)[0]
    head = f"producing {split} batch {k} failed ({kind}, {result.reason})"
    if result.public:
        return f"{head}: {result.public}"
    return f"{head}; the server's log has the details"


def _stream_text(spec: BatchSpec, server: BatchSpec) -> str:
    """How a session's stream differs from the server's, for its admission log line."""
    text = ""
    if (spec.height, spec.width) != (server.height, server.width):
        text += f" at {spec.height}x{spec.width}"
    if spec.batch_size != server.batch_size:
        text += f" in batches of {spec.batch_size}"
    return text


def clip(message: str) -> str:
    """An error text short enough for any client to read and for the log."""
    if len(message) <= MESSAGE_MAX:
        return message
    return f"{message[: MESSAGE_MAX - 20]}... ({len(message)} characters)"
