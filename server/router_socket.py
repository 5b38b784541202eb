"""The server's ROUTER socket: options, binding, and which peer is on which connection.

Everything zmq of the server that is not the poll loop: the socket's limits and timeouts (each
one says below what it protects against), binding (after the ipc:// path check), sending a
reply or a batch, receiving a turn's worth of messages, and the socket monitor that says which
connections closed. Used from the loop thread only (zmq sockets are not thread-safe).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator

import numpy as np
import zmq
from batchwire import wire
from batchwire.server.config import ServerConfig
from batchwire.server.handshakes import HandshakeFailures, classify
from batchwire.server.peer_names import shown
from batchwire.server.security import owner_only
from batchwire.server.splits import StartupError
from batchwire.wire.keys import ServerKeys
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("batchwire.server")

# A peer that never reads cannot make us queue replies without bound (batches are bounded by
# credits, which are capped at MAX_PREFETCH per client).
_SNDHWM = 4 * wire.MAX_PREFETCH + 64
# Frames above this are refused by ZeroMQ itself (the peer is disconnected); smaller oversized
# frames reach us and are counted as malformed.
_MAXMSGSIZE = 16 * 1024 * 1024
# A stats reply may be large (~1 MB with hundreds of clients) for a 20-byte request: each peer
# has at most one that ZeroMQ still holds, all of them together at most this many bytes, so a
# peer that asks again and again and never reads cannot make us hold its replies (an honest
# monitor asks once and waits for the answer).
_STATS_HELD_BYTES = 64 * 1024 * 1024
MAX_RECV_PER_TURN = 256  # then do other work: a flood cannot starve sending
# ZMTP heartbeats: the server pings every peer each second and closes a connection that answers
# nothing for 3 s (a trainer host that vanished without closing its sockets). A client's libzmq
# answers pings in its I/O thread, whatever its Python code is doing, and credits keep its
# receive queue short, so a live client always answers. No HEARTBEAT_TTL: it would make a client
# drop a connection on which one large batch takes longer than the TTL to arrive (a peer counts
# only whole messages as traffic). A closed connection is a DISCONNECTED monitor event. libzmq
# sends a ping only between messages, so a peer that stopped reading mid-batch is not caught
# here: the core notices it takes nothing (core.STALL_S) and TCP_USER_TIMEOUT closes it.
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
_LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn
_ACCEPT_FAILED_LOG_S = 10.0  # one warning per this long while accepts fail (e.g. EMFILE)


class RouterSocket:
    """The bound ROUTER, its monitor, and the peer-to-connection ties (`gone_peers`)."""

    def __init__(
        self,
        config: ServerConfig,
        keys: ServerKeys | None,
        on_handshake_failure: Callable[[str], None] | None = None,
    ) -> None:
        """``on_handshake_failure(reason)``: called per rejected handshake (the metric)."""
        self.config = config
        self.handshake_failures = HandshakeFailures()
        self._on_handshake_failure = on_handshake_failure
        self.ctx = zmq.Context()
        _seed_routing_ids()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.sndhwm = _SNDHWM
        self.router.maxmsgsize = _MAXMSGSIZE
        self.router.linger = 0
        self.router.heartbeat_ivl = _HEARTBEAT_IVL_MS
        self.router.heartbeat_timeout = _HEARTBEAT_TIMEOUT_MS
        # A connection that does not complete the ZMTP greeting and handshake in time is closed
        # by libzmq (a bare TCP connection that sends nothing never does): silent connections
        # cannot pile up and use up file descriptors. (A peer that did complete it is a ZeroMQ
        # socket, kept alive by its own libzmq's heartbeat answers; ROUTER has no call to close
        # one peer, see the report in issue 12; it holds no session and no buffer.)
        self.router.handshake_ivl = max(1, int(config.handshake_timeout * 1000))
        # Connections the kernel queues while none can be accepted (a burst of trainers, or
        # descriptors used up for a moment): queued, they are accepted as soon as descriptors
        # free up, instead of waiting out SYN retransmission back-off (1, 3, 7, 15 s...).
        self.router.backlog = _LISTEN_BACKLOG
        # A peer that takes nothing of what was sent (its socket full: a stopped process, a
        # peer that never reads, a host gone while data was in flight) answers no heartbeat,
        # as libzmq only pings between messages. TCP_USER_TIMEOUT (ZMQ_TCP_MAXRT) makes the
        # kernel close such a connection, which frees the buffers ZeroMQ holds for it. A
        # RemoteLoader's socket always takes what it asked for, so a live trainer is never cut.
        # tcp:// only.
        self.router.tcp_maxrt = max(1, int(config.stall_timeout * 1000))
        self._keys = keys
        if keys is not None:  # before any bind: no peer ever talks to a plain socket
            keys.guard(self.ctx, self.router)
        # Which peers left: ROUTER_NOTIFY would say it in-band, but it is a draft option that
        # pyzmq's bundled libzmq lacks; the socket monitor reports every connection accepted and
        # closed by its file descriptor, and each received frame says which descriptor it came
        # in on (SRCFD), so a peer is tied to its connection (see `track`). Failed handshakes
        # only with keys: without, there is no security handshake to fail, and a connection
        # that hangs up before ZeroMQ's greeting (a health check, a port scan) is no rejection.
        events = _PEER_EVENTS | (_HANDSHAKE_FAILED if keys is not None else 0)
        self.monitor = self.router.get_monitor_socket(events)
        self._peer_fd: dict[bytes, int] = {}  # identity with a session -> its connection's fd
        self._fd_open: dict[int, bool] = {}  # fd -> last event was ACCEPTED (not DISCONNECTED)
        self._gone: list[tuple[bytes, str]] = []
        # Stats replies ZeroMQ still holds: peer -> (tracker, bytes).
        self._stats_held: dict[bytes, tuple[zmq.MessageTracker, int]] = {}
        self._accept_failed_at = -math.inf  # last warning about failing accepts
        self._accept_failures = 0
        self.endpoints: list[str] = []
        for endpoint in config.bind:
            try:
                with owner_only(endpoint):
                    self.router.bind(endpoint)
            except zmq.ZMQError as exc:
                self.close(0)
                raise StartupError(f"cannot bind {endpoint}: {exc}") from None
            self.endpoints.append(self.router.last_endpoint.decode())

    # ------------------------------------------------------------------------- traffic

    def receive(self) -> Iterator[tuple[bytes, list[zmq.Frame]]]:
        """This turn's messages (at most `MAX_RECV_PER_TURN`): identity and the frames after."""
        for _ in range(MAX_RECV_PER_TURN):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            yield frames[0].bytes, frames[1:]

    def reply(self, identity: bytes, msg: wire.ServerMessage) -> None:
        try:
            self.router.send_multipart([identity, msg.pack()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("reply to %s dropped: %s", shown(identity), exc)

    def may_reply_stats(self, identity: bytes) -> bool:
        """Does ZeroMQ hold no stats reply of this peer's, and room for another peer's?"""
        self._stats_held = {i: h for i, h in self._stats_held.items() if not h[0].done}
        held = sum(size for _, size in self._stats_held.values())
        return identity not in self._stats_held and held < _STATS_HELD_BYTES

    def reply_stats(self, identity: bytes, packed: bytes) -> None:
        """Send a packed stats reply (shared by every peer asking in the same turn), tracked
        so that `may_reply_stats` knows while ZeroMQ holds it."""
        frame = zmq.Frame(packed, track=True, copy=False, copy_threshold=0)
        try:
            tracker = self.router.send_multipart(
                [identity, frame], zmq.NOBLOCK, copy=False, track=True
            )
        except zmq.ZMQError as exc:
            log.debug("stats reply to %s dropped: %s", shown(identity), exc)
            return
        self._stats_held[identity] = (tracker, len(packed))

    def send_batch(
        self, identity: bytes, header: wire.BatchHeader, images: np.ndarray, labels: np.ndarray
    ) -> zmq.MessageTracker:
        return wire.send_batch(self.router, header, images, labels, identity=identity)

    # ------------------------------------------------------------------------- peers

    def track(self, identity: bytes, frame: zmq.Frame) -> None:
        """Tie a peer with a session to the connection its message came in on.

        Events are handled before a new tie is made: a connection's ACCEPTED event precedes
        its first message, and the DISCONNECTED event of an earlier connection on the same
        descriptor number precedes that ACCEPTED, so neither can be mistaken for this one's.
        """
        try:
            fd = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, TypeError, ValueError):  # a libzmq without SRCFD: timeouts only
            return
        if self._peer_fd.get(identity) == fd:
            return
        self.peer_events()
        if not self._fd_open.get(fd, True):  # the connection closed since it sent this
            self._gone.append((identity, "disconnected"))
            return
        self._peer_fd[identity] = fd

    def peer_events(self) -> None:
        """Read the monitor's connection events; a closed connection's peers become gone."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)
            except Exception:  # not ours to fail on: the monitor format is libzmq's
                continue
            fd = int(event["value"])
            if event["event"] & _HANDSHAKE_FAILED:
                self._handshake_failed(event["event"], fd, event.get("endpoint", b""))
            elif event["event"] == zmq.EVENT_ACCEPT_FAILED:
                self._accept_failed(fd)  # the value is errno here
            elif event["event"] == zmq.EVENT_ACCEPTED:
                self._fd_open[fd] = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._fd_open[fd] = False
                for identity in [i for i, f in self._peer_fd.items() if f == fd]:
                    del self._peer_fd[identity]
                    self._gone.append((identity, "disconnected (closed, or no heartbeat answer)"))

    def gone_peers(self) -> list[tuple[bytes, str]]:
        """Peers whose connection closed since the last call, and how."""
        gone, self._gone = self._gone, []
        return gone

    @property
    def connections(self) -> int:
        """Connections open now (accepted and not yet closed), by the monitor's events."""
        return sum(self._fd_open.values())

    def _handshake_failed(self, kind: int, value: int, endpoint: bytes | str) -> None:
        """A peer failed the security handshake (the value is a protocol error code here)."""
        reason = classify(kind, value)
        if self._on_handshake_failure is not None:
            self._on_handshake_failure(reason)
        where = endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else endpoint
        line = self.handshake_failures.record(reason, where, time.monotonic())
        if line is not None:
            log.warning("%s", line)

    def log_handshake_summary(self) -> None:
        """Log the rejected handshakes not yet said, once their interval is over (a burst
        that ended is still said: `HandshakeFailures.due`); called at every turn of the loop."""
        line = self.handshake_failures.due(time.monotonic())
        if line is not None:
            log.warning("%s", line)

    def _accept_failed(self, errno_value: int) -> None:
        """libzmq could not accept a connection (out of descriptors?): warn now and then."""
        self._accept_failures += 1
        now = time.monotonic()
        if now - self._accept_failed_at < _ACCEPT_FAILED_LOG_S:
            return
        self._accept_failed_at = now
        log.warning(
            "cannot accept connections: %s (%d failed accepts; %d connections open, "
            "descriptor limit %s); silent ones are closed after --handshake-timeout %g s",
            os.strerror(errno_value),
            self._accept_failures,
            self.connections,
            _nofile_limit(),
            self.config.handshake_timeout,
        )
        self._accept_failures = 0

    # ------------------------------------------------------------------------- closing

    def close(self, linger_ms: int) -> None:
        """Close the monitor and the socket (``linger_ms`` for replies still queued), stop the
        keys' authenticator and end the context."""
        with contextlib.suppress(zmq.ZMQError):
            self.router.disable_monitor()
        self.monitor.close(0)
        self.router.close(linger=linger_ms)
        if self._keys is not None:
            self._keys.stop()  # the ZAP authenticator's socket, before the context ends
        self.ctx.term()


def _seed_routing_ids() -> None:
    """Make the routing ids libzmq gives peers that set none unguessable.

    libzmq names such a peer (every RemoteLoader) 0x00 + a 32-bit counter that starts at
    libc's rand() when the ROUTER is made, and nobody seeds it: 0x6b8b4567 in every process.
    A peer may claim a name of that form for itself, and the next peer given the same name
    aborts the process in a libzmq assertion (its auto-naming checks no name in use), so the
    names must not be guessable. Seeded from the OS, the counter's start is not.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).srand(int.from_bytes(os.urandom(4), "little"))


def check_ipc_endpoint(endpoint: str) -> None:
    """Refuse to bind an ipc:// path another process listens on, or that is not a socket.

    libzmq unlinks whatever is at the path before binding: another server's socket (that server
    keeps running, unreachable) or any file. A socket file nobody listens on (a server that
    was killed) is stale and is replaced.
    """
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    if path.startswith("@"):  # Linux abstract namespace: no file; bind fails if taken
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StartupError(f"cannot bind {endpoint}: {exc}") from None
    if not stat.S_ISSOCK(mode):
        raise StartupError(
            f"cannot bind {endpoint}: {path} exists and is not a socket (binding would delete it)"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: nobody listens; libzmq replaces it
    except OSError as exc:
        raise StartupError(f"cannot bind {endpoint}: {path}: {exc}") from None
    finally:
        probe.close()
    raise StartupError(f"another server is listening on {endpoint}; stop it or bind another path")


def _nofile_limit() -> str:
    try:
        import resource

        return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):
        return "unknown"
