"""The DEALER socket to one pipeline-server: sending control frames, receiving frames.

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
import enum

import zmq
from batchwire import wire
from batchwire.client.errors import ServerUnavailable
from batchwire.wire import keys as wire_keys
from batchwire.wire.endpoints import UnresolvableHost, check_resolvable
from zmq.utils.monitor import recv_monitor_message

_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED  # a connect failed (refused: nothing listens) and is retried
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


class ConnectionEvent(enum.Enum):
    """What the socket monitor reported (handshake failures are kept in `handshake_error`)."""

    CONNECTED = "connected"  # a connection completed its handshake (first time or again)
    DISCONNECTED = "disconnected"  # the connection dropped
    CONNECT_FAILED = "connect failed"  # an attempt failed (refused; no such ipc path): retried


class ServerConnection:
    """The DEALER socket to one endpoint and its monitor. It holds no session state: what is
    owed and what to send is `fleet.Fleet`'s business; this class only moves frames."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        keys: wire_keys.ClientKeys | None = None,
    ) -> None:
        self.endpoint = endpoint
        try:  # a host name nothing resolves: an error now, not a quiet retry for ever
            check_resolvable(endpoint)
        except UnresolvableHost as exc:
            raise ServerUnavailable(endpoint, str(exc)) from None
        #: Why the last handshake failed (a key problem), or None.
        self.handshake_error: str | None = None
        self._sock = ctx.socket(zmq.DEALER)
        try:  # a socket left open here would make the context's term() wait for ever
            self._configure(keys)
            self._monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS)
        except BaseException:
            self._sock.close(linger=0)
            raise
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot connect to {endpoint!r}: {exc}") from None

    def _configure(self, keys: wire_keys.ClientKeys | None) -> None:
        """The DEALER's options (see the module's docstring), then its CURVE keys: `KeysError`
        for keys ZeroMQ refuses (a hand-edited or truncated file that still parses)."""
        self._sock.linger = 0
        self._sock.immediate = True
        self._sock.ipv6 = self.endpoint.startswith("tcp://[")  # an AAAA record's address
        self._sock.rcvtimeo = 0  # every receive below is preceded by a poll
        # Reconnect quickly after a restart; back off to at most 1 s while the server is gone.
        self._sock.reconnect_ivl = 100
        self._sock.reconnect_ivl_max = 1000
        if keys is None:
            return
        try:
            keys.apply(self._sock)
        except zmq.ZMQError as exc:  # a key of the wrong length or alphabet: a damaged file
            raise wire_keys.KeysError(
                f"the keys folder's keys are not usable CURVE keys ({exc}): make the folder "
                "again with `pipeline-keys DIR` and copy it here"
            ) from None

    # ------------------------------------------------------------------ sockets for polling

    @property
    def socket(self) -> zmq.Socket:
        return self._sock

    @property
    def monitor(self) -> zmq.Socket:
        return self._monitor

    def close(self, say_bye: bool = False) -> None:
        """Close both sockets, first saying bye (best effort) if ``say_bye``; safe to call twice.

        The bye frees the server's buffers for us at once (instead of after its client
        timeout): it gets a moment to leave, never more (a dead peer fails the send anyway).
        """
        if self._sock.closed:
            return
        said_bye = say_bye and self.send(wire.Bye().pack())
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=_BYE_LINGER_MS if said_bye else 0)

    # ------------------------------------------------------------------ connection events

    def drain_events(self) -> list[ConnectionEvent]:
        """The monitor's pending events, in order; handshake failures set `handshake_error`."""
        events: list[ConnectionEvent] = []
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return events
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                events.append(ConnectionEvent.CONNECTED)
            elif kind in _HANDSHAKE_FAILURES:
                # The most specific one wins: a rejected key may also show as "no detail".
                if self.handshake_error is None or kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.handshake_error = _HANDSHAKE_FAILURES[kind]
            elif kind == zmq.EVENT_DISCONNECTED:
                events.append(ConnectionEvent.DISCONNECTED)
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                events.append(ConnectionEvent.CONNECT_FAILED)

    # ------------------------------------------------------------------ sending

    def send(self, frame: bytes) -> bool:
        """Send one control frame; False if no connection is complete (``IMMEDIATE``): the
        caller tries again later."""
        try:
            self._sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    # ------------------------------------------------------------------ receiving

    def recv_control(self) -> tuple[wire.ServerMessage, bool]:
        """Receive the first frame of the next message, decoded, and whether frames follow.

        Raises `wire.ProtocolError` for a frame that is not a valid message; the rest of
        that message is discarded first so the socket stays aligned on message boundaries.
        """
        frame = self._sock.recv(copy=True)
        more = bool(self._sock.rcvmore)
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
