"""Turning received host bytes into the tensors the training loop gets, on CPU or CUDA.

`CudaStager` follows the usual double-buffering discipline (as in ffcv's epoch iterator): the
host-to-device copy (and optional normalisation) of a received batch is queued on a dedicated
side stream as soon as it arrives, an event marks its end, and the consumer's stream waits on
that event when the batch is handed out, so the copy overlaps the training step before it. A
slot is reused only when it is safe on both sides: its host memory after its previous copy's
event completed (the host is about to overwrite it), its device memory after an event recorded
on the consumer's stream when the *next* batch was requested (the GPU has finished every kernel
the training step queued on it).

`CpuStager` is the trivial counterpart: fresh tensors per batch, no streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from batchwire.client.normalize import channel_stats, normalize_uint8
from batchwire.client.ring import HostSlot, SlotRing, fresh_slot, images_view, labels_fixup
from batchwire.server import protocol


@dataclass(frozen=True)
class BatchFormat:
    """What the server's welcome promised, and what the loader should make of it."""

    shape: list[int]  # [B, 3, H, W] of a full batch
    dtype: str  # wire dtype
    layout: str
    normalize: bool  # uint8 wire -> float on the target device
    out_dtype: torch.dtype
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @property
    def nbytes(self) -> int:
        return protocol.images_nbytes(self.shape, self.dtype)


@dataclass(eq=False)
class Staged:
    """A received batch on its way to the consumer."""

    slot: HostSlot
    images: torch.Tensor
    labels: torch.Tensor


class CpuStager:
    """CPU target: receive into fresh tensors, normalise (if asked) on the CPU."""

    def __init__(self, fmt: BatchFormat) -> None:
        self.fmt = fmt
        self._mean = channel_stats(fmt.mean, "mean", torch.device("cpu"))
        self._std = channel_stats(fmt.std, "std", torch.device("cpu"))

    def acquire(self, header: protocol.BatchHeader) -> HostSlot:
        return fresh_slot(header.nbytes, header.batch_size)

    def stage(self, slot: HostSlot, header: protocol.BatchHeader) -> Staged:
        images = images_view(slot.images, header.shape, header.dtype, header.layout)
        labels = labels_fixup(slot.labels[: header.batch_size])
        if self.fmt.normalize:
            out = torch.empty_like(images, dtype=self.fmt.out_dtype)
            images = normalize_uint8(images, self._mean, self._std, out)
        return Staged(slot, images, labels)

    def hand_out(self, staged: Staged) -> None:
        pass

    def release(self, staged: Staged) -> None:
        pass

    def discard(self, staged: Staged) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(eq=False)
class _DeviceHalf:
    images: torch.Tensor  # uint8 [capacity] on the device
    labels: torch.Tensor  # int64 [B] on the device
    out: torch.Tensor | None  # normalised [B, 3, H, W] when normalising
    copied: torch.cuda.Event  # recorded on the side stream after the copy (and normalise)
    freed: torch.cuda.Event  # recorded on the consumer stream when the batch is released
    copy_pending: bool = False
    freed_recorded: bool = False
    consumer: torch.cuda.Stream | None = None


class CudaStager:
    """CUDA target: a ring of pinned slots, a side stream for copies, events for reuse."""

    def __init__(self, fmt: BatchFormat, device: torch.device, slots: int) -> None:
        self.fmt = fmt
        self.device = device
        b, c, h, w = fmt.shape
        self.ring = SlotRing(slots, fmt.nbytes, b, pin=True)
        self.stream = torch.cuda.Stream(device)
        self._mean = channel_stats(fmt.mean, "mean", device)
        self._std = channel_stats(fmt.std, "std", device)
        memory_format = torch.channels_last if fmt.layout == "nhwc" else torch.contiguous_format
        for slot in self.ring.slots:
            out = None
            if fmt.normalize:
                out = torch.empty(
                    (b, c, h, w), dtype=fmt.out_dtype, device=device, memory_format=memory_format
                )
            slot.device = _DeviceHalf(
                images=torch.empty(fmt.nbytes, dtype=torch.uint8, device=device),
                labels=torch.empty(b, dtype=torch.int64, device=device),
                out=out,
                copied=torch.cuda.Event(),
                freed=torch.cuda.Event(),
            )

    def acquire(self, header: protocol.BatchHeader) -> HostSlot:
        slot = self.ring.acquire()
        dev: _DeviceHalf = slot.device
        if dev.copy_pending:  # the host memory is about to be overwritten by recv_into
            dev.copied.synchronize()
            dev.copy_pending = False
        return slot

    def stage(self, slot: HostSlot, header: protocol.BatchHeader) -> Staged:
        dev: _DeviceHalf = slot.device
        b = header.batch_size
        nbytes = header.nbytes
        labels_fixup(slot.labels[:b])
        with torch.cuda.stream(self.stream):
            if dev.freed_recorded:  # the consumer's last kernels on this slot come first
                self.stream.wait_event(dev.freed)
            dev.images[:nbytes].copy_(slot.images[:nbytes], non_blocking=True)
            dev.labels[:b].copy_(slot.labels[:b], non_blocking=True)
            images = images_view(dev.images, header.shape, header.dtype, header.layout)
            if self.fmt.normalize:
                assert dev.out is not None
                images = normalize_uint8(images, self._mean, self._std, dev.out[:b])
            dev.copied.record(self.stream)
        dev.copy_pending = True
        return Staged(slot, images, dev.labels[:b])

    def hand_out(self, staged: Staged) -> None:
        dev: _DeviceHalf = staged.slot.device
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(dev.copied)
        dev.consumer = consumer

    def release(self, staged: Staged) -> None:
        dev: _DeviceHalf = staged.slot.device
        if dev.consumer is not None:
            dev.freed.record(dev.consumer)
            dev.freed_recorded = True
            dev.consumer = None
        self.ring.give_back(staged.slot)

    def discard(self, staged: Staged) -> None:
        """A batch that was received but never handed out (epoch restart, reconnect)."""
        self.ring.give_back(staged.slot)

    def close(self) -> None:
        """Wait for queued copies so no buffer is freed while the GPU still uses it."""
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
