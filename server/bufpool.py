"""Output buffers for every client's batches: `BufferRing` chunks under one global cap.

The streams bound what each client may hold (see `streams.py`: its work-ahead in production
or ready, plus as many sent batches ZeroMQ still holds); this pool bounds what all of them hold
together, whatever the number of clients: never more than ``max_buffers`` batch buffers exist.
It hands out free buffers, adds a chunk when all are held (never per batch: pinned allocation
is slow), and gives chunks back to the system once no client needs them (`trim`).

Who may take a buffer when it is scarce (`may_lend`, the rule README states):

- a client that holds no buffer may take any free one: ``reserve`` buffers are kept for such
  clients, so a new client gets its batches even while others hold everything they may and
  never read;
- any other client takes only from the rest (``max_buffers - reserve``), and only while it holds
  fewer than its share of them: that rest divided by the clients holding or wanting buffers.

A client over its share (it took them before others came) keeps what it holds until it reads
its batches or leaves; it only takes no more. So a new client gets a buffer at once while fewer
than ``max_buffers`` other clients hold batches they do not take; beyond that, when one of
them is freed: a tcp:// client whose socket stays full for --stall-timeout is disconnected
(TCP_USER_TIMEOUT), which frees what ZeroMQ held for it. Used from the ROUTER loop thread only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from batchwire.pipeline.buffers import BufferRing
from batchwire.wire import BatchSpec

log = logging.getLogger("batchwire.server")

#: Buffers allocated at once when every allocated buffer is held.
CHUNK = 8
#: Clients served at full work-ahead by the default cap (a node of 8 GPUs, one rank each).
DEFAULT_FULL_CLIENTS = 8


def default_max_buffers(producers: int, prefetch_depth: int) -> int:
    """The default --max-buffers: ``DEFAULT_FULL_CLIENTS`` clients at their full share
    (2 x prefetch-depth each: work-ahead plus as many in ZeroMQ's hands) plus the producers' jobs
    (2 x producers: one in production and one queued per producer)."""
    return 2 * producers + 2 * prefetch_depth * DEFAULT_FULL_CLIENTS


def default_reserve(max_buffers: int, producers: int) -> int:
    """Buffers only clients holding none may take: one per producer, at most a quarter."""
    return max(1, min(producers, max_buffers // 4))


@dataclass(eq=False)
class Slot:
    """A buffer on loan: its tensor (the batch's memory) and the ring it goes back to."""

    tensor: torch.Tensor
    ring: BufferRing


class BufferPool:
    """Hands out batch tensors of one `BatchSpec`, at most ``max_buffers`` of them, allocated
    ``chunk`` at a time."""

    def __init__(
        self,
        spec: BatchSpec,
        max_buffers: int,
        reserve: int = 1,
        chunk: int = CHUNK,
        pin: bool | None = None,
    ) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self.spec = spec
        self.max_buffers = int(max_buffers)
        self.reserve = max(0, min(int(reserve), self.max_buffers))
        self.chunk = chunk
        self.pin = pin
        self._rings: list[BufferRing] = []
        self.held = 0
        self.peak = 0  # most buffers allocated at once

    @property
    def capacity(self) -> int:
        """Buffers allocated now (held or free)."""
        return sum(len(r) for r in self._rings)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._rings)

    @property
    def shared(self) -> int:
        """Buffers clients that already hold some may share (the cap less the reserve)."""
        return self.max_buffers - self.reserve

    def share(self, clients: int) -> int:
        """What each of ``clients`` clients holding or wanting buffers may hold of the shared
        part, at least 1."""
        return max(1, self.shared // max(1, clients))

    def may_lend(self, holding: int, share: int) -> bool:
        """May a client that holds ``holding`` buffers take another (see the module doc)?"""
        if self.held >= self.max_buffers:
            return False
        if holding == 0:
            return True
        return self.held < self.shared and holding < share

    def acquire(self) -> Slot:
        """A free buffer; allocates a chunk when every buffer is held. The caller checked
        `may_lend` (RuntimeError past the cap: a bug, never a silent excess)."""
        if self.held >= self.max_buffers:
            raise RuntimeError(f"all {self.max_buffers} batch buffers are held")
        for ring in self._rings:  # the first rings first: the last ones drain, to be trimmed
            if ring.free:
                self.held += 1
                return Slot(ring.acquire(timeout=0), ring)
        count = min(self.chunk, self.max_buffers - self.capacity)
        ring = BufferRing.for_spec(count, self.spec, self.pin)
        self._rings.append(ring)
        self.peak = max(self.peak, self.capacity)
        log.debug(
            "batch buffers: %d of at most %d (%.1f MB%s)",
            self.capacity,
            self.max_buffers,
            self.nbytes / 1e6,
            ", pinned" if ring.pinned else "",
        )
        self.held += 1
        return Slot(ring.acquire(timeout=0), ring)

    def release(self, slot: Slot) -> None:
        slot.ring.release(slot.tensor)
        self.held -= 1

    def trim(self, keep: int) -> int:
        """Free whole chunks whose buffers are all free, last ones first, while at least
        ``keep`` buffers stay allocated; returns the number of buffers freed."""
        freed = 0
        capacity = self.capacity
        for ring in reversed(list(self._rings)):
            if capacity - len(ring) < keep:
                continue
            if ring.idle:
                self._rings.remove(ring)
                capacity -= len(ring)
                freed += len(ring)
        if freed:
            if self.pin:
                # Pinned blocks go back to torch's caching host allocator, not the system.
                empty = getattr(torch._C, "_host_emptyCache", None)
                if empty is not None:
                    empty()
            log.debug(
                "batch buffers: freed %d, %d left (%.1f MB)", freed, capacity, self.nbytes / 1e6
            )
        return freed
