"""A client reduced to the wire: one DEALER socket, messages sent and read by hand.

For tests that must control exactly when a trainer says what (a peer that never reads, a hello
of another world size), for the transport benchmark's bare receiver, and for poking a live
server from a shell. `batchwire.client.RemoteLoader` is the real client; this one has no
reconnects, reorder buffer or staging, on purpose.

    client = RawClient.connect(ctx, "tcp://127.0.0.1:5555", batches=(0, 1))
    welcome = client.start()
    header, images, labels = client.batch()
    client.credit([2])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq
from batchwire.wire.frames import labels_from_frame
from batchwire.wire.messages import (
    BatchHeader,
    Bye,
    Credit,
    ErrorReply,
    Hello,
    ServerMessage,
    StatsRequest,
    Welcome,
    decode_server_message,
)
from batchwire.wire.stats import ServerStats
from batchwire.wire.stats_client import receive_stats

#: A first hello's fields: rank 0 of 1, epoch 0 from its first batch, one server.
HELLO_DEFAULTS: dict[str, Any] = dict(
    split="train",
    rank=0,
    world_size=1,
    epoch=0,
    batches=(0, 1),
    session=1,
)


class RawClient:
    """One DEALER speaking the protocol by hand; ``hello`` is what `start` sends."""

    def __init__(self, sock: zmq.Socket, **hello: Any) -> None:
        self.sock = sock
        self.hello = Hello(**{**HELLO_DEFAULTS, **hello})

    @classmethod
    def connect(
        cls, ctx: zmq.Context, endpoint: str, *, identity: bytes | None = None, **hello: Any
    ) -> RawClient:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        if identity is not None:
            sock.identity = identity
        sock.connect(endpoint)
        return cls(sock, **hello)

    def send(self, msg: Any) -> None:
        self.sock.send(msg.pack())

    def recv(self, timeout: float = 20.0) -> tuple[ServerMessage, list[bytes]]:
        """The next message and the frames after it; AssertionError after ``timeout`` s."""
        if not self.sock.poll(int(timeout * 1000)):
            raise AssertionError(f"nothing from the server in {timeout}s")
        frames = self.sock.recv_multipart()
        return decode_server_message(frames[0]), frames[1:]

    def start(self, timeout: float = 60.0, **changes: Any) -> Welcome:
        """Send the hello (with ``changes``) and return the welcome; an error reply raises."""
        if changes:
            self.hello = dataclasses.replace(self.hello, **changes)
        self.send(self.hello)
        while True:
            msg, _ = self.recv(timeout)
            if isinstance(msg, ErrorReply):
                raise AssertionError(f"server refused the hello: {msg.message}")
            if isinstance(msg, Welcome) and msg.session == self.hello.session:
                return msg

    def credit(self, batches: Sequence[int] = (), stats: dict[str, Any] | None = None) -> None:
        """Ask for ``batches`` too (one credit each); ``stats`` may travel alone."""
        self.send(Credit(batches=tuple(batches), stats=stats))

    def batch(self, timeout: float = 20.0) -> tuple[BatchHeader, bytes, np.ndarray]:
        """The next batch (other messages are skipped): header, image bytes, labels."""
        while True:
            msg, rest = self.recv(timeout)
            if isinstance(msg, BatchHeader):
                images, labels = rest
                if len(images) != msg.nbytes:
                    raise AssertionError(f"images frame of {len(images)} bytes, not {msg.nbytes}")
                return msg, images, labels_from_frame(labels, msg.batch_size, width=msg.label_width)

    def stats(self, timeout: float = 20.0) -> ServerStats:
        """Ask over this client's own socket (so the server counts it as heard from); other
        messages meanwhile are dropped. AssertionError after ``timeout`` s."""
        self.send(StatsRequest())
        stats = receive_stats(self.sock, timeout)
        if stats is None:
            raise AssertionError(f"no stats reply from the server in {timeout}s")
        return stats

    def bye(self) -> None:
        self.send(Bye())

    def close(self) -> None:
        self.sock.close(0)
