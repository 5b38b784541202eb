"""One server as the client's core sees it: the state of its session, and what it owes.

A *session* is what one hello opens (each hello carries a fresh session id): the server owes
it a welcome, then the batches credited to it, in the order asked. A session ends when the
server is lost (its connection dropped, it said ``shutdown``, it stayed silent while owing
something), when it answers with an error, or when the loader moves to another position; what
it still owed goes back to the unasked batches (`fleet.Fleet` does the taking back).

States of one server (`Peer.state`), and how they move:

    DISCONNECTED --connected--> IDLE --hello--> HELLO_SENT --welcome--> STREAMING
    IDLE | STREAMING (owing nothing, epoch all asked) --next-epoch hello--> SPECULATING
    SPECULATING --the loader starts that epoch--> STREAMING (or HELLO_SENT if not welcomed)
    any session --lost / silent / start elsewhere--> IDLE (DISCONNECTED if the connection is down)
    any session --error reply--> BACKING_OFF --retry_at--> IDLE
    HELLO_SENT --refusal--> REFUSED --retry_at--> IDLE
    any --shutdown--> DRAINING --disconnected--> DISCONNECTED
    any --its endpoint left the fleet (DNS)--> retiring: no new batches; once it owes none
        (delivered, or taken back when lost) --> REMOVED (its connection is closed, for good)

The connection itself (`Peer.connected`) is a fact about the socket, kept beside the state:
BACKING_OFF and REFUSED wait out their time whether or not the server is connected meanwhile.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class SessionState(enum.Enum):
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
WAITING = frozenset({SessionState.BACKING_OFF, SessionState.REFUSED})


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
    state: SessionState = SessionState.DISCONNECTED
    session: Session | None = None
    connected: bool = False
    ever_connected: bool = False
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
    #: fleet asks little of a server much slower than the fastest (`fleet.SLOW_PACE_FACTOR`).
    pace: float = 0.0
    #: When it last went from owing nothing to owing batches (`pace` counts from there).
    busy_since: float = 0.0

    def owes(self) -> bool:
        """Does its session of the current epoch owe a welcome or batches?"""
        if self.state is SessionState.HELLO_SENT:
            return True
        return self.state is SessionState.STREAMING and bool(self.session and self.session.pending)

    def outstanding(self) -> int:
        """Batches asked of its session and not received yet."""
        return 0 if self.session is None else len(self.session.pending)

    def in_fleet(self) -> bool:
        """Is it one of the loader's servers now (not removed, not on its way out)?"""
        return self.state is not SessionState.REMOVED and not self.retiring

    def assignable(self) -> bool:
        """May batches prefer it (`rendezvous`)? Connected, in the fleet, not refusing, not
        backing off, not shutting down."""
        return (
            self.connected
            and self.in_fleet()
            and self.state not in (*WAITING, SessionState.DRAINING, SessionState.DISCONNECTED)
        )

    def at_rest(self) -> SessionState:
        """The state of a server without a session: IDLE if connected, else DISCONNECTED."""
        return SessionState.IDLE if self.connected else SessionState.DISCONNECTED
