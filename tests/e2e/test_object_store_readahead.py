"""Tar shards on a real S3 store (SeaweedFS, tests/objectstore.py) read with the epoch's next
batches along (`storage.readahead`, `SampleLoader.load(upcoming=...)`): the same samples and
pixels as the local shards, on three producer threads at once, in fewer GETs (the store's own
count, and `ObjectStore.counters()`); a member whose read along failed is still a counted bad
sample of its own batch, replaced there as without reading ahead, the reads still seen by the
loader's AccessWatch."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import ImageDataset, open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder
from batchwire.pipeline.local import LocalLoader
from batchwire.pipeline.producer import BatchProducer
from batchwire.pipeline.sample_window import SampleWindow
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.samples import (
    LoadedSample,
    SampleLoader,
    TransientReadError,
    next_batches,
)
from batchwire.pipeline.stages import StageHook
from batchwire.pipeline.storage.readahead import ReadAhead
from batchwire.pipeline.synthetic import default_dataset
from batchwire.prepare.shards import write_shards
from batchwire.server.jobs import BatchOrder, Job
from batchwire.server.workers import ProducerThreads

seaweed = pytest.importorskip("objectstore", reason="needs tests/objectstore.py").seaweed
BUCKET = "readahead"
CONFIG = AugmentConfig(image_size=24, train=True)
BATCH = 4


@pytest.fixture(scope="module")
def shards(seaweed, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The local shards' pattern, and the same shards in the bucket under two prefixes (one
    for a test to damage)."""
    root = tmp_path_factory.mktemp("readahead")
    src = default_dataset().val_root
    for cls in sorted(p for p in src.iterdir() if p.is_dir())[:4]:
        (root / "folder" / cls.name).mkdir(parents=True)
        for f in sorted(cls.iterdir())[:12]:
            shutil.copyfile(f, root / "folder" / cls.name / f.name)
    summary = write_shards(str(root / "folder"), str(root / "shards"), 150_000, jobs=1)
    last = len(summary.shards) - 1
    assert last >= 2
    seaweed.upload_folder(root / "shards", BUCKET, "a")
    seaweed.upload_folder(root / "shards", BUCKET, "b")
    span = f"train-{{000000..{last:06d}}}.tar"
    with pytest.MonkeyPatch.context() as mp:
        for name, value in seaweed.env().items():
            mp.setenv(name, value)
        yield {
            "local": str(root / "shards" / span),
            "a": f"s3://{BUCKET}/a/{span}",
            "b": f"s3://{BUCKET}/b/{span}",
            "cache": str(root / "cache"),
        }


_OPENED: list[ImageDataset] = []


def _open(spec: str, cache: str) -> ImageDataset:
    dataset = open_dataset(spec, verify_checksums="off", cache_dir=cache)
    _OPENED.append(dataset)
    return dataset


@pytest.fixture(autouse=True)
def _background_reads_end_with_the_test() -> Iterator[None]:
    """A window still being read in the background when a test ends would make GETs on the
    shared store during the next test (whose GET counts would be off): wait for them."""
    yield
    while _OPENED:
        pool = getattr(_OPENED.pop().reader, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)


def _epoch(
    loader: SampleLoader, sampler: ShardSampler, epoch: int, ahead: bool, threads: int = 1
) -> list[list[LoadedSample]]:
    """Every batch of ``epoch``, ``threads`` batches in flight at once (as producers are)."""

    def one(b: int) -> list[LoadedSample]:
        plan = sampler.plan(epoch, b)
        upcoming = next_batches(sampler, plan) if ahead else None
        return loader.load(epoch, plan.indices, upcoming=upcoming)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(sampler.num_batches)))


def _same(got: list[list[LoadedSample]], want: list[list[LoadedSample]]) -> None:
    for batch, expected in zip(got, want, strict=True):
        assert [s.index for s in batch] == [s.index for s in expected]
        for s, e in zip(batch, expected, strict=True):
            assert torch.equal(s.image, e.image)


