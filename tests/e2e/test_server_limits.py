"""Hostile load on a real pipeline-server: its memory, descriptors and replies stay bounded.

- batch buffers never exceed --max-buffers whatever the clients do, a client holding none is
  served while others hold what they may, and the memory returns once the clients leave; the
  server's peak resident size stays under the whole expected figure its start line states;
- bare TCP connections that say nothing are closed after --handshake-timeout, so 300 of them
  do not take a server limited to 256 descriptors down; a real client is served after;
- a hello beyond --max-clients gets an error naming the limit;
- the stats reply lists the most recently active clients and sums the rest, so it stays small
  with hundreds of clients (Prometheus and pipeline-monitor too);
- an ipc:// path another server listens on is refused at start; a stale one is replaced.

Everything runs against real server processes over real sockets; waits poll a probe.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from batchwire import wire
from batchwire.pipeline.synthetic import default_dataset
from batchwire.server.budget import BufferBudget
from batchwire.server.bufpool import BufferPool
from batchwire.wire import BatchSpec
from batchwire.wire.raw_client import RawClient
from promtext import parse_metrics
from rawclient import SERVER_ARGS, wait_for
from serverproc import ServerProcess, running_server

_MONITOR = Path(sys.executable).parent / "pipeline-monitor"
MONITOR = [str(_MONITOR)] if _MONITOR.exists() else [sys.executable, "-m", "batchwire.monitor.cli"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident size so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ buffer pool


def test_pool_never_exceeds_its_cap_keeps_a_reserve_and_frees_idle_chunks() -> None:
    spec = BatchSpec(batch_size=2, height=4, width=4, dtype="uint8")
    budget = BufferBudget(max_buffers=10, reserve=2)  # who may borrow (the core's rule)
    pool = BufferPool(spec, max_buffers=10, chunk=4, pin=False)  # the memory itself

    def lend():
        budget.lend()
        return pool.acquire()

    assert budget.shared == 8 and budget.share(3) == 2 and budget.share(100) == 1
    slots = []
    while budget.may_lend(holding=len(slots), share=8):
        slots.append(lend())
    assert len(slots) == 8 == pool.held == budget.held  # the shared part, not the reserve
    assert budget.may_lend(holding=0, share=1)  # a client holding none takes from the reserve
    slots += [lend(), lend()]
    assert pool.capacity == 10 and not budget.may_lend(holding=0, share=1)
    with pytest.raises(RuntimeError, match="all 10"):
        pool.acquire()
    with pytest.raises(RuntimeError, match="all 10"):
        budget.lend()
    assert pool.trim(keep=0) == 0  # nothing is idle
    for slot in slots[4:]:
        pool.release(slot)
    assert pool.trim(keep=0) == 6  # the chunks of 4 and 2 whose buffers are all free
    assert pool.capacity == 4 and pool.held == 4
    for slot in slots[:4]:
        pool.release(slot)
    assert pool.trim(keep=4) == 0 and pool.trim(keep=0) == 4 and pool.capacity == 0


def _stalled(ctx: zmq.Context, endpoint: str, n: int, epoch: int) -> RawClient:
    """A client that asks for many batches and takes none: its socket fills, so what the server
    sent stays with ZeroMQ and holds the buffer (until the heartbeat gives up on it)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvhwm = 1
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return RawClient(sock, rank=n, world_size=8, epoch=epoch, batches=tuple(range(6)), session=n)


def _pool_args(max_buffers: int) -> tuple[str, ...]:
    """Batches of 3 MiB (4 x 3 x 512 x 512 uint8): far more than a socket buffer takes."""
    root = str(default_dataset().val_root)
    return (
        *("--train", root, "--batch-size", "4", "--image-size", "512", "--workers", "1"),
        *("--output-dtype", "uint8", "--prefetch-depth", "2", "--producers", "2"),
        *("--max-buffers", str(max_buffers)),
    )


BATCH_BYTES = 4 * 3 * 512 * 512


