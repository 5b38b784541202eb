"""server/lending.py: fair share of the buffer budget, who may take a buffer, and the order of
clients by debt (the rules alone, over a real BufferBudget, Deliveries and PeerLedger)."""

from __future__ import annotations

from batchwire.server.budget import BufferBudget
from batchwire.server.delivery import Deliveries
from batchwire.server.lending import NOT_READING_S, Lender, Lending
from batchwire.server.peers import PeerLedger
from coresim import FakeSlot, session


def _lender(max_buffers: int = 12, depth: int = 2) -> Lender:
    return Lender(depth, BufferBudget(max_buffers, 1), Deliveries(), PeerLedger())


def test_uncontended_every_client_may_take_its_full_work_ahead() -> None:
    lender = _lender(max_buffers=40)
    readers = [session(bytes([i]), asked=(0, 1, 2)) for i in range(3)]
    assert lender.uncontended(len(readers))
    lending = lender.lending(readers, 0.0)
    assert lending == Lending(lender.budget.shared, 0)
    assert lender.may_lend(readers[0], lending, len(readers), 0.0)


def test_contended_a_client_that_never_took_a_batch_gets_one_at_a_time() -> None:
    lender = _lender(max_buffers=6, depth=4)
    reader, new = session(b"r", asked=(0, 1, 2, 3)), session(b"n", asked=(0, 1, 2, 3))
    reader.taken_at = 0.0
    sessions = [reader, new]
    assert not lender.uncontended(len(sessions))
    lending = lender.lending(sessions, 0.0)
    assert lending.need > 0  # the reader misses its work-ahead: the new one gets none of it
    assert not lender.may_lend(new, lending, len(sessions), 0.0)
    assert lender.may_lend(reader, lending, len(sessions), 0.0)
    new.take_next()  # holding one
    assert not lender.may_lend(new, Lending(lending.share, 0), len(sessions), 0.0)


def test_a_peer_that_does_not_read_is_lent_nothing() -> None:
    lender = _lender()
    s = session(b"a", asked=(0, 1))
    s.taken_at = 0.0
    lender.deliveries.sent(b"a", FakeSlot(1), s.serial, 0.0)
    assert lender.holding(s) == 1 and lender.reads(s, NOT_READING_S)
    assert lender.not_reading(s, NOT_READING_S + 0.1)
    lending = lender.lending([s], NOT_READING_S + 0.1)
    assert not lender.may_lend(s, lending, 1, NOT_READING_S + 0.1)


def test_rank_is_zero_in_good_standing_else_the_debt() -> None:
    lender = _lender()
    s = session(b"a", asked=(0, 1))
    assert lender.rank(s) == 0 and lender.in_good_standing(s)
    lender.peers.opened(b"a", s.hello, 0.0)
    for _ in range(2):  # sent both, no credit
        lender.peers.sent(b"a")
    s.send_pos = 2
    lender.peers.closed(b"a", finished=True)
    again = session(b"a", asked=tuple(range(8)))  # the same pass, asked again
    lender.peers.opened(b"a", again.hello, 1.0)
    debt = lender.debt(again)
    assert debt > lender.peers.slack and lender.rank(again) == debt
    assert not lender.in_good_standing(again)
