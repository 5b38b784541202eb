"""The batches of one epoch that no server has been asked for yet.

Any server can produce any batch (a batch is a pure function of seed, epoch, rank, world size
and index), so the loader does not split an epoch between its servers up front: it hands the
lowest unasked batch to whichever server has room, and a lost server's batches come back here
to go to the others. Lowest first keeps the reorder buffer short: the batch the trainer needs
next is always the one asked for earliest.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable


class UnaskedBatches:
    """Batch indices ``[start, total)`` not yet asked of any server, lowest first."""

    def __init__(self) -> None:
        self._fresh = 0  # lowest index never handed out
        self._returned: list[int] = []  # handed out, then given back (a heap)
        self.total: int | None = None  # unknown until the first welcome

    def reset(self, start: int, total: int | None) -> None:
        self._fresh, self._returned, self.total = start, [], total

    def set_total(self, total: int) -> None:
        self.total = total
        self._returned = [k for k in self._returned if k < total]
        heapq.heapify(self._returned)

    def __bool__(self) -> bool:
        """Is there a batch left to hand out? (Nothing is, before the epoch's length is known.)"""
        return bool(self._returned) or (self.total is not None and self._fresh < self.total)

    def take(self) -> int:
        """The lowest batch left; only call when there is one."""
        if self._returned and (
            self.total is None or self._fresh >= self.total or self._returned[0] < self._fresh
        ):
            return heapq.heappop(self._returned)
        k = self._fresh
        self._fresh += 1
        return k

    def give_back(self, indices: Iterable[int]) -> None:
        """Batches a lost server will not deliver: the next servers with room get them."""
        for k in indices:
            heapq.heappush(self._returned, k)
