"""Scheduling and sharing: which session's batch starts next, joined or produced, and sending.

Part of the server's core (core.py, no I/O). Each turn (`schedule`), round-robin over the
sessions (`RoundRobin`: every client gets its share of the producers), the lowest rank first
(`Lender.rank`: clients in good standing, then the least indebted), the first session with room
that may start its next batch (`_may_take`: joining a production already lent costs the budget
nothing, anything else needs a producer slot, its turn if it is in debt, and
`Lender.may_lend`) either joins that batch's `Production`
(sharing.py: in production, or done and still held or in the share window) or submits a new
one. `send_ready` sends what is ready, in the order asked, at most --prefetch-depth batches of a
peer in ZeroMQ's hands. A production's buffer goes back when its last reference goes and the
window lets it go (`unref`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from batchwire.server.actions import Action, Release, SendBatch, Submit
from batchwire.server.admission import SplitInfo
from batchwire.server.budget import BufferBudget
from batchwire.server.config import ServerConfig
from batchwire.server.delivery import Deliveries
from batchwire.server.jobs import BatchOrder
from batchwire.server.lending import DEBTOR_EVERY_S, Lender, Lending
from batchwire.server.pacing import Laggards, Pacing, sample_position
from batchwire.server.peers import PeerLedger
from batchwire.server.sessions import ClientSession, ReadyBatch
from batchwire.server.sharing import BatchKey, Production, SharedBatches
from batchwire.wire import BatchHeader, BatchSpec


class RoundRobin:
    """The order sessions take turns in: whoever starts a batch goes to the back, and those
    passed over before it with it; one that may not start now keeps its place."""

    def __init__(self) -> None:
        self.order: deque[bytes] = deque()

    def add(self, identity: bytes) -> None:
        if identity not in self.order:
            self.order.append(identity)

    def remove(self, identity: bytes) -> None:
        if identity in self.order:
            self.order.remove(identity)

    def served(self, at: int) -> None:
        """The session at place ``at`` started a batch: it and those before it go back."""
        self.order.rotate(-(at + 1))


class Scheduling:
    """Starts, joins and sends the sessions' batches (see the module doc)."""

    def __init__(
        self,
        config: ServerConfig,
        spec: BatchSpec,
        splits: Mapping[str, SplitInfo],
        sessions: Mapping[bytes, ClientSession],
        by_serial: Mapping[int, ClientSession],
        budget: BufferBudget,
        deliveries: Deliveries,
        peers: PeerLedger,
        shared: SharedBatches,
        lender: Lender,
        share_samples: bool,
        pace_span: int,
        now: float,
    ) -> None:
        self.config = config
        self.spec = spec
        self.splits = splits
        self.sessions = sessions  # the core's, read only here
        self.by_serial = by_serial
        self.budget = budget
        self.deliveries = deliveries
        self.peers = peers
        self.shared = shared
        self.lender = lender
        self.share_samples = share_samples  # orders go through the producers' sample window
        self.scheduler = RoundRobin()
        # A session far ahead on its split waits for the others (pacing.py): ``pace_span`` is
        # the share window in samples (0: sharing off, no pacing).
        self.pacing = Pacing(pace_span, self._position, batch_sizes_share=share_samples)
        # Jobs submitted whose result has not come back: one in production and one queued per
        # producer at most, so a job never waits long behind others for a client that left.
        self.jobs_out = 0
        self.max_jobs = 2 * config.producers
        self.buffers_used_at = now  # last time a buffer was lent
        self._debtor_started_at = -DEBTOR_EVERY_S  # the last job started for a client in debt
        self._served_from_window = False

    # ------------------------------------------------------------------------- starting

    def schedule(self, now: float) -> list[Action]:
        """Start every batch the sessions may start now; then, if some were served at once
        from the window, send those this turn too."""
        actions = self._start_batches(now)
        if self._served_from_window:  # batches ready at once: out this turn, not next
            self._served_from_window = False
            actions += self.send_ready(now)
        return actions

    def _start_batches(self, now: float) -> list[Action]:
        sessions = self.sessions.values()
        lending = self.lender.lending(sessions, now)
        debtors_limited = self.lender.good_standing_busy(sessions, now)
        paced = len(self.sessions) > 1 and self.pacing.enabled
        laggards = self.pacing.laggards(sessions, now) if paced else {}
        actions: list[Action] = []
        while True:
            session = self._next(lending, debtors_limited, laggards, now)
            if session is None:
                break
            if paced:
                self.pacing.started(session, now)
            p = self._next_production(session)
            pos, batch_index = session.take_next()
            if p is not None:
                self._join(session, p, pos, batch_index, now)
                continue
            actions += self._produce(session, pos, batch_index, now)
        return actions

    def _next(
        self, lending: Lending, debtors_limited: bool, laggards: Laggards, now: float
    ) -> ClientSession | None:
        """The session to start a batch now, or None: of those with room that may start one
        (`_may_take`), the lowest rank, and of one rank the first in turn; it (and those passed
        over before it) go to the back of the order."""
        best: ClientSession | None = None
        best_rank = best_at = 0
        for at, identity in enumerate(self.scheduler.order):
            session = self.sessions.get(identity)
            if session is None or not session.has_room():
                continue
            r = self.lender.rank(session)
            if best is not None and r >= best_rank:
                continue
            if self._may_take(session, lending, debtors_limited, laggards, now):
                best, best_rank, best_at = session, r, at
                if r <= 0:
                    break
        if best is not None:
            self.scheduler.served(best_at)
        return best

    def _produce(
        self, session: ClientSession, pos: int, batch_index: int, now: float
    ) -> list[Action]:
        """A new production of the session's batch: a buffer lent, one `Submit`."""
        key = self._key(session, batch_index)
        room = self.shared.make_room(self.budget.held, self.budget.max_buffers)
        actions: list[Action] = [Release(s) for s in room]
        self.budget.lend()
        self.jobs_out += 1
        self.buffers_used_at = now
        p = self.shared.start(key, session.serial, pos, batch_index)
        p.peers.add(session.identity)
        if not self.lender.in_good_standing(session):
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
            production=p.id,
            spec=None if session.spec is self.spec else session.spec,
            share_samples=self.share_samples,
        )
        actions.append(Submit(order))
        return actions

    def _may_take(
        self,
        session: ClientSession,
        lending: Lending,
        debtors_limited: bool,
        laggards: Laggards,
        now: float,
    ) -> bool:
        """May the session start its next batch? Joining a buffer already lent costs the
        budget nothing (only the session's own work-ahead, `has_room`, bounds it); anything
        else needs a buffer: a producer slot too for a new production (for a client in debt,
        while ``debtors_limited``, not before its turn, `_debtors_wait`), and `may_lend`; and
        a new production waits while the session is far ahead of its split's others
        (`Pacing.holds`: ``laggards``, their positions)."""
        p = self._next_production(session)
        if not self.shared.costs_a_buffer(p):
            return not self.lender.not_reading(session, now)
        if p is None and self.jobs_out >= self.max_jobs:
            return False
        if p is None and debtors_limited and self._debtors_wait(session, now):
            return False
        clients = len(self.sessions)
        if self.budget.full or not self.lender.may_lend(session, lending, clients, now):
            return False
        return p is not None or not laggards or not self.pacing.holds(session, laggards, now)

    def _debtors_wait(self, session: ClientSession, now: float) -> bool:
        """Must this session, if in debt, wait for its next job? Those in debt start one job
        every `DEBTOR_EVERY_S` between them (while a client in good standing is busy)."""
        if self.lender.in_good_standing(session):
            return False
        return now - self._debtor_started_at < DEBTOR_EVERY_S

    # ------------------------------------------------------------------------- sharing

    def _key(self, session: ClientSession, k: int) -> BatchKey | None:
        h = session.hello
        if h.start_sample:  # a resumed pass (elastic): its batch k is not the epoch's: unshared
            return None
        spec = self.spec_of(session)
        size = None if spec is self.spec else (spec.batch_size, spec.height, spec.width)
        return self.shared.key(h.split, h.epoch, h.rank, h.world_size, k, size)

    def _next_production(self, session: ClientSession) -> Production | None:
        """The production the session's next batch would join (None: produce it anew)."""
        if not self.shared.enabled:
            return None
        return self.shared.find(self._key(session, session.batches[session.next_pos]))

    def _join(self, session: ClientSession, p: Production, pos: int, k: int, now: float) -> None:
        """The session's batch ``k`` is production ``p``'s: wait for it, or take it now."""
        session.sharing = "shared"
        p.peers.add(session.identity)
        leader = self.by_serial.get(p.leader)
        if leader is not None and leader is not session:
            leader.sharing = "shared"
        if not p.done:
            p.waiters.append((session.serial, pos, k))
            return
        if self.shared.join_done(p):  # an idle window buffer: lent again
            self.budget.lend()
            self.buffers_used_at = now
        session.completed(pos, self.ready(p, k))
        self._served_from_window = True

    def ready(self, p: Production, k: int) -> ReadyBatch:
        """A session's ready batch of production ``p`` (its own batch index ``k``)."""
        assert p.output is not None
        return ReadyBatch(k, p.output, p.id)

    def unref(self, production: int) -> list[Action]:
        """A session let go of a shared buffer: back to the budget once nobody holds it."""
        returned, slots = self.shared.unref(production)
        if returned:
            self.budget.returned()
        return [Release(s) for s in slots]

    # ------------------------------------------------------------------------- sending

    def _position(self, session: ClientSession) -> int | None:
        """Where the session's next batch starts in its split's epoch order (pacing.py)."""
        num_samples = self.splits[session.hello.split].num_samples
        return sample_position(session, self.spec_of(session).batch_size, num_samples)

    def spec_of(self, session: ClientSession) -> BatchSpec:
        return session.spec if session.spec is not None else self.spec

    def send_ready(self, now: float) -> list[Action]:
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
        spec = self.spec_of(session)
        p = self.shared.get(batch.production)
        split = self.splits[h.split]
        out = batch.output
        header = BatchHeader(
            session=h.session,
            split=h.split,
            epoch=h.epoch,
            batch_index=batch.batch_index,
            **spec.wire_fields(),
            indices=out.indices,
            replaced=out.replaced,
            nbytes=spec.nbytes,
            label_width=split.label_width,
            metadata=split.batch_metadata(out.indices) if h.metadata else None,
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
            session.identity, out.slot, session.serial, now, production=batch.production
        )
        return SendBatch(
            session.identity,
            header,
            out.slot,
            out.labels,
            ticket,
            spec.batch_size,
            spec.nbytes + header.labels_nbytes,
            resent,
            now - out.done_at,
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
