"""One server as the client's core sees it: the state of its session, and what it owes.

A *session* is what one hello opens (each hello carries a fresh session id): the server owes
it a welcome, then the batches credited to it, in the order asked. A session ends when the
server is lost (its connection dropped, it said ``shutdown``, it stayed silent while owing
something), when it answers with an error, or when the loader moves to another position; what
it still owed goes back to the unasked batches (`fleet.Fleet` does the taking back).

States of one server (`Peer.state`) move only by `TRANSITIONS`, a table of (state, event) ->
new state in the manner of h11's ``_state.py``: `Peer.move` looks the pair up and raises
`IllegalTransition` (naming server, state and event) for any pair the table lacks, so a
transition the core did not mean is an error where it happens, not a drift found later.
Read as a diagram:

    DISCONNECTED --connected--> IDLE --hello--> HELLO_SENT --welcomed--> STREAMING
    IDLE | STREAMING (owing nothing, epoch all asked) --hello ahead--> SPECULATING
    SPECULATING --adopted (the loader starts that epoch)--> STREAMING (HELLO_SENT if not welcomed)
    any session --ended (silent, start elsewhere, a failed send)--> IDLE
    IDLE | any session --disconnected--> DISCONNECTED
    any session --error--> BACKING_OFF; HELLO_SENT --refused--> REFUSED
    BACKING_OFF | REFUSED --retry due--> IDLE (DISCONNECTED if the connection is down)
    any but DISCONNECTED --shutdown--> DRAINING --disconnected--> DISCONNECTED
    at rest (no session) --left (its endpoint left the fleet and it owes nothing)--> REMOVED

The states that hold a session (HELLO_SENT, STREAMING, SPECULATING) hold it only while connected: a
dropped connection ends it (``disconnected``), so ``ended`` always lands on IDLE.

The connection itself (`Peer.connected`) is a fact about the socket, kept beside the state:
BACKING_OFF and REFUSED wait out their time whether or not the server is connected meanwhile.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from batchwire.wire import ProtocolError


class PeerState(enum.Enum):
    """Where one server stands with this loader."""

    DISCONNECTED = "disconnected"  # no connection (not yet, or it dropped); no session
    IDLE = "idle"  # connected, no session: the next step sends a hello
    HELLO_SENT = "hello sent"  # a hello of the current epoch, not welcomed yet
    STREAMING = "streaming"  # welcomed: the current epoch's batches are credited to it
    SPECULATING = "speculating"  # a hello of the next epoch: its batches wait for that epoch
    BACKING_OFF = "backing off"  # an error reply ended the session: no hello before retry_at
    REFUSED = "refused"  # it refused our hello: out of the assignment until retry_at
    DRAINING = "draining"  # it said shutdown: no hello until the old process has gone
    REMOVED = "removed"  # left the fleet (its DNS record went): connection closed, never used


#: States that wait for ``retry_at`` before the next hello.
WAITING = frozenset({PeerState.BACKING_OFF, PeerState.REFUSED})


class Event(enum.Enum):
    """What happened to one server, as far as its state goes (`TRANSITIONS`)."""

    CONNECTED = "connected"  # its connection completed (first time, or after a restart)
    DISCONNECTED = "disconnected"  # its connection dropped: any session of it is over
    HELLO = "hello"  # a hello of the current epoch went out
    HELLO_AHEAD = "hello ahead"  # a hello of the next epoch went out
    WELCOMED = "welcomed"  # it welcomed the current epoch's hello
    ADOPTED = "adopted"  # the loader started the epoch of its welcomed next-epoch session
    ADOPTED_UNWELCOMED = "adopted unwelcomed"  # the same, before that session's welcome
    ENDED = "ended"  # the session ended while connected: silent, moved elsewhere, send failed
    ERROR = "error"  # an error reply that backs off (transient, busy, after the welcome)
    REFUSED = "refused"  # it refused the current epoch's hello
    RETRY_DUE = "retry due"  # retry_at passed, connected
    RETRY_DUE_DISCONNECTED = "retry due, disconnected"  # retry_at passed, not connected
    SHUTDOWN = "shutdown"  # it said it is shutting down (while connected)
    LEFT = "left"  # its endpoint left the fleet and it owes nothing: closed for good


_SESSION = (PeerState.HELLO_SENT, PeerState.STREAMING, PeerState.SPECULATING)
_AT_REST = (
    PeerState.DISCONNECTED,
    PeerState.IDLE,
    PeerState.BACKING_OFF,
    PeerState.REFUSED,
    PeerState.DRAINING,
)


def _table() -> dict[tuple[PeerState, Event], PeerState]:
    S, E = PeerState, Event
    table = {
        (S.DISCONNECTED, E.CONNECTED): S.IDLE,
        (S.IDLE, E.HELLO): S.HELLO_SENT,
        (S.IDLE, E.HELLO_AHEAD): S.SPECULATING,
        (S.STREAMING, E.HELLO_AHEAD): S.SPECULATING,  # it owes nothing of this epoch
        (S.HELLO_SENT, E.WELCOMED): S.STREAMING,
        (S.SPECULATING, E.ADOPTED): S.STREAMING,
        (S.SPECULATING, E.ADOPTED_UNWELCOMED): S.HELLO_SENT,
        (S.HELLO_SENT, E.REFUSED): S.REFUSED,
        (S.IDLE, E.DISCONNECTED): S.DISCONNECTED,
        (S.DISCONNECTED, E.DISCONNECTED): S.DISCONNECTED,
        (S.DRAINING, E.DISCONNECTED): S.DISCONNECTED,  # the old process has gone
        (S.REMOVED, E.DISCONNECTED): S.REMOVED,  # a late event of its closed connection
        # Waiting states wait out their time whether or not the connection is up.
        (S.BACKING_OFF, E.DISCONNECTED): S.BACKING_OFF,
        (S.REFUSED, E.DISCONNECTED): S.REFUSED,
        (S.BACKING_OFF, E.CONNECTED): S.BACKING_OFF,
        (S.REFUSED, E.CONNECTED): S.REFUSED,
    }
    for state in WAITING:
        table[state, E.RETRY_DUE] = S.IDLE
        table[state, E.RETRY_DUE_DISCONNECTED] = S.DISCONNECTED
    for state in _SESSION:
        table[state, E.ENDED] = S.IDLE
        table[state, E.DISCONNECTED] = S.DISCONNECTED
        table[state, E.ERROR] = S.BACKING_OFF
    for state in (*_SESSION, S.IDLE, *WAITING, S.DRAINING):
        table[state, E.SHUTDOWN] = S.DRAINING
    for state in _AT_REST:
        table[state, E.LEFT] = S.REMOVED
    return table


#: Every legal (state, event) and the state it leads to; any other pair is `IllegalTransition`.
TRANSITIONS: dict[tuple[PeerState, Event], PeerState] = _table()


class IllegalTransition(ProtocolError):
    """An event that the server's state does not allow (a bug of the core, or a server that
    broke the protocol in a way no check caught): raised where it happens."""

    def __init__(self, endpoint: str, state: PeerState, event: Event) -> None:
        self.endpoint, self.transition = endpoint, (state, event)
        super().__init__(
            f"pipeline-server at {endpoint}: event {event.value!r} is not allowed in state "
            f"{state.value!r}"
        )


@dataclass
class Session:
    """What one hello opened: its id, its epoch, and what the server still owes it."""

    id: int
    epoch: int
    #: Batches asked for in this session and not received yet, in the order the server sends.
    pending: deque[int] = field(default_factory=deque)
    welcomed: bool = False
    #: Next-epoch batches already received (their frames wait in the receiver until adopted).
    early: list[int] = field(default_factory=list)

    def owed(self) -> list[int]:
        """Batches this session was asked for and the loader has not used: taken back at its end."""
        return [*self.pending, *self.early]


@dataclass
class Peer:
    """One server of the loader: its session state and the times the core decides by."""

    index: int
    endpoint: str
    #: Silence (seconds) tolerated while it owes something; adapts to its pace (see `fleet`).
    heartbeat: float
    last_heard: float  # when its last frame arrived
    prev_heard: float  # when the frame before that arrived
    state: PeerState = PeerState.DISCONNECTED
    session: Session | None = None
    connected: bool = False
    ever_connected: bool = False
    #: It welcomed one of this loader's hellos before: a later silence is not a protocol
    #: mismatch (a stopped or overloaded server), whatever the current session's state.
    ever_welcomed: bool = False
    last_sent: float = 0.0
    #: BACKING_OFF / REFUSED: no hello before this time.
    retry_at: float = 0.0
    last_error: str | None = None
    #: The server's words when it last refused a hello (None once it welcomes one).
    refusal: str | None = None
    #: The same error in a row (reset by a batch): after a few the loader raises it.
    error_streak: int = 0
    #: Transient errors in a row (reset by a batch): they set the back-off, not a limit.
    transient_streak: int = 0
    #: Refused hellos in a row (reset by a welcome): they set the back-off.
    refusal_streak: int = 0
    #: Its endpoint left the fleet (`Fleet.on_endpoints`): it delivers what it owes, is asked
    #: for nothing more, then is REMOVED. Not a fault: nothing is retried or reported.
    retiring: bool = False
    #: Connection attempts that failed at once (refused) since its last completed one.
    connect_failures: int = 0
    #: Seconds between its batches while it owed some, smoothed (0: none received yet); the
    #: fleet asks little of a server much slower than the fastest (`assignment.SLOW_PACE_FACTOR`).
    pace: float = 0.0
    #: Times it fell silent while owing since it last delivered a batch (`liveness.silent`):
    #: a server that welcomes every hello and then sends nothing must not keep the batch the
    #: consumer waits for while another server could take it.
    silences: int = 0
    #: When it last went from owing nothing to owing batches (`pace` counts from there).
    busy_since: float = 0.0

    def owes(self) -> bool:
        """Does its session of the current epoch owe a welcome or batches?"""
        if self.state is PeerState.HELLO_SENT:
            return True
        return self.state is PeerState.STREAMING and bool(self.session and self.session.pending)

    def outstanding(self) -> int:
        """Batches asked of its session and not received yet."""
        return 0 if self.session is None else len(self.session.pending)

    def in_fleet(self) -> bool:
        """Is it one of the loader's servers now (not removed, not on its way out)?"""
        return self.state is not PeerState.REMOVED and not self.retiring

    def assignable(self) -> bool:
        """May batches prefer it (`rendezvous`)? Connected, in the fleet, not refusing, not
        backing off, not shutting down."""
        return (
            self.connected
            and self.in_fleet()
            and self.state not in (*WAITING, PeerState.DRAINING, PeerState.DISCONNECTED)
        )

    def connecting(self) -> bool:
        """Is its first connection under way (never connected, no attempt refused yet)?"""
        return (
            self.state is PeerState.DISCONNECTED
            and not self.ever_connected
            and not self.connect_failures
            and self.in_fleet()
        )

    def waits_out_busy(self) -> bool:
        """Is it waiting out a ``busy`` refusal (one that clears by itself)?"""
        return (
            self.state is PeerState.BACKING_OFF
            and self.refusal is not None
            and self.refusal == self.last_error
        )

    def move(self, event: Event) -> PeerState:
        """Take ``event`` (`TRANSITIONS`); the only way `state` changes."""
        try:
            self.state = TRANSITIONS[self.state, event]
        except KeyError:
            raise IllegalTransition(self.endpoint, self.state, event) from None
        return self.state
