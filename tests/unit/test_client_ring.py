"""The client's receive slots, byte views (the CUDA ring's host half runs here unpinned), and
the CPU output pool that must never recycle a buffer someone still refers to."""

from __future__ import annotations

import gc

import pytest
import torch
from batchwire.client import ProtocolError
from batchwire.client.normalize import Affine, normalize_uint8
from batchwire.client.ring import RecycledBuffers, SlotRing, writable
from batchwire.wire import BatchSpec, tensor_bytes


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
def test_spec_views_the_bytes_a_server_sends(dtype, layout):
    batch = (torch.arange(2 * 3 * 4 * 5) % 251).to(dtype).view(2, 3, 4, 5)
    if layout == "nhwc":
        batch = batch.contiguous(memory_format=torch.channels_last)
        wire = batch.permute(0, 2, 3, 1).contiguous()  # NHWC bytes, as the server sends them
    else:
        wire = batch.contiguous()
    flat = torch.empty(1000, dtype=torch.uint8)  # larger than the batch, like a ring slot
    raw = wire.reshape(-1).view(torch.uint8)
    writable(flat, raw.numel())[:] = raw.numpy().tobytes()
    spec = BatchSpec(2, 4, 5, str(dtype).removeprefix("torch."), layout)
    assert spec.nbytes == raw.numel()
    assert torch.equal(torch.from_numpy(tensor_bytes(batch).copy()), raw)  # the server's bytes
    view = spec.view_bytes(flat)
    assert view.shape == (2, 3, 4, 5) and view.dtype == dtype
    assert torch.equal(view, batch)
    assert view.is_contiguous(memory_format=torch.channels_last) == (layout == "nhwc")


def make_buffers(size: int = 2) -> RecycledBuffers:
    return RecycledBuffers(lambda: torch.zeros(4, 6), size)


def test_pool_reuses_a_buffer_only_when_no_view_of_it_is_left():
    pool = make_buffers()
    first = pool.take()
    handed = first[:3]  # what a loader yields: a fresh view
    assert pool.take() is not first, "a buffer whose view is alive was reused"
    del handed
    gc.collect()
    assert pool.take() is first
    assert pool.allocated == 2


@pytest.mark.parametrize(
    "keep",
    [
        lambda v: v[1],  # a view of the view: the yielded tensor itself is gone
        lambda v: v.numpy(),  # a numpy array over it
        lambda v: memoryview(v.numpy()),
        lambda v: v.view(torch.int32).t(),
        lambda v: v.requires_grad_().mul(2),  # autograd saves the input for backward
    ],
    ids=["view", "numpy", "memoryview", "reinterpreted", "autograd"],
)
def test_pool_never_reuses_what_is_still_referenced(keep):
    pool = make_buffers()
    buf = pool.take()
    held = keep(buf[:2])
    gc.collect()
    assert pool.take() is not buf
    del held
    gc.collect()
    assert pool.take() is buf


def test_pool_replaces_buffers_kept_for_good_and_drops_shared_memory():
    pool = make_buffers(size=1)
    a = pool.take()
    kept = a[:]  # the user keeps this batch
    b = pool.take()  # the one pooled buffer is held: a new one replaces it in the pool
    assert b is not a
    assert pool.take() is b, "the pool must recycle the newer buffer, not stay blocked"
    del kept
    assert pool.take() is b, "a buffer that left the pool never comes back"
    b.share_memory_()  # as if sent to another process: it may be mapped there
    c = pool.take()
    assert c is not b and pool.take() is c
    assert pool.allocated == 3


def test_pool_of_size_zero_always_allocates():
    pool = make_buffers(size=0)
    a = pool.take()
    assert pool.take() is not a and pool.allocated == 2


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("layout", "in_layout"), [("nchw", "nchw"), ("nhwc", "nhwc"), ("nchw", "nhwc")]
)
def test_cpu_normalize_is_the_affine_formula_exactly(out_dtype, layout, in_layout):
    """Every uint8 value in every channel: the table path (same layouts) and the ufunc path
    (input and output layouts differ) give exactly the affine formula's float32 values."""
    x = torch.arange(256).repeat(2, 3, 1).view(2, 3, 16, 16).to(torch.uint8)
    x[1] = x[1].flip(-1)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    in_fmt = torch.channels_last if in_layout == "nhwc" else torch.contiguous_format
    x = x.contiguous(memory_format=in_fmt)
    affine = Affine.from_stats((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), torch.device("cpu"))
    out = torch.empty(x.shape, dtype=out_dtype, memory_format=fmt)
    normalize_uint8(x, affine, out)
    expected = (x.float() * affine.scale_t + affine.bias_t).to(out_dtype)
    assert torch.equal(out, expected)
    assert out.is_contiguous(memory_format=fmt)
    # the device path (torch ops) computes the same values
    generic = torch.empty_like(out)
    assert torch.equal(out, generic.copy_(affine.apply_(x.float())))
