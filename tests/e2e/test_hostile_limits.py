"""Hostile peers that hurt the server before 2026-11-28 (a hostile-peer audit), each now bounded.

- A peer claiming the routing id libzmq would give the next anonymous peer (0x00 + a 32-bit
  counter) aborted the server in a libzmq assertion: the counter started at 0x6b8b4567 in every
  process (an unseeded rand()) and the stats showed it. Now seeded from the OS
  (router_socket._seed_routing_ids) and shown only as a keyed hash (server/peer_names.py).
- A peer asking for stats and reading none made the server hold a reply per request (257 MiB).
- Hellos and reconnects in a loop logged a line each; a metrics connection reset logged a
  traceback each.
"""

from __future__ import annotations

import socket
import struct
import time

import msgpack
import pytest
import zmq
from batchwire import wire
from batchwire.wire.raw_client import RawClient
from rawclient import wait_for
from serverproc import free_tcp_endpoint, running_server, small_server_args

pytestmark = pytest.mark.timeout(120)


def _hello(**fields):
    m = {"v": 2, "type": "hello", "split": "train", "rank": 0, "world_size": 1, "epoch": 0}
    m.update({"batches": [], "session": 1, "job": "flood"}, **fields)
    return msgpack.packb(m)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def test_a_peer_repeating_hellos_or_reconnecting_cannot_flood_the_log():
    """2000 hellos on one connection, then 300 connect-hello-vanish cycles: the log must
    not take a line per message (a peer must not fill the disk)."""
    with running_server(*small_server_args(seed=6)) as srv:
        before = srv.log().count("\n")
        sock = srv.dealer()
        for i in range(2000):
            sock.send(_hello(session=i))
        got = 0
        while got < 2000 and sock.poll(5000):
            sock.recv_multipart()
            got += 1
        sock.close(0)
        assert got == 2000
        for i in range(300):
            peer = srv.dealer()
            peer.send(_hello(session=i))
            assert peer.poll(5000)
            peer.close(0)
        time.sleep(1.0)  # the last disconnects reach the log
        lines = srv.log().count("\n") - before
        assert lines <= 200, f"{lines} log lines for 2300 hellos:\n{srv.log(tail_chars=600)}"


def test_a_peer_asking_for_stats_without_reading_holds_bounded_server_memory(ctx):
    """100 sessions with long job names and full loader reports make a stats reply of about
    270 KB; one peer that sends 1000 stats requests (20 bytes each) and reads nothing must
    not make the server hold 1000 replies."""
    with running_server(*small_server_args(seed=7), "--client-timeout", "120") as srv:
        figures = {f"figure_{i:02d}_" + "x" * 50: 1.0 for i in range(32)}
        clients = []
        for i in range(100):
            c = RawClient.connect(ctx, srv.endpoint, batches=(), session=i, job=f"{i:03d}" * 85)
            c.send(c.hello)
            c.credit([], stats=figures)
            clients.append(c)
        probe = srv.dealer()

        def stats_size() -> int:
            probe.send(wire.StatsRequest().pack())
            assert probe.poll(10_000)
            return len(probe.recv())

        wait_for(lambda: stats_size() > 200_000, "100 sessions with their loader reports")
        base = _rss(srv.pid)
        hog = ctx.socket(zmq.DEALER)
        hog.linger = 0
        hog.rcvhwm = 1
        hog.setsockopt(zmq.RCVBUF, 4096)
        hog.connect(srv.endpoint)
        for _ in range(1000):
            hog.send(wire.StatsRequest().pack())
        time.sleep(3)  # the server answers them all in well under a second
        grown = _rss(srv.pid) - base
        for c in clients:
            c.close()
        hog.close(0)
        probe.close(0)
        assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB held for one peer's unread stats"


def test_metrics_connections_that_hang_up_write_no_traceback_to_the_log():
    """A scanner that sends a request and resets the connection (or a scraper that gives up)
    must not cost the server's log a traceback each."""
    port = int(free_tcp_endpoint().rsplit(":", 1)[1])
    with running_server(*small_server_args(seed=8), "--metrics-port", str(port)) as srv:
        before = len(srv.log())
        for _ in range(30):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.sendall(b"GET /nope HTTP/1.0\r\n\r\n")
            c.close()  # SO_LINGER 0: a reset, before the 404 is written
        time.sleep(1.0)
        grown = srv.log()[before:]
        assert "Traceback" not in grown, f"{grown.count('Traceback')} tracebacks:\n{grown[-1500:]}"


def test_the_stats_do_not_tell_a_peer_the_name_the_next_anonymous_peer_gets(ctx):
    """libzmq names a peer that sets no routing id (every RemoteLoader) 0x00 + a 32-bit
    counter, and never checks that a peer has not claimed that name for itself: the next
    anonymous peer then trips an assertion (socket_base.cpp) that aborts the server. Before,
    the stats showed a peer its own name, so it could claim the next few (the server died at
    once). Now such names are shown as a keyed hash ("z" and 9 hex digits: two peers connected one
    after the other share nothing, not a counter's steps); a name a client chose is shown as it
    is."""
    with running_server(*small_server_args(seed=9)) as srv:
        first = RawClient.connect(ctx, srv.endpoint, batches=(), session=1, job="first")
        first.start()
        second = RawClient.connect(ctx, srv.endpoint, batches=(), session=2, job="second")
        second.start()
        chosen = RawClient.connect(
            ctx, srv.endpoint, identity=b"notebook", batches=(), session=3, job="chosen"
        )
        chosen.start()
        wait_for(lambda: len(srv.stats()["clients"]) == 3, "the three clients in the stats")
        ids = {c["job"]: c["id"] for c in srv.stats()["clients"]}
        assert ids["chosen"] == b"notebook".hex()
        first_id, second_id = ids["first"], ids["second"]
        assert len(first_id) == len(second_id) == 10 and first_id.startswith("z"), ids
        # Raw, they were the counter's next steps ("006b8b4567", "006b8b4568"): nothing shared.
        assert first_id[1:5] != second_id[1:5], ids
        for _ in range(3):  # anonymous peers still served
            honest = srv.dealer()
            honest.send(wire.StatsRequest().pack())
            answered = honest.poll(5000)
            honest.close(0)
            assert answered and srv.running, f"server gone:\n{srv.log(tail_chars=300)}"


def test_a_blind_claim_of_the_first_automatic_names_cannot_crash_the_server():
    """libzmq's automatic names start at 0x6b8b4567 in a process that never seeded rand(): a peer
    that reads nothing first claims the first 16 (a fresh server: no anonymous peer before)."""
    ctx = zmq.Context()
    try:
        with running_server(*small_server_args(seed=9)) as srv:
            claims = []
            for k in range(16):
                sock = ctx.socket(zmq.DEALER)
                sock.linger = 0
                sock.identity = b"\x00" + (0x6B8B4567 + k).to_bytes(4, "big")
                sock.connect(srv.endpoint)
                claims.append(sock)
            for sock in claims:
                sock.send(wire.StatsRequest().pack())
            for sock in claims:
                sock.poll(2000)
            for _ in range(3):
                honest = srv.dealer()
                honest.send(wire.StatsRequest().pack())
                answered = honest.poll(5000)
                honest.close(0)
                assert answered and srv.running, srv.log(tail_chars=300)
    finally:
        ctx.destroy(linger=0)
