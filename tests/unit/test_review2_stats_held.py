"""Review 2 (dc6472b): a stats reply ZeroMQ holds for a peer bounds that peer, and only while
it is held. A peer that asks and never reads gets one reply held and no more; a second peer is
answered meanwhile; and once the first peer's connection closes, libzmq frees what it held, so
an honest monitor that reconnected under the same routing id is answered again (not dropped for
ever). Real ROUTER and DEALER sockets on loopback; every wait is bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from batchwire.server.config import ServerConfig
from batchwire.server.router_socket import RouterSocket

WAIT_S = 5.0
# Larger than what the kernel's socket buffers and the peer's libzmq take in: ZeroMQ holds it.
BIG = b"s" * (24 * 1024 * 1024)


@pytest.fixture
def rs() -> Iterator[RouterSocket]:
    sock = RouterSocket(ServerConfig(bind=["tcp://127.0.0.1:*"]), None)
    yield sock
    sock.close(0)


def asking(ctx: zmq.Context, rs: RouterSocket, routing_id: bytes) -> zmq.Socket:
    """A DEALER that reads nothing, with the routing id the server knows it by. Each second
    without its request arriving, a new DEALER asks again, as a monitor would reconnect: a
    reconnection under a routing id the ROUTER has not yet let go of is refused (on a loaded
    machine, for seconds in a full suite)."""
    deadline = time.monotonic() + 3 * WAIT_S
    while True:
        peer = ctx.socket(zmq.DEALER)
        peer.linger, peer.routing_id, peer.rcvhwm = 0, routing_id, 1
        peer.connect(rs.endpoints[0])
        peer.send(b"stats?")
        if rs.router.poll(1000):
            break
        peer.close(0)
        assert time.monotonic() < deadline, "the request never arrived"
    received = list(rs.receive())
    assert received and {identity for identity, _ in received} == {routing_id}
    return peer


def replies_until_held(rs: RouterSocket, identity: bytes) -> int:
    """Answer ``identity`` as the loop does, each time it may be, until ZeroMQ holds one."""
    sent, deadline = 0, time.monotonic() + WAIT_S
    while rs.may_reply_stats(identity):
        assert time.monotonic() < deadline, f"{sent} replies sent and none held"
        rs.reply_stats(identity, BIG)
        sent += 1
        time.sleep(0.05)
    return sent


def test_a_peer_that_never_reads_holds_one_reply_until_its_connection_closes(ctx, rs) -> None:
    monitor = b"honest-monitor"
    peer = asking(ctx, rs, monitor)
    # Answered until ZeroMQ holds one, then no more: no second reply queued behind it. (How
    # long it stays held depends on the peer's libzmq and the machine's load: not asserted.)
    assert replies_until_held(rs, monitor) >= 1

    other = asking(ctx, rs, b"another-peer")  # one peer's held reply bounds that peer only
    assert rs.may_reply_stats(b"another-peer")
    other.close(0)

    peer.close(0)  # gone: libzmq drops what it held, the tracker completes
    deadline = time.monotonic() + WAIT_S
    while not rs.may_reply_stats(monitor):
        assert time.monotonic() < deadline, "a closed peer's held reply was never released"
        time.sleep(0.02)
    again = asking(ctx, rs, monitor)  # the same routing id, reconnected: answered again
    assert rs.may_reply_stats(monitor)
    rs.reply_stats(monitor, b"small")
    assert again.poll(int(WAIT_S * 1000)) and again.recv() == b"small"
    again.close(0)