def test_buffers_stay_under_the_cap_a_new_client_is_served_and_memory_returns(ctx) -> None:
    """Six clients asking for 6 batches each and taking none, with --max-buffers 8: never more
    than 8 buffers, each stalled client holds its share, a seventh client is served at once
    from what is left, and once they all leave the buffers are freed and the resident size
    falls back."""
    with running_server(*_pool_args(8)) as srv:
        assert "host memory bound for batches: 8 buffers (--max-buffers) x 3.0 MiB" in srv.log()
        warm = RawClient.connect(ctx, srv.endpoint, rank=6, world_size=8, epoch=2)
        warm.start()
        warm.batch()  # every code path has run once: its pages count from here on
        warm.close()
        wait_for(lambda: srv.stats()["buffers"]["allocated"] == 0, "the buffers to be freed", 20)
        base = rss_bytes(srv.pid)
        stalled = [_stalled(ctx, srv.endpoint, n, epoch=3) for n in range(6)]
        fresh = RawClient.connect(ctx, srv.endpoint, rank=7, world_size=8, epoch=3, session=9)
        peak_rss, peak_held = 0, 0

        def held() -> int:
            nonlocal peak_rss, peak_held
            buffers = srv.stats()["buffers"]
            assert buffers["allocated"] <= 8 and buffers["held"] <= 8, buffers
            peak_held = max(peak_held, buffers["held"])
            peak_rss = max(peak_rss, rss_bytes(srv.pid))
            return buffers["held"]

        try:
            for c in stalled:
                c.send(c.hello)
            wait_for(lambda: held() >= 6, "the stalled clients to hold a buffer each", 20)
            fresh.start()
            assert [fresh.batch(10)[0].batch_index for _ in range(2)] == [0, 1]
            for _ in range(10):
                held()
            assert peak_rss - base < 8 * BATCH_BYTES + 16 * 2**20, (peak_rss - base) / 2**20
        finally:
            for c in (*stalled, fresh):
                c.close()
        wait_for(lambda: srv.stats()["buffers"]["allocated"] == 0, "the buffers to be freed", 20)
        after = rss_bytes(srv.pid)
        assert peak_held >= 6
        assert after - base < 2 * BATCH_BYTES, (base / 2**20, peak_rss / 2**20, after / 2**20)
        # The whole expected resident memory said at start holds the loaded server's peak.
        stated = re.search(r"expected resident memory: up to about (\d+) MiB", srv.log())
        assert stated is not None, srv.log()
        assert peak_rss_bytes(srv.pid) <= int(stated.group(1)) * 2**20, (
            peak_rss_bytes(srv.pid) / 2**20,
            stated.group(0),
        )


def test_clients_that_take_nothing_are_cut_after_the_stall_timeout(ctx) -> None:
    """More stalled clients than buffers: everything is held, so a new client waits until
    --stall-timeout (2 s) closes the stalled connections, then it is served."""
    with running_server(*_pool_args(2), "--stall-timeout", "2") as srv:
        stalled = [_stalled(ctx, srv.endpoint, n, epoch=4) for n in range(3)]
        fresh = RawClient.connect(ctx, srv.endpoint, rank=7, world_size=8, epoch=4, session=9)
        try:
            for c in stalled:
                c.send(c.hello)
            wait_for(lambda: srv.stats()["buffers"]["held"] == 2, "the pool to be taken", 20)
            started = time.monotonic()
            fresh.start()
            assert [fresh.batch(20)[0].batch_index for _ in range(2)] == [0, 1]
            assert time.monotonic() - started < 15
            assert "disconnected" in srv.log()
        finally:
            for c in (*stalled, fresh):
                c.close()


# ------------------------------------------------------------------------------ connections

_LIMITED = (
    "import resource, runpy, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "sys.argv = ['pipeline-server', *sys.argv[2:]]; "
    "runpy.run_module('batchwire.server.cli', run_name='__main__')"
)


class LimitedServer(ServerProcess):
    """A server process started under RLIMIT_NOFILE = ``nofile`` (soft and hard)."""

    nofile = 256

    @property
    def command(self) -> list[str]:
        return [
            sys.executable,
            "-c",
            _LIMITED,
            str(self.nofile),
            "--bind",
            self.endpoint,
            *self.args,
        ]


