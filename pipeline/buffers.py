"""A ring of preallocated batch tensors, reused instead of allocating one per batch.

Allocating a fresh pinned tensor per batch is slow (cudaHostAlloc is a synchronising call that
costs milliseconds) and fragments memory; a fixed set of buffers also bounds how much memory
the pipeline can hold, which is what gives back-pressure its teeth. `acquire` blocks until a
buffer is free and fails loudly after a timeout instead of hanging when a consumer forgot to
release one.

A ring's buffers are page-aligned slices of **one** block (`BufferRing.block`), whatever the
memory, so pinned, unpinned and device rings share one layout and one accounting (`nbytes`). One
block rather than one allocation per buffer because torch's pinned allocator rounds every
allocation up to a power of two: a 38.5 MB batch pinned alone took 64 MiB (1.66x). Only the
block is rounded now, and `pinned_ring_size` sizes a pinned ring to fill its rounded block
(the client's `SlotRing` slices one pinned block the same way). Accounting: `block_nbytes`.

Unpinned CPU blocks are anonymous memory maps of their own (`host_buffer`), not malloc'd
blocks: when a ring is dropped its pages go back to the operating system at once, whereas
glibc keeps freed blocks of this size in its heap (its mmap threshold rises to 32 MB after the
first free), so a server whose clients left would keep its peak resident size for good.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence

import torch
from batchwire.wire import BatchSpec


def host_buffer(
    shape: Sequence[int],
    dtype: torch.dtype,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """An unpinned CPU tensor on its own anonymous memory map, unmapped when it is freed.

    Its pages are only resident once written, and return to the system when the tensor (and
    every view of it) is gone. Strides are those ``torch.empty`` gives ``memory_format``.
    """
    stride = torch.empty(tuple(shape), dtype=dtype, device="meta", memory_format=memory_format)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = stride.numel()
    mem = mmap.mmap(-1, max(1, numel * itemsize))
    flat = torch.frombuffer(mem, dtype=torch.uint8).view(dtype)  # the tensor keeps `mem` alive
    return flat.as_strided(tuple(shape), stride.stride())


#: Each buffer starts on a page boundary of its ring's block: aligned for any dtype view and
#: for the copy engine, and a freed ring's pages are whole.
BUFFER_ALIGN = 4096


def buffer_span(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes one buffer takes in its ring's block: its size rounded up to `BUFFER_ALIGN`."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    return -(-nbytes // BUFFER_ALIGN) * BUFFER_ALIGN


def pinned_ring_size(count: int, span: int, room: int) -> int:
    """How many buffers of `span` bytes a pinned ring of at least `count` should hold: as many
    as the block torch's pinned allocator really takes (the power of two at or above
    ``count * span``) holds, at most `room` (the pool's cap). Those buffers cost no memory
    beyond what `count` of them take anyway."""
    rounded = 1 << max(0, count * span - 1).bit_length()
    return max(1, min(room, max(count, rounded // span)))


def _block(nbytes: int, device: torch.device, pin: bool) -> torch.Tensor:
    """One uint8 block of `nbytes`: an anonymous map (unpinned CPU), pinned host memory, or
    device memory."""
    if device.type == "cpu" and not pin:
        return host_buffer((nbytes,), torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


def slice_buffer(
    block: torch.Tensor,
    offset: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    memory_format: torch.memory_format = torch.contiguous_format,
) -> torch.Tensor:
    """The tensor of `shape`, `dtype` and `memory_format` strides at byte `offset` of the
    uint8 `block` (offset a multiple of the item size): a view, sharing the block's memory."""
    strided = torch.empty(tuple(shape), dtype=dtype, device="meta", memory_format=memory_format)
    nbytes = strided.numel() * strided.element_size()
    flat = block[offset : offset + nbytes].view(dtype)
    return flat.as_strided(tuple(shape), strided.stride())


class BufferTimeout(TimeoutError):
    """No buffer came free in time: every buffer is held (a consumer did not release one?)."""


class BufferRing:
    """`count` preallocated tensors of one shape, dtype and memory format: slices of one block.

    CPU buffers are pinned (page-locked, for asynchronous host-to-device copies) when `pin` is
    True, or when it is None and CUDA is available. `device` may be a CUDA device, for batches
    produced on the GPU. `block_nbytes` is the block's size (each buffer's `span` times
    `count`), `nbytes` the buffers' own.
    """

    def __init__(
        self,
        count: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        memory_format: torch.memory_format = torch.contiguous_format,
        pin: bool | None = None,
        *,
        device: str | torch.device = "cpu",
    ) -> None:
        if count < 1:
            raise ValueError(f"a buffer ring needs at least 1 buffer, got {count}")
        self.device = torch.device(device)
        if pin is None:
            pin = self.device.type == "cpu" and torch.cuda.is_available()
        if pin and self.device.type != "cpu":
            raise ValueError(f"only CPU buffers can be pinned, not {self.device}")
        self.pinned = bool(pin)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        self.memory_format = memory_format
        self.span = buffer_span(self.shape, dtype)
        # One block, each buffer a view in its final layout (a `.contiguous(channels_last)`
        # of a pinned tensor would be a copy in ordinary, unpinned memory).
        self.block = _block(count * self.span, self.device, self.pinned)
        self.buffers: list[torch.Tensor] = [
            slice_buffer(self.block, i * self.span, self.shape, dtype, memory_format)
            for i in range(count)
        ]
        self._slot = {t.data_ptr(): i for i, t in enumerate(self.buffers)}
        self._free = list(range(count))
        self._cond = threading.Condition()

    @classmethod
    def for_spec(
        cls,
        count: int,
        spec: BatchSpec,
        pin: bool | None = None,
        *,
        device: str | torch.device = "cpu",
    ) -> BufferRing:
        """A ring of full batches as ``spec`` describes them (shape, dtype and layout). A
        multi-view spec's buffers are flat uint8 of ``spec.nbytes`` (its views back to back:
        `BatchSpec.view_bytes` gives the view tensors)."""
        if spec.multi_view:
            return cls(count, (spec.nbytes,), torch.uint8, pin=pin, device=device)
        return cls(count, spec.shape, spec.torch_dtype, spec.memory_format, pin, device=device)

    def __len__(self) -> int:
        return len(self.buffers)

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def idle(self) -> bool:
        """Every buffer is free: the ring may be dropped without pulling one from under anyone."""
        with self._cond:
            return len(self._free) == len(self.buffers)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers themselves (their batches)."""
        return sum(t.numel() * t.element_size() for t in self.buffers)

    @property
    def block_nbytes(self) -> int:
        """Bytes of the ring's block, what is allocated (before any rounding by the pinned
        allocator): `span` per buffer."""
        return self.block.numel()

    def acquire(self, timeout: float | None = 60.0) -> torch.Tensor:
        """A free buffer (oldest released first); BufferTimeout after `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout):
                raise BufferTimeout(
                    f"no free batch buffer after {timeout} s: all {len(self.buffers)} are held "
                    "(release() each acquired buffer when done with it)"
                )
            return self.buffers[self._free.pop(0)]

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer back; releasing a foreign or already-free buffer is an error."""
        slot = self._slot.get(buf.data_ptr())
        if slot is None:
            raise ValueError("release() of a tensor that is not one of this ring's buffers")
        with self._cond:
            if slot in self._free:
                raise ValueError("release() of a buffer that is already free")
            self._free.append(slot)
            self._cond.notify()
