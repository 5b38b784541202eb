"""server/scheduling.py: starting, joining and sending the sessions' batches, on the part's own
collaborators (a real budget, deliveries, peer ledger, shared batches and lender; no core)."""

from __future__ import annotations

import numpy as np
from batchwire.server.actions import SendBatch, Submit
from batchwire.server.budget import BufferBudget
from batchwire.server.config import ServerConfig
from batchwire.server.delivery import Deliveries
from batchwire.server.lending import Lender
from batchwire.server.peers import PeerLedger
from batchwire.server.scheduling import RoundRobin, Scheduling
from batchwire.server.sessions import ClientSession, Produced
from batchwire.server.sharing import SharedBatches
from coresim import BATCH, FakeSlot, session, split_info


class Part:
    """A `Scheduling` and the sessions it schedules."""

    def __init__(self, window: int = 0, producers: int = 2, max_buffers: int = 40) -> None:
        self.config = ServerConfig(
            batch_size=BATCH, image_size=8, producers=producers, prefetch_depth=2
        )
        self.sessions: dict[bytes, ClientSession] = {}
        self.by_serial: dict[int, ClientSession] = {}
        budget = BufferBudget(max_buffers, 1)
        deliveries, peers = Deliveries(), PeerLedger()
        self.shared = SharedBatches(window)
        lender = Lender(self.config.prefetch_depth, budget, deliveries, peers)
        self.part = Scheduling(
            self.config,
            self.config.batch_spec(),
            {"train": split_info()},
            self.sessions,
            self.by_serial,
            budget,
            deliveries,
            peers,
            self.shared,
            lender,
            False,
            window * BATCH,  # pacing within the share window
            0.0,
        )

    def add(self, identity: bytes, asked: tuple[int, ...], serial: int) -> ClientSession:
        s = session(identity, asked=asked, depth=2)
        s.serial = serial
        self.sessions[identity] = self.by_serial[serial] = s
        self.part.scheduler.add(identity)
        return s

    def finish(self, order, now: float) -> None:
        """A producer finished ``order``: its waiters' batches are ready (as the core does)."""
        p = self.shared.get(order.production)
        slot, labels = FakeSlot(order.production), np.zeros(BATCH, np.int64)
        self.shared.finished(p, Produced(slot, labels, [1, 2, 3, 4], 0, 0.0, now))
        for serial, pos, k in p.waiters:
            p.refs += 1
            self.by_serial[serial].completed(pos, self.part.ready(p, k))
        p.waiters.clear()
        self.part.jobs_out -= 1


def test_round_robin_up_to_the_producers_jobs() -> None:
    t = Part(producers=2)
    t.add(b"a", (0, 1, 2), 1)
    t.add(b"b", (5, 6, 7), 2)
    orders = [a.order for a in t.part.schedule(0.0) if isinstance(a, Submit)]
    assert [(o.session_serial, o.batch_index) for o in orders] == [(1, 0), (2, 5), (1, 1), (2, 6)]
    assert t.part.jobs_out == t.part.max_jobs == 4
    assert t.part.schedule(0.0) == []  # the producers are full: nothing more this turn


def test_a_second_session_joins_a_batch_in_production() -> None:
    t = Part(window=8)
    t.add(b"a", (0,), 1)
    t.add(b"b", (0,), 2)
    submits = [a for a in t.part.schedule(0.0) if isinstance(a, Submit)]
    assert len(submits) == 1  # b joined a's production
    t.finish(submits[0].order, now=1.0)
    sends = [a for a in t.part.send_ready(1.5) if isinstance(a, SendBatch)]
    assert [s.identity for s in sends] == [b"a", b"b"] and sends[0].slot is sends[1].slot
    assert [s.resent for s in sends] == [False, True]  # the shell counts the second as shared
    assert sends[0].ready_s == 0.5 and sends[0].images == BATCH


def test_send_ready_leaves_at_most_prefetch_depth_with_zeromq() -> None:
    t = Part()
    t.add(b"a", (0, 1, 2, 3), 1)
    for order in [a.order for a in t.part.schedule(0.0) if isinstance(a, Submit)]:
        t.finish(order, now=0.0)
    assert len(t.part.send_ready(0.0)) == 2  # --prefetch-depth 2 in ZeroMQ's hands
    assert t.part.send_ready(0.0) == []  # until the peer takes them


def test_round_robin_moves_the_served_and_those_passed_over_to_the_back() -> None:
    rr = RoundRobin()
    for identity in (b"a", b"b", b"c", b"a"):
        rr.add(identity)  # once each
    assert list(rr.order) == [b"a", b"b", b"c"]
    rr.served(1)  # b started a batch; a was passed over
    assert list(rr.order) == [b"c", b"a", b"b"]
    rr.remove(b"a")
    assert list(rr.order) == [b"c", b"b"]


def test_a_client_in_debt_goes_after_those_in_good_standing() -> None:
    t = Part(producers=1)
    debtor = t.add(b"d", (0, 1, 2, 3), 1)
    peers = t.part.peers
    peers.opened(b"d", debtor.hello, 0.0)
    for _ in range(4):  # sent its batches, never a credit; then asks them all again
        peers.sent(b"d")
    debtor.send_pos = 4
    peers.closed(b"d", finished=True)
    debtor = t.add(b"d", (0, 1, 2, 3), 1)
    peers.opened(b"d", debtor.hello, 0.0)
    t.add(b"g", (0, 1, 2, 3), 2)
    assert not t.part.lender.in_good_standing(debtor)
    orders = [a.order for a in t.part.schedule(0.0) if isinstance(a, Submit)]
    assert [o.session_serial for o in orders] == [2, 2]  # the producers' two jobs: g's


def test_a_session_far_ahead_waits_while_the_one_behind_produces() -> None:
    """Pacing through the scheduler (server/pacing.py): a 8-batch window; b is 7 batches ahead
    of a (past 3/4 of it): a's batches start, b's wait until a has moved on."""
    t = Part(window=8, producers=4)
    t.add(b"a", (0, 1), 1)
    t.add(b"b", (7, 8), 2)
    started = [a.order.session_serial for a in t.part.schedule(0.0) if isinstance(a, Submit)]
    assert started == [1, 1]  # a's two; b held
    t.sessions[b"a"].progress_at = 0.5  # a keeps asking; its next batch is 2: b is 5 ahead
    later = [a.order.session_serial for a in t.part.schedule(0.5) if isinstance(a, Submit)]
    assert later == [2, 2]


def test_a_session_far_ahead_of_one_that_went_quiet_does_not_wait() -> None:
    t = Part(window=8, producers=4)
    t.add(b"a", (0,), 1)
    t.add(b"b", (7, 8), 2)
    started = [a.order.session_serial for a in t.part.schedule(1.5) if isinstance(a, Submit)]
    assert sorted(started) == [1, 2, 2]  # a asked at 0: quiet for over a second by 1.5
