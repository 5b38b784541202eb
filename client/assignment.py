"""Who produces which batch: the budget, each batch's preferred server, and who has room.

Any server can produce any batch, so nothing is split up front. The loader keeps at most
``budget`` batches asked for or waiting in the reorder buffer, and whenever one is free it takes
the lowest batch nobody has been asked for (`unasked.UnaskedBatches`) and asks its *preferred*
server: the one of highest rendezvous weight for (split, epoch, world size, rank, batch) among
the servers in the assignment (`rendezvous`), so the jobs of a sweep ask the same server for the
same batch and it produces that batch once for all (shared production). Only when that server
has ``cap`` batches outstanding already (1.5 times its even share), is slow (its pace over
`SLOW_PACE_FACTOR` times the fastest's), or is not streaming (lost, refusing, not welcomed yet:
a batch waits `WELCOME_GRACE_S` for a welcome due) does the batch go to the streaming server
with the fewest outstanding.

`Assignment` decides and returns the asks; `fleet.Fleet` opens the sessions they go to and
sends the credits. No I/O, no clock (``now`` comes with each call).
"""

from __future__ import annotations

from collections.abc import Sequence

from batchwire.client import rendezvous
from batchwire.client.session import Peer, PeerState
from batchwire.client.unasked import UnaskedBatches

_PER_SERVER = 4  # the least budget per server when a loader has several
# A batch whose preferred server was sent a hello this recently waits for its welcome rather
# than going to another server (bounded: a server that does not answer is passed over then).
WELCOME_GRACE_S = 0.5
# Slow: a server whose pace (seconds between its batches while it owes some, smoothed: see
# `liveness`) is SLOW_PACE_FACTOR times the fastest streaming server's is asked for at most
# one batch, one the consumer needs late; the batches that prefer it go to the others. Sharing
# holds between servers of like pace; a stalled or CPU-starved server no longer stalls the loader.
SLOW_PACE_FACTOR = 4.0


class Assignment:
    """The budget of one loader and the choice of server for each batch it asks for."""

    def __init__(self, *, split: str, rank: int, world_size: int, prefetch: int) -> None:
        self.split, self.rank, self.world_size = split, rank, world_size
        self.prefetch = int(prefetch)
        #: The most `budget` may grow to as servers join (the shell's staging slots); None: any.
        self.max_budget: int | None = None
        self.budget = 0
        #: Next-epoch batches one server may be asked for ahead of time (`speculation`).
        self.share = 0
        self._turn = 0  # the server first in line when several have as few outstanding

    def size(self, members: int) -> None:
        """Budget and next-epoch share for ``members`` servers in the fleet now.

        With several servers at least 4 each: a server with fewer outstanding idles its
        producers while a slower one holds the batch the consumer waits for (bench_fleet: 0.75
        of the two servers' summed rate with 2 each, 0.97 with 4 each). A fleet that grows
        stops at `max_budget` (the shell's staging slots); one that shrinks keeps its budget:
        batches already received beyond the cursor may fill a smaller one, and the batch the
        consumer waits for could then never be asked.
        """
        n = max(1, members)
        budget = self.prefetch if n == 1 else max(self.prefetch, _PER_SERVER * n)
        if self.max_budget is not None:
            budget = min(budget, max(self.max_budget, self.prefetch))
        self.budget = max(self.budget, budget)
        self.share = max(1, self.budget // n)

    def cap(self) -> None:
        """The budget grows no more (the shell's staging has that many slots now)."""
        self.max_budget = self.budget

    def preferred(
        self, k: int, candidates: list[tuple[str, Peer]], epoch: int, start: int = 0
    ) -> Peer | None:
        """Batch ``k`` of ``epoch`` (of the pass starting at sample ``start``)'s preferred
        server among ``candidates`` ((endpoint, peer) pairs)."""
        key = rendezvous.batch_key(self.split, epoch, self.world_size, self.rank, k, start)
        return rendezvous.preferred(key, candidates)

    def assign(
        self,
        unasked: UnaskedBatches,
        free: int,
        peers: Sequence[Peer],
        takers: Sequence[Peer],
        *,
        cursor: int,
        epoch: int,
        start: int,
        now: float,
    ) -> dict[int, list[int]]:
        """Up to ``free`` of the lowest ``unasked`` batches (of ``epoch``'s pass from sample
        ``start``), taken out of it, by server index: each to its preferred server unless that
        one is slow, full or not streaming; then fewest outstanding first among ``takers`` (the
        streaming servers of ``peers`` not retiring). ``cursor``: the batch the consumer takes
        next."""
        asks: dict[int, list[int]] = {}
        if not takers:
            return asks
        n = len(peers)
        candidates = candidates_of(peers)
        # Room: 1.5 times its even share of the budget outstanding (not less: at an epoch's
        # start the whole budget is asked at once, and hashing spreads batches unevenly); a
        # slow server (SLOW_PACE_FACTOR) is asked as `takes` says.
        cap = max(1, -(-3 * self.budget // (2 * max(1, len(candidates)))))
        fastest = min((p.pace for p in takers if p.pace > 0.0), default=0.0)
        # A server silent while it owed since it last delivered (`liveness.silent`) is slow
        # while another is not: until it delivers again, not for the pace it then shows.
        heard = any(not p.silences for p in takers)

        def outstanding(p: Peer) -> int:
            return p.outstanding() + len(asks.get(p.index, ()))

        def slow(p: Peer) -> bool:
            return (heard and p.silences > 0) or p.pace > SLOW_PACE_FACTOR * fastest > 0.0

        def takes(p: Peer, k: int) -> bool:
            """Does ``p``, batch ``k``'s preferred server, get it? Not past its room; a slow
            one holds one batch, and only one the consumer needs late (batches come in order:
            one it needs soon would stall it while the others idle), so it stays measured."""
            if slow(p):
                return outstanding(p) == 0 and k >= cursor + self.budget // 2
            return outstanding(p) < cap

        while free > 0 and unasked:
            k = unasked.take()
            p = self.preferred(k, candidates, epoch, start)
            if p is not None and welcome_due(p, now):
                # Its welcome is due any moment (at an epoch's start every server is asked at
                # once, and connections complete one by one): wait for it rather than send the
                # batch elsewhere; after the grace a later tick gives it to another server.
                unasked.give_back([k])
                break
            if p is None or p.state is not PeerState.STREAMING or not takes(p, k):
                # Fewest outstanding first, slow servers last; ties go round the servers, so a
                # consumer slower than its servers still spreads the epoch over all of them.
                p = min(takers, key=lambda p: (slow(p), outstanding(p), (p.index - self._turn) % n))
                self._turn = p.index + 1
            asks.setdefault(p.index, []).append(k)
            free -= 1
        return asks


def candidates_of(peers: Sequence[Peer]) -> list[tuple[str, Peer]]:
    """The servers batches may prefer: the assignable ones, and those whose first connection is
    still under way (else the first server to answer a loader that just started would be every
    batch's preferred one, unlike in the other jobs of a sweep)."""
    return [(p.endpoint, p) for p in peers if p.assignable() or p.connecting()]


def welcome_due(p: Peer, now: float) -> bool:
    """Is ``p`` about to stream? Its hello was sent less than `WELCOME_GRACE_S` ago, or it
    joined (the loader started, or DNS added it) that recently and is still connecting."""
    if p.state is PeerState.HELLO_SENT:
        return now - p.last_sent < WELCOME_GRACE_S
    return p.connecting() and now - p.last_heard < WELCOME_GRACE_S