@contextmanager
def limited_server(*args: str, nofile: int) -> Iterator[LimitedServer]:
    with tempfile.TemporaryDirectory(prefix="bw-limited-") as tmp:
        srv = LimitedServer(args, None, None, 120.0, 10.0, Path(tmp))
        srv.nofile = nofile
        try:
            srv.start()
            yield srv
            srv.stop()
        finally:
            srv.kill()
            srv.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Has the server closed this (non-blocking) connection? Its greeting bytes are skipped."""
    try:
        while sock.recv(4096):
            pass
        return True  # end of stream
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


@pytest.mark.timeout(120)
def test_silent_connections_are_closed_and_cannot_use_up_descriptors(ctx) -> None:
    """300 TCP connections that send nothing, against a server limited to 256 descriptors:
    libzmq closes each after --handshake-timeout (1 s here), the accepts that failed meanwhile
    are warned about, and then a real client is served."""
    with limited_server(*SERVER_ARGS, "--handshake-timeout", "1", nofile=256) as srv:
        host, port = srv.endpoint[len("tcp://") :].rsplit(":", 1)
        socks = []
        try:
            for _ in range(300):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex((host, int(port)))  # EINPROGRESS, or queued in the backlog
                socks.append(s)
            wait_for(
                lambda: all(_closed_by_peer(s) for s in socks),
                "the server to close all 300 silent connections",
                60,
            )
        finally:
            for s in socks:
                s.close()
        client = RawClient.connect(ctx, srv.endpoint)
        client.start(timeout=20)
        assert [client.batch()[0].batch_index for _ in range(2)] == [0, 1]
        assert srv.stats()["connections"] <= 3  # this client, the stats request, maybe one more
        client.close()
        log = srv.log()
        assert "cannot accept connections: Too many open files" in log, log  # it was exhausted
        assert "Traceback" not in log, log


def test_a_hello_beyond_max_clients_is_refused_with_the_limit(ctx) -> None:
    with running_server(*SERVER_ARGS, "--max-clients", "2") as srv:
        a, b, c = (
            RawClient.connect(ctx, srv.endpoint, rank=r, world_size=3, batches=(), session=r + 1)
            for r in range(3)
        )
        try:
            a.start()
            b.start()
            c.send(c.hello)
            msg, _ = c.recv()
            assert isinstance(msg, wire.ErrorReply), msg
            assert "this server serves at most 2 clients (--max-clients)" in msg.message
            b.start(epoch=1)  # a client already served may replace its stream at the limit
            b.bye()
            wait_for(lambda: len(srv.stats()["clients"]) == 1, "the bye to free a place")
            c.start()
        finally:
            for x in (a, b, c):
                x.close()


# ------------------------------------------------------------------------------ stats size

_LOADER = {f"figure_{i:02d}_" + "x" * 52: float(i) for i in range(32)}  # 32 keys of 64 chars


def test_stats_stay_small_with_hundreds_of_clients(ctx) -> None:
    """300 clients with the longest identities and loader maps the server keeps, then 600
    short-lived ones: the stats reply lists 256 clients and sums the rest, well under the
    8 MiB frame limit; Prometheus and pipeline-monitor work."""
    ctx.set(zmq.MAX_SOCKETS, 4096)
    port = free_port()
    args = (*SERVER_ARGS, "--max-clients", "1000", "--metrics-port", str(port))
    with running_server(*args) as srv:
        clients = []
        try:
            for n in range(300):
                identity = n.to_bytes(2, "big") + b"\xfe" * 253
                # Each its own job: Prometheus labels a client by (train_job, split, rank), so
                # distinct jobs make 256 distinct per-client series.
                c = RawClient.connect(
                    ctx, srv.endpoint, identity=identity, batches=(), session=1, job=f"job{n}"
                )
                c.send(c.hello)
                clients.append(c)
            for c in clients:
                c.start()
                c.credit(stats=_LOADER)
            for _wave in range(6):  # short-lived clients: hello, welcome, gone
                brief = [
                    RawClient.connect(ctx, srv.endpoint, batches=(), session=2) for _ in range(100)
                ]
                for c in brief:
                    c.send(c.hello)
                for c in brief:
                    c.start()
                    c.close()
            wait_for(
                lambda: srv.stats()["clients_unlisted"]["count"] == 300 - 256,
                "the short-lived clients to be dropped",
            )
            stats = clients[0].stats()
            reply = wire.StatsReply(stats).pack()
            assert len(stats.clients) == 256
            assert stats.clients[0].id == clients[0].sock.identity.hex()  # latest first
            assert all(len(r.loader.to_map()) == 32 for r in stats.clients if r.loader)
            # 256 rows of the largest kind: about 1 MB, an eighth of the frame limit.
            assert len(reply) < wire.MAX_SERVER_FRAME_BYTES / 4, len(reply)

            def scrape() -> dict:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                    return parse_metrics(r.read().decode())

            # A short-lived client's hello still queued when it closed makes a session that the
            # disconnect then drops: wait for the count to settle, as for the stats reply.
            wait_for(lambda: scrape()["batchwire_clients"] == 300, "the client count to settle")
            metrics = scrape()
            assert metrics["batchwire_clients"] == 300
            assert metrics["batchwire_clients_unlisted"] == 44
            rows = [k for k in metrics if k.startswith("batchwire_client_credits{")]
            assert len(rows) == 256

            t0 = time.monotonic()
            out = subprocess.run(
                [*MONITOR, srv.endpoint, "--once", "--no-color"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert out.returncode == 0, out.stderr
            assert "clients" in out.stdout and time.monotonic() - t0 < 20
        finally:
            for c in clients:
                c.close()


# ------------------------------------------------------------------------------ ipc paths


def test_a_live_ipc_path_is_refused_and_a_stale_one_is_replaced(tmp_path) -> None:
    with running_server(*SERVER_ARGS, endpoint="ipc") as first:
        path = first.endpoint[len("ipc://") :]
        second = subprocess.run(
            [sys.executable, "-m", "batchwire.server", "--bind", first.endpoint, *SERVER_ARGS],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2, second.stderr
        assert f"another server is listening on {first.endpoint}" in second.stderr
        assert first.stats()["uptime_s"] > 0  # the first one still answers on its path
        first.kill()  # SIGKILL: the socket file stays, nobody listens on it
        assert os.path.exists(path)
        first.start()  # the same path again: the stale file is replaced
        assert first.stats()["uptime_s"] >= 0

    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    refused = subprocess.run(
        [sys.executable, "-m", "batchwire.server", "--bind", f"ipc://{precious}", *SERVER_ARGS],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "is not a socket" in refused.stderr, refused.stderr
    assert precious.read_text() == "keep me"
