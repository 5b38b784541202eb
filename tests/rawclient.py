"""A trainer reduced to the wire, for tests that watch a live pipeline-server from outside.

    from rawclient import SERVER_ARGS, RawTrainer, wait_for

`RawTrainer` is the wire's `RawClient` speaking the protocol by hand (hello, credits carrying a real
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
from batchwire.wire.raw_client import RawClient

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


class RawTrainer(RawClient):
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
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = identity
        sock.connect(endpoint)
        super().__init__(sock, split=split, batches=tuple(range(prefetch)))
        self.identity = identity
        self.prefetch = prefetch
        self.loader_stats = LoaderStats()
        self._next = prefetch  # the next batch index to ask for

    @property
    def id(self) -> str:
        return self.identity.hex()

    def credit(self, n: int) -> None:  # type: ignore[override]
        """Ask for the next ``n`` batches of the epoch, with the loader's stats."""
        batches = range(self._next, self._next + n)
        self._next += n
        super().credit(batches, stats=self.loader_stats.as_dict())

    def next_batch(self, timeout: float = 60.0) -> wire.BatchHeader:
        started = time.monotonic()
        header, _, _ = self.batch(timeout)
        self.loader_stats.record_wait(time.monotonic() - started)
        self.loader_stats.record_batch(header.batch_size)
        return header

    def consume(self, n: int) -> None:
        """Read ``n`` batches, giving one credit back for each, as a training loop would."""
        for _ in range(n):
            self.next_batch()
            self.credit(1)

    def leave(self) -> None:
        self.bye()
        self.sock.close()
