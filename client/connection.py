"""One DEALER session with one pipeline-server: sending control messages, receiving frames.

Why a socket monitor: a killed and restarted server looks, to a DEALER, like silence; the TCP
connection events tell us at once when the old peer vanished and when a new one completed its
handshake, so the loader can re-send its hello immediately instead of guessing from silence
(silence stays the fallback, see `RemoteLoader`). ``IMMEDIATE`` keeps control messages from
queueing towards a peer that is not there: a hello sent while the server is down fails with
EAGAIN and is retried once the handshake event arrives, so a restarted server never sees a burst
of stale hellos and credits.

All methods are called from the loader's own thread; nothing here blocks for longer than the
poll timeout it is given.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
from batchwire import wire
from batchwire.wire import keys as wire_keys
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
# What a failed handshake means for us (CURVE keys: `wire.keys`); each is a configuration
# error that waiting will not fix, so the loader raises it instead of timing out.
_HANDSHAKE_FAILURES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: (
        "the server rejected our key: this loader's keys folder is not the server's (copy the "
        "server's keys folder here, or add our client.key to its authorized/ folder)"
    ),
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (
        "the security handshake failed: one side uses keys and the other does not (give the "
        "loader the server's keys folder: keys=DIR or BATCHWIRE_KEYS=DIR)"
    ),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: (
        "the security handshake failed: the server rejected our key, or its key is not our "
        "keys folder's server.key, or one side uses keys and the other does not (give the "
        "loader the server's keys folder: keys=DIR or BATCHWIRE_KEYS=DIR)"
    ),
}
_BYE_LINGER_MS = 200


@dataclass
class StreamState:
    """What one server owes us in the current session (reset by every hello)."""

    session: int = -1
    epoch: int = -1
    welcomed: bool = False
    #: Batches asked for in this session and not received yet, in the order the server sends.
    pending: deque[int] = field(default_factory=deque)

    @property
    def outstanding(self) -> int:
        return len(self.pending)


class ServerConnection:
    """The DEALER socket to one endpoint (the loader's ``index``-th), its monitor, and its
    stream bookkeeping. A lost session's ``stream.pending`` and ``ahead`` are left for the
    receiver to take back (`BatchReceiver` gives them to the other servers)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        index: int,
        keys: wire_keys.ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.index = index
        #: Why the last handshake failed (a key problem), or None.
        self.handshake_error: str | None = None
        self.stream = StreamState()
        #: Batches of a session for the *next* epoch, received ahead as raw frames:
        #: ``(header, images frame, labels frame)``; see `receiver` ("next epoch").
        self.ahead: list[tuple[wire.BatchHeader, zmq.Frame, zmq.Frame]] = []
        #: False after a disconnect or `shutdown` until the hello of a new session is sent.
        self.hello_sent = False
        #: After `shutdown`: hold the next hello until the old process has disconnected.
        self.wait_reconnect = False
        self.connected = False
        self.ever_connected = False
        self.last_heard = self.prev_heard = time.monotonic()
        self.last_sent = 0.0
        self.last_error: str | None = None
        #: The same error in a row (reset by a batch): after a few the loader raises it.
        self.error_streak = 0
        #: Transient errors in a row (reset by a batch): they set the back-off, not a limit.
        self.transient_streak = 0
        #: No hello before this time (backing off after an error reply).
        self.retry_at = 0.0
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.immediate = True
        self._sock.rcvtimeo = 0  # every receive below is preceded by a poll
        # Reconnect quickly after a restart; back off to at most 1 s while the server is gone.
        self._sock.reconnect_ivl = 100
        self._sock.reconnect_ivl_max = 1000
        if keys is not None:
            keys.apply(self._sock)
        self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot connect to {endpoint!r}: {exc}") from None

    # ------------------------------------------------------------------ sockets for polling

    @property
    def socket(self) -> zmq.Socket:
        return self._sock

    @property
    def monitor(self) -> zmq.Socket:
        return self._monitor

    def close(self) -> None:
        """Say bye (best effort) and close both sockets; safe to call twice."""
        if self._sock.closed:
            return
        # The bye frees the server's buffers for us at once (instead of after its client
        # timeout): give it a moment to leave, never more (a dead peer fails the send anyway).
        said_bye = self.hello_sent and self.connected and self._send(wire.Bye().pack())
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=_BYE_LINGER_MS if said_bye else 0)

    # ------------------------------------------------------------------ connection events

    def drain_events(self) -> None:
        """Apply pending monitor events: a disconnect invalidates the session's hello."""
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self.ever_connected = True
                log.debug("connected to %s", self.endpoint)
            elif kind in _HANDSHAKE_FAILURES:
                # The most specific one wins: a rejected key may also show as "no detail".
                if self.handshake_error is None or kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.handshake_error = _HANDSHAKE_FAILURES[kind]
            elif kind == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    log.warning("lost pipeline-server at %s; will re-send hello", self.endpoint)
                self.connected = False
                self.hello_sent = False
                self.wait_reconnect = False

    def mark_lost(self, wait_reconnect: bool = False) -> None:
        """The server said `shutdown` or went silent: the next hello starts a new session.

        ``wait_reconnect`` (after `shutdown`) holds that hello until the exiting process has
        dropped the connection, so it reaches the server that replaces it.
        """
        self.hello_sent = False
        self.wait_reconnect = wait_reconnect

    @property
    def may_send_hello(self) -> bool:
        return not self.hello_sent and not self.wait_reconnect and time.monotonic() >= self.retry_at

    # ------------------------------------------------------------------ sending

    def _send(self, frame: bytes) -> bool:
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # no completed connection (IMMEDIATE): the caller retries later
            return False
        self.last_sent = time.monotonic()
        return True

    def send_hello(self, hello: wire.Hello) -> bool:
        """Start session ``hello.session``; False if no server is connected yet (retry later)."""
        if not self._send(hello.pack()):
            return False
        self.stream = StreamState(
            session=hello.session, epoch=hello.epoch, pending=deque(hello.batches)
        )
        self.ahead.clear()
        self.hello_sent = True
        self.wait_reconnect = False
        return True

    def send_credit(self, batches: list[int], stats: dict | None) -> bool:
        """Ask for ``batches`` too in the current session; False (nothing asked) when no session
        is up or the send would block."""
        if not self.hello_sent:
            return False
        if not self._send(wire.Credit(batches=tuple(batches), stats=stats).pack()):
            return False
        self.stream.pending.extend(batches)
        return True

    # ------------------------------------------------------------------ receiving

    def recv_control(self) -> tuple[wire.ServerMessage, bool]:
        """Receive the first frame of the next message, decoded, and whether frames follow.

        Raises `wire.ProtocolError` for a frame that is not a valid message; the rest of
        that message is discarded first so the socket stays aligned on message boundaries.
        """
        frame = self._sock.recv(copy=True)
        more = bool(self._sock.rcvmore)
        self.prev_heard, self.last_heard = self.last_heard, time.monotonic()
        try:
            msg = wire.decode_server_message(frame)
        except wire.ProtocolError:
            if more:
                self.discard_rest()
            raise
        return msg, more

    def recv_into(self, buffer: memoryview) -> tuple[int, bool]:
        """Receive the next frame of this message into ``buffer``; (frame size, more follow).

        A frame larger than ``buffer`` is truncated by ZeroMQ: the returned size tells.
        """
        size = self._sock.recv_into(buffer)
        return size, bool(self._sock.rcvmore)

    def recv_frame(self) -> tuple[zmq.Frame, bool]:
        """Receive the next frame of this message without copying it; (frame, more follow).

        The frame owns ZeroMQ's receive buffer: a tensor viewing ``frame.buffer`` keeps it
        alive, so the bytes are handed on without the copy ``recv_into`` would make.
        """
        frame = self._sock.recv(copy=False)
        return frame, bool(self._sock.rcvmore)

    def discard_rest(self) -> None:
        """Drop the remaining frames of the current message (stale session, bad header)."""
        while self._sock.rcvmore:
            try:
                self._sock.recv_into(bytearray())
            except zmq.Again:  # defensive: ZeroMQ delivers a message's frames atomically
                return
