"""The one stats client (wire/stats_client.py) against in-process ROUTER sockets that play the
server: an answer, a hostile answer, a refusal, silence, and keys that do not match, each
told apart by its exception."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
import zmq
from batchwire import wire
from batchwire.wire.keys import ClientKeys, ServerKeys, create_keys
from batchwire.wire.stats_client import (
    StatsClient,
    StatsKeysError,
    StatsTimeout,
    StatsUnavailable,
    fetch_stats,
)

STATS = wire.ServerStats(
    v=wire.STATS_VERSION,
    uptime_s=1.0,
    time=0.0,
    stages=(wire.StageStats("read", 1, 2, 0.5),),
    throughput=wire.Throughput(0.0, 0.0, 0.0),
    counters=wire.Counters(0, 0, 0, 0, 0, 0, 0),
    clients=(),
)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@contextmanager
def fake_server(
    ctx: zmq.Context, answer: Callable[[], bytes] | None, keys: ServerKeys | None = None
) -> Iterator[str]:
    """A ROUTER on a free loopback port answering each request with ``answer()`` (None: never)."""
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    if keys is not None:
        keys.guard(ctx, router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if router.poll(20) and answer is not None:
                identity, _request = router.recv_multipart()
                router.send_multipart([identity, answer()])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join()
        router.close(linger=0)
        if keys is not None:
            keys.stop()


def test_an_answer_is_a_server_stats(ctx: zmq.Context) -> None:
    with fake_server(ctx, lambda: wire.StatsReply(STATS).pack()) as endpoint:
        assert fetch_stats(endpoint, 5.0, ctx=ctx) == STATS
        with StatsClient(endpoint, 5.0, ctx=ctx) as client:  # one socket, several requests
            assert client.fetch() == client.fetch() == STATS


def test_a_hostile_answer_is_unavailable_naming_the_field(ctx: zmq.Context) -> None:
    bad = STATS.to_map() | {"uptime_s": "forever"}
    frame = msgpack.packb({"v": 2, "type": "stats", "stats": bad})
    with (
        fake_server(ctx, lambda: frame) as endpoint,
        pytest.raises(StatsUnavailable, match=r"bad reply from .*stats\.uptime_s"),
    ):
        fetch_stats(endpoint, 5.0, ctx=ctx)


def test_a_refusal_is_unavailable_with_the_servers_words(ctx: zmq.Context) -> None:
    with (
        fake_server(ctx, lambda: wire.ErrorReply("not today").pack()) as endpoint,
        pytest.raises(StatsUnavailable, match="refused the stats request: not today"),
    ):
        fetch_stats(endpoint, 5.0, ctx=ctx)


def test_silence_is_a_timeout(ctx: zmq.Context) -> None:
    with (
        fake_server(ctx, None) as endpoint,
        pytest.raises(StatsTimeout, match="no answer from") as info,
    ):
        fetch_stats(endpoint, 0.2, ctx=ctx)
    assert isinstance(info.value, TimeoutError)


def test_a_late_answer_never_passes_for_the_next_requests(ctx: zmq.Context) -> None:
    """The first answer comes after the client gave up: the next fetch gets its own answer."""
    answers = iter([(0.6, 111.0), (0.0, 222.0)])

    def answer() -> bytes:
        delay, uptime = next(answers)
        time.sleep(delay)
        return wire.StatsReply(dataclasses.replace(STATS, uptime_s=uptime)).pack()

    with fake_server(ctx, answer) as endpoint, StatsClient(endpoint, 5.0, ctx=ctx) as client:
        with pytest.raises(StatsTimeout):
            client.fetch(timeout=0.3)
        time.sleep(0.5)  # the late answer to the first request has arrived by now
        assert client.fetch().uptime_s == 222.0


def test_a_malformed_endpoint_fails_at_connect() -> None:
    client = StatsClient("tcp://no-port-here")
    try:
        with pytest.raises(StatsUnavailable, match="cannot connect"):
            client.connect()
    finally:
        client.close()


@pytest.mark.parametrize("client_side", ["no keys", "other keys"])
def test_keys_that_do_not_match_are_a_keys_error_not_a_timeout(
    ctx: zmq.Context, tmp_path: Path, client_side: str
) -> None:
    server = ServerKeys(create_keys(tmp_path / "server"))
    keys = None if client_side == "no keys" else ClientKeys.load(create_keys(tmp_path / "other"))
    with fake_server(ctx, lambda: wire.StatsReply(STATS).pack(), server) as endpoint:
        started = time.monotonic()
        with pytest.raises(StatsKeysError, match="--keys DIR"):
            fetch_stats(endpoint, 10.0, ctx=ctx, keys=keys)
        assert time.monotonic() - started < 5  # told at the handshake, not at the timeout
        # The server's own keys folder gets the answer.
        own = ClientKeys.load(tmp_path / "server")
        assert fetch_stats(endpoint, 5.0, ctx=ctx, keys=own) == STATS
