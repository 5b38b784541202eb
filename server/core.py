"""The server's protocol core: every decision, no I/O (the h11 / wsproto pattern).

`ServerCore` takes events and returns actions; `app.py` owns the sockets, the producer threads,
the clock and the telemetry, feeds the events in and carries the actions out. Nothing here
touches a socket, a thread, a lock or the clock (tests/unit/test_server_core_purity.py reads
the imports): every event carries ``now`` (monotonic seconds), what the shell records travels
in the actions (`SendBatch`'s figures, `Reply.counts`), and cancelling a job is an action
(`Cancel`), so the unit tests drive it with a fake clock and read the actions
(tests/unit/test_server_core.py). One lock is left: a session's `RateMeter`, which a
stats scrape on another thread reads.

Events                                        Actions (returned, in order)
  on_frames(identity, frames, now)              Reply(identity, message)
  on_message(identity, message, now)            ReplyStats(identity)   (the shell's snapshot)
  on_result(result, now)   a producer finished  Submit(order)          (lend a buffer, produce)
  on_sent(ticket, now)     ZeroMQ let go        SendBatch(identity, header, slot, labels, ticket)
  on_peer_gone(identity, why, now)              Release(slot)          (a buffer comes back)
  tick(now)    after every turn of the loop     TrimBuffers(keep)      (free idle chunks)
  begin_drain(now) (SIGTERM: see "Draining")    Cancel(production)     (skip a queued job)
  shutdown(now)
Queries: drained(now), drain_over(now), client_rows(now), ready, jobs_out.

Draining (`begin_drain`, the shell's SIGTERM with --drain-timeout > 0): no hello is admitted
any more (a ``transient`` error: the client's fleet backs off, hands the batches it asked of
us to its other servers and never counts us as a server that refuses it for good); nothing
new is submitted; each session is sent what is already in production or ready, then told
`Shutdown` (the client takes back what it asked and was not sent and asks the other servers)
and dropped. A session whose peer does not read (`Lender.not_reading`) is told at once: its batches
move rather than wait. `drained` says when every session has been told and ZeroMQ holds no
batch for a peer that reads; `drain_over` ends it then, or --drain-timeout after it began.

What lives here, in parts a reader can take one at a time (each a module with its unit tests):
the events and sessions (this file: each client's session, sessions.py; what each peer was sent
and never acknowledged across its hellos, peers.py), admission (admission.py: splits, specs,
world-size agreement; --max-clients here), lending (lending.py: fair share of the buffer
budget, budget.py, over what ZeroMQ still holds per peer, delivery.py, and the peers' debts:
the least indebted are scheduled first, so clients that re-send their hello and never read
cannot starve a trainer), scheduling and sharing (scheduling.py: round-robin over the producers,
one batch produced once for every session asking for it, sharing.py; sending), and
housekeeping (housekeeping.py: dropping clients that are gone, silent or stalled; trimming
buffers; whom a drain may tell). The actions are actions.py's.

Memory bounds, and what bounds them:

- buffers: never more than --max-buffers lent (`BufferBudget`), whatever the clients do;
- per client: --prefetch-depth in production or ready (the session) plus at most as many sent
  and still held by ZeroMQ (`Scheduling.send_ready`);
- fair share (`Lender.lending`, `Lender.may_lend`): while buffers are contended they are
  divided among the clients that read; one that never took a batch (a hello and gone, a
  client that never reads), or that asks again for batches it was sent
  (`Lender.in_good_standing`), is lent one buffer at a time,
  so such clients cannot starve a trainer that reads;
- a peer that takes nothing of what it was sent (a stopped process, a vanished host with a
  batch in flight) is lent nothing more after `lending.NOT_READING_S` and leaves the fair
  share to the others; after `housekeeping.STALL_S` its session is dropped: its ready batches
  come back at once, its
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
fair share as it was: a session's holding (`Lender.holding`) counts every buffer it references,
shared or not, so each job's work-ahead and share are what they would be alone; but only a
batch that needs a buffer (a new production, or an idle window buffer taken back) asks the
budget (`Lender.may_lend`), since joining a buffer already lent costs the cap nothing. The budget
counts each physical buffer once; idle window buffers are outside it and are freed first when
a loan would otherwise pass --max-buffers (`SharedBatches.make_room`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from batchwire import wire
from batchwire.server import housekeeping
from batchwire.server.actions import (
    Action,
    Cancel,
    Release,
    Reply,
    ReplyStats,
    SendBatch,
    Submit,
    TrimBuffers,
)
from batchwire.server.admission import (
    SplitInfo,
    spec_for,
    spec_text,
    world_size_conflict,
    world_size_holder,
)
from batchwire.server.budget import BufferBudget
from batchwire.server.config import ServerConfig
from batchwire.server.delivery import Deliveries
from batchwire.server.housekeeping import BUFFERS_IDLE_S, HOUSEKEEPING_S, STALL_S
from batchwire.server.jobs import JobResult
from batchwire.server.lending import DEBTOR_EVERY_S, NOT_READING_S, Lender, Lending
from batchwire.server.lograte import (
    ERROR_LINES_PER_WINDOW,
    MALFORMED_LINES_PER_WINDOW,
    PEER_FAULT_WINDOW_S,
    LineBudget,
)
from batchwire.server.peer_names import shown
from batchwire.server.peers import PeerLedger
from batchwire.server.scheduling import Scheduling
from batchwire.server.sessions import ClientSession, Produced
from batchwire.server.sharing import (
    SharedBatches,
    sample_window_applies,
    sample_window_samples,
    window_batches,
)
from batchwire.wire import (
    BatchSpec,
    Bye,
    ClientRow,
    Credit,
    ErrorReply,
    Hello,
    LoaderReport,
    ProtocolError,
    StatsRequest,
    UnlistedClients,
    VersionMismatch,
    Welcome,
)
from batchwire.wire.messages import welcome_classes

# The actions and the parts' settings, importable from here as before the split.
__all__ = [
    "BUFFERS_IDLE_S",
    "DEBTOR_EVERY_S",
    "HOUSEKEEPING_S",
    "NOT_READING_S",
    "STALL_S",
    "Action",
    "Cancel",
    "Lending",
    "Release",
    "Reply",
    "ReplyStats",
    "SendBatch",
    "ServerCore",
    "SplitInfo",
    "Submit",
    "TrimBuffers",
]

log = logging.getLogger("batchwire.server")

# Log lines about clients going into debt (a peer cycling in and out must not fill the log).
DEBTS_LOGGED = 20
# Stats list this many clients in full, the most recently heard from first; the others are
# summed in "clients_unlisted", so a stats reply stays far below wire.MAX_SERVER_FRAME_BYTES
# (a row is at most ~4 KB: a 255-byte identity, a loader report of wire.stats.MAX_LOADER_FIGURES
# figures) whatever the client count.
STATS_CLIENTS_LISTED = 256
MESSAGE_MAX = 1000  # characters of an error reply or log line about a peer's message


class ServerCore:
    """Sessions and events of one server, composing its parts; see the module doc."""

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
        self.deliveries = Deliveries()
        # Each peer's sent and unacknowledged batches across its sessions (server/peers.py).
        self.peers = PeerLedger()
        self._debts_logged = 0
        self.shared = SharedBatches(window_batches(config.share_window, budget.max_buffers))
        self.lender = Lender(config.prefetch_depth, budget, self.deliveries, self.peers)
        share_samples = self.shared.enabled and sample_window_applies(config)
        self.scheduling = Scheduling(
            config,
            spec,
            self.splits,
            self.sessions,
            self._by_serial,
            budget,
            self.deliveries,
            self.peers,
            self.shared,
            self.lender,
            # Orders go through the producers' sample window: sharing is on and it applies.
            share_samples,
            _share_span(config, self.shared.window, share_samples),
            now,
        )
        self._next_housekeeping = now + HOUSEKEEPING_S
        self._malformed_lines = LineBudget(
            "malformed messages", MALFORMED_LINES_PER_WINDOW, PEER_FAULT_WINDOW_S, logging.WARNING
        )
        self._client_lines = LineBudget()  # admitted, bye, disconnected: bounded per window
        self._error_lines = LineBudget(
            "refusals", ERROR_LINES_PER_WINDOW, PEER_FAULT_WINDOW_S, logging.WARNING
        )
        self.draining = False  # begin_drain: admit nothing, finish what is under way
        self.drain_started = self.drain_deadline = float("inf")  # begin_drain: --drain-timeout

    # ------------------------------------------------------------------------- events

    def on_frames(
        self, identity: bytes, frames: Sequence[bytes | memoryview], now: float
    ) -> list[Action]:
        """A message's frames after the routing frame: checked and decoded, then handled."""
        if len(frames) != 1:
            return self._malformed(now, identity, f"expected 1 control frame, got {len(frames)}")
        try:
            msg = wire.decode_client_message(frames[0])
        except VersionMismatch as exc:
            return self._malformed(
                now,
                identity,
                f"protocol version mismatch: client speaks v{wire.show(exc.peer_version)}, "
                f"server speaks v{wire.PROTOCOL_VERSION}",
            )
        except ProtocolError as exc:
            return self._malformed(now, identity, str(exc))
        return self.on_message(identity, msg, now)

    def on_message(self, identity: bytes, msg: wire.ClientMessage, now: float) -> list[Action]:
        session = self.sessions.get(identity)
        if session is not None:
            session.last_seen = now
        self.peers.seen(identity, now)
        if isinstance(msg, Credit):
            if session is None:  # e.g. after a restart or a drop: the client will re-send hello
                log.debug("credit from unknown client %s ignored", shown(identity))
                return []
            session.loader_stats = LoaderReport.clean(msg.stats)
            refused = session.ask(msg.batches, now)
            if refused is not None:
                return self._error(
                    now, identity, f"credit refused: {refused}", session=session.hello.session
                )
            self.peers.acknowledged(identity, len(msg.batches), session.owed)
            return []
        if isinstance(msg, Hello):
            return self._on_hello(identity, msg, now)
        if isinstance(msg, Bye):
            if session is None:
                return []
            self._client_log(now, "client %s said bye", shown(identity))
            return self._drop(identity)
        if isinstance(msg, StatsRequest):
            return [ReplyStats(identity)]
        return []

    def on_result(self, result: JobResult, now: float) -> list[Action]:
        """A producer finished (or gave up on) a job: every session waiting for it gets it."""
        self.scheduling.jobs_out -= 1
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
                    now,
                    session.identity,
                    _failure_text(session.hello.split, k, result),
                    result.reason,
                    session=session.hello.session,
                    detail=f": {result.error}",
                )
                actions += self._drop(session.identity)
            return actions
        output = Produced(
            slot, result.labels, list(result.indices), int(result.replaced), result.seconds, now
        )
        self.shared.finished(p, output)
        for serial, pos, k in waiters:
            session = self._by_serial.get(serial)
            if session is None or session.closed:
                continue
            p.refs += 1
            session.completed(pos, self.scheduling.ready(p, k))
        if p.refs:
            return []
        self.budget.returned()  # nobody waits any more: windowed (idle) or released
        return [Release(s) for s in self.shared.settle(p)]

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
        return self.scheduling.unref(sent.production)

    def on_peer_gone(self, identity: bytes, why: str, now: float) -> list[Action]:
        """The peer's connection closed (or never answered a heartbeat)."""
        self.peers.forget(identity)
        session = self.sessions.get(identity)
        if session is not None:
            h = session.hello
            self._client_log(
                now,
                "client %s (%s rank %d/%d) %s: its session and queued batches dropped",
                shown(identity),
                h.split,
                h.rank,
                h.world_size,
                why,
            )
            return self._drop(identity)
        held = self.deliveries.held(identity)
        if held:
            self._client_log(
                now,
                "client %s %s: the %d sent batch(es) ZeroMQ held for it are freed",
                shown(identity),
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
        actions += self.scheduling.send_ready(now)
        if self.draining:
            actions += self._drain_step(now)
        else:
            actions += self.scheduling.schedule(now)
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
        return self.scheduling.send_ready(now) + self._drain_step(now)

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
            if housekeeping.may_tell_shutdown(session, self.lender.not_reading(session, now)):
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
    def jobs_out(self) -> int:
        """Jobs submitted whose result has not come back (`Scheduling.jobs_out`)."""
        return self.scheduling.jobs_out

    @property
    def ready(self) -> int:
        """Produced batches not yet sent, all clients."""
        return sum(s.ready for s in list(self.sessions.values()))

    def debt(self, session: ClientSession) -> int:
        """`Lender.debt`: what its peer asked again of what it was sent."""
        return self.lender.debt(session)

    def in_good_standing(self, session: ClientSession) -> bool:
        """`Lender.in_good_standing`."""
        return self.lender.in_good_standing(session)

    def share(self, now: float) -> int:
        """What each client that reads may hold of the shared buffers (`Lending.share`)."""
        return self.lender.lending(self.sessions.values(), now).share

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
                now,
                identity,
                "this server is draining (shutting down): ask the other servers; "
                "a replacement takes its place",
                "transient",
                session=session_no,
            )
        split = self.splits.get(hello.split)
        if split is None:
            return self._error(
                now,
                identity,
                f"unknown split {wire.show(hello.split)}: this server serves {sorted(self.splits)}",
                session=session_no,
            )
        # The two refusals that clear by themselves (a holder leaves or falls silent, a client
        # leaves) say "busy": a loader asks again until its timeout instead of failing.
        holder = world_size_holder(self.sessions.values(), identity, hello, now)
        if holder is not None:
            return self._error(
                now,
                identity,
                world_size_conflict(hello, holder, now, self.config.client_timeout),
                "busy",
                session=session_no,
            )
        limit = self.config.max_clients
        if identity not in self.sessions and len(self.sessions) >= limit:
            return self._error(
                now,
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
        spec = spec_for(hello, self.spec, self.config)
        if isinstance(spec, str):
            return actions + self._error(
                now, identity, f"cannot serve this hello: {spec}", session=session_no
            )
        try:  # e.g. more ranks x batch than the split has samples: this client's problem alone
            sampler = split.sampler(spec.batch_size, self.config.seed, hello.rank, hello.world_size)
            if hello.start_sample:  # the rest of an epoch resumed at another world size
                sampler = sampler.resumed(hello.start_sample, hello.epoch_world_size)
        except ValueError as exc:
            return actions + self._error(
                now, identity, f"cannot serve this hello: {exc}", session=session_no
            )
        self._serial += 1
        session = ClientSession(
            identity, hello, sampler, self.config.prefetch_depth, now, serial=self._serial
        )
        session.spec = spec
        session.taken_at = taken_at
        if self.shared.enabled:  # "off" is --share-window 0's; a new epoch keeps the peer's state
            session.sharing = "solo" if previous is None else previous.sharing
        refused = session.ask(hello.batches, now)
        if refused is not None:
            return actions + self._error(
                now, identity, f"cannot serve this hello: {refused}", session=session_no
            )
        self.sessions[identity] = session
        self._by_serial[session.serial] = session
        self.scheduling.scheduler.add(identity)
        if self.peers.opened(identity, hello, now):
            self._log_debt(session)
        asks = f"batch {hello.batches[0]}" if hello.batches else "nothing yet"
        self._client_log(
            now,
            "client %s%s: %s epoch %d rank %d/%d%s, asks for %s (%d asked, %d in the epoch)",
            shown(identity),
            f" (job {wire.show(hello.job)})" if hello.job else "",
            hello.split,
            hello.epoch,
            hello.rank,
            hello.world_size,
            spec_text(spec, self.spec),
            asks,
            len(hello.batches),
            sampler.num_batches,
        )
        welcome = Welcome(
            session=hello.session,
            num_batches=sampler.num_batches,
            num_samples=split.num_samples,
            batch_size=spec.batch_size,
            **spec.wire_fields(),
            mean=list(split.mean),
            std=list(split.std),
            num_classes=split.num_classes,
            classes=welcome_classes(list(split.classes)),
            label_width=split.label_width,
            share_window=self.shared.window,
            mix_fingerprint=split.mix_fingerprint,
        )
        return [*actions, Reply(identity, welcome)]

    def _drop(self, identity: bytes) -> list[Action]:
        """Forget a client's session and release its queued batches (in-flight ones: when
        ZeroMQ lets go, `on_sent`; those in production: when they come back, `on_result`)."""
        session = self.sessions.pop(identity, None)
        self.scheduling.scheduler.remove(identity)
        if session is None:
            return []
        self._by_serial.pop(session.serial, None)
        self.peers.closed(identity, finished=session.owed == 0)
        actions: list[Action] = []
        actions += [Cancel(pid) for pid in self.shared.forget_waiter(session.serial, identity)]
        for batch in session.drain():
            actions += self.scheduling.unref(batch.production)
        return actions

    # ------------------------------------------------------------------------- housekeeping

    def _housekeeping(self, now: float) -> list[Action]:
        """Drop the sessions `housekeeping.why_drop` names, forget old peers, trim buffers."""
        actions: list[Action] = []
        timeout = self.config.client_timeout
        for identity, session in list(self.sessions.items()):
            held = self.deliveries.held(identity)
            why = housekeeping.why_drop(
                session, self.deliveries.waiting(identity, now), held, now, timeout
            )
            if why is not None:
                log.warning("client %s %s", shown(identity), why)
                actions += self._drop(identity)
        self.peers.expire(now, timeout, self.sessions)
        for budget in (self._client_lines, self._error_lines, self._malformed_lines):
            held = budget.summary(now)  # a window that held lines back is over: say how many
            if held is not None:
                log.log(budget.summary_level, "%s", held)
        if not self.sessions:  # nobody left to share with: the memory goes back now
            actions += [Release(s) for s in self.shared.flush()]
        keep = housekeeping.buffers_to_keep(
            len(self.sessions),
            now - self.scheduling.buffers_used_at,
            self.config.producers,
            self.config.prefetch_depth,
            self.budget.max_buffers,
            self.shared.window,
        )
        actions.append(TrimBuffers(keep))
        return actions

    def _client_log(self, now: float, msg: str, *args: object) -> None:
        """A line about a client coming or going, within its `LineBudget` (a peer reconnecting
        or re-sending hellos in a loop must not fill the disk)."""
        self._budgeted(self._client_lines, now, logging.INFO, msg, *args)

    @staticmethod
    def _budgeted(budget: LineBudget, now: float, level: int, msg: str, *args: object) -> None:
        """Log one line a peer caused within ``budget``: its level while the window allows,
        else DEBUG; the summary of a window that held lines back first."""
        held = budget.summary(now)
        if held is not None:
            log.log(budget.summary_level, "%s", held)
        level = budget.level(now, level)
        if level != logging.DEBUG and budget.last_in_window():
            msg += f" (further ones only counted for up to {budget.window_s:g} s)"
        log.log(level, msg, *args)

    def _log_debt(self, session: ClientSession) -> None:
        self._debts_logged += 1
        level = logging.WARNING if self._debts_logged <= DEBTS_LOGGED else logging.DEBUG
        log.log(
            level,
            "client %s asks again for %d batch(es) it was sent (a new hello of the same pass, "
            "no credit after them): while other clients are served, clients in debt get one "
            "batch every %g s, until their credits pay it back or they start another pass",
            session.peer_hex,
            self.peers.debt(session.identity, session.owed),
            DEBTOR_EVERY_S,
        )

    # ------------------------------------------------------------------------- replies

    def _error(
        self,
        now: float,
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
        # Refused hellos are rare from real trainers; a peer repeating one must not fill the log.
        self._budgeted(
            self._error_lines,
            now,
            logging.WARNING,
            "client %s: %s%s",
            shown(identity),
            message,
            clip(detail),
        )
        return [Reply(identity, ErrorReply(message, reason, session=session), "errors_total")]

    def _malformed(self, now: float, identity: bytes, message: str) -> list[Action]:
        message = clip(message)
        # A flood of garbage must not flood the log too: the counter in stats tells the rest.
        self._budgeted(
            self._malformed_lines,
            now,
            logging.WARNING,
            "malformed message from %s: %s",
            shown(identity),
            message,
        )
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


def clip(message: str) -> str:
    """An error text short enough for any client to read and for the log."""
    if len(message) <= MESSAGE_MAX:
        return message
    return f"{message[: MESSAGE_MAX - 20]}... ({len(message)} characters)"


def _share_span(config: ServerConfig, window: int, share_samples: bool) -> int:
    """How many samples of a split's epoch order the share window holds (0: sharing off): the
    sample window's (the samples its bytes hold, `sample_window_samples`, of --max-buffers as
    server/sizing.py divides it) where it applies, else the batch window's. Pacing keeps a
    split's sessions within it (server/pacing.py)."""
    if share_samples:
        return sample_window_samples(config, config.buffer_cap)
    return window * int(config.batch_size)
