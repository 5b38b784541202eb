"""What the server remembers of a peer across its sessions: the batches it was sent and never
acknowledged (issue 28: a client that re-sends its hello must not start afresh each time).

A hello replaces a client's session (the next epoch, a reconnect, a resume), so what the
session knows ends with it. A client that sends a new hello every second and never reads would
otherwise be a new client every second, asking for a new window each time; its libzmq takes
the frames off the socket whether its code reads or not (up to its receive high-water mark,
1000 messages by default), so ZeroMQ's hand-over (`delivery.Deliveries`) cannot tell it from a
trainer. What can: a loader asks for its next batch only once its consumer took one, so every
batch it is sent beyond its window was asked for by a credit. Per peer identity, over its
sessions:

- ``unacked``: batches sent to it less the batches its credits asked for (below 0 while
  credits run ahead of the sends; back to at least 0 when a session ends, since the asks it
  was never sent are gone with it);
- ``advance``: the batches the first hello of its pass asked for (a loader's window: it is
  sent them before it takes anything). A hello re-sent for the same pass (after a silence or
  an error) asks only for what the loader did not get, and gets no new advance;
- its ``debt``: what it would have been sent and not acknowledged once its session's owed
  batches are sent, ``unacked + owed - advance``. Sends and credits leave it as it is (a send
  moves one batch from owed to unacked, a credit one the other way); a hello sets it: one that
  asks again for batches the peer was sent raises it by as many. A trainer's is 0 (within a
  pass, all it asks beyond its window is asked by credits), or the few batches a re-sent
  hello asked again because they were lost in flight; a client that asks the same pass again
  and again, with no credit, owes what it was sent of each hello's window.

A peer whose debt is over `SLACK` (what a loader's re-sent hello may ask again of the batches
in flight when it gave up on its session) is *in debt*: the core schedules its sessions after
the others, the least indebted first; while a client in good standing is busy, those in debt
start one job a second between them (`core.DEBTOR_EVERY_S`), and only when no such client may
start one; they are lent buffers as a client that never took one
(`core.ServerCore.in_good_standing`). A client that re-sends its hello every second and never
reads is in debt after two or three hellos. Credits pay a debt back (`PeerLedger.acknowledged`).

A hello that starts another pass (epoch, split, rank, world size, job, resumed pass, batch
size or output size) has its own window as its advance. What the peer owes is wiped by a hello
after a session that was sent everything it asked for (``finished``) and either was of another
pass (a loader's next epoch; a validation pass of another epoch, which may ask for all its
batches in the hello and send no credit) or came after credits asking for at least its window
since the last wipe (a validation loader evaluating the same epoch again: it took the pass).
A re-hello of the same pass with fewer credits since, or one before the last session was
served, carries the debt: so does a validation loader's pass of the same epoch when the split
has fewer batches than twice its window, one pass's worth at a time.

What this cannot tell apart: a client that sends credits without reading (its libzmq takes
the batches; nothing on the wire says it did not read), or one that starts a new pass once
its last one was served; both ask only as fast as they are served, as a trainer does. A record
is forgotten when the peer's connection closes (a new connection is a new identity unless the
client sets one) and when it has had no session for --client-timeout.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, replace

from batchwire.wire import Hello

#: Batches a peer may owe and still be in good standing: those a loader's hello re-sent for the
#: same pass (after a silence or an error) may ask again because they were on their way when
#: it gave up on its session, and reached it after, when it drops them as stale.
SLACK = 2


def pass_of(hello: Hello) -> Hello:
    """The pass a hello asks for: everything in it but its batches, session and metadata."""
    return replace(hello, batches=(), session=0, metadata=False)


@dataclass
class PeerRecord:
    """One peer's history over its sessions (see the module doc)."""

    seen_at: float
    unacked: int = 0
    advance: int = 0  # batches the first hello of its pass asked for
    last_pass: Hello | None = None  # the `pass_of` its current (or last) session's hello
    finished: bool = False  # that session had been sent all it asked for when it ended
    repaid: int = 0  # batches its credits asked for since it went into debt
    credited: int = 0  # batches its credits asked for since its pass started or was wiped
    in_debt_since: float | None = None

    def debt(self, owed: int) -> int:
        """What it would owe once its session's ``owed`` batches are sent."""
        return max(0, self.unacked + owed - self.advance)


class PeerLedger:
    """`PeerRecord` per peer identity; the core tells it of hellos, sends, credits and ends."""

    def __init__(self, slack: int = SLACK) -> None:
        self.slack = int(slack)
        self._records: dict[bytes, PeerRecord] = {}

    def __len__(self) -> int:
        return len(self._records)

    def get(self, identity: bytes) -> PeerRecord | None:
        return self._records.get(identity)

    def debt(self, identity: bytes, owed: int) -> int:
        """The peer's debt while its session owes ``owed`` batches (0 for a peer unknown)."""
        record = self._records.get(identity)
        return 0 if record is None else record.debt(owed)

    def opened(self, identity: bytes, hello: Hello, now: float) -> bool:
        """A session of ``hello`` was admitted (the peer's previous one has `closed`); True
        when this hello puts the peer in debt (the core logs it)."""
        record = self._records.get(identity)
        if record is None:
            record = self._records[identity] = PeerRecord(seen_at=now)
        this_pass = pass_of(hello)
        other = record.last_pass != this_pass
        if record.finished and (other or record.credited >= record.advance):
            record.unacked = record.credited = 0  # its next epoch, or a whole pass taken
        if other:
            record.advance, record.credited = len(hello.batches), 0
        record.last_pass, record.finished, record.seen_at = this_pass, False, now
        if record.debt(len(hello.batches)) <= self.slack:
            record.in_debt_since = None
        elif record.in_debt_since is None:
            record.in_debt_since, record.repaid = now, 0
            return True
        return False

    def closed(self, identity: bytes, finished: bool) -> None:
        """The peer's session ended; ``finished``: it had been sent all it asked for."""
        record = self._records.get(identity)
        if record is not None:
            record.finished = finished
            record.unacked = max(0, record.unacked)

    def seen(self, identity: bytes, now: float) -> None:
        record = self._records.get(identity)
        if record is not None:
            record.seen_at = now

    def sent(self, identity: bytes) -> None:
        """A batch went to the peer."""
        record = self._records.get(identity)
        if record is not None:
            record.unacked += 1

    def acknowledged(self, identity: bytes, batches: int, owed: int) -> None:
        """The peer's credit asked for ``batches`` more (its session now owes ``owed``): as
        many batches sent are paid for. A peer in debt whose credits since then cover its
        window and its debt has taken, by its own account, what it asked again: it owes
        nothing any more (a loader that lost a few batches in flight is back in a few steps;
        a client that asks again and again, with no credit, never is)."""
        record = self._records.get(identity)
        if record is None:
            return
        record.unacked -= batches
        record.credited += batches
        if record.in_debt_since is None:
            return
        record.repaid += batches
        if record.repaid >= record.advance + record.debt(owed):
            record.unacked = min(record.unacked, record.advance - owed)
            record.in_debt_since = None

    def forget(self, identity: bytes) -> None:
        """The peer's connection closed: a new one starts afresh."""
        self._records.pop(identity, None)

    def expire(self, now: float, timeout: float, live: Container[bytes]) -> None:
        """Forget the peers without a session (not in ``live``) unheard of for ``timeout``."""
        for identity, record in list(self._records.items()):
            if identity not in live and now - record.seen_at > timeout:
                del self._records[identity]
