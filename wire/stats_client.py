"""Ask a `pipeline-server` for its stats: the one stats client of batchwire.

`fetch_stats` asks once; `StatsClient` keeps one socket for a live view (``pipeline-monitor``)
and splits a request into `StatsClient.send` and `StatsClient.receive` for a caller that must
look at something else while it waits (the launcher watches its child process). Three ways a
request fails, three exceptions, all `StatsUnavailable`:

- `StatsTimeout` (also a `TimeoutError`): nothing came back in time; nobody serves there, or
  the server is busy starting;
- `StatsKeysError`: ZeroMQ's security handshake failed, which waiting will not fix: the server
  uses ``--keys`` and we do not, or the other way round, or our keys are not its keys;
- plain `StatsUnavailable`: the endpoint is malformed, the server refused the request, or its
  answer is not a valid stats reply (a hostile or newer-and-incompatible peer).

`wire.RawClient.stats` asks over a raw client's own socket through the same `receive_stats`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import zmq
from batchwire.wire.endpoints import UnresolvableHost, check_resolvable
from batchwire.wire.errors import ProtocolError
from batchwire.wire.keys import ClientKeys
from batchwire.wire.messages import ErrorReply, StatsReply, StatsRequest, decode_server_message
from batchwire.wire.stats import ServerStats
from zmq.utils.monitor import recv_monitor_message

__all__ = [
    "StatsClient",
    "StatsKeysError",
    "StatsTimeout",
    "StatsUnavailable",
    "fetch_stats",
    "receive_stats",
]

# What a failed security handshake means (CURVE keys, `wire.keys`); the most specific first.
_HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server rejected our key (our keys folder is not its)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (
        "the security handshake failed: one side uses keys and the other does not"
    ),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: (
        "the security handshake failed: the server rejected our key, or its key is not our "
        "keys folder's server.key, or one side uses keys and the other does not"
    ),
}
_MONITOR_EVENTS = (
    zmq.EVENT_CONNECT_RETRIED  # a connect failed at once (refused): nothing listens there
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class StatsUnavailable(RuntimeError):
    """No usable stats from the server; the message names the endpoint and why."""


class StatsTimeout(StatsUnavailable, TimeoutError):
    """The server did not answer in time."""


class StatsKeysError(StatsUnavailable):
    """The security handshake failed: a keys problem, not a slow server."""


class StatsClient:
    """One DEALER to one server, reused across requests.

    After a timeout or a bad answer the socket is replaced: a late reply to the old request
    would otherwise be read as the answer to the next one, and a DEALER's queue to a dead
    peer goes with it. ``keys``: a server started with ``--keys`` answers only their holder.
    """

    def __init__(
        self,
        endpoint: str,
        timeout: float = 5.0,
        *,
        ctx: zmq.Context | None = None,
        keys: ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout = float(timeout)
        self.keys = keys
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._refused = False  # a connection attempt was refused since the socket opened

    def connect(self) -> None:
        """Open the socket now: a malformed endpoint fails here, before any waiting."""
        self._socket()

    def fetch(self, timeout: float | None = None) -> ServerStats:
        """Send one request and return the answer (see the module docstring for failures)."""
        timeout = self.timeout if timeout is None else float(timeout)
        self.send()
        stats = self.receive(timeout)
        if stats is None:
            refused = self._refused
            self._reset()  # the late answer to this request must not pass for the next one's
            if refused:
                raise StatsTimeout(
                    f"no answer from {self.endpoint} within {timeout:g} s: nothing is listening "
                    "there, every connection was refused (is the port, or the ipc:// path, "
                    "right? pipeline-server says 'serving ... on ENDPOINT' when it starts)"
                )
            raise StatsTimeout(
                f"no answer from {self.endpoint} within {timeout:g} s: the connection never "
                "completed, or the server did not answer (is the host up and the port open? "
                "is pipeline-server running there?)"
            )
        return stats

    def send(self) -> None:
        """Send a stats request; ZeroMQ queues it until the server is there."""
        self._socket().send(StatsRequest().pack())

    def receive(self, timeout: float) -> ServerStats | None:
        """The answer to the last `send` if it comes within ``timeout`` seconds, else None."""
        sock = self._socket()
        try:
            return receive_stats(sock, timeout, self.endpoint, self._check_handshake)
        except StatsUnavailable:
            self._reset()
            raise

    def close(self) -> None:
        self._reset()
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> StatsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            try:  # a host name nothing resolves: say so now (libzmq would retry quietly)
                check_resolvable(self.endpoint)
            except UnresolvableHost as exc:
                raise StatsUnavailable(str(exc)) from None
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            if self.keys is not None:
                self.keys.apply(sock)
            monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
            try:
                sock.connect(self.endpoint)
            except zmq.ZMQError as exc:
                _close(sock, monitor)
                raise StatsUnavailable(f"cannot connect to {self.endpoint}: {exc}") from None
            self._sock, self._monitor = sock, monitor
        return self._sock

    def _check_handshake(self) -> None:
        """Raise `StatsKeysError` if the monitor saw the security handshake fail."""
        failure = None
        while self._monitor is not None:
            try:
                kind = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if kind == zmq.EVENT_CONNECT_RETRIED:
                self._refused = True
                continue
            if failure is None or kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                failure = _HANDSHAKE_FAILURES.get(kind, failure)
        if failure is not None:
            raise StatsKeysError(
                f"no stats from {self.endpoint}: {failure} (give the server's keys folder: "
                "--keys DIR or BATCHWIRE_KEYS=DIR)"
            )

    def _reset(self) -> None:
        self._refused = False
        if self._sock is not None:
            _close(self._sock, self._monitor)
            self._sock = self._monitor = None


def _close(sock: zmq.Socket, monitor: zmq.Socket | None) -> None:
    with contextlib.suppress(zmq.ZMQError):
        sock.disable_monitor()
    if monitor is not None:
        monitor.close(linger=0)
    sock.close(linger=0)


# How often a wait looks at the handshake events while no answer has come.
_EVENT_POLL_S = 0.05


def receive_stats(
    sock: zmq.Socket,
    timeout: float,
    endpoint: str = "the server",
    check: Callable[[], None] | None = None,
) -> ServerStats | None:
    """Wait up to ``timeout`` s on ``sock`` for a stats reply; None if none came.

    Other messages (a raw client's batches, a shutdown notice) are skipped: they are not our
    answer, as is an error about a session (a raw client's stream). An error about no session
    or a frame that is not a valid message raises `StatsUnavailable`.
    ``check``, if given, runs every few milliseconds while waiting and may raise (the
    handshake check of `StatsClient`).
    """
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        step = remaining if check is None else min(remaining, _EVENT_POLL_S)
        if not sock.poll(max(1, int(step * 1000))):
            continue
        frames = sock.recv_multipart()
        try:
            reply = decode_server_message(frames[0])
        except ProtocolError as exc:
            raise StatsUnavailable(f"bad reply from {endpoint}: {exc}") from None
        if isinstance(reply, StatsReply):
            return reply.stats
        if isinstance(reply, ErrorReply) and reply.session is None:  # else about a stream
            raise StatsUnavailable(f"{endpoint} refused the stats request: {reply.message}")


def fetch_stats(
    endpoint: str,
    timeout: float = 5.0,
    *,
    ctx: zmq.Context | None = None,
    keys: ClientKeys | None = None,
) -> ServerStats:
    """The stats of the server at ``endpoint``, asked once over a fresh socket."""
    with StatsClient(endpoint, timeout, ctx=ctx, keys=keys) as client:
        return client.fetch()
