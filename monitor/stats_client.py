"""Ask a running pipeline-server for its stats over its own ZeroMQ endpoint."""

from __future__ import annotations

import time

import zmq
from batchwire import wire
from batchwire.wire.keys import ClientKeys


class StatsUnavailable(RuntimeError):
    """The server did not answer (in time, or sensibly); the message names the endpoint."""


class StatsClient:
    """One DEALER socket reused across polls of a live view.

    After a timeout the socket is replaced: a late reply to the old request would otherwise be
    read as the answer to the next one, and a DEALER's queue to a dead peer is dropped with it.
    """

    def __init__(
        self,
        endpoint: str,
        timeout: float = 5.0,
        ctx: zmq.Context | None = None,
        keys: ClientKeys | None = None,
    ):
        self.endpoint = endpoint
        self.timeout = float(timeout)
        self.keys = keys  # a server started with --keys answers only a key holder
        self._own_ctx = ctx is None
        self._ctx = ctx or zmq.Context()
        self._sock: zmq.Socket | None = None

    def connect(self) -> None:
        """Open the socket now: a malformed endpoint fails here, before any waiting."""
        self._socket()

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            if self.keys is not None:
                self.keys.apply(sock)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                sock.close()
                raise StatsUnavailable(f"cannot connect to {self.endpoint}: {exc}") from None
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def fetch(self) -> dict:
        """Send one ``stats`` request and return the Stats-schema dict from the reply."""
        sock = self._socket()
        sock.send(wire.StatsRequest().pack())
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000))):
                self._reset()
                raise StatsUnavailable(
                    f"no answer from {self.endpoint} within {self.timeout:g} s "
                    "(is pipeline-server running there?)"
                )
            frames = sock.recv_multipart()
            try:
                reply = wire.decode_server_message(frames[0])
            except wire.ProtocolError as exc:
                self._reset()
                raise StatsUnavailable(f"bad reply from {self.endpoint}: {exc}") from None
            if isinstance(reply, wire.StatsReply):
                return reply.stats
            if isinstance(reply, wire.ErrorReply):
                self._reset()
                raise StatsUnavailable(
                    f"{self.endpoint} refused the stats request: {reply.message}"
                )
            # Anything else (a shutdown notice) is not our answer: keep waiting until the deadline.

    def close(self) -> None:
        self._reset()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> StatsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_stats(endpoint: str, timeout: float = 5.0) -> dict:
    """One-shot convenience: the server's current stats, or `StatsUnavailable`."""
    with StatsClient(endpoint, timeout) as client:
        return client.fetch()
