"""Batch buffers are slices of one block per ring (issue 25, defect 7): one pinned allocation
per server chunk, so torch's pinned allocator rounds the chunk, not every batch, up to a power
of two, and a pinned chunk is sized to fill what it rounds to. The slicing and accounting are
the same code for every kind of memory; here on unpinned CPU memory, pinned under CUDA."""

from __future__ import annotations

import pytest
import torch
from batchwire.pipeline.buffers import (
    BUFFER_ALIGN,
    BufferRing,
    buffer_span,
    pinned_ring_size,
)
from batchwire.server.bufpool import BufferPool
from batchwire.wire import BatchSpec

MiB = 2**20


def _check_ring(ring: BufferRing, count: int) -> None:
    base = ring.block.data_ptr()
    assert ring.block_nbytes == count * ring.span and ring.span % BUFFER_ALIGN == 0
    assert ring.nbytes == sum(t.numel() * t.element_size() for t in ring.buffers)
    for i, t in enumerate(ring.buffers):
        assert t.untyped_storage().data_ptr() == ring.block.untyped_storage().data_ptr()
        assert t.data_ptr() == base + i * ring.span  # page-aligned, in order, no overlap
        assert t.numel() * t.element_size() <= ring.span
        assert t.device == ring.block.device and t.is_pinned() == ring.pinned


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32])
def test_buffers_are_aligned_views_of_one_block(fmt, dtype) -> None:
    ring = BufferRing(3, (4, 3, 5, 7), dtype, fmt, pin=False)
    _check_ring(ring, 3)
    assert all(t.is_contiguous(memory_format=fmt) for t in ring.buffers)
    for i, t in enumerate(ring.buffers):
        t.fill_(i + 1)
    assert [int(t.float().mean()) for t in ring.buffers] == [1, 2, 3]  # independent


def test_acquire_and_release_still_track_each_slice() -> None:
    ring = BufferRing(2, (2, 3, 4, 4), torch.uint8, pin=False)
    a, b = ring.acquire(), ring.acquire()
    assert a.data_ptr() != b.data_ptr() and ring.free == 0
    ring.release(b)
    ring.release(a)
    assert ring.idle
    with pytest.raises(ValueError, match="not one of this ring"):
        ring.release(torch.empty_like(a))


def test_a_pinned_chunk_fills_its_power_of_two() -> None:
    """The issue's example: a 38.5 MB batch pinned alone took 64 MiB; 8 in one block take
    512 MiB, which holds 13 of them (41.3 MB each, 1.07x) when the cap allows."""
    assert pinned_ring_size(8, 38_500_352, room=100) == 13
    batch = buffer_span((100, 3, 224, 256), torch.uint8)  # 17.2 MB: 8 of them round to 256 MiB
    assert pinned_ring_size(8, batch, room=100) == 15
    assert pinned_ring_size(8, 38_500_352, room=10) == 10  # the cap wins
    assert pinned_ring_size(8, 38_500_352, room=3) == 3
    assert pinned_ring_size(8, MiB, room=100) == 8  # 8 MiB: a power of two already
    assert pinned_ring_size(1, 3 * MiB, room=100) == 1  # 4 MiB holds one


def test_the_pool_sizes_pinned_chunks_to_the_rounded_block(monkeypatch) -> None:
    spec = BatchSpec(batch_size=4, height=96, width=80, dtype="float32")  # 368,640 B a batch
    span = buffer_span(spec.shape, spec.torch_dtype)
    pool = BufferPool(spec, max_buffers=40, chunk=8, pin=False)
    monkeypatch.setattr(pool, "_pinned", lambda: True)  # the count pinned memory would get
    slot = pool.acquire()
    want = pinned_ring_size(8, span, 40)
    assert want == 11 and pool.capacity == want and pool.held == 1
    assert pool.nbytes == want * span  # the block, as allocated
    _check_ring(slot.ring, want)
    pool.release(slot)
    assert pool.trim(0) == want and pool.capacity == 0 and pool.nbytes == 0


def test_an_unpinned_pool_keeps_its_chunk() -> None:
    spec = BatchSpec(batch_size=4, height=96, width=80, dtype="float32")
    pool = BufferPool(spec, max_buffers=20, chunk=8, pin=False)
    slots = [pool.acquire() for _ in range(9)]
    assert pool.capacity == 16 and len({s.ring for s in slots}) == 2
    for s in slots:
        pool.release(s)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
def test_pinned_pool_is_one_pinned_block_per_chunk() -> None:
    spec = BatchSpec(batch_size=4, height=96, width=80, dtype="float32")
    span = buffer_span(spec.shape, spec.torch_dtype)
    pool = BufferPool(spec, max_buffers=40, chunk=8, pin=True)
    slot = pool.acquire()
    assert slot.ring.pinned and slot.ring.block.is_pinned()
    _check_ring(slot.ring, pinned_ring_size(8, span, 40))
    device = torch.empty(spec.shape, device="cuda").fill_(3.0)
    slot.tensor.copy_(device, non_blocking=True)  # the server's device-to-host copy
    torch.cuda.synchronize()
    assert torch.equal(slot.tensor, device.cpu())
    pool.release(slot)