def test_the_local_batches_in_fewer_gets(seaweed, shards) -> None:
    local = _open(shards["local"], shards["cache"])
    remote = _open(shards["a"], shards["cache"])
    assert local.read_ahead_batches == 0 and remote.read_ahead_batches > 0  # local pays nothing
    assert local.read_ahead_bytes == 0 and remote.read_ahead_bytes == 64 << 20
    sampler = ShardSampler(len(remote), BATCH, seed=5, shuffle=True, drop_last=True)
    store = remote.reader.located.store
    with CpuBatchDecoder(2) as dec:
        want = _epoch(SampleLoader(local, CONFIG, 5, dec), sampler, 1, ahead=False)
        gets = []
        for ahead in (False, True):
            loader = SampleLoader(remote, CONFIG, 5, dec)
            gets0, ours0 = seaweed.settled_requests("GET", BUCKET), store.counters()["requests"]
            got = _epoch(loader, sampler, 1, ahead, threads=3)
            # A window read in the background may still be in flight: count once it is done
            # (the pool has one thread, so a no-op submitted now runs after it).
            remote.reader._background().submit(lambda: None).result()
            gets.append(seaweed.settled_requests("GET", BUCKET) - gets0)
            assert store.counters()["requests"] - ours0 == gets[-1]
            _same(got, want)
            assert loader.bad_total == 0
    plain, read_ahead = gets
    assert plain >= sampler.num_batches  # one GET per shard a batch touches at least
    assert read_ahead * 2 <= plain, gets
    counters = remote.reader.ahead.counters()
    assert counters["taken"] > 0 and counters["held_bytes"] + counters["flight_bytes"] == 0


