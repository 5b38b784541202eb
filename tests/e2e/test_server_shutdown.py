"""SIGTERM with --drain-timeout 0 (SIGINT always) stops a real pipeline-server within 2 s, exit
code 0, whatever its threads are doing; with a drain (the default), the drain is bounded by
--drain-timeout whatever its clients and producers do (tests/e2e/test_health.py and
test_drain.py show a drain that finishes).

Producers busy with huge images (a list file of one 6000 x 6000 PNG, one decode thread: a batch
takes seconds) are not waited for beyond a short grace: they are daemon threads, and the
decoder they use is not closed under them. Clients are told (`shutdown`) first.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from batchwire import wire
from batchwire.wire.raw_client import RawClient
from rawclient import wait_for
from serverproc import running_server

cv2 = pytest.importorskip("cv2")


@pytest.fixture(scope="module")
def huge_images(tmp_path_factory) -> Path:
    """A list file naming one 36-megapixel PNG 32 times (decoding one takes ~0.2 s)."""
    folder = tmp_path_factory.mktemp("huge")
    side = 6000
    ramp = np.arange(side, dtype=np.uint16)
    image = np.empty((side, side, 3), np.uint8)
    image[..., 0] = (ramp[None, :] * 255 // side).astype(np.uint8)
    image[..., 1] = (ramp[:, None] * 255 // side).astype(np.uint8)
    image[..., 2] = 128
    assert cv2.imwrite(str(folder / "huge.png"), image, [cv2.IMWRITE_PNG_COMPRESSION, 1])
    listing = folder / "list.txt"
    listing.write_text("".join(f"huge.png {i % 2}\n" for i in range(32)))
    return listing


def _busy(srv) -> bool:
    depth = {s["name"]: s["depth"] for s in srv.stats()["stages"]}
    return depth["decode"] + depth["augment"] >= 1


@pytest.mark.timeout(120)
def test_sigterm_exits_within_2s_while_producers_are_busy(huge_images, ctx) -> None:
    args = (
        *("--train", str(huge_images), "--batch-size", "16", "--image-size", "32"),
        *("--workers", "1", "--producers", "2", "--metrics-port", "0"),
        *("--drain-timeout", "0"),
    )
    with running_server(*args) as srv:
        client = RawClient.connect(ctx, srv.endpoint, batches=(0, 1))
        client.start()
        wait_for(lambda: _busy(srv), "a producer to be decoding", 30)
        started = time.monotonic()
        srv._proc.send_signal(signal.SIGTERM)
        code = srv._proc.wait(10)
        elapsed = time.monotonic() - started
        assert code == 0, srv.log()
        assert elapsed < 2.0, (elapsed, srv.log())
        msg, _ = client.recv(5)  # told before the sockets closed
        assert isinstance(msg, wire.Shutdown), msg
        assert "producers still busy at shutdown" in srv.log()
        client.close()


@pytest.mark.timeout(120)
def test_sigterm_exits_within_2s_with_a_client_that_reads_nothing(ctx) -> None:
    """Sent batches stuck in ZeroMQ for a peer that reads nothing do not hold the exit up."""
    from batchwire.pipeline.synthetic import default_dataset

    root = str(default_dataset().val_root)
    args = ("--train", root, "--batch-size", "4", "--image-size", "512", "--workers", "1")
    with running_server(*args, "--output-dtype", "uint8", "--drain-timeout", "0") as srv:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvhwm = 1
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(srv.endpoint)
        stalled = RawClient(sock, batches=tuple(range(8)))
        stalled.send(stalled.hello)
        wait_for(
            lambda: any(r["in_flight"] for r in srv.stats()["clients"]),
            "a batch stuck in flight",
            30,
        )
        started = time.monotonic()
        srv._proc.send_signal(signal.SIGTERM)
        code = srv._proc.wait(10)
        assert code == 0 and time.monotonic() - started < 2.0, srv.log()
        stalled.close()


@pytest.mark.timeout(120)
def test_a_drain_is_bounded_by_drain_timeout_while_producers_are_busy(huge_images, ctx) -> None:
    """Producers that take seconds a batch do not stretch the drain past --drain-timeout: the
    clients are told at its end (what was not sent moves to other servers) and the process
    exits 0 within --drain-timeout + 2 s."""
    args = (
        *("--train", str(huge_images), "--batch-size", "16", "--image-size", "32"),
        *("--workers", "1", "--producers", "2", "--drain-timeout", "0.5"),
    )
    with running_server(*args) as srv:
        client = RawClient.connect(ctx, srv.endpoint, batches=(0, 1))
        client.start()
        wait_for(lambda: _busy(srv), "a producer to be decoding", 30)
        started = time.monotonic()
        srv._proc.send_signal(signal.SIGTERM)
        code = srv._proc.wait(10)
        elapsed = time.monotonic() - started
        assert code == 0, srv.log()
        assert elapsed < 2.5, (elapsed, srv.log())
        assert "drain not done after 0.5 s" in srv.log()
        msg, _ = client.recv(5)
        assert isinstance(msg, wire.Shutdown), msg
        client.close()


@pytest.mark.timeout(120)
def test_sigint_stops_at_once_even_with_a_drain_timeout(huge_images, ctx) -> None:
    """Ctrl-C at a terminal means now: SIGINT never drains."""
    args = (
        *("--train", str(huge_images), "--batch-size", "16", "--image-size", "32"),
        *("--workers", "1", "--producers", "2", "--drain-timeout", "60"),
    )
    with running_server(*args) as srv:
        client = RawClient.connect(ctx, srv.endpoint, batches=(0, 1))
        client.start()
        wait_for(lambda: _busy(srv), "a producer to be decoding", 30)
        started = time.monotonic()
        srv._proc.send_signal(signal.SIGINT)
        assert srv._proc.wait(10) == 0, srv.log()
        assert time.monotonic() - started < 2.0, srv.log()
        assert "draining" not in srv.log()
        client.close()
