"""The server's ROUTER socket shell (server/router_socket.py) against real peers in this process.

DEALER sockets (and, where a peer must not be a ZeroMQ client, a bare TCP socket) connect to a
`RouterSocket` bound on a loopback port, an ipc path in tmp_path, or inproc where a queue must
be filled at once. What is checked is what the module promises the loop: messages with their
peer's identity, at most a turn's worth at a time; replies and batches to one peer; the limits
and timeouts that close a connection; which tracked peers are gone; the security handshake's
failures; binding (owner-only ipc, refused paths, a failed bind leaving nothing bound) and
closing. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import wirefakes
import zmq
from batchwire import wire
from batchwire.server.config import ServerConfig
from batchwire.server.router_socket import MAX_RECV_PER_TURN, RouterSocket, check_ipc_endpoint
from batchwire.server.splits import StartupError
from batchwire.wire.keys import ClientKeys, ServerKeys, create_keys

WAIT_S = 2.0
LOOPBACK = "tcp://127.0.0.1:*"
GONE = "disconnected (closed, or no heartbeat answer)"


@pytest.fixture
def reported() -> list[str]:
    """The reasons the test's server passed to ``on_handshake_failure`` (the metric's hook)."""
    return []


@pytest.fixture
def make_server(reported) -> Iterator[Callable[..., RouterSocket]]:
    """``make_server(*bind, keys=None, **config)``: a RouterSocket, closed after the test."""
    made: list[RouterSocket] = []

    def make(*bind: str, keys: ServerKeys | None = None, **config: object) -> RouterSocket:
        config.setdefault("bind", list(bind) or [LOOPBACK])
        made.append(RouterSocket(ServerConfig(**config), keys, reported.append))
        return made[-1]

    yield make
    for rs in made:
        rs.close(0)


def dealer(
    ctx: zmq.Context, endpoint: str, routing_id: bytes | None = None, keys: ClientKeys | None = None
) -> zmq.Socket:
    """A connected DEALER that does not reconnect (a closed connection stays closed), whose
    sends fail rather than wait past WAIT_S."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = int(WAIT_S * 1000)
    sock.reconnect_ivl = -1
    if routing_id is not None:
        sock.routing_id = routing_id
    if keys is not None:
        keys.apply(sock)
    sock.connect(endpoint)
    return sock


def received(rs: RouterSocket, count: int) -> list[tuple[bytes, list[zmq.Frame]]]:
    """The next ``count`` messages, through `receive`, within WAIT_S."""
    got: list[tuple[bytes, list[zmq.Frame]]] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} messages arrived"
        if rs.router.poll(20):
            got += rs.receive()
    return got


