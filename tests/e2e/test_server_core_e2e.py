"""The server core's rules, end to end: a real pipeline-server process over loopback.

- a transient failure (the server out of file descriptors while reading) is replied with
  reason "transient" and the session it concerns, and the same client is served once it asks
  again in a new session;
- a hello that asks for nothing, kept alive with empty credits, holds no world size;
- a client that stops taking its batches mid-transfer loses its session (world size, queued
  buffers) within seconds, long before --stall-timeout closes its connection;
- clients that never read and clients that say hello and vanish do not starve a trainer.

Each test takes seconds; waits poll a probe, never a bare sleep.
"""

from __future__ import annotations

import os
import resource
import socket
import time

import pytest
import zmq
from batchwire import wire
from batchwire.pipeline.synthetic import default_dataset
from batchwire.wire.raw_client import RawClient
from rawclient import SERVER_ARGS, RawTrainer, wait_for
from serverproc import running_server

pytestmark = pytest.mark.timeout(90)

# Batches of 3 MiB (4 x 3 x 512 x 512 uint8): far more than a stalled socket's buffers take.
BIG = (
    *("--train", str(default_dataset().val_root), "--batch-size", "4", "--image-size", "512"),
    *("--workers", "1", "--output-dtype", "uint8", "--prefetch-depth", "2", "--producers", "2"),
)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _stalled(ctx: zmq.Context, endpoint: str, identity: bytes, **hello) -> RawClient:
    """A client whose socket takes (almost) nothing: a stopped process, as the server sees it."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = identity
    sock.rcvhwm = 1
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return RawClient(sock, **hello)


def test_a_transient_failure_carries_its_session_and_the_client_is_served_after(ctx) -> None:
    """The server's descriptors run out while a batch is read: after its retries (~1 s) the
    reply says "transient" and names the session; with descriptors back, the client's next
    session is served. Nothing about the failure ends the client's run."""
    with running_server(*SERVER_ARGS) as srv:
        client = RawTrainer(srv.endpoint, b"trainer", ctx, prefetch=1)
        client.start()
        client.next_batch()  # batch 0: the epoch's order is planned, every module imported
        session = client.hello.session
        soft, hard = resource.prlimit(srv.pid, resource.RLIMIT_NOFILE)
        bare: list[socket.socket] = []
        try:
            # No descriptor left: the limit at what is open, and bare connections take any
            # that closes meanwhile (libzmq accepts them until accepting fails).
            resource.prlimit(srv.pid, resource.RLIMIT_NOFILE, (_open_fds(srv.pid) + 2, hard))
            host, port = srv.endpoint[len("tcp://") :].rsplit(":", 1)
            for _ in range(6):
                bare.append(socket.create_connection((host, int(port))))
            wait_for(lambda: "cannot accept connections" in srv.log(), "accepts to fail", 20)
            client.credit(1)  # batch 1: its files cannot be opened
            msg, _ = client.recv(timeout=20)
            assert isinstance(msg, wire.ErrorReply), msg
            assert (msg.reason, msg.session) == ("transient", session), msg
        finally:
            resource.prlimit(srv.pid, resource.RLIMIT_NOFILE, (soft, hard))
            for s in bare:
                s.close()
        welcome = client.start(session=session + 1, batches=(1, 2))
        assert welcome.session == session + 1
        heads = [client.next_batch() for _ in range(2)]
        assert [(h.session, h.batch_index) for h in heads] == [(session + 1, 1), (session + 1, 2)]
        client.leave()
        assert "TransientReadError" in srv.log()


def test_a_hello_that_asks_for_nothing_holds_no_world_size(ctx) -> None:
    """An anonymous client at world size 7 that asks for no batch, kept up with empty credits,
    cannot keep a real job (the default job name too) off the split; a client that took a
    batch still holds its world size."""
    with running_server(*SERVER_ARGS) as srv:
        anon = RawClient.connect(ctx, srv.endpoint, world_size=7, batches=(), session=1)
        anon.start()
        for _ in range(3):
            anon.credit(stats={"images_per_s": 0.0})
            time.sleep(0.2)
        job = RawClient.connect(ctx, srv.endpoint, world_size=2, rank=0, session=2)
        assert job.start().session == 2  # not refused
        assert [job.batch()[0].batch_index for _ in range(2)] == [0, 1]
        anon.credit()
        other = RawClient.connect(ctx, srv.endpoint, world_size=7, rank=1, session=3)
        other.send(other.hello)
        msg, _ = other.recv()
        assert isinstance(msg, wire.ErrorReply) and "world_size mismatch" in msg.message, msg
        assert msg.session == 3
        for c in (anon, job, other):
            c.close()


def test_a_client_stalled_mid_transfer_loses_its_session_within_seconds(ctx) -> None:
    """A client with 3 MiB batches in transit that takes nothing more: within a few seconds
    (not the 30 s of --stall-timeout) its session is dropped, its queued buffers come back and
    its world size is free; only what ZeroMQ holds for it (at most the depth) stays held."""
    with running_server(*BIG) as srv:
        frozen = _stalled(ctx, srv.endpoint, b"frozen", world_size=8, batches=tuple(range(6)))
        frozen.start()
        wait_for(lambda: srv.stats()["clients"], "the frozen client's session")
        t0 = time.monotonic()
        wait_for(lambda: not srv.stats()["clients"], "the stalled session to be dropped", 15)
        dropped_after = time.monotonic() - t0
        assert dropped_after < 10, dropped_after
        held = wait_for(
            lambda: (b := srv.stats()["buffers"])["held"] <= 2 and b, "queued buffers back", 10
        )
        assert held["held"] <= 2, held  # at most --prefetch-depth, with ZeroMQ
        job = RawClient.connect(ctx, srv.endpoint, world_size=1, session=5, batches=(0,))
        assert job.start().session == 5  # the world size is free
        assert job.batch(20)[0].batch_index == 0
        log = srv.log()
        assert "took none of its" in log, log
        for c in (frozen, job):
            c.close()


def test_clients_that_never_read_or_vanish_do_not_starve_a_trainer(ctx) -> None:
    """5 clients that never read (3 MiB batches stuck in ZeroMQ, each pinning up to the depth
    until --stall-timeout) and 20 that say hello and vanish, with buffers scarce
    (--max-buffers 16): a trainer that reads is served throughout, and the cap holds."""
    with running_server(*BIG, "--max-buffers", "16") as srv:
        stuck = [
            _stalled(ctx, srv.endpoint, b"stuck-%d" % i, rank=i, world_size=16, job="x")
            for i in range(5)
        ]
        for c in stuck:
            c.send(c.hello)
        trainer = RawTrainer(srv.endpoint, b"trainer", ctx, prefetch=2)
        trainer.start()
        for _ in range(4):
            for i in range(5):
                gone = RawClient.connect(ctx, srv.endpoint, rank=10 + i, world_size=16, job="x")
                gone.send(gone.hello)
                gone.sock.linger = 500  # the hello leaves before the socket goes
                gone.sock.close()
            trainer.consume(3)
            buffers = srv.stats()["buffers"]
            assert buffers["held"] <= 16 and buffers["allocated"] <= 16, buffers
        assert trainer.loader_stats.as_dict()  # 12 batches read
        trainer.leave()
        for c in stuck:
            c.close()
