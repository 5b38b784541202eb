"""Device-to-host staging of finished GPU batches into pinned ring buffers.

With `--device cuda` the server decodes and augments on the GPU but still sends from host
memory (ZeroMQ frames). The copy back must not stall the GPU work of the next batch, so it runs
on a stream of its own: the stager orders its stream after the producer's (`wait_stream`),
copies asynchronously into a pinned `BufferRing` buffer (pinned memory is what makes the copy
truly asynchronous), tells the caching allocator the device batch is in use on its stream
(`record_stream`), and records an event. The server adopts the host buffer once the event has
completed (`StagedBatch.wait()` / `ready()`) and releases it to the ring when ZeroMQ is done.

Importable without CUDA; constructing a stager without CUDA is a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from batchwire.pipeline.buffers import BufferRing


@dataclass
class StagedBatch:
    """A host buffer that an in-flight copy is filling, and the event that marks its end."""

    host: torch.Tensor
    event: torch.cuda.Event

    def ready(self) -> bool:
        """True once the copy has completed (never blocks)."""
        return bool(self.event.query())

    def wait(self) -> torch.Tensor:
        """Block the calling thread until the copy is done; returns the host buffer."""
        self.event.synchronize()
        return self.host


class DeviceToHostStager:
    """Copies device batches into `ring`'s pinned buffers on its own CUDA stream."""

    def __init__(self, device: str | torch.device, ring: BufferRing) -> None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device-to-host staging copies from a CUDA device, got {dev}")
        if not torch.cuda.is_available():
            raise RuntimeError("device-to-host staging needs CUDA, and torch sees no CUDA device")
        if ring.device.type != "cpu" or not ring.pinned:
            raise ValueError(
                "the staging ring must hold pinned CPU buffers (BufferRing(..., pin=True)); "
                "a pageable destination would make every copy synchronous"
            )
        self.device = torch.device("cuda", dev.index if dev.index is not None else 0)
        self.ring = ring
        self.stream = torch.cuda.Stream(device=self.device)

    def stage(self, batch: torch.Tensor, timeout: float | None = 60.0) -> StagedBatch:
        """Start copying `batch` (finished, or queued, on the current stream) into a ring buffer.

        Blocks only for a free buffer (`BufferTimeout` after `timeout`), never for the copy.
        """
        if batch.device != self.device:
            raise ValueError(f"batch is on {batch.device}, the stager copies from {self.device}")
        if tuple(batch.shape) != self.ring.shape or batch.dtype != self.ring.dtype:
            raise ValueError(
                f"batch {tuple(batch.shape)} {batch.dtype} does not fit the ring's "
                f"{self.ring.shape} {self.ring.dtype}"
            )
        host = self.ring.acquire(timeout)
        producer = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(producer)
        with torch.cuda.stream(self.stream):
            host.copy_(batch, non_blocking=True)
            batch.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
        return StagedBatch(host=host, event=event)
