"""ClientStream bookkeeping: shard selection, credit-limited in-order sending, bounded work-ahead,
and round-robin scheduling (the invariants that bound server memory and keep clients fair)."""

from __future__ import annotations

import pytest
from batchwire.server.streams import ClientStream, Produced, Scheduler
from batchwire.wire import Hello

ANY = 1 << 30  # no limit from unread batches


def _stream(identity=b"a", *, start=0, shard=(0, 1), prefetch=2, depth=3, num_batches=10):
    hello = Hello(
        split="train",
        rank=0,
        world_size=1,
        epoch=0,
        start_batch=start,
        prefetch=prefetch,
        shard=shard,
        session=1,
    )
    s = ClientStream(identity, hello, num_batches, depth, sampler=None)
    s.credits = prefetch
    return s


def _batch(k):
    return Produced(batch_index=k, slot=None, labels=None, indices=[], replaced=0, produce_s=0)


@pytest.mark.parametrize(
    ("start", "shard", "expected"),
    [
        (0, (0, 1), list(range(10))),
        (0, (1, 3), [1, 4, 7]),
        (5, (0, 2), [6, 8]),
        (5, (1, 2), [5, 7, 9]),
        (9, (0, 1), [9]),
        (12, (0, 1), []),
    ],
)
def test_stream_owes_its_shard_from_start_batch(start, shard, expected):
    assert list(_stream(start=start, shard=shard).batches) == expected


def test_work_ahead_is_bounded_and_credits_limit_sending():
    s = _stream(prefetch=2, depth=3)
    taken = []
    while s.has_room():
        taken.append(s.take_next())
    assert [k for _, k in taken] == [0, 1, 2]  # depth 3, no further
    # finish out of order: nothing goes out until batch 0 is there
    s.completed(taken[2][0], _batch(2))
    s.completed(taken[1][0], _batch(1))
    assert list(s.pop_sendable(ANY)) == []
    assert s.ready == 2 and not s.has_room()
    s.completed(taken[0][0], _batch(0))
    sent = [b.batch_index for b in s.pop_sendable(ANY)]
    assert sent == [0, 1]  # two credits
    assert s.credits == 0 and s.ready == 1 and s.sent == 2
    assert s.has_room()  # one slot of work-ahead freed
    s.credits += 1
    assert [b.batch_index for b in s.pop_sendable(ANY)] == [2]


def test_sending_stops_at_the_limit_whatever_the_credits():
    """The server passes how many more batches the peer may have unread (prefetch minus what
    ZeroMQ still holds for it): credits alone do not let a peer that never reads pin buffers."""
    s = _stream(prefetch=4, depth=4)
    while s.has_room():
        pos, k = s.take_next()
        s.completed(pos, _batch(k))
    s.credits = 50
    assert [b.batch_index for b in s.pop_sendable(1)] == [0]
    assert list(s.pop_sendable(0)) == [] and s.credits == 49
    assert [b.batch_index for b in s.pop_sendable(ANY)] == [1, 2, 3]


def test_stopped_client_costs_nothing_beyond_its_depth():
    s = _stream(prefetch=1, depth=2)
    for _ in range(2):
        pos, k = s.take_next()
        s.completed(pos, _batch(k))
    list(s.pop_sendable(ANY))  # the one credit
    pos, k = s.take_next()
    s.completed(pos, _batch(k))
    assert s.ready == 2 and not s.has_room()
    assert s.next_pos == 3  # never more than sent + depth produced


def test_drain_closes_and_returns_queued_batches():
    s = _stream()
    pos, k = s.take_next()
    s.completed(pos, _batch(k))
    s.credits = 0
    assert [b.batch_index for b in s.drain()] == [0]
    assert s.closed and not s.has_room() and s.ready == 0


def test_done_after_last_batch_sent():
    s = _stream(start=8, prefetch=4)
    while s.has_room():
        pos, k = s.take_next()
        s.completed(pos, _batch(k))
    assert [b.batch_index for b in s.pop_sendable(ANY)] == [8, 9]
    assert s.done and not s.has_room()


def test_scheduler_round_robin_skips_full_streams():
    streams = {i: _stream(i, depth=2) for i in (b"a", b"b", b"c")}
    sched = Scheduler()
    for i in streams:
        sched.add(i)
    order = []
    while (s := sched.next(streams)) is not None:
        s.take_next()
        order.append(s.identity)
    assert order == [b"a", b"b", b"c", b"a", b"b", b"c"]
    sched.remove(b"b")
    pos_a = streams[b"a"]
    pos_a.completed(0, _batch(0))
    list(pos_a.pop_sendable(ANY))
    assert sched.next(streams) is pos_a  # only a has room again
    assert sched.next(streams) is pos_a
