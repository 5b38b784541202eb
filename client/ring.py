"""Host buffers that batches are received into, and the views that turn bytes into tensors.

Two policies, chosen by the target device:

- CPU: nothing is recycled behind the user's back. Received bytes are used where ZeroMQ put
  them (`staging.CpuStager`), and a normalised batch is written into a `RecycledBuffers` buffer
  that is reused only once no tensor, view or array refers to it any more: a yielded tensor is
  the user's for as long as they keep it. Why recycle at all: a fresh 38 MB tensor per batch
  costs ~9,000 page faults (glibc maps allocations that large afresh every time), more CPU
  than the arithmetic that fills it.
- CUDA: a fixed ring of pinned slots (`SlotRing`, one pinned block sliced into slots), so
  ``recv_into`` writes straight into page-locked memory that the copy engine can read
  asynchronously; `staging.CudaStager` owns the device half of each slot and the events that
  say when a slot may be reused. Only a CUDA target pins anything.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from batchwire import wire

log = logging.getLogger(__name__)


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


#: Each slot's images and labels start on a page boundary of the ring's one block: aligned for
#: any dtype view and for the copy engine.
SLOT_ALIGN = 4096


def _round_up(n: int, to: int) -> int:
    return -(-max(n, 1) // to) * to


class SlotRing:
    """A fixed set of host slots handed out and returned by index.

    All slots are views of **one** block, allocated once: pinned (``pin=True``) only when a
    GPU copy reads the slots, i.e. for a CUDA target (`staging.CudaStager`); nothing else needs
    page-locked memory. One block rather than one per slot because torch's pinned allocator
    rounds every block up to a power of two (a 9.6 MB batch would take 16 MiB per slot); only
    the whole block is rounded now. Whoever pins must make the target device current first
    (``torch.cuda.device``): the first pinned allocation of a process opens a CUDA context
    on the current device, GPU 0 unless told otherwise.

    The ring only tracks which slots are free; *when* a returned slot's memory is really free
    (its copy finished, the consumer stream is done) is the stager's business.
    """

    def __init__(self, count: int, nbytes: int, batch_size: int, pin: bool = False) -> None:
        if count < 1:
            raise ValueError(f"a slot ring needs at least one slot, got {count}")
        images_span = _round_up(nbytes, SLOT_ALIGN)
        labels_span = _round_up(batch_size * 8, SLOT_ALIGN)
        span = images_span + labels_span
        self.pinned = bool(pin)
        self.block = torch.empty(count * span, dtype=torch.uint8, pin_memory=self.pinned)
        self.slots = [
            HostSlot(
                images=self.block[i * span : i * span + nbytes],
                labels=self.block[
                    i * span + images_span : i * span + images_span + 8 * batch_size
                ].view(torch.int64),
                index=i,
            )
            for i in range(count)
        ]
        # First in, first out: a returned slot is reused last, which gives the events guarding
        # it the most time to complete before anyone has to wait on them.
        self._free = deque(range(count))

    @property
    def nbytes(self) -> int:
        """Bytes of the ring's block (before any rounding by the pinned allocator)."""
        return self.block.numel()

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
    """Does this torch count storage users as `RecycledBuffers` relies on? (checked, not assumed)"""
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


class RecycledBuffers:
    """Buffers handed to the user as fresh views, each reused only once nobody refers to it.

    A buffer is free when its storage has no user but our own tensor: every tensor that
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
        # (our tensor, its idle use count), oldest first. When all are held, a new buffer
        # replaces the oldest: batches a user keeps for good leave the set, not block it.
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
