"""Turning received host bytes into the tensors the training loop gets, on CPU or CUDA.

`CudaStager` follows the usual double-buffering discipline (as in ffcv's epoch iterator): the
host-to-device copy (and optional normalisation) of a received batch is queued on a dedicated
side stream (``copy_stream``) as soon as it arrives, an event marks its end, and the consumer's
stream waits on that event when the batch is handed out, so the copy overlaps the training step
before it. A slot is reused only when it is safe on both sides: its host memory after its
previous copy's event completed (the host is about to overwrite it), its device memory after an
event recorded on the consumer's stream when the *next* batch was requested (the GPU has
finished every kernel the training step queued on it): a `common.cuda_events.HandOff` per slot.

`CpuStager` is the CPU counterpart: no copy at all for the wire's own dtype (the yielded tensor
views the ZeroMQ frame it arrived in, and keeps it alive), and normalisation, when the batch is
handed out, straight into a recycled output buffer (see `ring.RecycledBuffers`).

Multi-view batches (`BatchSpec.views`) arrive as one frame holding the views back to back: one
slot, one copy, and ``Staged.images`` is the list of the views' tensors (``views_list[k]`` is
``[B, 3, Hk, Wk]``); normalisation runs per view, each into its own output (and scratch).

Both take a batch either received into a slot (``acquire``, ``recv_into``, ``stage``: the
CUDA path, whose slots are pinned) or as ZeroMQ frames (``stage_frames``: the CPU path, and
batches of the next epoch that arrived early).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from batchwire import wire
from batchwire.client.normalize import Affine, normalize_uint8
from batchwire.client.ring import HostSlot, RecycledBuffers, SlotRing
from batchwire.common.cuda_events import HandOff


@dataclass(frozen=True)
class BatchFormat:
    """What the server's welcome promised, and what the loader should make of it."""

    spec: wire.BatchSpec  # a full batch as the welcome described it
    normalize: bool  # uint8 wire -> float on the target device
    out_dtype: torch.dtype
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    label_width: int = 0  # K of a multi-label stream's [B, K] labels; 0: [B]
    num_classes: int = 0  # the welcome's: a label past it is a ProtocolError (0: unchecked)

    @property
    def labels_per_sample(self) -> int:
        return max(self.label_width, 1)

    def output(self, device: torch.device | str = "cpu", view: int = 0) -> torch.Tensor:
        """A full normalised batch (of view ``view``) in the wire's layout, on ``device``."""
        return self.spec.view_specs[view].empty(dtype=self.out_dtype, device=device)

    def scratch(self, device: torch.device | str = "cpu", view: int = 0) -> torch.Tensor:
        """float32 working memory for a normalisation into another float dtype."""
        return self.spec.view_specs[view].empty(dtype=torch.float32, device=device)

    @property
    def num_views(self) -> int:
        return len(self.spec.view_specs)


