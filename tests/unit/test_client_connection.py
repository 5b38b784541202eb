"""The client's socket to one server (client/connection.py) against in-process ROUTER sockets
that play the server, speaking the real wire (`batchwire.wire`'s messages).

What is checked is what `ServerConnection` promises its caller (`client/receiver.py`): a control
frame reaches the server only over a completed connection (``IMMEDIATE``), the monitor's events
come out in order and a failed CURVE handshake is told apart by its cause, a server's message is
decoded and a malformed or hostile one is a `ProtocolError` that leaves the socket on the next
message's first frame, the data frames are handed over as they are, nothing blocks, and closing
says bye only when asked and leaves no socket open (a socket left open makes the context's
``term()`` wait for ever). Every wait is a poll with a timeout.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import wirefakes
import zmq
from batchwire import wire
from batchwire.client.connection import ConnectionEvent, ServerConnection
from batchwire.client.errors import ServerUnavailable
from batchwire.wire.keys import ClientKeys, KeysError, ServerKeys, create_keys

WAIT_S = 5.0  # a bound on every wait; each normally ends within milliseconds
QUIET_MS = 100  # how long "nothing arrives" is watched for
SESSION = 7
IMAGES = bytes(range(wirefakes.NBYTES))
LABELS = np.array([3, 4], dtype=wire.LABELS_DTYPE).tobytes()
CONNECTED, DISCONNECTED, CONNECT_FAILED = (
    ConnectionEvent.CONNECTED,
    ConnectionEvent.DISCONNECTED,
    ConnectionEvent.CONNECT_FAILED,
)


def hello(*batches: int) -> wire.Hello:
    return wire.Hello(
        split="train", rank=0, world_size=1, epoch=0, batches=batches, session=SESSION
    )


def bind_router(ctx: zmq.Context, endpoint: str = "tcp://127.0.0.1:0") -> tuple[zmq.Socket, str]:
    """A ROUTER playing the server at ``endpoint`` (port 0: a free one); (socket, its address)."""
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    return router, router.last_endpoint.decode()


def rebind(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A new ROUTER at the address of one just closed (libzmq closes its listener a moment later:
    the port is in use until then)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return bind_router(ctx, endpoint)[0]
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.002)


def free_port() -> int:
    """A loopback port nothing listens on (a connect there is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_events(
    conn: ServerConnection, done: Callable[[list[ConnectionEvent]], bool]
) -> list[ConnectionEvent]:
    """The connection's events until ``done(events)``, waiting on its monitor (at most WAIT_S)."""
    events: list[ConnectionEvent] = []
    deadline = time.monotonic() + WAIT_S
    while not done(events):
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0, f"waited {WAIT_S} s; events so far: {events}"
        conn.monitor.poll(left_ms)
        events += conn.drain_events()
    return events


def until(event: ConnectionEvent) -> Callable[[list[ConnectionEvent]], bool]:
    return lambda events: event in events


def collapsed(events: list[ConnectionEvent]) -> list[ConnectionEvent]:
    """``events`` with repeats in a row shown once (a refused connect is retried every 100 ms)."""
    return [e for i, e in enumerate(events) if i == 0 or events[i - 1] is not e]


def writable(conn: ServerConnection) -> None:
    """Wait until a send will go out: the handshake event may be seen a moment before the socket
    takes the new connection (a send then fails, and the receiver sends again later)."""
    assert conn.socket.poll(int(WAIT_S * 1000), zmq.POLLOUT), "no connection to send on"


def connect(ctx: zmq.Context, endpoint: str, keys: ClientKeys | None = None) -> ServerConnection:
    """A connection whose handshake has completed, ready to send."""
    conn = ServerConnection(ctx, endpoint, keys)
    wait_events(conn, until(CONNECTED))
    writable(conn)
    return conn


def server_recv(router: zmq.Socket) -> tuple[bytes, wire.ClientMessage]:
    """The next client message the ROUTER gets: (the client's identity, the message)."""
    assert router.poll(int(WAIT_S * 1000)), "the server got nothing"
    identity, frame = router.recv_multipart()
    return identity, wire.decode_client_message(frame)


def greeted(ctx: zmq.Context) -> tuple[zmq.Socket, bytes, ServerConnection]:
    """A server, a connection to it and the identity its hello came from (to answer it)."""
    router, endpoint = bind_router(ctx)
    conn = connect(ctx, endpoint)
    assert conn.send(hello(0).pack())
    identity, _ = server_recv(router)
    return router, identity, conn


def next_message(conn: ServerConnection) -> tuple[wire.ServerMessage, bool]:
    """`recv_control` once a message is there (the receiver polls first, too)."""
    assert conn.socket.poll(int(WAIT_S * 1000)), "nothing arrived from the server"
    return conn.recv_control()


class TrackingContext(zmq.Context):
    """A context that keeps every socket made from it (the connection's monitor included), to
    tell which were left open: one left open makes ``term()`` wait for ever."""

    made: list[zmq.Socket]  # declared here: pyzmq takes other attributes for context options

    def __init__(self) -> None:
        super().__init__()
        self.made = []

    def socket(self, *args: Any, **kwargs: Any) -> zmq.Socket:
        sock = super().socket(*args, **kwargs)
        self.made.append(sock)
        return sock

    def left_open(self) -> list[zmq.Socket]:
        return [s for s in self.made if not s.closed]


@pytest.fixture
def tracked() -> Iterator[TrackingContext]:
    ctx = TrackingContext()
    yield ctx
    ctx.destroy(linger=0)


# --------------------------------------------------------------------------- sending


def test_a_sent_frame_reaches_the_server_as_the_message_sent(ctx: zmq.Context) -> None:
    router, endpoint = bind_router(ctx)
    conn = connect(ctx, endpoint)
    sent = hello(0, 1, 2)
    assert conn.send(sent.pack()) is True
    assert server_recv(router)[1] == sent


def test_nothing_is_sent_or_queued_before_a_connection_completes(ctx: zmq.Context) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    conn = ServerConnection(ctx, endpoint)
    assert conn.send(hello(0).pack()) is False  # the caller tries again once connected
    router, _ = bind_router(ctx, endpoint)  # the server starts late
    wait_events(conn, until(CONNECTED))
    writable(conn)
    assert conn.send(hello(1).pack()) is True
    assert server_recv(router)[1] == hello(1)
    assert not router.poll(QUIET_MS), "the hello sent while no server was there came late"


# --------------------------------------------------------------------------- connection events


def test_events_tell_a_refused_connect_a_handshake_a_drop_and_a_restart(
    ctx: zmq.Context,
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    conn = ServerConnection(ctx, endpoint)
    assert collapsed(wait_events(conn, until(CONNECT_FAILED))) == [CONNECT_FAILED]
    router, _ = bind_router(ctx, endpoint)
    first = collapsed(wait_events(conn, until(CONNECTED)))
    assert first in ([CONNECTED], [CONNECT_FAILED, CONNECTED]), first
    router.close(linger=0)  # the server is killed
    assert wait_events(conn, until(DISCONNECTED))[0] is DISCONNECTED
    restarted = rebind(ctx, endpoint)  # and restarted at the same address
    again = collapsed(wait_events(conn, until(CONNECTED)))
    assert again in ([CONNECTED], [CONNECT_FAILED, CONNECTED]), again
    assert conn.drain_events() == []  # drained: each event is told once
    assert conn.handshake_error is None
    assert not restarted.closed


# --------------------------------------------------------------------------- CURVE keys


@pytest.fixture
def server_keys(ctx: zmq.Context, tmp_path: Path) -> Iterator[ServerKeys]:
    """The server's side of a keys folder (tmp_path/server); its ZAP thread stops before ``ctx``."""
    keys = ServerKeys(create_keys(tmp_path / "server"))
    yield keys
    keys.stop()


def curve_router(ctx: zmq.Context, keys: ServerKeys) -> tuple[zmq.Socket, str]:
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    keys.guard(ctx, router)
    router.bind("tcp://127.0.0.1:0")
    return router, router.last_endpoint.decode()


def test_the_server_s_keys_folder_gets_an_encrypted_connection(
    ctx: zmq.Context, tmp_path: Path, server_keys: ServerKeys
) -> None:
    router, endpoint = curve_router(ctx, server_keys)
    conn = connect(ctx, endpoint, ClientKeys.load(tmp_path / "server"))
    assert conn.send(hello(0).pack())
    identity, msg = server_recv(router)
    assert msg == hello(0)
    router.send_multipart([identity, wirefakes.welcome(SESSION).pack()])
    assert next_message(conn) == (wirefakes.welcome(SESSION), False)
    assert conn.handshake_error is None


@pytest.mark.parametrize(
    ("client_side", "cause"),
    [
        ("no keys", r"the security handshake failed: one side uses keys and the other does not"),
        ("another folder's client key", r"the server rejected our key: "),
        ("another folder's server key", r"the security handshake failed: the server rejected our"),
    ],
)
def test_a_failed_handshake_says_why_and_never_connects(
    ctx: zmq.Context, tmp_path: Path, server_keys: ServerKeys, client_side: str, cause: str
) -> None:
    router, endpoint = curve_router(ctx, server_keys)
    ours = ClientKeys.load(tmp_path / "server")
    other = ClientKeys.load(create_keys(tmp_path / "other"))
    keys = {
        "no keys": None,
        "another folder's client key": ClientKeys(other.public, other.secret, ours.server_public),
        "another folder's server key": ClientKeys(ours.public, ours.secret, other.server_public),
    }[client_side]
    conn = ServerConnection(ctx, endpoint, keys)
    events = wait_events(conn, lambda _: conn.handshake_error is not None)
    assert re.match(cause, conn.handshake_error or ""), conn.handshake_error
    assert CONNECTED not in events
    assert conn.send(hello(0).pack()) is False
    assert not router.poll(QUIET_MS)


def test_keys_zeromq_refuses_are_a_keys_error_and_leave_no_socket_open(
    tracked: TrackingContext, tmp_path: Path
) -> None:
    """A damaged file is caught when the folder loads (tests/unit/test_wire_keys.py); keys
    built in code are not, and ZeroMQ refuses a secret key cut short."""
    ours = ClientKeys.load(create_keys(tmp_path / "keys"))
    damaged = ClientKeys(ours.public, ours.secret[:20], ours.server_public)
    with pytest.raises(KeysError, match="not usable"):
        ServerConnection(tracked, "tcp://127.0.0.1:5555", damaged)
    assert tracked.left_open() == []


# --------------------------------------------------------------------------- receiving


def test_a_server_message_is_decoded_and_says_whether_frames_follow(ctx: zmq.Context) -> None:
    router, identity, conn = greeted(ctx)
    router.send_multipart([identity, wirefakes.welcome(SESSION).pack()])
    header = wirefakes.header(SESSION, 0)
    router.send_multipart([identity, header.pack(), IMAGES, LABELS])
    assert next_message(conn) == (wirefakes.welcome(SESSION), False)
    assert next_message(conn) == (header, True)


def test_data_frames_are_handed_over_without_a_copy(ctx: zmq.Context) -> None:
    router, identity, conn = greeted(ctx)
    router.send_multipart([identity, wirefakes.header(SESSION, 0).pack(), IMAGES, LABELS])
    assert next_message(conn)[1] is True  # the frames of a message arrive together
    images, more = conn.recv_frame()
    assert isinstance(images, zmq.Frame) and more is True  # ZeroMQ's own buffer
    assert bytes(images.buffer) == IMAGES
    labels, more = conn.recv_frame()
    assert (np.frombuffer(labels.buffer, wire.LABELS_DTYPE).tolist(), more) == ([3, 4], False)


def test_a_frame_received_into_a_buffer_tells_its_size_even_when_too_large(
    ctx: zmq.Context,
) -> None:
    router, identity, conn = greeted(ctx)
    router.send_multipart([identity, wirefakes.header(SESSION, 0).pack(), IMAGES, LABELS])
    router.send_multipart([identity, wirefakes.welcome(SESSION).pack()])
    next_message(conn)
    images = bytearray(len(IMAGES))
    assert conn.recv_into(memoryview(images)) == (len(IMAGES), True)
    assert images == IMAGES
    short = bytearray(len(LABELS) // 2)  # a frame larger than the buffer: the size says so
    assert conn.recv_into(memoryview(short)) == (len(LABELS), False)
    assert short == LABELS[: len(short)]
    assert next_message(conn) == (wirefakes.welcome(SESSION), False)  # still aligned


def test_discarding_drops_the_rest_of_this_message_only(ctx: zmq.Context) -> None:
    router, identity, conn = greeted(ctx)
    router.send_multipart([identity, wirefakes.header(SESSION, 0).pack(), IMAGES, LABELS])
    router.send_multipart([identity, wirefakes.welcome(SESSION).pack()])
    router.send_multipart([identity, wire.Shutdown().pack()])
    next_message(conn)
    conn.discard_rest()  # a stale batch's frames
    assert next_message(conn) == (wirefakes.welcome(SESSION), False)
    conn.discard_rest()  # nothing left of the welcome: the next message stays
    assert next_message(conn) == (wire.Shutdown(), False)


HOSTILE = {
    "not msgpack": (b"\xc1", wire.ProtocolError, "not a valid msgpack frame"),
    "an empty frame": (b"", wire.ProtocolError, "not a valid msgpack frame"),
    "not a map": (msgpack.packb([1, 2]), wire.ProtocolError, "must be a map"),
    "no version": (wire.pack({"type": "welcome"}), wire.ProtocolError, "no protocol version"),
    "another version": (
        wire.pack({**wirefakes.welcome(SESSION).to_map(), "v": wire.PROTOCOL_VERSION + 1}),
        wire.VersionMismatch,
        f"peer speaks v{wire.PROTOCOL_VERSION + 1}",
    ),
    "a client's message": (hello(0).pack(), wire.ProtocolError, "unknown message type 'hello'"),
    "an oversized frame": (
        b"\x90" * (wire.MAX_SERVER_FRAME_BYTES + 1),
        wire.ProtocolError,
        "exceeds the limit",
    ),
    "a header whose size lies": (
        wire.pack({**wirefakes.header(SESSION, 0).to_map(), "nbytes": 1}),
        wire.ProtocolError,
        "field 'nbytes'",
    ),
}


@pytest.mark.parametrize("trailing", [0, 2], ids=["alone", "with data frames"])
@pytest.mark.parametrize("kind", HOSTILE)
def test_a_malformed_message_is_a_protocol_error_and_the_next_one_is_read_whole(
    ctx: zmq.Context, kind: str, trailing: int
) -> None:
    frame, error, words = HOSTILE[kind]
    router, identity, conn = greeted(ctx)
    router.send_multipart([identity, frame, IMAGES, LABELS][: 2 + trailing])
    router.send_multipart([identity, wirefakes.welcome(SESSION).pack()])
    with pytest.raises(error, match=re.escape(words)):
        next_message(conn)
    assert next_message(conn) == (wirefakes.welcome(SESSION), False)


def test_receiving_from_an_empty_socket_never_blocks(ctx: zmq.Context) -> None:
    _, _, conn = greeted(ctx)
    outcome: list[str] = []

    def receive() -> None:
        try:
            conn.recv_control()
        except zmq.Again:
            outcome.append("again")

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert outcome == ["again"]


# --------------------------------------------------------------------------- closing


def test_closing_with_bye_tells_the_server_and_is_safe_twice(ctx: zmq.Context) -> None:
    router, _, conn = greeted(ctx)
    conn.close(say_bye=True)
    assert server_recv(router)[1] == wire.Bye()
    assert conn.socket.closed and conn.monitor.closed
    conn.close(say_bye=True)  # a second close does nothing, says nothing
    assert not router.poll(QUIET_MS)


def test_closing_without_bye_sends_nothing(ctx: zmq.Context) -> None:
    router, _, conn = greeted(ctx)
    conn.close()
    assert conn.socket.closed and conn.monitor.closed
    assert not router.poll(QUIET_MS)


def test_closing_with_no_server_there_leaves_no_socket_open(tracked: TrackingContext) -> None:
    conn = ServerConnection(tracked, f"tcp://127.0.0.1:{free_port()}")
    wait_events(conn, until(CONNECT_FAILED))
    conn.close(say_bye=True)  # no connection: the bye is not sent
    assert tracked.left_open() == []
    tracked.term()


# --------------------------------------------------------------------------- endpoints


def test_a_host_name_nothing_resolves_is_unavailable_and_opens_no_socket(
    tracked: TrackingContext,
) -> None:
    with pytest.raises(ServerUnavailable, match="cannot resolve the host name") as caught:
        ServerConnection(tracked, "tcp://nosuchhost.invalid:5555")  # RFC 2606: never resolves
    assert caught.value.endpoint == "tcp://nosuchhost.invalid:5555"
    assert tracked.made == []


def test_a_malformed_endpoint_is_a_value_error_and_leaves_no_socket_open(
    tracked: TrackingContext,
) -> None:
    with pytest.raises(ValueError, match="cannot connect to 'tcp://no-port-here'"):
        ServerConnection(tracked, "tcp://no-port-here")
    assert tracked.left_open() == []


def test_an_ipv6_address_gets_an_ipv6_socket(ctx: zmq.Context) -> None:
    # Without the option libzmq accepts the connect and never reaches the address.
    v6 = ServerConnection(ctx, "tcp://[::1]:5555")
    v4 = ServerConnection(ctx, "tcp://127.0.0.1:5555")
    try:
        assert v6.socket.ipv6
        assert not v4.socket.ipv6
    finally:
        v6.close()
        v4.close()
