"""Next epoch early: which server is asked for which of the next epoch's batches, and when.

Once every batch of the epoch has been asked for, a server owing nothing is sent the next
epoch's hello with `assignment.Assignment.share` of its batches (SPECULATING), so it produces
them while the consumer finishes this epoch; `fleet.Fleet.start` of that epoch adopts those
sessions, any other `start` ends them. A session not sent to for `ahead_max_age` seconds is
replaced on adoption (the server may have dropped it); a refused early hello stops guessing for
that epoch (`refused`).

`Speculation` decides; `fleet.Fleet` sends the hellos and adopts. No I/O, no clock.
"""

from __future__ import annotations

from batchwire.client.assignment import Assignment, candidates_of
from batchwire.client.session import Peer, PeerState
from batchwire.client.unasked import UnaskedBatches

# A next-epoch session we have not spoken to for this long may have been dropped by the server
# (its --client-timeout, 60 s by default, counts our silence): its batches already here are
# used, but it is replaced rather than trusted to send the rest.
AHEAD_MAX_AGE_S = 30.0


class Speculation:
    """Whether to ask ahead, and what: the next epoch's batches that prefer a server."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled)
        self.ahead_max_age = AHEAD_MAX_AGE_S
        self._refused_in = -1  # an epoch in which a next-epoch hello was refused

    def refused(self, epoch: int) -> None:
        """A next-epoch hello was refused during ``epoch``: no more guessing until it ends (if
        the server really refuses that epoch, the hello sent when it starts is refused then)."""
        self._refused_in = epoch

    def may(
        self,
        *,
        epoch: int,
        welcomed: bool,
        pass_start: int,
        resizing: bool,
        unasked: UnaskedBatches,
        unasked_next: UnaskedBatches,
    ) -> bool:
        """May the loader ask ahead now? Only once this ``epoch`` is all asked for (nothing
        ``unasked``) and some of the next is left; not in a resumed pass (its welcome does not
        say the next epoch's length), nor before a welcome, nor while the next epoch will ask
        another output size (``resizing``), nor after a refusal this epoch."""
        return not (
            not self.enabled
            or pass_start
            or not welcomed
            or epoch < 0
            or self._refused_in == epoch
            or resizing
            or unasked
            or not unasked_next
        )

    @staticmethod
    def ready(p: Peer) -> bool:
        """Is ``p`` free for the next epoch: in the fleet, idle or streaming and owing none?"""
        if p.retiring:
            return False
        return p.state is PeerState.IDLE or (p.state is PeerState.STREAMING and not p.outstanding())

    def pick(
        self,
        p: Peer,
        unasked_next: UnaskedBatches,
        peers: list[Peer],
        assignment: Assignment,
        epoch: int,
    ) -> list[int]:
        """The lowest of ``epoch``'s (the next one's) batches that prefer ``p``, up to a share,
        taken out of ``unasked_next`` (as the refill will ask them once that epoch starts: the
        jobs of a sweep then ask the same server for each one, whichever of their servers runs
        out of work first); [] when none does."""
        candidates = candidates_of(peers)
        n = max(1, len(candidates))
        share = assignment.share
        batches: list[int] = []
        others: list[int] = []
        looked_at = 0  # bounded: a few shares' worth, so a tick never walks a whole epoch
        while unasked_next and len(batches) < share and looked_at < 4 * share * n:
            looked_at += 1
            k = unasked_next.take()
            mine = assignment.preferred(k, candidates, epoch) is p
            (batches if mine else others).append(k)
        unasked_next.give_back(others)
        return batches

    def stale(self, p: Peer, now: float) -> bool:
        """Has ``p``'s next-epoch session gone unspoken to for too long to be trusted?"""
        return now - p.last_sent > self.ahead_max_age
