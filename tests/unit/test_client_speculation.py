"""Next epoch early (client/speculation.py), driven alone: when to ask ahead, and what.

test_client_fleet.py drives the same through the fleet's events (adoption, drops, resizing).
"""

from __future__ import annotations

from collections import deque

from batchwire.client.assignment import Assignment, candidates_of
from batchwire.client.session import Peer, PeerState, Session
from batchwire.client.speculation import AHEAD_MAX_AGE_S, Speculation
from batchwire.client.unasked import UnaskedBatches

S = PeerState


def peers(n: int) -> list[Peer]:
    out = []
    for i in range(n):
        p = Peer(i, f"tcp://server-{i}:5555", heartbeat=1.0, last_heard=0.0, prev_heard=0.0)
        p.state, p.connected, p.ever_connected = S.STREAMING, True, True
        p.session = Session(100 + i, 0, deque(), welcomed=True)
        out.append(p)
    return out


def batches(total: int, start: int = 0) -> UnaskedBatches:
    u = UnaskedBatches()
    u.reset(start, total)
    return u


def may(spec: Speculation, **changes) -> bool:
    kw = dict(
        epoch=0,
        welcomed=True,
        pass_start=0,
        resizing=False,
        unasked=batches(12, start=12),  # this epoch: all asked
        unasked_next=batches(12),
    )
    kw.update(changes)
    return spec.may(**kw)


def test_it_asks_ahead_only_once_the_epoch_is_all_asked_for() -> None:
    spec = Speculation(enabled=True)
    assert may(spec)
    assert not may(spec, unasked=batches(12, start=11))  # batch 11 of this epoch is left
    assert not may(spec, unasked_next=batches(12, start=12))  # nothing of the next is left
    assert not may(spec, welcomed=False)  # the epoch's length is not known
    assert not may(spec, pass_start=48)  # a resumed pass: the next epoch's length differs
    assert not may(spec, resizing=True)  # the next epoch asks another output size
    assert not may(spec, epoch=-1)  # not started
    assert not may(Speculation(enabled=False))


def test_a_refusal_stops_the_guessing_for_the_rest_of_that_epoch() -> None:
    spec = Speculation(enabled=True)
    spec.refused(3)
    assert not may(spec, epoch=3)
    assert may(spec, epoch=4)


def test_only_a_server_owing_nothing_of_this_epoch_is_ready() -> None:
    p = peers(1)[0]
    assert Speculation.ready(p)
    p.session.pending.append(7)
    assert not Speculation.ready(p)
    p.session.pending.clear()
    p.retiring = True
    assert not Speculation.ready(p)
    p.retiring, p.state = False, S.BACKING_OFF
    assert not Speculation.ready(p)


def test_a_server_gets_the_lowest_next_epoch_batches_that_prefer_it_the_rest_stay() -> None:
    fleet = peers(2)
    a = Assignment(split="train", rank=0, world_size=1, prefetch=4)
    a.size(2)
    nxt = batches(12)
    picked = Speculation(enabled=True).pick(fleet[0], nxt, fleet, a, epoch=1)
    candidates = candidates_of(fleet)
    mine = [k for k in range(12) if a.preferred(k, candidates, 1) is fleet[0]]
    assert picked == mine[: a.share]
    left = []
    while nxt:
        left.append(nxt.take())
    assert sorted(left + picked) == list(range(12))


def test_a_session_unspoken_to_for_too_long_is_stale() -> None:
    spec, p = Speculation(enabled=True), peers(1)[0]
    p.last_sent = 100.0
    assert not spec.stale(p, 100.0 + AHEAD_MAX_AGE_S)
    assert spec.stale(p, 100.0 + AHEAD_MAX_AGE_S + 0.1)
    spec.ahead_max_age = 0.0
    assert spec.stale(p, 100.1)
