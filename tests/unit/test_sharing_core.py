"""Shared production in the server's core (server/sharing.py), driven with a fake clock.

Several sessions asking for the same batch (split, epoch, global batch) get one production and
one slot, each its own `SendBatch` (header and ticket); the slot is released once the last send
is taken and the window let it go. Joining a batch in production, being served from the window
after the send, the window's bound, --share-window 0, a lagging session's own production and
fair share with shared slots.
"""

from __future__ import annotations

import pytest
from batchwire.server.core import Release, SendBatch, Submit
from batchwire.wire import Bye, Credit
from coresim import Server, split_info


def _server(window: int | None = None, **kw) -> Server:
    return Server(config={"share_window": window}, **kw)


def _slots(s: Server, identity: bytes) -> list[object]:
    return [snd.slot for snd in s.sends if snd.identity == identity]


def test_two_sessions_asking_the_same_batch_share_one_production_and_slot() -> None:
    s = _server()
    s.hello(b"a", batches=(0,), session=1)
    s.hello(b"b", batches=(0,), session=2)
    submits = [a for a in s.tick() if isinstance(a, Submit)]
    assert len(submits) == 1 and len(s.jobs) == 1
    s.finish()
    sends = [a for a in s.tick() if isinstance(a, SendBatch)]
    assert [x.identity for x in sends] == [b"a", b"b"]
    assert sends[0].slot is sends[1].slot  # zero copy: one buffer
    assert sends[0].ticket != sends[1].ticket
    assert [x.header.session for x in sends] == [1, 2]  # a header per session
    assert s.budget.held == 1
    s.deliver(b"a")
    assert s.released == []  # b's send still holds it
    s.deliver(b"b")
    assert s.released == []  # now an idle window buffer, outside the budget
    assert s.budget.held == 0 and s.core.shared.idle == 1
    counters = s.telemetry.counters()
    assert counters["batches_produced_total"] == 1
    assert counters["batches_total"] == 2 and counters["batches_shared_total"] == 1


def test_a_request_arriving_during_production_joins_it() -> None:
    s = _server()
    s.hello(b"a", batches=(0, 1))
    s.tick()
    assert len(s.jobs) == 2
    s.hello(b"b", batches=(0, 1))
    assert not [a for a in s.tick() if isinstance(a, Submit)]
    s.finish()
    s.tick()
    assert s.sent_to(b"a") == [0, 1] and s.sent_to(b"b") == [0, 1]
    assert _slots(s, b"a") == _slots(s, b"b")
    assert s.core.sessions[b"b"].sharing == "shared"
    assert s.core.sessions[b"a"].sharing == "shared"


def test_a_request_after_the_send_is_served_from_the_window() -> None:
    s = _server()
    s.hello(b"a", batches=(0, 1, 2))
    s.turn(readers=(b"a",))
    assert s.sent_to(b"a") == [0, 1, 2] and s.budget.held == 0
    s.hello(b"b", batches=(2, 0))
    actions = s.tick()
    assert not [a for a in actions if isinstance(a, Submit)]
    assert s.sent_to(b"b") == [2, 0]
    assert _slots(s, b"b") == [_slots(s, b"a")[2], _slots(s, b"a")[0]]
    assert s.budget.held == 2  # taken back from the window: lent again while sent
    s.deliver(b"b")
    assert s.budget.held == 0 and s.released == []


def test_the_window_keeps_its_bound_and_lets_the_oldest_go() -> None:
    s = _server(window=2)
    s.hello(b"a", batches=tuple(range(5)))
    for _ in range(3):
        s.turn(readers=(b"a",))
    assert s.sent_to(b"a") == [0, 1, 2, 3, 4]
    slots = _slots(s, b"a")
    assert s.released == slots[:3]  # the window holds the 2 newest
    assert s.core.shared.idle == 2
    s.hello(b"b", batches=(0,))
    assert len([a for a in s.tick() if isinstance(a, Submit)]) == 1  # 0 is produced again
    assert s.core.sessions[b"b"].sharing == "lagging"
    s.send(b"b", Credit(batches=(4,), stats=None))
    assert not [a for a in s.tick() if isinstance(a, Submit)]  # 4 is still in the window
    assert s.core.sessions[b"b"].sharing == "shared"


def test_share_window_zero_turns_sharing_off() -> None:
    s = _server(window=0)
    s.hello(b"a", batches=(0,))
    s.hello(b"b", batches=(0,))
    assert len([a for a in s.tick() if isinstance(a, Submit)]) == 2
    s.turn(readers=(b"a", b"b"))
    assert _slots(s, b"a") != _slots(s, b"b")
    assert len(s.released) == 2 and s.core.shared.idle == 0
    assert s.core.sessions[b"a"].sharing == "off"


def test_world_sizes_one_and_two_share_their_global_batches() -> None:
    """Rank r of world size 2 batch k is world size 1 batch 2k + r (pipeline/sampler.py)."""
    s = _server()
    s.hello(b"solo", batches=(0, 1, 2, 3), job="j1")
    s.hello(b"r0", batches=(0, 1), rank=0, world_size=2, job="j2")
    s.hello(b"r1", batches=(0, 1), rank=1, world_size=2, job="j2")
    s.tick()
    assert len(s.jobs) == 4
    s.finish()
    s.tick()
    solo = _slots(s, b"solo")
    assert _slots(s, b"r0") == [solo[0], solo[2]] and _slots(s, b"r1") == [solo[1], solo[3]]
    assert s.sent_to(b"r1") == [0, 1]  # each header carries its own batch index
    plans = [split_info().sampler(4, s.cfg.seed, r, w) for r, w in ((0, 1), (1, 2))]
    assert (plans[0].plan(0, 3).indices == plans[1].plan(0, 1).indices).all()


