"""Who may touch a batch's memory when: the stream and event bookkeeping of the CUDA paths.

The bookkeeping (which stream waits on which event, on which stream an event is recorded, what
`close` waits for) runs here on CPU tensors: this torch has no CUDA, so `torch.cuda`'s Stream,
Event, current_stream, stream and device are replaced by small fakes that log what is asked of
them (only those torch objects are faked; the stagers, rings and loaders are the real ones).
`tests/test_remote_loader_cuda.py` checks the same contracts on a GPU, by the data.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest
import torch
from batchwire import wire
from batchwire.client import RemoteLoader
from batchwire.client.staging import BatchFormat, CudaStager
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.local import LocalLoader, _CudaOrder
from oddfiles import write_image_folder

CPU = torch.device("cpu")


class FakeCuda:
    """The few `torch.cuda` objects the stagers use, logging every call in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.device_depth = 0
        self._local = threading.local()
        cuda = self

        class Stream:
            def __init__(self, device=None, name="stream") -> None:
                self.device = CPU if device is None else torch.device(device)
                self.name = name
                cuda.add("new_stream", self, cuda.device_depth > 0)

            def wait_event(self, event) -> None:
                cuda.add("wait", self, event)

            def wait_stream(self, other) -> None:
                cuda.add("wait_stream", self, other)

            def synchronize(self) -> None:
                cuda.add("sync", self)

            def __repr__(self) -> str:
                return f"<{self.name}>"

        class Event:
            def __init__(self, *args, **kwargs) -> None:
                cuda.add("new_event", self, cuda.device_depth > 0)

            def record(self, stream=None) -> None:
                cuda.add("record", self, stream if stream is not None else cuda.current())

            def synchronize(self) -> None:
                cuda.add("sync", self)

        self.Stream, self.Event = Stream, Event
        self.default = Stream(name="default")

    def add(self, *op) -> None:
        with self.lock:
            self.log.append(op)

    def current(self, device=None):
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, s):
        old = self.current()
        self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = old

    @contextlib.contextmanager
    def device(self, d):
        self.device_depth += 1
        try:
            yield
        finally:
            self.device_depth -= 1

    def ops(self, kind: str, obj=None) -> list[tuple]:
        return [op for op in self.log if op[0] == kind and (obj is None or op[1] is obj)]

    def index(self, op: tuple) -> int:
        return next(i for i, o in enumerate(self.log) if o[0] == op[0] and o[1:] == op[1:])


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", fake.Stream)
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "device", fake.device)
    return fake


# ---------------------------------------------------------------------- RemoteLoader's stager

B, H, W = 2, 4, 5


def make_stager(slots: int = 3, normalize: bool = False) -> CudaStager:
    spec = wire.BatchSpec(B, H, W, "uint8", "nchw")
    fmt = BatchFormat(spec, normalize, torch.float32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return CudaStager(fmt, CPU, slots)


def receive(stager: CudaStager, k: int, fill: int):
    """What the receiver does for batch ``k``: acquire a slot, write it, stage it."""
    header = wire.BatchHeader(1, "train", 0, k, [B, 3, H, W], "uint8", "nchw", [0, 1], 0, B * 60)
    slot = stager.acquire(header)
    slot.images_buffer(header.nbytes)[:] = bytes([fill]) * header.nbytes
    slot.labels_buffer(B)[:] = torch.full((B,), k, dtype=torch.int64).numpy().tobytes()
    return stager.stage(slot, header)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_multi_view_batch_is_one_slot_normalised_view_by_view(
    cuda: FakeCuda, out_dtype: torch.dtype
) -> None:
    views = ((H, W), (3, 2))
    spec = wire.BatchSpec(B, H, W, "uint8", "nchw", views)
    fmt = BatchFormat(spec, True, out_dtype, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    stager = CudaStager(fmt, CPU, 2)
    assert stager.ring.slots[0].images.numel() >= spec.nbytes == B * 3 * (H * W + 3 * 2)
    header = wire.BatchHeader(
        1, "train", 0, 0, spec.shape, "uint8", "nchw", [0, 1], 0, spec.nbytes, [[H, W], [3, 2]]
    )
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8)
    slot = stager.acquire(header)
    slot.images_buffer(spec.nbytes)[:] = raw.numpy().tobytes()
    slot.labels_buffer(B)[:] = torch.arange(B, dtype=torch.int64).numpy().tobytes()
    staged = stager.stage(slot, header)
    assert isinstance(staged.images, list) and len(staged.images) == 2
    for got, want in zip(staged.images, spec.view_bytes(raw), strict=True):
        assert got.shape == want.shape and got.dtype == out_dtype
        expected = ((want.float() / 255 - 0.5) / 0.25).to(out_dtype)
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)
    stager.hand_out(staged)
    stager.release(staged)
    stager.close()