def _as_views(images: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    return images if isinstance(images, list) else [images]


def _like(images: torch.Tensor | list[torch.Tensor], views: list[torch.Tensor]) -> Any:
    return views if isinstance(images, list) else views[0]


@dataclass(eq=False)
class Staged:
    """A received batch on its way to the consumer."""

    slot: HostSlot | None  # None on the CPU path
    images: Any  # a tensor, or a list of one per view (multi-view)
    labels: torch.Tensor  # int64 [B], or [B, K] for a multi-label stream
    #: CPU: ``images`` is still the uint8 wire batch, normalised when handed out.
    normalize_pending: bool = False


def frame_tensor(frame: zmq.Frame, dtype: torch.dtype) -> torch.Tensor:
    """A flat uint8 tensor over ``frame``'s bytes, sharing them (and keeping the frame alive).

    Copied instead when the bytes are not aligned for ``dtype`` (ZeroMQ allocates large
    messages on their own, aligned; small ones may sit anywhere in its receive buffer).
    """
    flat = torch.frombuffer(frame.buffer, dtype=torch.uint8)
    if flat.data_ptr() % dtype.itemsize:
        flat = flat.clone()
    return flat


class CpuStager:
    """CPU target: tensors over the received frames, normalised (if asked) on the CPU."""

    wants_frames = True

    def __init__(self, fmt: BatchFormat, outputs: int) -> None:
        self.fmt = fmt
        self._affine = Affine.from_stats(fmt.mean, fmt.std, torch.device("cpu"))
        self._outputs: list[RecycledBuffers] = []
        self._scratch: list[torch.Tensor | None] = [None] * fmt.num_views
        if fmt.normalize:
            self._outputs = [
                RecycledBuffers(functools.partial(fmt.output, "cpu", k), outputs)
                for k in range(fmt.num_views)
            ]
            if fmt.out_dtype != torch.float32:  # never handed out: reused every batch
                self._scratch = [fmt.scratch("cpu", k) for k in range(fmt.num_views)]

    def stage_frames(
        self, header: wire.BatchHeader, images: zmq.Frame, labels: zmq.Frame
    ) -> Staged:
        spec = header.spec
        raw = spec.view_bytes(frame_tensor(images, spec.torch_dtype))
        own = torch.from_numpy(
            wire.labels_from_frame(
                labels.buffer,
                header.batch_size,
                width=header.label_width,
                num_classes=self.fmt.num_classes,
            )
        )
        return Staged(None, raw, own, normalize_pending=self.fmt.normalize)

    def hand_out(self, staged: Staged, stream: object = None) -> None:
        """Normalise now, not on arrival: a batch waiting in the reorder buffer (or several,
        arriving at once when an early epoch is adopted) costs no work before its turn, and
        only the batches handed out hold output buffers."""
        if not staged.normalize_pending:
            return
        assert self._outputs
        done = []
        for k, raw in enumerate(_as_views(staged.images)):
            b = raw.shape[0]
            out = self._outputs[k].take()[:b]  # a fresh view: it is what keeps the buffer taken
            scratch = self._scratch[k]
            scratch = None if scratch is None else scratch[:b]
            done.append(normalize_uint8(raw, self._affine, out, scratch))
        staged.images = _like(staged.images, done)
        staged.normalize_pending = False

    def release(self, staged: Staged) -> None:
        pass

    def discard(self, staged: Staged) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(eq=False)
class _DeviceHalf:
    images: torch.Tensor  # uint8 [capacity] on the device
    labels: torch.Tensor  # int64 [B * K] on the device (K = 1 unless multi-label)
    out: list[torch.Tensor] | None  # normalised [B, 3, H, W] per view when normalising
    #: ``ready``: recorded on the side stream after the copy (and normalise); ``freed``: on the
    #: stream the batch was handed out to, when it is released (common/cuda_events.py).
    hand: HandOff


class CudaStager:
    """CUDA target: a ring of pinned slots, a side stream for copies, events for reuse.

    Everything is created with the target device current (``torch.cuda.device``), the side
    stream first: creating it opens the device's context, so the pinned block (whose allocator
    uses any existing context, else the current device's) never opens one on GPU 0 of a rank
    that trains on another GPU.
    """

    wants_frames = False

    def __init__(self, fmt: BatchFormat, device: torch.device, slots: int) -> None:
        self.fmt = fmt
        self.device = device
        b = fmt.spec.batch_size
        k = fmt.labels_per_sample
        with torch.cuda.device(device):
            self.copy_stream = torch.cuda.Stream(device)
            # Pinned only for a real GPU copy (the CPU-side tests drive this class on "cpu").
            self.ring = SlotRing(slots, fmt.spec.nbytes, b * k, pin=device.type == "cuda")
            self._affine = Affine.from_stats(fmt.mean, fmt.std, device)
            self._scratch: list[torch.Tensor] | None = None
            for slot in self.ring.slots:
                out = None
                if fmt.normalize:
                    out = [fmt.output(device, k) for k in range(fmt.num_views)]
                    if fmt.out_dtype != torch.float32 and self._scratch is None:
                        # Used by the side stream only, one batch at a time.
                        self._scratch = [fmt.scratch(device, k) for k in range(fmt.num_views)]
                slot.device = _DeviceHalf(
                    images=torch.empty(fmt.spec.nbytes, dtype=torch.uint8, device=device),
                    labels=torch.empty(b * k, dtype=torch.int64, device=device),
                    out=out,
                    hand=HandOff(),
                )
            # The slots came from the caching allocator on the current stream (a block freed
            # there may still be read by its queued kernels); copy_stream writes them.
            self.copy_stream.wait_stream(torch.cuda.current_stream(device))

    def acquire(self, header: wire.BatchHeader) -> HostSlot:
        slot = self.ring.acquire()
        dev: _DeviceHalf = slot.device
        dev.hand.ready.synchronize()  # recv_into overwrites what the last copy reads
        return slot

    def stage(self, slot: HostSlot, header: wire.BatchHeader) -> Staged:
        dev: _DeviceHalf = slot.device
        b = header.batch_size
        w = header.label_width
        n = b * max(w, 1)  # labels in the frame
        nbytes = header.nbytes
        wire.labels_from_frame(
            slot.labels_buffer(n),
            b,
            out=slot.labels[:n].numpy(),
            width=w,
            num_classes=self.fmt.num_classes,
        )
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            dev.hand.before_write(self.copy_stream)  # the consumer's last kernels on it come first
            dev.images[:nbytes].copy_(slot.images[:nbytes], non_blocking=True)
            dev.labels[:n].copy_(slot.labels[:n], non_blocking=True)
            images = header.spec.view_bytes(dev.images)
            if self.fmt.normalize:
                assert dev.out is not None
                done = []
                for k, raw in enumerate(_as_views(images)):
                    scratch = None if self._scratch is None else self._scratch[k][:b]
                    done.append(normalize_uint8(raw, self._affine, dev.out[k][:b], scratch))
                images = _like(images, done)
            dev.hand.written(self.copy_stream)
        labels = dev.labels[:n].view(b, w) if w else dev.labels[:b]
        return Staged(slot, images, labels)

    def stage_frames(
        self, header: wire.BatchHeader, images: zmq.Frame, labels: zmq.Frame
    ) -> Staged:
        """A batch that arrived as frames (ahead of its epoch): copied into a pinned slot."""
        slot = self.acquire(header)
        slot.images_buffer(header.nbytes)[:] = images.buffer
        slot.labels_buffer(header.labels_nbytes // 8)[:] = labels.buffer
        return self.stage(slot, header)

    def consumer_stream(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Stream:
        """The stream a batch is handed to: ``stream``, else the device's current stream."""
        return stream if stream is not None else torch.cuda.current_stream(self.device)

    def hand_out(self, staged: Staged, stream: torch.cuda.Stream | None = None) -> None:
        """Make the consumer stream (``stream``, else the current one) wait for the copy; the
        slot is then guarded by that stream until `release`."""
        dev: _DeviceHalf = staged.slot.device
        dev.hand.hand_out(self.consumer_stream(stream))

    def release(self, staged: Staged) -> None:
        """The consumer is done with the batch: everything it queued on its stream so far must
        finish before the slot's device memory is written again."""
        dev: _DeviceHalf = staged.slot.device
        dev.hand.give_back()
        self.ring.give_back(staged.slot)

    def discard(self, staged: Staged) -> None:
        """A batch that was received but never handed out (epoch restart, reconnect)."""
        self.ring.give_back(staged.slot)

    def close(self) -> None:
        """Wait until no stream still reads or writes any slot, so freeing them is safe.

        Every slot: a batch still handed out is released on its consumer stream now, and each
        slot's last release event (on whatever stream the batch was handed to, not only the
        current one) and the side stream's queued copies are waited for.
        """
        with torch.cuda.device(self.device):
            for slot in self.ring.slots:
                hand: HandOff = slot.device.hand
                hand.give_back()
                hand.freed.synchronize()
                hand.ready.synchronize()
            self.copy_stream.synchronize()
