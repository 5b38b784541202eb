"""server/delivery.py: the sent batches ZeroMQ still holds, per peer, and how long each peer has
held some without taking any (how the core tells a peer that does not read from one that does).

Each send gets its own ticket; `done` (ZeroMQ let go of the frame) returns whose batch it was,
once. A peer's wait starts at a send into its empty pipe and starts again at each batch taken.
"""

from __future__ import annotations

from batchwire.server.delivery import Deliveries, Sent
from coresim import FakeSlot


def test_each_send_gets_a_ticket_of_its_own_and_counts_as_held() -> None:
    d = Deliveries()
    assert len(d) == 0 and d.held(b"a") == 0
    tickets = [d.sent(b"a", FakeSlot(k), 1, 0.0) for k in range(3)]
    tickets.append(d.sent(b"b", FakeSlot(9), 2, 0.0))
    assert len(set(tickets)) == 4
    assert len(d) == 4 and d.held(b"a") == 3 and d.held(b"b") == 1


def test_done_says_whose_batch_it_was_once() -> None:
    d = Deliveries()
    slot = FakeSlot(1)
    ticket = d.sent(b"a", slot, 7, 0.0, production=5)
    assert d.done(ticket, 1.0) == Sent(b"a", slot, 7, 5)
    assert d.done(ticket, 2.0) is None  # reported twice: nothing more to let go
    assert d.done(ticket + 100, 2.0) is None  # never issued
    assert len(d) == 0 and d.held(b"a") == 0


def test_a_shared_slot_sent_to_two_peers_is_held_until_each_lets_go() -> None:
    d, slot = Deliveries(), FakeSlot(1)
    first, second = d.sent(b"a", slot, 1, 0.0), d.sent(b"b", slot, 2, 0.0)
    assert first != second
    assert d.done(first, 1.0) == Sent(b"a", slot, 1)
    assert d.held(b"a") == 0 and d.held(b"b") == 1 and len(d) == 1
    assert d.done(second, 1.0) == Sent(b"b", slot, 2)


def test_held_by_peer_lists_only_peers_holding_batches_and_is_a_copy() -> None:
    d = Deliveries()
    t = d.sent(b"a", FakeSlot(1), 1, 0.0)
    d.sent(b"b", FakeSlot(2), 2, 0.0)
    d.sent(b"b", FakeSlot(3), 2, 0.0)
    d.done(t, 1.0)
    held = d.held_by_peer()
    assert held == {b"b": 2}
    held[b"b"] = 0
    held[b"c"] = 5
    assert d.held_by_peer() == {b"b": 2}


def test_waiting_runs_from_the_first_send_into_an_empty_pipe() -> None:
    d = Deliveries()
    assert d.waiting(b"a", 50.0) == 0.0  # holds nothing
    d.sent(b"a", FakeSlot(1), 1, 10.0)
    d.sent(b"a", FakeSlot(2), 1, 12.0)  # a send while it holds some does not restart the wait
    assert d.waiting(b"a", 13.0) == 3.0


def test_each_batch_taken_restarts_the_wait_and_the_last_one_ends_it() -> None:
    d = Deliveries()
    first = d.sent(b"a", FakeSlot(1), 1, 10.0)
    second = d.sent(b"a", FakeSlot(2), 1, 10.0)
    d.done(first, 14.0)
    assert d.waiting(b"a", 15.0) == 1.0
    d.done(second, 16.0)
    assert d.waiting(b"a", 30.0) == 0.0
    d.sent(b"a", FakeSlot(3), 1, 40.0)  # a new send into the empty pipe: a new wait
    assert d.waiting(b"a", 41.5) == 1.5
