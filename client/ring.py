"""Host buffers that batches are received into, and the views that turn bytes into tensors.

Two policies, chosen by the target device:

- CPU: nothing is recycled behind the user's back. Received bytes are used where ZeroMQ put
  them (`staging.CpuStager`), and a normalised batch is written into a `RecyclingPool` buffer
  that is reused only once no tensor, view or array refers to it any more: a yielded tensor is
  the user's for as long as they keep it. Why a pool at all: a fresh 38 MB tensor per batch
  costs ~9,000 page faults (glibc maps allocations that large afresh every time), more CPU
  than the arithmetic that fills it.
- CUDA: a fixed ring of pinned slots (`SlotRing`), so ``recv_into`` writes straight into
  page-locked memory that the copy engine can read asynchronously; `staging.CudaStager` owns
  the device half of each slot and the events that say when a slot may be reused.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from batchwire import wire

log = logging.getLogger(__name__)


def labels_fixup(labels: torch.Tensor) -> torch.Tensor:
    """Labels travel little-endian; swap them in place on the rare big-endian host."""
    if sys.byteorder != "little":
        labels.copy_(torch.from_numpy(labels.numpy().byteswap()))
    return labels


def writable(t: torch.Tensor, nbytes: int) -> memoryview:
    """A writable memoryview over the first ``nbytes`` bytes of a contiguous CPU tensor."""
    return memoryview(t.view(torch.uint8).numpy())[:nbytes]


@dataclass(eq=False)
class HostSlot:
    """Receive buffers for one batch: raw image bytes and int64 labels (CPU memory)."""

    images: torch.Tensor  # uint8 [capacity]
    labels: torch.Tensor  # int64 [max batch size]
    index: int = -1  # position in its ring; -1 for a one-off CPU slot
    #: Device half and events, owned by `staging.CudaStager` (None on the CPU path).
    device: object | None = field(default=None, repr=False)

    def images_buffer(self, nbytes: int) -> memoryview:
        if nbytes > self.images.numel():
            raise wire.ProtocolError(
                f"batch of {nbytes} bytes does not fit the {self.images.numel()}-byte receive "
                "buffer sized from the server's welcome"
            )
        return writable(self.images, nbytes)

    def labels_buffer(self, batch_size: int) -> memoryview:
        if batch_size > self.labels.numel():
            raise wire.ProtocolError(
                f"batch of {batch_size} labels exceeds the welcome's batch size "
                f"{self.labels.numel()}"
            )
        return writable(self.labels, batch_size * 8)


class SlotRing:
    """A fixed set of pinned host slots handed out and returned by index.

    The ring only tracks which slots are free; *when* a returned slot's memory is really free
    (its copy finished, the consumer stream is done) is the stager's business.
    """

    def __init__(self, count: int, nbytes: int, batch_size: int, pin: bool) -> None:
        if count < 1:
            raise ValueError(f"a slot ring needs at least one slot, got {count}")
        self.slots = [
            HostSlot(
                images=torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin),
                labels=torch.empty(batch_size, dtype=torch.int64, pin_memory=pin),
                index=i,
            )
            for i in range(count)
        ]
        # First in, first out: a returned slot is reused last, which gives the events guarding
        # it the most time to complete before anyone has to wait on them.
        self._free = deque(range(count))

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def free(self) -> int:
        return len(self._free)

    def acquire(self) -> HostSlot:
        if not self._free:
            raise wire.ProtocolError(
                "no free receive slot: the server sent more batches than it was credited"
            )
        return self.slots[self._free.popleft()]

    def give_back(self, slot: HostSlot) -> None:
        if slot.index in self._free:
            raise RuntimeError(f"slot {slot.index} returned twice")
        self._free.append(slot.index)


def _storage_use_count(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (views, numpy arrays over it, saved tensors...)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _use_count_works() -> bool:
    """Does this torch count storage users as `RecyclingPool` relies on? (checked, not assumed)"""
    try:
        base = torch.empty(64, dtype=torch.uint8)
        idle = _storage_use_count(base)
        view = base[8:].view(torch.int32)
        arr = base.numpy()
        held = _storage_use_count(base)
        del view, arr
        return held == idle + 2 and _storage_use_count(base) == idle
    except Exception:  # any failure means: do not recycle
        return False


class RecyclingPool:
    """Buffers handed to the user as fresh views, each reused only once nobody refers to it.

    A buffer is free when its storage has no user but the pool's own tensor: every tensor that
    views it (the yielded one, slices of it, ``.numpy()`` arrays, tensors autograd saved)
    holds a reference to the storage, counted by torch. A storage that became shared memory
    (sent to another process) is never reused. If this torch's counting does not behave as
    checked at start-up, nothing is recycled: every ``take`` allocates.
    """

    def __init__(self, make: Callable[[], torch.Tensor], size: int) -> None:
        self._make = make
        self._size = size
        self._enabled = size > 0 and _use_count_works()
        if size > 0 and not self._enabled:
            log.info("this torch's storage use count is unusable: output buffers are not reused")
        # (pool's tensor, its idle use count), oldest first. When all are held, a new buffer
        # replaces the oldest: batches a user keeps for good leave the pool, not block it.
        self._buffers: deque[tuple[torch.Tensor, int]] = deque(maxlen=max(size, 1))
        self.allocated = 0

    def take(self) -> torch.Tensor:
        """A buffer nobody else refers to; the caller hands out views of it, never itself."""
        if self._enabled:
            for i, (buf, idle) in enumerate(self._buffers):
                if _storage_use_count(buf) == idle:
                    if buf.untyped_storage().is_shared():
                        del self._buffers[i]  # another process may map it: never reuse
                        break
                    return buf
        buf = self._make()
        self.allocated += 1
        if self._enabled:
            self._buffers.append((buf, _storage_use_count(buf)))
        return buf