@pytest.mark.parametrize(
    ("device", "window"),
    [
        ("cpu", False),
        ("cpu", True),
        pytest.param(
            "cuda",
            False,
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
    ids=["cpu", "cpu-sample-window", "cuda"],
)
def test_producer_threads_read_along_on_every_path(
    seaweed, shards, device: str, window: bool
) -> None:
    """The server's producer threads hand the producer the epoch's next batches on every path:
    `--device cuda` and the sample window (a server taking several batch sizes) gave none, so
    no member was ever read along (``taken`` stayed 0) and every batch paid its own GETs."""
    remote = _open(shards["a"], shards["cache"])
    sampler = ShardSampler(len(remote), BATCH, seed=5, shuffle=True, drop_last=True)
    config = AugmentConfig(image_size=24, train=True, output_dtype="uint8")
    spec = config.batch_spec(BATCH)
    samples = SampleWindow(64 << 20) if window else None
    r, w = os.pipe()
    with CpuBatchDecoder(1) as dec:
        producers = {"train": BatchProducer(remote, config, 5, dec)}
        threads = ProducerThreads(
            producers, 1, StageHook(), w, spec, device=device, samples=samples
        )
        try:
            for k in range(sampler.num_batches):
                order = BatchOrder("train", sampler, 1, k, 1, 0, share_samples=window)
                threads.submit(Job(order, SimpleNamespace(tensor=spec.empty())))  # type: ignore[arg-type]
                result = threads.results.get(timeout=60)
                assert result.ok, result
        finally:
            threads.stop()
            os.close(r)
            os.close(w)
    remote.reader._background().submit(lambda: None).result()
    counters = remote.reader.ahead.counters()
    assert counters["taken"] > 0, counters
    if samples is not None:
        assert samples.bytes > 0  # the batches went through the window


def test_local_loader_reads_along_like_the_server(seaweed, shards) -> None:
    """`LocalLoader` (in-process, no server) gives its producer the epoch's next batches as
    the server's producer threads do: before, it gave none, and a bucket's tar shards were
    read one batch at a time (``taken`` stayed 0)."""
    remote = _open(shards["a"], shards["cache"])
    loader = LocalLoader(remote, batch_size=BATCH, image_size=24, seed=5, threads=1)
    try:
        batches = sum(1 for _ in loader)
    finally:
        loader.close()
    assert batches == len(loader)
    remote.reader._background().submit(lambda: None).result()
    counters = remote.reader.ahead.counters()
    assert counters["taken"] > 0, counters


def _read_along_case(remote: ImageDataset) -> tuple[int, int]:
    """(seed, member): the last member of the last shard, in batch 1 of epoch 0 of that seed,
    whose batch 0 reads every shard batch 1 holds (so batch 0 reads all of batch 1 along)."""
    reader = remote.reader
    last = int(reader.shard_of.max())
    member = int(np.flatnonzero(reader.shard_of == last)[-1])
    for seed in range(500):
        sampler = ShardSampler(len(remote), BATCH, seed=seed, shuffle=True, drop_last=True)
        first, second = sampler.plan(0, 0).indices, sampler.plan(0, 1).indices
        held = set(reader.shard_of[first].tolist())
        if member in second and member not in first and set(reader.shard_of[second]) <= held:
            return seed, member
    raise AssertionError("no seed puts the member in batch 1 and its shard in batch 0")


def test_a_member_failing_in_a_read_along_is_a_bad_sample_of_its_own_batch(seaweed, shards) -> None:
    remote = _open(shards["b"], shards["cache"])
    seed, member = _read_along_case(remote)
    reader = remote.reader
    key = reader.located.keys[int(reader.shard_of[member])]
    data = (Path(shards["local"]).parent / Path(key).name).read_bytes()
    cut = int(reader.offsets[member] + reader.sizes[member] // 2)
    seaweed.put(BUCKET, f"b/{Path(key).name}", data[:cut])  # the shard cut short since indexed
    store = reader.located.store  # read as the cut object (indexed before: one member short)
    store.pin_versions({key: store.head(key).version})
    sampler = ShardSampler(len(remote), BATCH, seed=seed, shuffle=True, drop_last=True)
    with CpuBatchDecoder(1) as dec:
        ahead = SampleLoader(remote, CONFIG, seed, dec, check_start=False)
        got = []
        for b in range(sampler.num_batches):
            plan = sampler.plan(0, b)
            got.append(ahead.load(0, plan.indices, upcoming=next_batches(sampler, plan)))
            if b == 0:
                assert ahead.bad_total == 0  # read along here, judged in its own batch
            if b == 1:  # its members, the cut one too, came with batch 0's read
                assert reader.ahead.counters()["taken"] == BATCH
        plain = SampleLoader(remote, CONFIG, seed, dec, check_start=False)
        want = _epoch(plain, sampler, 0, ahead=False)
    _same(got, want)  # the same substitute, the same pixels, as without reading ahead
    slot = [s.requested for s in got[1]].index(member)
    assert got[1][slot].index != member  # replaced in its own batch
    assert all(s.index == s.requested for s in got[0])  # batch 0, which read it, is whole
    assert ahead.counts() == plain.counts()
    assert ahead.bad_total == 1 and ahead.bad_files() == [remote.paths[member]]
    assert reader.ahead.counters()["taken"] > 0
    state = ahead.access.state(time.monotonic())
    assert state.reads == plain.access.state(time.monotonic()).reads > 0


def test_a_store_killed_mid_epoch_costs_retries_never_a_sample(seaweed, shards) -> None:
    """SIGKILL the store after batch 1 (a window read ahead in flight or held), start it again
    3 s after a batch first fails: batches that fail do so as transient (as the client retries
    them), and the epoch ends with the local shards' batches, no sample marked bad. Windows of
    2 batches, so that the epoch's 12 batches outrun what was read ahead before the kill (with
    the default 8, the whole epoch could be held by then and the outage never met)."""
    local = _open(shards["local"], shards["cache"])
    remote = _open(shards["a"], shards["cache"])
    remote.reader.ahead = ReadAhead(batches=2)
    sampler = ShardSampler(len(remote), BATCH, seed=11, shuffle=True, drop_last=True)
    assert sampler.num_batches >= 8
    with CpuBatchDecoder(1) as dec:
        want = _epoch(SampleLoader(local, CONFIG, 11, dec), sampler, 2, ahead=False)
        loader = SampleLoader(remote, CONFIG, 11, dec, check_start=False)
        got, failed = [], 0
        restart: threading.Timer | None = None
        for b in range(sampler.num_batches):
            plan = sampler.plan(2, b)
            if b == 2:
                seaweed.kill()
            deadline = time.monotonic() + 60
            while True:
                try:
                    got.append(loader.load(2, plan.indices, upcoming=next_batches(sampler, plan)))
                    break
                except TransientReadError:  # what the client retries
                    if failed == 0:  # the outage is met: the store comes back 3 s later
                        restart = threading.Timer(3.0, seaweed.start)
                        restart.start()
                    failed += 1
                    assert time.monotonic() < deadline
    if restart is not None:
        restart.join(60)  # the store is up before the next test uses it
    _same(got, want)
    assert failed > 0, "the outage was not met"
    assert loader.bad_total == 0 and loader.transient_total > 0


class _RestartOnOutage(logging.Handler):
    """Starts the killed store again 1 s after the loader first says it makes a batch again
    (the outage met, however slow the machine), or after 30 s whatever happens (no hang)."""

    def __init__(self, seaweed) -> None:
        super().__init__()
        self._seaweed = seaweed
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._fallback = threading.Timer(30.0, self._start_once, args=(0.0,))
        self._fallback.start()

    def emit(self, record: logging.LogRecord) -> None:
        if "making it again" in record.getMessage():
            self._start_once(1.0)

    def _start_once(self, delay: float) -> None:
        with self._lock:
            if self._timer is None:
                self._timer = threading.Timer(delay, self._seaweed.start)
                self._timer.start()

    def join(self) -> None:
        self._fallback.cancel()
        self._start_once(0.0)
        assert self._timer is not None
        self._timer.join(60)


def test_local_loader_waits_out_a_store_restart(seaweed, shards, caplog) -> None:
    """The store SIGKILLed once the loader is open, before its first batch, and started again
    1 s after the first batch that failed (past the sample loader's own second of retries;
    a timer from the kill let a loaded machine's first read come after the store was back, the
    outage unmet): `LocalLoader` makes the batches
    that failed transient again, as a server's client asks for them again, and its epoch is the
    local shards' epoch, no sample replaced. It used to raise the first TransientReadError to
    the training loop. (Killed after the first batch instead, a loaded machine's read-ahead
    could have read every shard before the kill: the outage then went unmet.)"""
    local = _open(shards["local"], shards["cache"])
    remote = _open(shards["a"], shards["cache"])
    remote.reader.ahead = ReadAhead(batches=2)  # small windows: the epoch outruns them
    kw = {"batch_size": BATCH, "image_size": 24, "seed": 11, "threads": 1}
    with LocalLoader(local, output_dtype="uint8", **kw) as reference:
        want = [(images.clone(), labels.clone()) for images, labels in reference]
    got = []
    restart = _RestartOnOutage(seaweed)
    log = logging.getLogger("batchwire.pipeline")
    with (
        caplog.at_level(logging.WARNING, logger="batchwire.pipeline"),
        LocalLoader(remote, output_dtype="uint8", **kw) as loader,
    ):
        seaweed.kill()
        log.addHandler(restart)
        try:
            for images, labels in loader:
                got.append((images.clone(), labels.clone()))
        finally:
            log.removeHandler(restart)
            restart.join()  # the store is up before the next test kills it again
        assert loader.counts()["replaced_total"] == 0
    assert len(got) == len(want) >= 8
    for (images, labels), (ref_images, ref_labels) in zip(got, want, strict=True):
        assert torch.equal(labels, ref_labels) and torch.equal(images, ref_images)
    assert "making it again" in caplog.text, "the outage was not met"


def test_a_window_that_cannot_be_read_in_the_background_is_read_by_its_batches(
    seaweed, shards
) -> None:
    """The background thread gone (as at interpreter exit): a window handed to it is settled
    empty, and its batches read their members themselves, nobody waiting forever."""
    local = _open(shards["local"], shards["cache"])
    remote = _open(shards["a"], shards["cache"])
    remote.reader._background().shutdown()
    sampler = ShardSampler(len(remote), BATCH, seed=4, shuffle=True, drop_last=True)
    with CpuBatchDecoder(1) as dec:
        want = _epoch(SampleLoader(local, CONFIG, 4, dec), sampler, 0, ahead=False)
        got = _epoch(SampleLoader(remote, CONFIG, 4, dec), sampler, 0, ahead=True)
    _same(got, want)
    assert remote.reader.ahead.counters()["flight_bytes"] == 0
