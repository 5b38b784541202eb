"""ClientSession bookkeeping: asked-for batches in order, bounded work-ahead and sending (the
invariants that bound server memory); its state machine: test_server_session_state.py; the
round-robin over sessions: test_server_scheduling.py."""

from __future__ import annotations

from batchwire.pipeline.sampler import ShardSampler
from batchwire.server.sessions import ClientSession, Produced, ReadyBatch
from batchwire.wire import MAX_PREFETCH, ClientRow, Hello, LoaderReport

ANY = 1 << 30  # no limit from unread batches


def _stream(identity=b"a", *, asked=(0, 1), depth=3, num_batches=10):
    hello = Hello(split="train", rank=0, world_size=1, epoch=0, batches=tuple(asked), session=1)
    sampler = ShardSampler(num_batches, 1, seed=0, shuffle=False, drop_last=True)
    s = ClientSession(identity, hello, sampler, depth, now=0.0)
    assert s.ask(hello.batches, now=0.0) is None
    return s


def _batch(k):
    return ReadyBatch(k, Produced(None, None, [], 0, 0.0, 0.0))  # type: ignore[arg-type]


def _produce_all(s):
    while s.has_room():
        pos, k = s.take_next()
        s.completed(pos, _batch(k))


def test_a_stream_produces_and_sends_what_was_asked_in_the_order_asked():
    s = _stream(asked=(5, 2, 7), depth=10)
    assert s.credits == 3
    _produce_all(s)
    assert [b.batch_index for b in s.pop_sendable(ANY)] == [5, 2, 7]
    assert s.done and s.credits == 0
    assert s.ask([0, 9], now=0.0) is None and not s.done
    _produce_all(s)
    assert [b.batch_index for b in s.pop_sendable(ANY)] == [0, 9]


def test_asks_out_of_range_repeated_or_too_many_are_refused_whole():
    s = _stream(asked=(1,))
    assert "out of range" in s.ask([3, 10], now=0.0)
    assert "asked for already" in s.ask([1], now=0.0)
    assert s.batches == [1]  # nothing of a refused ask was taken
    big = _stream(asked=(), num_batches=10_000)
    assert big.ask(list(range(MAX_PREFETCH)), now=0.0) is None
    assert "more than" in big.ask([MAX_PREFETCH], now=0.0)


def test_work_ahead_is_the_servers_depth_whatever_the_client_asks():
    s = _stream(asked=range(10), depth=3)
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
    assert [b.batch_index for b in s.pop_sendable(ANY)] == [0, 1, 2]
    assert s.sent == 3 and s.credits == 7 and s.has_room()


def test_sending_stops_at_the_limit_whatever_was_asked():
    """The server passes how many more batches the peer may have unread (its --prefetch-depth
    minus what ZeroMQ still holds for it): asking alone does not let a peer that never reads
    pin buffers."""
    s = _stream(asked=range(50), depth=4, num_batches=50)
    _produce_all(s)
    assert [b.batch_index for b in s.pop_sendable(1)] == [0]
    assert list(s.pop_sendable(0)) == [] and s.credits == 49
    assert [b.batch_index for b in s.pop_sendable(ANY)] == [1, 2, 3]


def test_drain_closes_and_returns_queued_batches():
    s = _stream()
    pos, k = s.take_next()
    s.completed(pos, _batch(k))
    assert [b.batch_index for b in s.drain()] == [0]
    assert s.closed and not s.has_room() and s.ready == 0


def test_row_is_the_stats_schema_row_with_the_last_loader_report():
    s = _stream(b"\x01\x02", asked=(0, 1, 2), depth=2)
    s.last_seen = 1.0
    _produce_all(s)
    assert len(list(s.pop_sendable(1))) == 1
    s.loader_stats = LoaderReport(data_wait_fraction=0.5)
    row = s.row(now=3.0, in_flight=1)
    assert row == ClientRow(
        id="0102",
        split="train",
        rank=0,
        world_size=1,
        epoch=0,
        credits=2,
        ready=1,
        ready_capacity=2,
        in_flight=1,
        sent=1,
        images_per_s=0.0,
        last_seen_s=2.0,
        loader=LoaderReport(data_wait_fraction=0.5),
        job="",
        sharing="off",
    )
    assert ClientRow.from_map(row.to_map()) == row