def test_a_lagging_session_gets_its_own_production_and_rejoins() -> None:
    s = _server(window=4)
    s.hello(b"lead", batches=tuple(range(12)))
    for _ in range(4):
        s.turn(readers=(b"lead",))
    assert len(s.sent_to(b"lead")) == 12
    s.hello(b"late", batches=(0, 1, 10, 11))
    s.tick()
    assert [j.order.batch_index for j in s.jobs] == [0, 1]  # 10 and 11 come from the window
    assert s.core.sessions[b"late"].sharing in ("lagging", "shared")
    s.turn(readers=(b"late",))
    assert s.sent_to(b"late") == [0, 1, 10, 11]
    assert s.core.sessions[b"late"].sharing == "shared"  # back inside the window


def test_a_stopped_session_does_not_hold_back_the_others() -> None:
    s = _server()
    for who in (b"a", b"b"):
        s.hello(who, batches=tuple(range(40)))
    for _ in range(20):  # b stops reading after its first batches; a goes on alone
        s.turn(readers=(b"a",), dt=0.5)
    assert len(s.sent_to(b"a")) == 40
    assert b"b" not in s.core.sessions  # dropped after STALL_S, its references returned
    assert s.budget.held <= s.budget.max_buffers


@pytest.mark.parametrize("window", [None, 0])
def test_fair_share_with_shared_slots(window: int | None) -> None:
    """Buffers are short: two jobs follow one pass, a third is far behind. Memory stays
    inside the cap, and the lagging job still gets its share of the producers' buffers."""
    s = _server(window=window, max_buffers=12, reserve=2)
    readers = (b"a", b"b", b"late")
    s.hello(b"a", batches=tuple(range(200, 240)))
    s.hello(b"b", batches=tuple(range(200, 240)))
    s.hello(b"late", batches=tuple(range(40)))
    for _ in range(12):
        s.turn(readers=readers)
        assert s.budget.held + s.core.shared.idle <= 12
        for identity in readers:
            assert s.holding(identity) <= 12 // 4 + 2
    assert len(s.sent_to(b"late")) >= 8
    assert len(s.sent_to(b"a")) >= 8 and len(s.sent_to(b"b")) >= 8
    produced = s.telemetry.counters()["batches_produced_total"]
    sent = len(s.sends)
    if window is None:
        assert produced < sent  # a and b shared theirs
    else:
        assert produced == sent


def test_releases_when_a_session_drops_while_waiting_for_a_shared_batch() -> None:
    s = _server()
    s.hello(b"a", batches=(0,))
    s.hello(b"b", batches=(0,))
    s.tick()
    s.send(b"a", Bye())
    (job,) = s.jobs
    assert not job.order.cancelled.is_set()  # b still waits for it
    s.finish()
    s.tick()
    assert s.sent_to(b"b") == [0]
    s.deliver(b"b")
    assert s.budget.held == 0
    s.send(b"b", Bye())
    assert not [a for a in s.tick() if isinstance(a, Release)]


def test_the_window_is_emptied_once_no_client_is_left() -> None:
    s = _server()
    s.hello(b"a", batches=(0, 1))
    s.turn(readers=(b"a",))
    assert s.core.shared.idle == 2 and s.released == []
    s.send(b"a", Bye())
    s.tick(1.0)  # housekeeping
    assert len(s.released) == 2 and s.core.shared.idle == 0
    assert s.trims[-1] == 0


def test_the_share_window_in_use_is_said_and_a_cap_named() -> None:
    """`--share-window 100` with 70 buffers is capped at 17: the start line says so."""
    from batchwire.server.sharing import window_statement

    assert window_statement(100, 70) == (
        "share window: 17 batches, capped from 100 at a quarter of --max-buffers 70 "
        "(raise --max-buffers for more)"
    )
    assert window_statement(None, 70) == "share window: 16 batches (the default)"
    assert window_statement(8, 70) == "share window: 8 batches (--share-window)"
    assert window_statement(0, 70) == "share window: off (--share-window 0)"
    assert window_statement(None, 3).startswith("share window: off (a quarter")


def test_a_peer_that_stopped_waiting_shares_nothing_with_the_one_sent_the_batch() -> None:
    """b waited for batch 0 with a, then moved on to another epoch on the same socket: a is
    sent batch 0 alone, and its header must not say shared (the server counts one send, so a
    job's 'shared' figure stays backed by the server's counters, docs/sweeps.md)."""
    s = _server()
    s.hello(b"a", batches=(0,))
    s.hello(b"b", batches=(0,), session=2)
    s.tick()
    s.hello(b"b", batches=(0,), session=3, epoch=1)  # b's new session waits for other batches
    s.tick()
    s.finish(1)
    sends = [a for a in s.tick() if isinstance(a, SendBatch) and a.identity == b"a"]
    assert [x.header.batch_index for x in sends] == [0]
    assert sends[0].header.shared is False
