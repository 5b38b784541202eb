"""Host buffers that batches are received into, and the views that turn bytes into tensors.

Two policies, chosen by the target device:

- CPU: every batch gets freshly allocated tensors. A yielded tensor is then the user's to keep
  for as long as they like (no ring semantics to explain), and the allocation is cheap next to
  receiving megabytes.
- CUDA: a fixed ring of pinned slots (`SlotRing`), so ``recv_into`` writes straight into
  page-locked memory that the copy engine can read asynchronously; `prefetch.CudaStager` owns
  the device half of each slot and the events that say when a slot may be reused.
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass, field

import torch
from batchwire.server import protocol


def images_view(flat: torch.Tensor, shape: list[int], dtype: str, layout: str) -> torch.Tensor:
    """View the first bytes of ``flat`` (uint8) as the logical ``[B, 3, H, W]`` batch.

    ``layout="nhwc"`` bytes become a channels_last tensor (same logical shape, NHWC strides).
    """
    b, c, h, w = shape
    nbytes = protocol.images_nbytes(shape, dtype)
    typed = flat[:nbytes].view(protocol.torch_dtype(dtype))
    if layout == "nhwc":
        return typed.view(b, h, w, c).permute(0, 3, 1, 2)
    return typed.view(b, c, h, w)


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
    #: Device half and events, owned by `prefetch.CudaStager` (None on the CPU path).
    device: object | None = field(default=None, repr=False)

    def images_buffer(self, nbytes: int) -> memoryview:
        if nbytes > self.images.numel():
            raise protocol.ProtocolError(
                f"batch of {nbytes} bytes does not fit the {self.images.numel()}-byte receive "
                "buffer sized from the server's welcome"
            )
        return writable(self.images, nbytes)

    def labels_buffer(self, batch_size: int) -> memoryview:
        if batch_size > self.labels.numel():
            raise protocol.ProtocolError(
                f"batch of {batch_size} labels exceeds the welcome's batch size "
                f"{self.labels.numel()}"
            )
        return writable(self.labels, batch_size * 8)


def fresh_slot(nbytes: int, batch_size: int) -> HostSlot:
    """A one-off slot for the CPU path (the yielded tensors own this memory)."""
    return HostSlot(
        images=torch.empty(nbytes, dtype=torch.uint8),
        labels=torch.empty(batch_size, dtype=torch.int64),
    )


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
            raise protocol.ProtocolError(
                "no free receive slot: the server sent more batches than it was credited"
            )
        return self.slots[self._free.popleft()]

    def give_back(self, slot: HostSlot) -> None:
        if slot.index in self._free:
            raise RuntimeError(f"slot {slot.index} returned twice")
        self._free.append(slot.index)