def test_stager_creates_its_stream_and_events_with_the_device_current(cuda: FakeCuda) -> None:
    stager = make_stager()
    side = cuda.ops("new_stream", stager.copy_stream)
    assert side == [("new_stream", stager.copy_stream, True)]
    events = cuda.ops("new_event")
    assert len(events) == 2 * len(stager.ring) and all(inside for _, _, inside in events)
    # the stream first: it opens the device's context before anything else is allocated
    assert cuda.log.index(side[0]) < cuda.log.index(events[0])
    assert not stager.ring.pinned  # a CPU target pins nothing (only a GPU copy reads slots)


def test_stager_side_stream_waits_for_the_stream_its_slots_were_allocated_on(
    cuda: FakeCuda,
) -> None:
    """The caching allocator gives blocks on the current stream, where a freed block may still
    be read by queued kernels: the side stream that writes the slots waits for that stream."""
    stager = make_stager()
    assert cuda.ops("wait_stream", stager.copy_stream) == [
        ("wait_stream", stager.copy_stream, cuda.default)
    ]
    stager.close()


def test_batch_is_guarded_by_the_stream_it_was_handed_to(cuda: FakeCuda) -> None:
    stager = make_stager(slots=1)
    consumer = cuda.Stream(name="consumer")
    staged = receive(stager, 0, fill=7)
    slot = staged.slot
    assert torch.equal(staged.images, torch.full((B, 3, H, W), 7, dtype=torch.uint8))
    assert staged.labels.tolist() == [0, 0]
    stager.hand_out(staged, consumer)
    assert cuda.log[-1] == ("wait", consumer, slot.device.hand.ready.event)
    with cuda.stream(cuda.Stream(name="elsewhere")):  # released while another is current
        stager.release(staged)
    assert cuda.log[-1] == ("record", slot.device.hand.freed.event, consumer)
    cuda.log.clear()
    again = receive(stager, 1, fill=9)  # the same (only) slot
    assert again.slot is slot
    # the host half waits for its last copy, the side stream for the consumer's last work,
    # and the new copy's event comes after both
    assert cuda.log[0] == ("sync", slot.device.hand.ready.event)
    assert ("wait", stager.copy_stream, slot.device.hand.freed.event) in cuda.log
    assert cuda.index(("wait", stager.copy_stream, slot.device.hand.freed.event)) < cuda.index(
        ("record", slot.device.hand.ready.event, stager.copy_stream)
    )
    assert torch.equal(again.images, torch.full((B, 3, H, W), 9, dtype=torch.uint8))


def test_default_consumer_is_the_stream_current_at_hand_out(cuda: FakeCuda) -> None:
    stager = make_stager()
    side = cuda.Stream(name="side")
    staged = receive(stager, 0, fill=1)
    with cuda.stream(side):
        stager.hand_out(staged)
    stager.release(staged)  # the default stream is current now
    assert cuda.log[-1] == ("record", staged.slot.device.hand.freed.event, side)


def test_discarded_batch_records_nothing(cuda: FakeCuda) -> None:
    stager = make_stager()
    staged = receive(stager, 0, fill=1)
    cuda.log.clear()
    stager.discard(staged)
    assert cuda.ops("record") == [] and stager.ring.free == len(stager.ring)


def test_close_waits_on_every_consumer_stream_and_the_side_stream(cuda: FakeCuda) -> None:
    stager = make_stager(slots=4, normalize=True)
    a, b = cuda.Stream(name="a"), cuda.Stream(name="b")
    first, second, third = (receive(stager, k, fill=k) for k in range(3))
    stager.hand_out(first, a)
    stager.release(first)
    stager.hand_out(second, b)  # still held by the consumer when the loader closes
    cuda.log.clear()
    stager.close()
    assert ("record", second.slot.device.hand.freed.event, b) in cuda.log
    synced = {op[1] for op in cuda.ops("sync")}
    assert first.slot.device.hand.freed.event in synced
    assert second.slot.device.hand.freed.event in synced
    assert third.slot.device.hand.ready.event in synced  # staged, never handed out: copy waited
    assert cuda.log[-1] == ("sync", stager.copy_stream)
    never_handed = [s.device.hand.freed.event for s in stager.ring.slots[2:]]
    assert not any(e in synced for e in never_handed)  # only recorded events are waited on


def test_slot_ring_is_one_block_sliced_into_aligned_slots() -> None:
    from batchwire.client.ring import SLOT_ALIGN, SlotRing

    ring = SlotRing(3, nbytes=10_000, batch_size=5, pin=False)
    base = ring.block.data_ptr()
    assert not ring.pinned and ring.nbytes == 3 * (3 * SLOT_ALIGN + SLOT_ALIGN)
    for slot in ring.slots:
        assert slot.images.untyped_storage().data_ptr() == base
        assert slot.labels.untyped_storage().data_ptr() == base
        assert (slot.images.data_ptr() - base) % SLOT_ALIGN == 0
        assert (slot.labels.data_ptr() - base) % SLOT_ALIGN == 0
        assert slot.images.numel() == 10_000 and slot.labels.dtype == torch.int64
        assert slot.labels.numel() == 5
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for s in ring.slots
        for t in (s.images, s.labels)
    )
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))


