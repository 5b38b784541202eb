"""RemoteLoader's CUDA path: side-stream copies, events, slot reuse (skipped without CUDA).

The check that the events are right: the consumer stream is kept busy (``torch.cuda._sleep``)
before it reads each batch, while the host races ahead requesting the next ones. If a slot's
device memory were refilled before the consumer stream had finished with it, or a batch handed
out before its copy landed, the values read would differ from the CPU run of the same epoch.
"""

from __future__ import annotations

import re

import pytest
import torch
from batchwire.client import RemoteLoader
from serverproc import running_server, small_server_args

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time per batch on the consumer stream
# The wire's uint8 batches, as they are (the loader's default normalises them): what the copy
# path is compared on, bit for bit, and what test_cuda_normalize_on_device normalises by hand.
RAW = {"normalize_on_device": False}


@pytest.fixture(scope="module")
def server():
    with running_server(*small_server_args(seed=5)) as srv:
        yield srv


@pytest.fixture(scope="module")
def cpu_run(server):
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True, **RAW
    ) as loader:
        return [tuple(t.clone() for t in b) for b in loader]


def consume_slowly(loader, stream: torch.cuda.Stream) -> list[tuple[torch.Tensor, ...]]:
    """Read every batch on ``stream`` only after a long GPU sleep queued on that stream."""
    out = []
    with torch.cuda.stream(stream):
        for images, labels, indices in loader:
            assert images.is_cuda and labels.is_cuda
            torch.cuda._sleep(SLEEP_CYCLES)
            out.append((images.clone(), labels.clone(), indices.clone()))
    stream.synchronize()
    return [tuple(t.cpu() for t in batch) for batch in out]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("consumer", ["default", "side"])
def test_cuda_batches_equal_the_cpu_run_under_a_busy_consumer_stream(server, cpu_run, consumer):
    stream = torch.cuda.current_stream() if consumer == "default" else torch.cuda.Stream()
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cuda", with_indices=True,
        prefetch=2, **RAW,
    ) as loader:  # fmt: skip
        got = consume_slowly(loader, stream)
    assert len(got) == len(cpu_run)
    for k, (g, want) in enumerate(zip(got, cpu_run, strict=True)):
        for a, b in zip(g, want, strict=True):
            assert torch.equal(a, b), f"batch {k} differs from the CPU run"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_normalize_on_device(server, cpu_run, dtype):
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    with RemoteLoader(
        server.endpoint,
        "train",
        rank=0,
        world_size=1,
        device="cuda",
        with_indices=True,
        normalize_on_device=True,
        dtype=dtype,
        mean=mean.flatten().tolist(),
        std=std.flatten().tolist(),
    ) as loader:
        got = consume_slowly(loader, torch.cuda.current_stream())
    assert len(got) == len(cpu_run)
    tol = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    for (images, labels, _), (raw, want_labels, _) in zip(got, cpu_run, strict=True):
        assert images.dtype == dtype
        expected = ((raw.float() / 255 - mean) / std).to(dtype)
        torch.testing.assert_close(images.float(), expected.float(), **tol)
        assert torch.equal(labels, want_labels)


@pytest.mark.timeout(120)
def test_cuda_next_epoch_started_early_equals_a_fresh_cpu_run(server, cpu_run):
    """Epoch 1's first batches arrive as frames during epoch 0 and are copied into pinned slots
    when epoch 1 is adopted: with a busy consumer stream, both epochs must match CPU runs."""
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cpu", with_indices=True, **RAW
    ) as loader:
        loader.set_epoch(1)
        cpu_epoch1 = [tuple(t.clone() for t in b) for b in loader]
    hellos = re.compile(r": train epoch 1 rank 0/1, asks for ")
    before = len(hellos.findall(server.log()))
    assert before >= 1, "no hello for epoch 1 from the CPU run: the pattern is stale"
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cuda", with_indices=True,
        prefetch=2, **RAW,
    ) as loader:  # fmt: skip
        got0 = consume_slowly(loader, torch.cuda.current_stream())
        loader.set_epoch(1)
        got1 = consume_slowly(loader, torch.cuda.current_stream())
    # one hello for epoch 1, sent early: the early session was used, not replaced
    assert len(hellos.findall(server.log())) == before + 1
    for got, want in ((got0, cpu_run), (got1, cpu_epoch1)):
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            for a, b in zip(g, w, strict=True):
                assert torch.equal(a, b), f"batch {k} differs from the CPU run"


def assert_same(got, want) -> None:
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(g, w, strict=True):
            assert torch.equal(a, b), f"batch {k} differs from the CPU run"


@pytest.mark.timeout(120)
def test_cuda_prefetch_pattern_fetches_the_next_batch_before_the_step(server, cpu_run):
    """The next batch is requested before the step queues its work on the current one: with
    the default hold=2 the current batch must not be recycled by that request."""
    got = []
    with RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, device="cuda", with_indices=True,
        prefetch=2, **RAW,
    ) as loader:  # fmt: skip
        it = iter(loader)
        nxt = next(it, None)
        while nxt is not None:
            cur = nxt
            nxt = next(it, None)
            torch.cuda._sleep(SLEEP_CYCLES)  # the step, queued after the next request
            got.append(tuple(t.clone() for t in cur))
        torch.cuda.synchronize()
    assert_same([tuple(t.cpu() for t in b) for b in got], cpu_run)


@pytest.mark.timeout(120)
def test_cuda_stream_argument_hands_batches_to_that_stream(server, cpu_run):
    """stream=side: the loop runs on the default stream, the batches are used on `side` only;
    `side` (not the current stream) waits for each copy and guards each slot."""
    side = torch.cuda.Stream()
    got = []
    with RemoteLoader(
        server.endpoint,
        "train",
        rank=0,
        world_size=1,
        device="cuda",
        with_indices=True,
        prefetch=2,
        stream=side,
        **RAW,
    ) as loader:
        for batch in loader:
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                got.append(tuple(t.clone() for t in batch))
        side.synchronize()
    assert_same([tuple(t.cpu() for t in b) for b in got], cpu_run)


@pytest.mark.timeout(120)
def test_cuda_close_waits_for_work_on_another_consumer_stream(server, cpu_run):
    side = torch.cuda.Stream()
    loader = RemoteLoader(
        server.endpoint,
        "train",
        rank=0,
        world_size=1,
        device="cuda",
        with_indices=True,
        stream=side,
        **RAW,
    )
    batch = next(iter(loader))
    with torch.cuda.stream(side):
        torch.cuda._sleep(5 * SLEEP_CYCLES)
        kept = tuple(t.clone() for t in batch)
    loader.close()
    assert side.query(), "close() returned while a consumer stream still used a slot"
    assert_same([tuple(t.cpu() for t in kept)], cpu_run[:1])


def test_cuda_stream_on_its_own_device_is_accepted(server):
    loader = RemoteLoader(server.endpoint, device="cuda:0", stream=torch.cuda.Stream("cuda:0"))
    assert loader.server_info()  # connects: the stream's device is checked then
    loader.close()


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_stream_on_another_device_is_refused(server):
    loader = RemoteLoader(server.endpoint, device="cuda:0", stream=torch.cuda.Stream("cuda:1"))
    with pytest.raises(ValueError, match="stream= is on cuda:1"):
        loader.server_info()
    loader.close()
