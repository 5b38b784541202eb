"""Who produces which batch (client/assignment.py), driven alone over `Peer`s.

The fleet's own tests (test_client_fleet.py) drive the same rules through events; here each
rule is one call: the budget, the preferred server, room, slow servers, the welcome grace.
"""

from __future__ import annotations

from collections import deque

from batchwire.client.assignment import (
    SLOW_PACE_FACTOR,
    WELCOME_GRACE_S,
    Assignment,
    candidates_of,
    welcome_due,
)
from batchwire.client.session import Peer, PeerState, Session
from batchwire.client.unasked import UnaskedBatches

S = PeerState


def peers(n: int, state: PeerState = S.STREAMING) -> list[Peer]:
    out = []
    for i in range(n):
        p = Peer(i, f"tcp://server-{i}:5555", heartbeat=1.0, last_heard=0.0, prev_heard=0.0)
        p.state, p.connected, p.ever_connected = state, True, True
        p.session = Session(100 + i, 0, deque(), welcomed=state is S.STREAMING)
        out.append(p)
    return out


def streaming(fleet: list[Peer]) -> list[Peer]:
    """The takers: streaming servers not retiring (as `Fleet._refill` passes them)."""
    return [p for p in fleet if p.state is S.STREAMING and not p.retiring]


def assignment(servers: int, prefetch: int = 4) -> Assignment:
    a = Assignment(split="train", rank=0, world_size=1, prefetch=prefetch)
    a.size(servers)
    return a


def unasked(total: int, start: int = 0) -> UnaskedBatches:
    u = UnaskedBatches()
    u.reset(start, total)
    return u


def test_the_budget_is_prefetch_alone_at_least_four_a_server_in_a_fleet_and_never_shrinks() -> None:
    a = assignment(1)
    assert (a.budget, a.share) == (4, 4)
    a.size(3)
    assert (a.budget, a.share) == (12, 4)
    a.size(2)  # a server left: batches beyond the cursor may fill the old budget
    assert (a.budget, a.share) == (12, 6)
    a.cap()  # the stager's slots: no more growth
    a.size(5)
    assert a.budget == 12
    assert assignment(1, prefetch=16).budget == 16


def test_each_batch_goes_to_its_preferred_server_within_the_free_budget() -> None:
    a, fleet = assignment(2), peers(2)
    u = unasked(12)
    asks = a.assign(u, 8, fleet, streaming(fleet), cursor=0, epoch=0, start=0, now=0.0)
    candidates = candidates_of(fleet)
    assert sorted(k for ks in asks.values() for k in ks) == list(range(8))
    for i, ks in asks.items():
        assert all(a.preferred(k, candidates, 0) is fleet[i] for k in ks)
    assert u.take() == 8  # what was asked came out of the unasked batches


def test_a_server_with_its_room_full_passes_batches_to_the_others() -> None:
    a, fleet = assignment(2), peers(2)
    cap = -(-3 * a.budget // 4)
    fleet[0].session.pending.extend(range(100, 100 + cap))  # server 0 holds its 1.5x share
    asks = a.assign(unasked(12), 4, fleet, streaming(fleet), cursor=0, epoch=0, start=0, now=0.0)
    assert list(asks) == [1] and asks[1] == [0, 1, 2, 3]


def test_a_slow_server_holds_one_batch_the_consumer_needs_late() -> None:
    a, fleet = assignment(2), peers(2)
    fleet[0].pace, fleet[1].pace = 1.0, 1.0 * SLOW_PACE_FACTOR + 0.1
    asks = a.assign(unasked(40), 8, fleet, streaming(fleet), cursor=0, epoch=0, start=0, now=0.0)
    assert len(asks.get(1, [])) <= 1
    assert all(k >= a.budget // 2 for k in asks.get(1, []))
    assert len(asks[0]) >= 7


def test_nothing_is_asked_without_a_streaming_server() -> None:
    fleet = peers(2, S.HELLO_SENT)
    u = unasked(12)
    asks = assignment(2).assign(u, 8, fleet, streaming(fleet), cursor=0, epoch=0, start=0, now=9)
    assert asks == {}
    assert u.take() == 0  # nothing taken


def test_a_batch_waits_for_its_preferred_servers_welcome_within_the_grace() -> None:
    a, fleet = assignment(2), peers(2)
    late = fleet[1]
    late.state, late.last_sent = S.HELLO_SENT, 10.0
    candidates = candidates_of(fleet)
    first_of_1 = next(k for k in range(12) if a.preferred(k, candidates, 0) is late)
    asks = a.assign(unasked(12), 8, fleet, streaming(fleet), cursor=0, epoch=0, start=0, now=10.0)
    assert sorted(asks.get(0, [])) == list(range(first_of_1))  # stopped at server 1's first
    assert welcome_due(late, 10.0) and not welcome_due(late, 10.0 + WELCOME_GRACE_S)
    later = a.assign(unasked(12), 8, fleet, streaming(fleet), cursor=0, epoch=0, start=0, now=11.0)
    assert list(later) == [0] and later[0] == list(range(8))  # past the grace: to the others


def test_a_server_still_connecting_counts_as_a_candidate() -> None:
    fleet = peers(2)
    p = fleet[1]
    p.state, p.connected, p.ever_connected = S.DISCONNECTED, False, False
    assert [q for _, q in candidates_of(fleet)] == fleet
    p.connect_failures = 1  # nothing listens there: not a candidate
    assert [q for _, q in candidates_of(fleet)] == fleet[:1]


def test_a_resumed_pass_hashes_other_batches() -> None:
    a, fleet = assignment(3), peers(3)
    candidates = candidates_of(fleet)
    own = [a.preferred(k, candidates, 0).index for k in range(16)]
    resumed = [a.preferred(k, candidates, 0, start=48).index for k in range(16)]
    assert own != resumed
