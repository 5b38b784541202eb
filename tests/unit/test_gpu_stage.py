"""DeviceToHostStager: asynchronous device-to-host copies into pinned ring buffers."""

from __future__ import annotations

import pytest
import torch
from batchwire.pipeline.buffers import BufferRing
from batchwire.pipeline.gpu_stage import DeviceToHostStager

CUDA = torch.cuda.is_available()


def test_refuses_a_cpu_device():
    ring = BufferRing(1, (2, 3, 4, 4), torch.uint8, pin=False)
    with pytest.raises(ValueError, match="CUDA device"):
        DeviceToHostStager("cpu", ring)


@pytest.mark.skipif(CUDA, reason="checks the error without CUDA")
def test_without_cuda_is_a_clear_error():
    ring = BufferRing(1, (2, 3, 4, 4), torch.uint8, pin=False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        DeviceToHostStager("cuda", ring)


def test_ring_buffers_have_the_requested_layout():
    ring = BufferRing(2, (2, 3, 4, 5), torch.uint8, torch.channels_last, pin=False)
    assert all(t.is_contiguous(memory_format=torch.channels_last) for t in ring.buffers)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_channels_last_ring_buffers_are_really_pinned():
    """A pinned tensor made channels_last by `.contiguous()` is an unpinned copy, and the
    device-to-host copies into it would silently stop being asynchronous."""
    ring = BufferRing(2, (2, 3, 4, 5), torch.uint8, torch.channels_last, pin=True)
    assert all(t.is_pinned() for t in ring.buffers)
    assert all(t.is_contiguous(memory_format=torch.channels_last) for t in ring.buffers)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_staged_batches_arrive_intact_and_overlap():
    shape = (8, 3, 64, 64)
    ring = BufferRing(2, shape, torch.uint8, torch.channels_last, pin=True)
    stager = DeviceToHostStager("cuda", ring)
    with pytest.raises(ValueError, match="pinned"):
        DeviceToHostStager("cuda", BufferRing(1, shape, torch.uint8, pin=False))
    side = torch.cuda.Stream()
    staged, expected = [], []
    with torch.cuda.stream(side):  # the producer's own stream: the stager must order after it
        for _ in range(2):
            batch = torch.randint(0, 255, shape, dtype=torch.uint8, device="cuda")
            batch = batch.contiguous(memory_format=torch.channels_last)
            expected.append(batch.cpu())
            staged.append(stager.stage(batch))
            del batch  # record_stream keeps the memory until the copy is done
    for s, e in zip(staged, expected, strict=True):
        host = s.wait()
        assert s.ready() and host.is_pinned() and torch.equal(host, e)
    assert ring.free == 0
    with pytest.raises(ValueError, match="does not fit"):
        stager.stage(torch.zeros((1, 3, 64, 64), dtype=torch.uint8, device="cuda"))
    for s in staged:
        ring.release(s.host)
