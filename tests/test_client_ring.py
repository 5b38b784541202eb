"""The client's receive slots and byte views (the CUDA ring's host half runs here unpinned)."""

from __future__ import annotations

import pytest
import torch
from batchwire.client import ProtocolError
from batchwire.client.ring import SlotRing, images_view, writable


def test_ring_reuses_returned_slots_last_and_refuses_overdraw():
    ring = SlotRing(3, nbytes=48, batch_size=2, pin=False)
    a, b = ring.acquire(), ring.acquire()
    ring.give_back(a)
    assert ring.acquire() is ring.slots[2], "a returned slot must wait behind the free ones"
    assert ring.acquire() is a
    with pytest.raises(ProtocolError, match="more batches than it was credited"):
        ring.acquire()
    ring.give_back(b)
    with pytest.raises(RuntimeError, match="returned twice"):
        ring.give_back(b)


def test_buffers_refuse_frames_larger_than_the_welcome():
    slot = SlotRing(1, nbytes=48, batch_size=2, pin=False).acquire()
    assert len(slot.images_buffer(48)) == 48 and len(slot.labels_buffer(2)) == 16
    with pytest.raises(ProtocolError, match="does not fit"):
        slot.images_buffer(49)
    with pytest.raises(ProtocolError, match="exceeds the welcome's batch size"):
        slot.labels_buffer(3)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_images_view_reads_the_bytes_a_server_sends(dtype, layout):
    batch = (torch.arange(2 * 3 * 4 * 5) % 251).to(dtype).view(2, 3, 4, 5)
    if layout == "nhwc":
        batch = batch.contiguous(memory_format=torch.channels_last)
        wire = batch.permute(0, 2, 3, 1).contiguous()  # NHWC bytes, as the server sends them
    else:
        wire = batch.contiguous()
    flat = torch.empty(1000, dtype=torch.uint8)  # larger than the batch, like a ring slot
    raw = wire.reshape(-1).view(torch.uint8)
    writable(flat, raw.numel())[:] = raw.numpy().tobytes()
    view = images_view(flat, [2, 3, 4, 5], str(dtype).removeprefix("torch."), layout)
    assert view.shape == (2, 3, 4, 5) and view.dtype == dtype
    assert torch.equal(view, batch)
    assert view.is_contiguous(memory_format=torch.channels_last) == (layout == "nhwc")
