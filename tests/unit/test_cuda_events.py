"""common.cuda_events: the fence and hand-off contract, as calls (CPU) and by the data (CUDA).

Without CUDA, `torch.cuda.Event` is replaced by a recorder and streams are plain objects that
log what they are asked to wait for: the contract is which call reaches which stream. With
CUDA, a writer delayed on the GPU must still be seen finished by the next user.
"""

from __future__ import annotations

import pytest
import torch
from batchwire.common.cuda_events import BufferFence, HandOff

CUDA = torch.cuda.is_available()


class Log:
    def __init__(self) -> None:
        self.ops: list[tuple] = []
        self.created: list[dict[str, bool]] = []  # each event's flags


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    calls = Log()

    class Event:
        def __init__(self, **flags: bool) -> None:
            calls.created.append(flags)

        def record(self, stream) -> None:
            calls.ops.append(("record", self, stream))

        def synchronize(self) -> None:
            calls.ops.append(("sync", self))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    return calls


class Stream:
    def __init__(self, log: Log, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event) -> None:
        self.log.ops.append(("wait", self, event))


def test_fence_is_free_until_recorded(log: Log) -> None:
    fence = BufferFence()
    fence.wait(Stream(log, "s"))
    fence.synchronize()
    assert log.ops == []


def test_a_host_waiting_on_a_fence_sleeps(log: Log) -> None:
    """A blocking-sync event: a producer thread waiting for its copy does not spin a core."""
    BufferFence()
    assert log.created == [{"blocking": True}]


def test_fence_record_then_wait_and_synchronize(log: Log) -> None:
    fence = BufferFence()
    writer, reader = Stream(log, "writer"), Stream(log, "reader")
    fence.record(writer)
    fence.wait(reader)
    fence.wait(reader)  # a stream wait says nothing about completion: waited again
    fence.synchronize()
    fence.synchronize()  # the use has run: nothing left to wait for
    fence.wait(reader)
    e = fence.event
    assert log.ops == [("record", e, writer), ("wait", reader, e), ("wait", reader, e), ("sync", e)]


def test_hand_off_round_trip(log: Log) -> None:
    buf = HandOff()
    writer, consumer = Stream(log, "writer"), Stream(log, "consumer")
    ready, freed = buf.ready.event, buf.freed.event
    buf.before_write(writer)  # first write: nobody to wait for
    buf.written(writer)
    buf.hand_out(consumer)
    buf.give_back()
    buf.give_back()  # given back once: the second records nothing
    buf.before_write(writer)
    assert log.ops == [
        ("record", ready, writer),
        ("wait", consumer, ready),
        ("record", freed, consumer),
        ("wait", writer, freed),
    ]
    assert buf.consumer is None


def test_hand_off_never_handed_out_records_nothing(log: Log) -> None:
    buf = HandOff()
    buf.written(Stream(log, "writer"))
    log.ops.clear()
    buf.give_back()
    assert log.ops == [] and not buf.freed.recorded


def _slow_fill(t: torch.Tensor, value: int) -> None:
    """Queue ~tens of ms of GPU spinning, then fill `t` (on the current stream)."""
    torch.cuda._sleep(50_000_000)
    t.fill_(value)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_consumer_stream_sees_the_writers_data_on_the_gpu() -> None:
    dev = torch.device("cuda")
    writer, consumer = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    buf = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
    hand = HandOff()
    with torch.cuda.stream(writer):
        hand.before_write(writer)
        _slow_fill(buf, 7)
        hand.written(writer)
    hand.hand_out(consumer)
    with torch.cuda.stream(consumer):
        seen = buf.clone()
    hand.give_back()
    with torch.cuda.stream(writer):  # the next write waits for the consumer's clone
        hand.before_write(writer)
        buf.fill_(9)
        hand.written(writer)
    torch.cuda.synchronize()
    assert bool((seen == 7).all()) and bool((buf == 9).all())


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_host_synchronize_waits_for_the_copy_into_pinned_memory() -> None:
    dev = torch.device("cuda")
    stream = torch.cuda.Stream(dev)
    src = torch.zeros(1 << 20, dtype=torch.int32, device=dev)
    host = torch.zeros(1 << 20, dtype=torch.int32).pin_memory()
    fence = BufferFence()
    with torch.cuda.stream(stream):
        _slow_fill(src, 5)
        host.copy_(src, non_blocking=True)
        fence.record(stream)
    fence.synchronize()
    assert bool((host == 5).all())
