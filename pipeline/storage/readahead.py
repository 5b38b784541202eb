"""Members read for batches still to come, held until their batch takes them.

A shuffled batch of 50 holds about 7 members of each 16 MB shard, ~2 MB apart: too far apart
to share a GET (`coalesce`), so a batch costs ~31 GETs. The sampler knows the next batches of
the epoch (a pure function of seed, epoch, rank, world size, batch size), so a batch's read can
take along the members of the next few batches that lie in the shards it reads: 8 batches'
members per shard are ~0.3 MB apart and share GETs (5 GETs per 50 images instead of 37 in the
simulation of bench/RESULTS.md, at no more bytes per image). Those members wait here until
their batch comes.

Two reads bring a window: the batch that finds its own members missing (the first batch of an
epoch, or one after a miss) reads them and, in the same requests, the next `batches // 2 - 1`
batches' members of the shards it reads (half a window: it is waited for); and once a batch
finds that the members held or in flight run out within `batches // 2` batches, it hands the
next window (`batches` batches, all their shards) to a background read (`Claim.later`) and
goes on with its own: the next window arrives while this one is decoded, so no producer waits
for a window's GETs.

`ReadAhead` is that waiting room, one per split (a tar split's `TarReader` holds it):

- bounded: members held plus members in flight for later batches never exceed `budget`
  bytes (sizes are known from the shard index before a byte is read); a member that does not
  fit is not read along (its batch reads it), and room is made by dropping the oldest held
  members first (leftovers of an earlier window that no batch took);
- shared: a member in flight for a later batch is awaited by that batch's producer thread,
  never fetched twice; the reader settles its fetch before it waits for anyone's, so no two
  threads wait on each other;
- short-lived: a member is dropped once taken, and everything held when a newer epoch's batch
  reads (the next epoch's order is another permutation);
- read once: producers run batches out of order, so a window may hold a batch another
  producer already read; the last `SEEN` members taken or fetched this epoch are remembered
  and not read along again.

What is held is what the read returned, an error included: a member that failed while read
along is still its own batch's failed read (a counted bad sample there, a transient error
retried there). Nothing here judges bytes: the sample loader verifies them as any read's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

#: Bytes one split may hold for upcoming batches (held and in flight together): a window
#: being read plus what is left of the one before (8 + 4 batches of 50 members of 110 kB).
DEFAULT_BUDGET = 64 << 20
#: Upcoming batches whose members a read takes along (the simulation's 8: ~5 GETs per batch
#: of 50 on 16 MB shards); the budget may cut the window shorter.
DEFAULT_BATCHES = 8
#: Members taken or fetched this epoch remembered, not to be read along again (~1.5 MB; five
#: windows of 12 batches of 256).
SEEN = 16384

Got = bytes | OSError


class _Flight:
    """A member being read along by one thread; others wait on `done`."""

    def __init__(self) -> None:
        self.done = threading.Event()


@dataclass
class Claim:
    """One read's share of the work (`ReadAhead.claim`): `taken`, own members found held;
    `fetch`, own members this read must get; `along`, upcoming members it reads too (its
    flights); `waits`, own members in flight for another read, to await; `later`, the next
    window for a background read (its own `along`, settled when that read returns)."""

    epoch: int
    taken: dict[int, Got] = field(default_factory=dict)
    fetch: list[int] = field(default_factory=list)
    along: list[int] = field(default_factory=list)
    waits: dict[int, _Flight] = field(default_factory=dict)
    later: Claim | None = None


class ReadAhead:
    """Members (by sample index) read for upcoming batches: see the module doc.

    Counters (`counters()`): `taken` members a batch found here (held or awaited), `along`
    members read for a later batch, `dropped` members read along that no batch took (evicted
    for room, or their epoch passed), `held_bytes` / `flight_bytes` now."""

    def __init__(self, budget: int = DEFAULT_BUDGET, batches: int = DEFAULT_BATCHES) -> None:
        if budget < 0 or batches < 0:
            raise ValueError(f"read-ahead budget and batches must be >= 0: {budget}, {batches}")
        self.budget = int(budget)
        self.batches = int(batches)
        self._lock = threading.Lock()
        self._epoch = -1
        self._held: OrderedDict[int, tuple[Got, int]] = OrderedDict()  # oldest first
        self._held_bytes = 0
        self._flights: dict[int, tuple[_Flight, int]] = {}  # index -> (flight, bytes)
        self._flight_bytes = 0
        self._seen: OrderedDict[int, None] = OrderedDict()  # the last SEEN, oldest first
        self._taken = self._along = self._dropped = 0

    @property
    def wants(self) -> int:
        """Upcoming batches a read is to be handed: up to the end of a window read in the
        background from `batches // 2` batches ahead."""
        return self.batches + self.batches // 2

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {
                "taken": self._taken,
                "along": self._along,
                "dropped": self._dropped,
                "held_bytes": self._held_bytes,
                "flight_bytes": self._flight_bytes,
            }

    def claim(
        self,
        epoch: int,
        own: Iterable[int],
        upcoming: Sequence[Sequence[int]],
        size: Callable[[int], int],
        along_with: Callable[[Sequence[int]], Callable[[int], bool]],
    ) -> Claim:
        """Split the read of ``own`` (this batch's members) of ``epoch``: members held are
        taken, members in flight awaited, the rest fetched. ``upcoming``: the next batches'
        members, batch by batch. When something is fetched, the members of the next
        `batches // 2 - 1` batches that ``along_with(fetch)`` accepts (e.g. those in the shards
        the fetch reads) and that are neither held nor in flight are read along while they
        fit the budget; when nothing is, and the next `batches // 2` batches hold a member
        neither held nor in flight, the window from that batch on is `later`'s (module doc).
        Only a batch of the newest epoch reads ahead (a newer epoch first drops what is
        held)."""
        claim = Claim(int(epoch))
        with self._lock:
            if claim.epoch > self._epoch:
                self._epoch = claim.epoch
                self._drop(list(self._held))
                self._seen.clear()
            for i in dict.fromkeys(int(i) for i in own):
                if i in self._held:
                    claim.taken[i] = self._take(i)
                elif i in self._flights:
                    claim.waits[i] = self._flights[i][0]
                else:
                    claim.fetch.append(i)
                    self._see(i)
            if claim.epoch != self._epoch or not upcoming:
                return claim
            if claim.fetch:
                window = [i for batch in upcoming[: self.batches // 2 - 1] for i in batch]
                self._plan_along(claim, window, size, along_with(claim.fetch))
                return claim
            start = self._first_uncovered(upcoming[: self.batches // 2])
            if start is not None:
                later = Claim(claim.epoch)
                window = [i for batch in upcoming[start : start + self.batches] for i in batch]
                self._plan_along(later, window, size, lambda i: True)
                claim.later = later if later.along else None
        return claim

    def _first_uncovered(self, batches: Sequence[Sequence[int]]) -> int | None:
        """The first of ``batches`` with a member neither held nor in flight (lock held)."""
        for k, batch in enumerate(batches):
            if any(self._uncovered(int(i)) for i in batch):
                return k
        return None

    def _uncovered(self, i: int) -> bool:
        """Whether member ``i`` is neither held, in flight nor read this epoch (lock held)."""
        return i not in self._held and i not in self._flights and i not in self._seen

    def _see(self, i: int) -> None:
        self._seen[i] = None
        self._seen.move_to_end(i)
        if len(self._seen) > SEEN:
            self._seen.popitem(last=False)

    def _plan_along(
        self,
        claim: Claim,
        upcoming: Sequence[int],
        size: Callable[[int], int],
        wanted: Callable[[int], bool],
    ) -> None:
        """The members ``claim`` reads along: in order, while they fit (lock held)."""
        mine = set(claim.fetch)
        for i in dict.fromkeys(int(i) for i in upcoming):
            if i in mine or not self._uncovered(i) or not wanted(i):
                continue
            n = int(size(i))
            if not self._room(n):
                break  # the window ends here: later members are later batches'
            self._flights[i] = (_Flight(), n)
            self._flight_bytes += n
            claim.along.append(i)
            mine.add(i)

    def _room(self, n: int) -> bool:
        """Whether ``n`` more bytes fit, dropping the oldest held members if need be."""
        if n + self._flight_bytes > self.budget:
            return False
        while self._held and n + self._flight_bytes + self._held_bytes > self.budget:
            self._drop([next(iter(self._held))])
        return n + self._flight_bytes + self._held_bytes <= self.budget

    def settle(self, claim: Claim, got: dict[int, Got]) -> None:
        """What ``claim``'s read returned for its `along` members (a member missing from
        ``got``: the read failed as a whole, so nothing is held and its waiters read it
        themselves): held while the epoch lasts, and their waiters woken. Call it once, in a
        `finally`, before awaiting anything."""
        with self._lock:
            for i in claim.along:
                flight, n = self._flights.pop(i)
                self._flight_bytes -= n
                data = got.get(i)
                if data is None or claim.epoch != self._epoch:
                    self._dropped += data is not None
                else:
                    self._held[i] = (data, n)
                    self._held_bytes += n
                    self._along += 1
                flight.done.set()

    def await_claimed(self, claim: Claim) -> dict[int, Got]:
        """The members ``claim`` awaits, once their reads settled; a member whose read failed
        as a whole (or that another batch took first) is left out: read it yourself."""
        out: dict[int, Got] = {}
        for i, flight in claim.waits.items():
            flight.done.wait()
            with self._lock:
                if i in self._held:
                    out[i] = self._take(i)
        return out

    def _take(self, i: int) -> Got:
        data, n = self._held.pop(i)
        self._held_bytes -= n
        self._taken += 1
        self._see(i)
        return data

    def _drop(self, indices: list[int]) -> None:
        for i in indices:
            _, n = self._held.pop(i)
            self._held_bytes -= n
            self._dropped += 1