def until(rs: RouterSocket, probe: Callable[[], bool], what: str) -> None:
    """Handle the monitor's events as the loop does until ``probe()``; fail after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not probe():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        if rs.monitor.poll(20):
            rs.peer_events()


def tcp_address(endpoint: str) -> tuple[str, int]:
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def with_session(rs: RouterSocket, peer: zmq.Socket) -> bytes:
    """``peer`` sends one frame, which the loop receives and ties to its connection (`track`)."""
    peer.send(b"credit")
    [(identity, frames)] = received(rs, 1)
    rs.track(identity, frames[0])
    return identity


# ----------------------------------------------------------------------------- binding


def test_binds_every_endpoint_and_reports_the_bound_ones(ctx, make_server, tmp_path) -> None:
    ipc = f"ipc://{tmp_path}/server.sock"
    rs = make_server(LOOPBACK, ipc)
    tcp, bound_ipc = rs.endpoints
    assert tcp.startswith("tcp://127.0.0.1:") and tcp_address(tcp)[1] > 0, tcp  # not "*"
    assert bound_ipc == ipc
    peers = [dealer(ctx, tcp, b"over-tcp"), dealer(ctx, ipc, b"over-ipc")]
    for peer in peers:
        peer.send(b"hi")
    assert sorted(identity for identity, _ in received(rs, 2)) == [b"over-ipc", b"over-tcp"]


def test_an_ipc_socket_file_is_owner_only(make_server, tmp_path) -> None:
    make_server(f"ipc://{tmp_path}/server.sock")
    assert stat.S_IMODE(os.stat(tmp_path / "server.sock").st_mode) & 0o077 == 0


def test_a_failed_bind_is_a_startup_error_and_leaves_nothing_bound(ctx, tmp_path) -> None:
    taken = ctx.socket(zmq.ROUTER)
    taken.linger = 0
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    first = f"ipc://{tmp_path}/first.sock"
    with pytest.raises(StartupError, match=f"cannot bind tcp://127.0.0.1:{port}: ") as failed:
        RouterSocket(ServerConfig(bind=[first, f"tcp://127.0.0.1:{port}"]), None)
    # While the error is handled (its traceback holds the half-made socket), the endpoint it
    # had bound is already closed: no half-started server listens behind it.
    assert failed.tb is not None
    check_ipc_endpoint(first)


def test_an_endpoint_with_no_file_of_its_own_is_let_through(tmp_path, monkeypatch) -> None:
    """tcp://, an abstract ipc name and a path not there yet: nothing to check (the files
    named like them in the working folder are not theirs)."""
    monkeypatch.chdir(tmp_path)
    for name in ("127.0.0.1:5555", "@abstract-name"):
        (tmp_path / name).write_text("not an endpoint's file")
    check_ipc_endpoint("tcp://127.0.0.1:5555")
    check_ipc_endpoint("ipc://@abstract-name")
    check_ipc_endpoint(f"ipc://{tmp_path}/none-yet.sock")


def test_an_ipc_path_that_is_not_a_socket_is_refused(tmp_path) -> None:
    path = tmp_path / "data.txt"
    path.write_text("not mine to delete")
    with pytest.raises(StartupError, match="exists and is not a socket"):
        check_ipc_endpoint(f"ipc://{path}")
    assert path.read_text() == "not mine to delete"


def test_an_ipc_path_another_server_listens_on_is_refused(tmp_path) -> None:
    path = str(tmp_path / "other.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(path)
        other.listen(1)
        with pytest.raises(StartupError, match="another server is listening on ipc://"):
            check_ipc_endpoint(f"ipc://{path}")


def test_a_stale_ipc_socket_is_replaced(ctx, make_server, tmp_path) -> None:
    path = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as killed:
        killed.bind(path)  # a server that was killed: the file stays, nobody listens
    endpoint = f"ipc://{path}"
    check_ipc_endpoint(endpoint)
    rs = make_server(endpoint)
    peer = dealer(ctx, endpoint, b"after")
    peer.send(b"hi")
    assert [identity for identity, _ in received(rs, 1)] == [b"after"]


# ----------------------------------------------------------------------------- traffic


def test_receive_gives_each_message_with_its_peer_identity(ctx, make_server) -> None:
    rs = make_server()
    alpha, beta = dealer(ctx, rs.endpoints[0], b"alpha"), dealer(ctx, rs.endpoints[0], b"beta")
    alpha.send(b"x")
    beta.send_multipart([b"y", b"z"])
    got = {identity: [f.bytes for f in frames] for identity, frames in received(rs, 2)}
    assert got == {b"alpha": [b"x"], b"beta": [b"y", b"z"]}


def test_receive_takes_at_most_a_turn_of_messages_and_never_waits(make_server) -> None:
    rs = make_server("inproc://router-turn")
    peer = dealer(rs.ctx, "inproc://router-turn")  # inproc: every message is queued at once
    try:
        for i in range(MAX_RECV_PER_TURN + 44):
            peer.send(b"%d" % i)
        rs.router.rcvtimeo = 1000  # bounds a receive that waits: it would take this long
        started = time.monotonic()
        turns = [[f[0].bytes for _, f in rs.receive()] for _ in range(3)]
        took = time.monotonic() - started
    finally:
        peer.close(0)
    assert [len(turn) for turn in turns] == [MAX_RECV_PER_TURN, 44, 0]
    assert took < 0.5, f"an empty queue held the turn for {took:.2f} s"
    assert turns[0][0] == b"0" and turns[1][-1] == b"%d" % (MAX_RECV_PER_TURN + 43)


def test_a_reply_reaches_its_peer_only(ctx, make_server) -> None:
    rs = make_server()
    peers = {name: dealer(ctx, rs.endpoints[0], name) for name in (b"a", b"b")}
    for peer in peers.values():
        peer.send(b"hello")
    received(rs, 2)
    rs.reply(b"b", wire.ErrorReply("for b", reason="busy", session=2))
    rs.reply(b"a", wire.ErrorReply("for a", reason="busy", session=1))
    for name, peer in peers.items():
        assert peer.poll(int(WAIT_S * 1000))
        [frame] = peer.recv_multipart()
        reply = wire.decode_server_message(frame)
        assert reply == wire.ErrorReply(f"for {name.decode()}", "busy", session=b"_ab".index(name))


def test_send_batch_reaches_its_peer_and_tracks_the_images(ctx, make_server) -> None:
    rs = make_server()
    peer = dealer(ctx, rs.endpoints[0], b"trainer")
    peer.send(b"credit")
    received(rs, 1)
    header = wirefakes.header(session=7, k=3)
    buffer = np.arange(2 * wirefakes.NBYTES, dtype=np.uint8)  # a buffer larger than the batch
    images = memoryview(buffer)[: header.nbytes]
    tracker = rs.send_batch(b"trainer", header, images, np.array([5, 6]))
    assert peer.poll(int(WAIT_S * 1000))
    head, pixels, labels = peer.recv_multipart()
    assert wire.decode_server_message(head) == header
    assert pixels == buffer[: header.nbytes].tobytes()
    assert wire.labels_from_frame(labels, header.batch_size).tolist() == [5, 6]
    tracker.wait(WAIT_S)  # ZeroMQ let go of the buffer once it was sent


# ----------------------------------------------------------------------------- limits


def test_limits_and_timeouts_follow_the_config(make_server) -> None:
    """Those whose effect takes seconds to see (heartbeats, TCP_USER_TIMEOUT, the queue bound)."""
    rs = make_server(handshake_timeout=2.5, stall_timeout=7.0)
    router = rs.router
    assert router.handshake_ivl == 2500
    assert router.tcp_maxrt == 7000
    assert (router.heartbeat_ivl, router.heartbeat_timeout) == (1000, 3000)
    assert router.sndhwm == 4 * wire.MAX_PREFETCH + 64
    assert router.backlog == 1024
    assert router.linger == 0


def test_a_frame_above_the_size_limit_cuts_its_peer(ctx, make_server) -> None:
    rs = make_server()
    peer = dealer(ctx, rs.endpoints[0])
    identity = with_session(rs, peer)
    peer.send(b"x" * (16 * 1024 * 1024 + 1))
    until(rs, lambda: rs.connections == 0, "the connection to close")
    assert rs.gone_peers() == [(identity, GONE)]
    assert not rs.router.poll(0)  # the oversized frame never reached the loop


def test_a_connection_silent_past_the_handshake_timeout_is_closed(make_server) -> None:
    rs = make_server(handshake_timeout=0.05)
    with socket.create_connection(tcp_address(rs.endpoints[0])):  # sends nothing
        until(rs, lambda: rs.connections == 1, "the connection to be accepted")
        until(rs, lambda: rs.connections == 0, "the silent connection to be closed")


def test_a_keyless_server_counts_no_handshake_failure_for_a_port_probe(
    make_server, reported, caplog
) -> None:
    """A health check or port scanner that connects and hangs up is no security rejection:
    without --keys there is none (docs/metrics.md: connections `--keys` rejected)."""
    caplog.set_level(logging.WARNING, logger="batchwire.server")
    rs = make_server()
    with socket.create_connection(tcp_address(rs.endpoints[0])):
        until(rs, lambda: rs.connections == 1, "the probe to be accepted")
    until(rs, lambda: rs.connections == 0, "the probe's connection to close")
    assert reported == []
    assert not rs.handshake_failures.total
    assert "security handshake" not in caplog.text


# ----------------------------------------------------------------------------- peers


def test_a_tracked_peer_whose_connection_closes_is_gone_once(ctx, make_server) -> None:
    rs = make_server()
    tracked = dealer(ctx, rs.endpoints[0], b"tracked")
    untracked = dealer(ctx, rs.endpoints[0], b"untracked")
    staying = dealer(ctx, rs.endpoints[0], b"staying")
    assert with_session(rs, tracked) == b"tracked"
    assert with_session(rs, staying) == b"staying"
    untracked.send(b"stats")  # no session: received, never tracked
    received(rs, 1)
    until(rs, lambda: rs.connections == 3, "three connections")
    tracked.close(0)
    untracked.close(0)
    until(rs, lambda: rs.connections == 1, "two connections to close")
    assert rs.gone_peers() == [(b"tracked", GONE)]
    assert rs.gone_peers() == []  # said once
    staying.send(b"credit")
    [(identity, frames)] = received(rs, 1)
    rs.track(identity, frames[0])
    assert rs.gone_peers() == []


def test_a_message_from_a_connection_closed_since_makes_its_peer_gone(ctx, make_server) -> None:
    rs = make_server()
    peer = dealer(ctx, rs.endpoints[0], b"late")
    peer.send(b"credit")
    [(identity, frames)] = received(rs, 1)
    until(rs, lambda: rs.connections == 1, "the connection to be accepted")
    peer.close(0)
    assert rs.monitor.poll(int(WAIT_S * 1000))  # its DISCONNECTED event, not yet handled
    rs.track(identity, frames[0])  # the message was received before the close was seen
    assert rs.gone_peers() == [(b"late", "disconnected")]


# ----------------------------------------------------------------------------- keys


@pytest.fixture
def keys_dir(tmp_path) -> Path:
    return create_keys(tmp_path / "keys")


def test_a_server_with_keys_serves_a_client_holding_them(
    ctx, make_server, reported, keys_dir
) -> None:
    rs = make_server(keys=ServerKeys(keys_dir))
    peer = dealer(ctx, rs.endpoints[0], keys=ClientKeys.load(keys_dir))
    peer.send(b"hello")
    assert [f.bytes for _, frames in received(rs, 1) for f in frames] == [b"hello"]
    assert reported == []


# A plain (NULL mechanism) ZeroMQ 3.0 greeting, whole: signature, version, mechanism, as-server
# and filler. A plain DEALER hangs up as soon as it reads the server's CURVE greeting, so the
# server sees either reason ("no_keys", or "other" when the hang-up came first): this peer sends
# its whole greeting at once and stays, as a client without keys that is slower to hang up.
NULL_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


def rejected(
    rs: RouterSocket, reported: list[str], caplog: pytest.LogCaptureFixture, reason: str
) -> None:
    """Only ``reason`` was reported, counted and logged, and nothing of the peer got through."""
    until(rs, lambda: bool(reported), "the handshake failure")
    assert set(reported) == {reason}
    assert set(rs.handshake_failures.total) == {reason}
    assert "in the security handshake (--keys is on)" in caplog.text
    assert not rs.router.poll(0)


def test_a_client_without_keys_is_rejected_reported_counted_and_logged(
    make_server, reported, keys_dir, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.server")
    rs = make_server(keys=ServerKeys(keys_dir))
    assert len(NULL_GREETING) == 64
    with socket.create_connection(tcp_address(rs.endpoints[0])) as plain:
        plain.sendall(NULL_GREETING)
        rejected(rs, reported, caplog, "no_keys")


@pytest.mark.parametrize("reason", ["unauthorized_key", "wrong_server_key"])
def test_a_client_with_other_keys_is_rejected_reported_counted_and_logged(
    ctx, make_server, reported, keys_dir, tmp_path, caplog, reason
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.server")
    rs = make_server(keys=ServerKeys(keys_dir))
    good = ClientKeys.load(keys_dir)
    other = ClientKeys.load(create_keys(tmp_path / "other"))
    if reason == "unauthorized_key":  # our server, a client key it does not admit
        keys = ClientKeys(other.public, other.secret, good.server_public)
    else:  # a client of another server
        keys = ClientKeys(good.public, good.secret, other.server_public)
    peer = dealer(ctx, rs.endpoints[0], keys=keys)
    with contextlib.suppress(zmq.Again):  # its handshake may have failed already: no pipe left
        peer.send(b"hello", zmq.NOBLOCK)
    rejected(rs, reported, caplog, reason)


# ----------------------------------------------------------------------------- closing


def test_close_frees_the_endpoint_and_ends_the_context(ctx, keys_dir) -> None:
    rs = RouterSocket(ServerConfig(bind=[LOOPBACK]), ServerKeys(keys_dir))
    endpoint = rs.endpoints[0]
    rs.close(0)  # with keys: the authenticator's socket must close before the context ends
    assert rs.ctx.closed
    again = ctx.socket(zmq.ROUTER)
    again.linger = 0
    again.bind(endpoint)
