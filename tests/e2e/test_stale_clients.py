"""A client that dies does not hold the server for --client-timeout.

The server hears of a closed connection at once (socket monitor) and of a silent one through
ZMTP heartbeats (3 s), and drops that client's stream; a world-size refusal caused by a live
client names it, says when it was last heard from and when it would expire, and a loader
refused so ("busy": it clears by itself) asks again until it is served.

Real pipeline-server and real client processes (a "notebook" holding a world_size=1 stream on
the raw wire, see rawclient.py), SIGKILLed or SIGSTOPped; each test takes seconds.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
from batchwire import wire
from batchwire.client import RemoteLoader
from rawclient import SERVER_ARGS, RawTrainer, wait_for
from serverproc import running_server

TESTS = Path(__file__).resolve().parents[1]
# --client-timeout far above what the tests wait: only disconnect detection can free the split.
TIMEOUT_ARGS = (*SERVER_ARGS, "--client-timeout", "120")

_NOTEBOOK = """
import sys, time, zmq
sys.path.insert(0, sys.argv[2])
from rawclient import RawTrainer
trainer = RawTrainer(sys.argv[1], b"notebook", zmq.Context())
trainer.start()
print("welcomed", flush=True)
time.sleep(600)  # a notebook kernel idling with its loader open
"""


@contextmanager
def notebook(endpoint: str) -> Iterator[subprocess.Popen]:
    """A separate process holding a world_size=1 train stream (welcomed when this yields)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _NOTEBOOK, endpoint, str(TESTS)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "welcomed"
        yield proc
    finally:
        proc.kill()  # also ends a stopped process
        proc.wait()


def hello(sock: zmq.Socket, world_size: int, rank: int = 0, timeout: float = 10.0):
    sock.send(
        wire.Hello(
            split="train", rank=rank, world_size=world_size, epoch=0, batches=(0,),
            session=7,
        ).pack()
    )  # fmt: skip
    assert sock.poll(int(timeout * 1000)), "no reply to the hello"
    return wire.decode_server_message(sock.recv_multipart()[0])


def _clients(srv) -> list[str]:
    return [c["id"] for c in srv.stats()["clients"]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_dead_world_size_1_client_frees_the_split_within_seconds(how: str, ctx) -> None:
    """SIGKILL closes the notebook's connection (the server hears it at once); SIGSTOP leaves
    it open but unanswering (as a vanished host would), which the heartbeats catch in ~3 s.
    Then a world_size=2 job is served, long before --client-timeout."""
    with running_server(*TIMEOUT_ARGS) as srv:
        with notebook(srv.endpoint) as proc:
            assert _clients(srv) == [b"notebook".hex()]
            job = ctx.socket(zmq.DEALER)
            job.linger = 0
            job.connect(srv.endpoint)
            refused = hello(job, world_size=2)
            assert isinstance(refused, wire.ErrorReply), refused
            t0 = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
            wait_for(lambda: not _clients(srv), "the dead client's stream to be dropped", 10)
            noticed = time.monotonic() - t0
            assert noticed < (2.0 if how == "sigkill" else 8.0), noticed
            welcome = hello(job, world_size=2)
            assert isinstance(welcome, wire.Welcome), welcome
            job.close()
        log = srv.log()
    assert "client 6e6f7465626f6f6b (train rank 0/1) disconnected" in log, log


@pytest.mark.timeout(60)
def test_world_size_refusal_names_the_live_client_and_its_expiry(ctx) -> None:
    with running_server(*TIMEOUT_ARGS) as srv:
        live = RawTrainer(srv.endpoint, b"live-nb", ctx)
        live.start()
        job = ctx.socket(zmq.DEALER)
        job.linger = 0
        job.connect(srv.endpoint)
        reply = hello(job, world_size=2, rank=1)
        assert isinstance(reply, wire.ErrorReply), reply
        text = reply.message
        assert text.startswith("world_size mismatch on split 'train': this client says "), text
        assert f"world_size=2, but client {b'live-nb'.hex()} (rank 0 of world_size=1" in text
        m = re.search(r"last heard from ([\d.]+) s ago", text)
        assert m and 0 <= float(m.group(1)) < 30, text
        m = re.search(r"--client-timeout 120 s of silence, in ([\d.]+) s", text)
        assert m and 90 < float(m.group(1)) <= 120, text
        # It leaves: the split is free at once.
        live.leave()
        wait_for(lambda: not _clients(srv), "the client that said bye to be dropped", 10)
        assert isinstance(hello(job, world_size=2, rank=1), wire.Welcome)
        job.close()


@pytest.mark.timeout(60)
def test_a_new_trainer_waits_out_a_silent_rank_of_another_world_size(ctx, caplog) -> None:
    """A rank of the previous run (world size 2) hung with its connection open: the new
    trainer at world size 1 is refused "busy" and asks again, backing off, until the server
    drops the silent session (--client-timeout 3 here), then gets its batches. Before, it
    raised ServerError at once, although the refusal said it would clear."""
    with running_server(*SERVER_ARGS, "--client-timeout", "3") as srv:
        hung = ctx.socket(zmq.DEALER)
        hung.linger = 0
        hung.identity = b"hung-rank"
        hung.connect(srv.endpoint)
        reply = hello(hung, world_size=2)  # it asks for batch 0, takes it, then falls silent
        assert isinstance(reply, wire.Welcome), reply
        t0 = time.monotonic()
        with (
            caplog.at_level(logging.WARNING, logger="batchwire.client"),
            RemoteLoader(
                srv.endpoint, "train", rank=0, world_size=1, device="cpu", timeout=30.0
            ) as loader,
        ):
            images, labels = next(iter(loader))
        waited = time.monotonic() - t0
        hung.close()
    assert images.shape[0] == labels.shape[0] == 4
    assert 1.0 < waited < 20.0, waited  # served once the silent session was dropped
    said = [m for r in caplog.records if "cannot serve this loader yet" in (m := r.getMessage())]
    assert said and "world_size mismatch on split 'train'" in said[0], caplog.text
