"""A trainer reduced to the wire, for tests that watch a live pipeline-server from outside.

    from rawclient import SERVER_ARGS, RawTrainer, wait_for

`RawTrainer` is a DEALER socket speaking protocol v1 by hand (hello, credits carrying a real
`LoaderStats`, batches read or not), so a test controls exactly when a trainer reads and when it
stops. `wait_for` polls a probe with a deadline, never a bare sleep. `SERVER_ARGS` is a small,
fast server (4 images of 32 px a batch, one decode thread, `PREFETCH_DEPTH` batches of
work-ahead per client).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import zmq
from batchwire import wire
from batchwire.client.loader_stats import LoaderStats

PREFETCH_DEPTH = 3  # the server's work-ahead per client = each ready queue's capacity
SERVER_ARGS = (
    "--batch-size",
    "4",
    "--image-size",
    "32",
    "--workers",
    "1",
    "--prefetch-depth",
    str(PREFETCH_DEPTH),
)
T = TypeVar("T")


def wait_for(probe: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class RawTrainer:
    """A trainer reduced to the wire: hello, credits carrying LoaderStats, batches read or not."""

    def __init__(
        self,
        endpoint: str,
        identity: bytes,
        ctx: zmq.Context,
        *,
        split: str = "train",
        prefetch: int = 2,
    ) -> None:
        self.identity = identity
        self.split = split
        self.prefetch = prefetch
        self.loader_stats = LoaderStats()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.identity = identity
        self.sock.connect(endpoint)

    @property
    def id(self) -> str:
        return self.identity.hex()

    def _recv(self, timeout: float) -> list[bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"trainer {self.id}: nothing from the server in {timeout}s")
        return self.sock.recv_multipart()

    def hello(self, timeout: float = 60.0) -> wire.Welcome:
        self.sock.send(
            wire.Hello(
                split=self.split,
                rank=0,
                world_size=1,
                epoch=0,
                start_batch=0,
                prefetch=self.prefetch,
                shard=(0, 1),
                session=1,
            ).pack()
        )
        while True:
            msg = wire.decode_server_message(self._recv(timeout)[0])
            assert not isinstance(msg, wire.ErrorReply), msg.message
            if isinstance(msg, wire.Welcome):
                return msg

    def credit(self, n: int) -> None:
        self.sock.send(wire.Credit(n=n, stats=self.loader_stats.as_dict()).pack())

    def next_batch(self, timeout: float = 60.0) -> wire.BatchHeader:
        started = time.monotonic()
        while True:
            frames = self._recv(timeout)
            msg = wire.decode_server_message(frames[0])
            if isinstance(msg, wire.BatchHeader):
                self.loader_stats.record_wait(time.monotonic() - started)
                self.loader_stats.record_batch(msg.batch_size)
                return msg

    def consume(self, n: int) -> None:
        """Read ``n`` batches, giving one credit back for each, as a training loop would."""
        for _ in range(n):
            self.next_batch()
            self.credit(1)

    def leave(self) -> None:
        self.sock.send(wire.Bye().pack())
        self.sock.close()
