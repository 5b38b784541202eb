"""Output buffers for every client's batches: `BufferRing` chunks that grow on demand.

One fixed ring cannot serve an unknown number of clients fairly: a stalled client legitimately
holds up to its work-ahead depth plus its credits, and with a fixed total it would starve the
others. The streams bound what each client may hold (see `streams.py`), so the pool only has to
supply that: it hands out free buffers, adds a chunk when all are held, and never allocates per
batch (pinned allocation is slow). Used from the ROUTER loop thread only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from batchwire.pipeline.buffers import BufferRing
from batchwire.wire import BatchSpec

log = logging.getLogger("batchwire.server")


@dataclass(eq=False)
class Slot:
    """A buffer on loan: its tensor (the batch's memory) and the ring it goes back to."""

    tensor: torch.Tensor
    ring: BufferRing


class BufferPool:
    """Hands out batch tensors of one `BatchSpec`, growing by ``chunk`` buffers."""

    def __init__(self, spec: BatchSpec, chunk: int = 8, pin: bool | None = None) -> None:
        self.spec = spec
        self.chunk = chunk
        self.pin = pin
        self._rings: list[BufferRing] = []
        self.held = 0

    @property
    def capacity(self) -> int:
        return sum(len(r) for r in self._rings)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._rings)

    def acquire(self) -> Slot:
        """A free buffer; allocates a new chunk when every buffer is held."""
        for ring in self._rings:
            if ring.free:
                self.held += 1
                return Slot(ring.acquire(timeout=0), ring)
        ring = BufferRing.for_spec(self.chunk, self.spec, self.pin)
        self._rings.append(ring)
        log.debug(
            "batch buffers: %d (%.1f MB%s)",
            self.capacity,
            self.nbytes / 1e6,
            ", pinned" if ring.pinned else "",
        )
        self.held += 1
        return Slot(ring.acquire(timeout=0), ring)

    def release(self, slot: Slot) -> None:
        slot.ring.release(slot.tensor)
        self.held -= 1