# ---------------------------------------------------------------------- RemoteLoader arguments


def test_loader_checks_stream_and_hold(cuda: FakeCuda) -> None:
    with pytest.raises(ValueError, match=r"torch\.cuda\.Stream"):
        RemoteLoader("tcp://127.0.0.1:1", stream="side")  # type: ignore[arg-type]
    for hold in (0, 65, True, 1.5):
        with pytest.raises(ValueError, match="hold must be"):
            RemoteLoader("tcp://127.0.0.1:1", hold=hold)  # type: ignore[arg-type]
    loader = RemoteLoader("tcp://127.0.0.1:1", device="cpu", stream=cuda.Stream(name="s"))
    with pytest.raises(ValueError, match="stream= is for a CUDA loader"):
        loader.server_info()  # checked when the device is resolved, before any socket
    loader.close()


# ---------------------------------------------------------------------- LocalLoader


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> ImageDataset:
    tmp = tmp_path_factory.mktemp("lifetimes")
    root = write_image_folder(tmp / "tree", classes=2, good_per_class=6, bad={})
    return open_dataset(root, cache_dir=tmp / "cache")


def test_order_events_per_buffer(cuda: FakeCuda) -> None:
    order = _CudaOrder(CPU, 2)
    assert cuda.ops("new_stream", order.stream) == [("new_stream", order.stream, True)]
    consumer = cuda.Stream(name="consumer")
    order.before_produce(0)  # first use: nobody to wait for
    assert cuda.ops("wait") == []
    order.produced(0)
    with cuda.stream(consumer):
        order.hand_out(0)
    order.give_back(0)  # recorded on the hand-out stream, whatever is current now
    order.before_produce(0)
    ready = [b.ready.event for b in order.buffers]
    freed = [b.freed.event for b in order.buffers]
    assert cuda.log[-4:] == [
        ("record", ready[0], order.stream),
        ("wait", consumer, ready[0]),
        ("record", freed[0], consumer),
        ("wait", order.stream, freed[0]),
    ]
    order.give_back(1)  # never handed out: nothing to record
    assert cuda.log[-1] == ("wait", order.stream, freed[0])
    cuda.log.clear()
    order.synchronize()
    assert cuda.log == [("sync", freed[0]), ("sync", order.stream)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("copy", [True, False])
def test_local_loader_orders_each_buffer_between_producer_and_consumer_streams(
    cuda: FakeCuda, folder: ImageDataset, copy: bool
) -> None:
    """The whole LocalLoader flow with the CUDA ordering on (CPU tensors): every reuse of a
    buffer by the producer waits on an event recorded on the consumer's side stream after the
    consumer's use, and the consumer waits for each buffer's production."""
    decoder = CpuBatchDecoder(2)
    try:
        loader = LocalLoader(
            folder, batch_size=3, image_size=8, decoder=decoder, ring=2, copy=copy, seed=3
        )
        reference = [images.clone() for images, _ in loader]
        loader._order = order = _CudaOrder(CPU, len(loader.ring))
        side = cuda.Stream(name="consumer-side")
        got = []
        with cuda.stream(side):
            for images, _ in loader:
                got.append(images.clone())
        loader.close()
    finally:
        decoder.close()
    assert len(got) == len(reference) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
    per_buffer: dict[int, list[str]] = {0: [], 1: []}
    ready = [b.ready.event for b in order.buffers]
    freed = [b.freed.event for b in order.buffers]
    for op in cuda.log:
        for i in (0, 1):
            if op[0] == "record" and op[1] is ready[i]:
                assert op[2] is order.stream
                per_buffer[i].append("produced")
            elif op[0] == "wait" and op[2] is ready[i]:
                assert op[1] is side
                per_buffer[i].append("handed")
            elif op[0] == "record" and op[1] is freed[i]:
                assert op[2] is side
                per_buffer[i].append("freed")
            elif op[0] == "wait" and op[2] is freed[i]:
                assert op[1] is order.stream
                per_buffer[i].append("producer waits")
    cycle = ["produced", "handed", "freed"]
    for i, seq in per_buffer.items():
        assert seq[:3] == cycle, (i, seq)
        rest = seq[3:]
        while rest:  # every later production of the buffer first waits for its consumer
            assert rest[:4] == ["producer waits", *cycle], (i, seq)
            rest = rest[4:]
    assert cuda.log[-1] == ("sync", order.stream)  # close()


def test_local_loader_pins_nothing(folder: ImageDataset) -> None:
    with LocalLoader(folder, batch_size=3, image_size=8, threads=1) as loader:
        assert not loader.ring.pinned and loader._order is None
