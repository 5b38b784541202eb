"""Output buffers for every client's batches: `BufferRing` chunks under one global cap.

This module owns the memory only: it hands out free buffers, adds a chunk when all are held
(never per batch: pinned allocation is slow; a chunk is one block sliced into buffers, and a
pinned chunk holds as many as the block torch's pinned allocator rounds up to holds), and gives
chunks back to the system once no client needs them (`trim`). Who may borrow a buffer, and
when, is the core's decision, counted in `budget.BufferBudget`; the shell acquires and releases
here exactly as the core says, so never more than ``max_buffers`` batch buffers exist whatever
the clients do. Used from the ROUTER loop thread only.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from batchwire.pipeline.buffers import BufferRing, buffer_span, pinned_ring_size
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
    ``chunk`` at a time.

    ``flat``: each buffer is ``spec.nbytes`` of uint8 (``spec`` the largest batch: a server
    with --max-image-size writes smaller batches into their first bytes); a multi-view spec's
    buffers are always flat (its views back to back)."""

    def __init__(
        self,
        spec: BatchSpec,
        max_buffers: int,
        chunk: int = CHUNK,
        pin: bool | None = None,
        flat: bool = False,
        device: str = "cpu",
    ) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers must be >= 1, got {max_buffers}")
        self.spec = spec
        # The GPU whose copies read the buffers (--device): pinned blocks are allocated under
        # it (`_allocating_on`).
        self.device = torch.device(device)
        self.flat = flat or spec.multi_view
        self.max_buffers = int(max_buffers)
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
        """Bytes allocated for buffers: the rings' blocks (page-aligned buffers)."""
        return sum(r.block_nbytes for r in self._rings)

    def acquire(self) -> Slot:
        """A free buffer; allocates a chunk when every buffer is held. The core's budget decided
        the loan (RuntimeError past the cap: a bug, never a silent excess)."""
        if self.held >= self.max_buffers:
            raise RuntimeError(f"all {self.max_buffers} batch buffers are held")
        for ring in self._rings:  # the first rings first: the last ones drain, to be trimmed
            if ring.free:
                self.held += 1
                return Slot(ring.acquire(timeout=0), ring)
        room = self.max_buffers - self.capacity
        count = min(self.chunk, room)
        if self._pinned():  # fill the power of two the pinned allocator rounds the block to
            span = buffer_span((self.spec.nbytes,), torch.uint8)
            count = pinned_ring_size(count, span, room)
        with self._allocating_on():
            if self.flat:
                ring = BufferRing(count, (self.spec.nbytes,), torch.uint8, pin=self.pin)
            else:
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

    def _allocating_on(self) -> contextlib.AbstractContextManager:
        """The server's GPU as the current device while a pinned block is allocated. Where no
        CUDA context exists yet (the CPU decoder: the producers touch the GPU only later),
        torch's pinned allocator opens one on the thread's current device, GPU 0 for
        --device cuda:1: hundreds of MB on another job's GPU."""
        if self.device.type == "cuda" and self._pinned():
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _pinned(self) -> bool:
        """Whether new rings are pinned (`BufferRing`'s rule for ``pin=None``)."""
        return bool(self.pin) if self.pin is not None else torch.cuda.is_available()

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
