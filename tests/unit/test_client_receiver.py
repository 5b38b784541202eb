"""The client's shell (client/receiver.py) carrying out its core's actions on a real socket.

An in-process ROUTER on a loopback port plays the server's side of the wire (as in
test_stats_client.py): it welcomes each hello and answers each credit with that batch's frames,
and records every message the receiver sends. What is checked is the carry-out: the hello and
credits the core asked for go out, each credit carrying the loader's report that `get` was
handed (data, not a callback), and the batches come back in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import wirefakes
import zmq
from batchwire import wire
from batchwire.client.fleet import FleetConfig
from batchwire.client.receiver import BatchReceiver
from batchwire.client.staging import BatchFormat, CpuStager

NUM_BATCHES = 6


class PlayedServer:
    """A ROUTER answering the wire: welcome per hello, a batch per credited index."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.endpoint = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.received: list[wire.ClientMessage] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        session = epoch = 0
        while not self._stop.is_set():
            if not self.router.poll(10):
                continue
            identity, frame = self.router.recv_multipart()
            msg = wire.decode_client_message(frame)
            self.received.append(msg)
            if isinstance(msg, wire.Hello):
                session, epoch = msg.session, msg.epoch
                welcome = wirefakes.welcome(session, NUM_BATCHES)
                self.router.send_multipart([identity, welcome.pack()])
                batches = msg.batches
            elif isinstance(msg, wire.Credit):
                batches = msg.batches
            else:
                continue
            for k in batches:
                header = wirefakes.header(session, k, epoch)
                images = np.full(wirefakes.NBYTES, k, dtype=np.uint8).tobytes()
                labels = np.array([k, k], dtype="<i8").tobytes()
                self.router.send_multipart([identity, header.pack(), images, labels])

    def credits(self) -> list[wire.Credit]:
        return [m for m in list(self.received) if isinstance(m, wire.Credit)]

    @contextmanager
    def running(self) -> Iterator[PlayedServer]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def cpu_stager(welcome: wire.Welcome, slots: int) -> CpuStager:
    fmt = BatchFormat(
        spec=welcome.spec,
        normalize=False,
        out_dtype=torch.float32,
        mean=tuple(welcome.mean),
        std=tuple(welcome.std),
        label_width=welcome.label_width,
    )
    return CpuStager(fmt, 0)


def test_credits_carry_the_report_handed_to_get_and_batches_come_in_order() -> None:
    ctx = zmq.Context()
    server = PlayedServer(ctx)
    # speculate=False: one epoch, no next-epoch hello at its end.
    config = FleetConfig("train", 0, 1, prefetch=2, timeout=10.0, heartbeat=1.0, speculate=False)
    receiver = BatchReceiver([server.endpoint], config, make_stager=cpu_stager)
    try:
        with server.running():
            receiver.start(0, 0)
            assert receiver.wait_welcome().num_batches == NUM_BATCHES
            reports = [{"images_per_s": float(k)} for k in range(NUM_BATCHES)]
            got = []
            for k in range(NUM_BATCHES):
                arrived = receiver.get(k, reports[k])
                receiver.hand_out(arrived)
                got.append(int(arrived.staged.labels[0]))
                receiver.release(arrived.staged)
            deadline = time.monotonic() + 5.0
            while len(server.credits()) < NUM_BATCHES - 2 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        receiver.close()
        ctx.destroy(linger=0)
    assert got == list(range(NUM_BATCHES))
    (hello,) = [m for m in server.received if isinstance(m, wire.Hello)]
    assert (hello.split, hello.epoch, hello.batches) == ("train", 0, ())
    credits = server.credits()
    # The welcome's credits come before any get: no report yet. Each get's hand-out then asks
    # for one more batch (prefetch 2), carrying the report that get was handed.
    first, *later = credits
    assert first.batches == (0, 1) and first.stats is None
    assert [c.batches for c in later] == [(k + 2,) for k in range(NUM_BATCHES - 2)]
    assert [c.stats for c in later] == [reports[k] for k in range(NUM_BATCHES - 2)]
