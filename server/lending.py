"""Lending: which client may take another batch buffer, and in what order clients are served.

Part of the server's core (core.py, no I/O). The rules, over the `BufferBudget` (budget.py:
counting), what ZeroMQ holds per peer (`Deliveries`, delivery.py) and each peer's debt across
its hellos (`PeerLedger`, peers.py):

- fair share (`lending`, `may_lend`): while buffers are contended they are divided among the
  clients that read (`reads`); one that never took a batch, or that asks again for batches it
  was sent (`in_good_standing`), is lent one buffer at a time, and only what the readers do not
  need, so such clients cannot starve a trainer that reads;
- a peer that takes none of what ZeroMQ holds for it for `NOT_READING_S` (`not_reading`) is
  lent nothing more and leaves the fair share to the others;
- order (`rank`): clients in good standing first, then the least indebted; while a client in
  good standing is busy (`good_standing_busy`) those in debt start one job every
  `DEBTOR_EVERY_S` between them (the scheduling part paces them).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from batchwire.server.budget import BufferBudget
from batchwire.server.delivery import Deliveries
from batchwire.server.peers import PeerLedger
from batchwire.server.sessions import ClientSession

# A peer that has taken none of the batches ZeroMQ holds for it for this long is not reading:
# it is lent nothing more and the fair share is divided among the others.
NOT_READING_S = 1.0
# While a client in good standing is busy, the clients in debt (server/peers.py: they asked
# again for batches they were sent, with no credit saying they took them) start one job this
# often between them, and only when no client in good standing may start one: enough for a
# loader in debt to take the batches whose credits pay it back, too little to slow a trainer.
DEBTOR_EVERY_S = 1.0


@dataclass(frozen=True)
class Lending:
    """One turn's lending rule: ``share``, what a client that reads may hold of the shared
    buffers, and ``need``, what such clients still miss of their full work-ahead (clients
    that never took a batch may borrow only beyond it)."""

    share: int
    need: int


class Lender:
    """The lending rules over the budget, the deliveries and the peers' debts."""

    def __init__(
        self,
        prefetch_depth: int,
        budget: BufferBudget,
        deliveries: Deliveries,
        peers: PeerLedger,
    ) -> None:
        self.prefetch_depth = prefetch_depth
        self.budget = budget
        self.deliveries = deliveries
        self.peers = peers

    def holding(self, session: ClientSession) -> int:
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
        of those may start a batch, one job every `DEBTOR_EVERY_S` between all such clients;
        it is lent buffers as a client that never took a batch."""
        return self.debt(session) <= self.peers.slack

    def rank(self, session: ClientSession) -> int:
        """The scheduler's order (`ClientSession.rank`): clients in good standing first (0),
        then by debt."""
        debt = self.debt(session)
        return 0 if debt <= self.peers.slack else debt

    def good_standing_busy(self, sessions: Collection[ClientSession], now: float) -> bool:
        """Is a client in good standing at work: producing, holding or owed a batch, or making
        progress in the last `DEBTOR_EVERY_S` (a trainer whose batches all went out is
        between two steps, not done: its next credit must not find the producers taken)?"""
        return any(
            self.in_good_standing(s)
            and (
                s.has_room()
                or self.holding(s)
                or (s.progress_at is not None and now - s.progress_at < DEBTOR_EVERY_S)
            )
            for s in sessions
        )

    def uncontended(self, clients: int) -> bool:
        """Could every client have its full work-ahead (production and in flight) at once?"""
        return clients * 2 * self.prefetch_depth <= self.budget.shared

    def lending(self, sessions: Collection[ClientSession], now: float) -> Lending:
        """This turn's fair share, and what the clients that read still need of it.

        The shared buffers are divided among the clients that read (`reads`) and hold or want
        buffers; buffers held by anyone else (clients that never took a batch, clients that
        stopped reading, batches ZeroMQ holds for peers whose session is gone) are not there
        to divide. So clients that do not read cannot shrink the share of those that do.
        """
        shared = self.budget.shared
        if self.uncontended(len(sessions)):
            return Lending(shared, 0)
        sharing = [s for s in sessions if (s.has_room() or self.holding(s)) and self.reads(s, now)]
        others = self.budget.held - sum(self.holding(s) for s in sharing)
        share = self.budget.share(len(sharing), shared - max(0, others))
        # What each would hold if only readers shared (their full work-ahead at most): the
        # clients that never took a batch may borrow only beyond what the readers miss of it.
        full = min(self.budget.share(len(sharing)), 2 * self.prefetch_depth)
        need = sum(max(0, full - self.holding(s)) for s in sharing if s.has_room())
        return Lending(share, need)

    def may_lend(self, session: ClientSession, lending: Lending, clients: int, now: float) -> bool:
        """May this client take another buffer (the budget's rule, see budget.py)?

        A client that is not taking what it holds gets nothing more (it could not be sent
        it). While buffers are contended (``clients`` sessions), one that never took a batch
        (a hello and gone, a client that never reads, or a new trainer until its first batch
        arrives) gets one at a time, and only what the clients that read do not need; once
        they miss nothing, it may take from the reserve, as any client holding none may.
        """
        if self.not_reading(session, now):
            return False
        holding = self.holding(session)
        untried = session.taken_at is None or not self.in_good_standing(session)
        if untried and not self.uncontended(clients):
            if holding:
                return False
            if lending.need:  # only what the readers do not miss
                return self.budget.held + lending.need < self.budget.shared
        return self.budget.may_lend(holding, lending.share)
