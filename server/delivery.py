"""Sent batches ZeroMQ still holds, per peer, and how long each peer has taken none of them.

A batch's images leave zero-copy: its buffer stays lent until ZeroMQ lets go of the frame (its
`MessageTracker` is done), which happens once the whole batch is in the kernel's socket buffer.
A peer that reads keeps letting go of its batches within milliseconds (its libzmq reads from
the socket whatever its Python code is doing, and credits bound what it was sent); a peer that
takes nothing (a stopped process, a host gone while data was in flight) lets go of none.

Per peer (identity, across its sessions), `Deliveries` counts the batches held and the time
since the peer last took one while holding some (`waiting`): that is how the core tells a
peer that does not read from one that does, without any timer of ZeroMQ's (libzmq's heartbeats
are only sent between messages, so they never fire while a batch is stuck half-written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchwire.server.bufpool import Slot


@dataclass
class _Peer:
    held: int = 0
    waiting_since: float = 0.0  # the last send into an empty pipe, or the last batch taken


@dataclass(frozen=True)
class Sent:
    """A sent batch still with ZeroMQ: whose, and the buffer it pins."""

    identity: bytes
    slot: Slot
    session_serial: int
    production: int = 0  # the `sharing.Production` whose buffer it is


class Deliveries:
    """Tickets for sent batches; the shell reports each ticket's tracker once it is done."""

    def __init__(self) -> None:
        self._sent: dict[int, Sent] = {}
        self._peers: dict[bytes, _Peer] = {}
        self._next_ticket = 0

    def __len__(self) -> int:
        return len(self._sent)

    def sent(
        self, identity: bytes, slot: Slot, session_serial: int, now: float, production: int = 0
    ) -> int:
        """Count a batch handed to ZeroMQ; returns its ticket. Several peers may be sent the
        same slot (a shared batch): each send has its own ticket."""
        peer = self._peers.setdefault(identity, _Peer())
        if peer.held == 0:
            peer.waiting_since = now
        peer.held += 1
        self._next_ticket += 1
        self._sent[self._next_ticket] = Sent(identity, slot, session_serial, production)
        return self._next_ticket

    def done(self, ticket: int, now: float) -> Sent | None:
        """ZeroMQ let go of ticket's batch: the peer took it (or its connection closed)."""
        sent = self._sent.pop(ticket, None)
        if sent is None:
            return None
        peer = self._peers[sent.identity]
        peer.held -= 1
        peer.waiting_since = now
        if peer.held <= 0:
            del self._peers[sent.identity]
        return sent

    def held(self, identity: bytes) -> int:
        """Sent batches ZeroMQ still holds for this peer."""
        peer = self._peers.get(identity)
        return 0 if peer is None else peer.held

    def held_by_peer(self) -> dict[bytes, int]:
        """A copy (the stats may be built on another thread)."""
        return {identity: p.held for identity, p in list(self._peers.items())}

    def waiting(self, identity: bytes, now: float) -> float:
        """Seconds this peer has held sent batches without taking any (0 if it holds none)."""
        peer = self._peers.get(identity)
        return 0.0 if peer is None else now - peer.waiting_since
