"""Producer threads: a sticky CUDA error ends the server (issue 25, defect 8), and the decoder's
fallbacks reach the stats and Prometheus (defect 4). In-process, no GPU: the exceptions are the
real types with the messages CUDA, torch and DALI give; the decoders are real ones (a
`GpuDecoderBase` on the CPU, DALI's CPU backend where it is installed)."""

from __future__ import annotations

import io
import os
import threading
from types import SimpleNamespace

import pytest
import torch
from batchwire.pipeline.augment_plan import AugmentConfig
from batchwire.pipeline.dataset import open_dataset
from batchwire.pipeline.decode import CpuBatchDecoder, DecodeRequest, read_header
from batchwire.pipeline.decode.fallback import GpuBatch, GpuDecoderBase
from batchwire.pipeline.producer import BatchProducer
from batchwire.pipeline.sampler import ShardSampler
from batchwire.pipeline.samples import SampleLoader
from batchwire.pipeline.stages import DECODE, BatchStats, StageClock, StageHook
from batchwire.server.jobs import BatchOrder, Job
from batchwire.server.telemetry import Telemetry
from batchwire.server.workers import ProducerThreads, sticky_cuda_error
from batchwire.wire import BatchSpec
from oddfiles import jpeg_bytes, smooth_image, write_image_folder
from PIL import Image
from promtext import parse_metrics

ILLEGAL = (
    "CUDA error: an illegal memory access was encountered\n"
    "Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
    "group__CUDART__TYPES.html for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect."
)


@pytest.mark.parametrize(
    "exc",
    [
        torch.AcceleratorError(ILLEGAL),
        torch.AcceleratorError("CUDA error: device-side assert triggered\nCompile with ..."),
        torch.AcceleratorError("CUDA error: unspecified launch failure"),
        torch.AcceleratorError("CUDA error: misaligned address"),
        RuntimeError("CUDA error: an illegal instruction was encountered"),  # torch < 2.8
        RuntimeError(  # DALI's CUDA_CALL wording
            "Critical error in pipeline:\nError in MIXED operator `decoders__Image`,\n"
            "CUDA runtime API error cudaErrorIllegalAddress (700):\n"
            "an illegal memory access was encountered"
        ),
        torch.AcceleratorError("CUDA error: uncorrectable ECC error encountered"),
    ],
)
def test_context_killing_cuda_errors_are_sticky(exc: BaseException) -> None:
    reason = sticky_cuda_error(exc)
    assert reason is not None and reason.startswith(type(exc).__name__)
    assert "\n" not in reason


def test_a_sticky_error_is_found_under_the_one_raised() -> None:
    try:
        try:
            raise torch.AcceleratorError(ILLEGAL)
        except RuntimeError as inner:
            raise ValueError("producing batch 3 failed") from inner
    except ValueError as outer:
        assert "illegal memory access" in sticky_cuda_error(outer)


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.AcceleratorError(
            "CUDA error: no kernel image is available for execution on the device"
        ),
        torch.AcceleratorError("CUDA error: invalid argument"),
        ValueError("JPEG: misaligned address of a segment"),  # not CUDA, not a RuntimeError
        RuntimeError("libjpeg: unspecified launch failure of a fictional decoder"),  # no CUDA
        OSError(5, "Input/output error"),
    ],
)
def test_other_errors_are_not_sticky(exc: BaseException) -> None:
    assert sticky_cuda_error(exc) is None


class _Sampler:
    def plan(self, epoch: int, k: int) -> object:
        return SimpleNamespace(epoch=epoch, k=k)


class _Producer:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def produce(
        self, plan: object, out: torch.Tensor, clock: StageClock, upcoming: object = None
    ) -> object:
        raise self.exc

    def batch_stats(self, clock: StageClock) -> BatchStats:
        return BatchStats(clock.stop(), "cpu", 0)


def _run_one(exc: BaseException) -> tuple[list[str], object]:
    spec = BatchSpec(batch_size=1, height=2, width=2, dtype="uint8")
    broken: list[str] = []
    r, w = os.pipe()
    threads = ProducerThreads(
        {"train": _Producer(exc)},  # type: ignore[dict-item]
        1,
        StageHook(),
        w,
        spec,
        on_broken_cuda=broken.append,
    )
    try:
        order = BatchOrder("train", _Sampler(), 0, 3, 1, 0)  # type: ignore[arg-type]
        threads.submit(Job(order, SimpleNamespace(tensor=torch.empty(1))))  # type: ignore[arg-type]
        result = threads.results.get(timeout=10)
    finally:
        threads.stop()
        os.close(r)
        os.close(w)
    return broken, result


def test_a_sticky_cuda_error_in_a_worker_ends_the_server() -> None:
    broken, result = _run_one(torch.AcceleratorError(ILLEGAL))
    assert len(broken) == 1 and "illegal memory access" in broken[0]
    assert not result.ok  # had the exit been injected away, the batch still fails


def test_an_ordinary_failure_leaves_the_server_up() -> None:
    broken, result = _run_one(torch.OutOfMemoryError("CUDA out of memory."))
    assert broken == [] and not result.ok and result.reason == "failed"


# ----------------------------------------------------------------------------- fallbacks


class RefusingGpuDecoder(GpuDecoderBase):
    """A GPU decoder whose library refuses every image, on the CPU device: everything falls
    back, through the base class's real routing, checks and CPU safety net."""

    name = "refusing"

    def __init__(self, threads: int = 1) -> None:
        self.device = torch.device("cpu")
        self.max_batch = 8
        self.max_image_pixels = None
        self._start_fallback(threads)

    def _decode_group(self, items: list[int], batch: GpuBatch) -> None:
        for i in items:
            batch.rejected[i] = "refused by the test library"


def _request(index: int, data: bytes) -> DecodeRequest:
    h = read_header(data)
    return DecodeRequest(index, data, h, (0.0, 0.0, float(h.height), float(h.width)), (8, 8))


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(smooth_image(16, 24, seed=3)).save(out, "PNG")
    return out.getvalue()


def test_gpu_decoder_base_counts_every_image_the_cpu_decoded() -> None:
    dec = RefusingGpuDecoder()
    try:
        requests = [_request(i, jpeg_bytes(smooth_image(16, 24, seed=i))) for i in range(3)]
        requests.append(_request(3, _png()))  # routed: not a JPEG
        results = dec.decode_batch(requests)
        assert all(r.image is not None for r in results)
        assert dec.fallbacks == 4 and dec.failures == 0
    finally:
        dec.close()


def _telemetry_view(decoder: object, batches: list[list[DecodeRequest]]) -> tuple[object, dict]:
    """Decode ``batches`` and record each one's `BatchStats` as the server's loop does
    (`ServerApp._record`: the decoder's fallback total, a total, per decoder)."""
    telemetry = Telemetry()
    hook = StageHook()
    for batch in batches:
        clock = hook.start()
        clock.enter(DECODE)
        decoder.decode_batch(batch)  # type: ignore[attr-defined]
        name, total = decoder.name, int(getattr(decoder, "fallbacks", 0))  # type: ignore[attr-defined]
        stats = BatchStats(clock.stop(), name, total)
        for row, seconds in stats.seconds.items():
            telemetry.observe_stage(row, seconds)
        telemetry.set_fallbacks(stats.decoder, stats.fallbacks)
    snap = telemetry.snapshot([], [])
    return snap, parse_metrics(telemetry.prometheus_text().decode())


def test_fallbacks_reach_stats_and_prometheus_per_decoder() -> None:
    dec = RefusingGpuDecoder()
    try:
        batch = [_request(i, jpeg_bytes(smooth_image(16, 24, seed=i))) for i in range(2)]
        snap, metrics = _telemetry_view(dec, [batch, batch[:1]])
    finally:
        dec.close()
    assert snap.counters.decode_fallbacks_total == 3
    assert snap.to_map()["counters"]["decode_fallbacks_total"] == 3
    assert metrics['batchwire_decode_fallbacks_total{decoder="refusing"}'] == 3.0


def test_the_cpu_decoder_reports_zero() -> None:
    dec = CpuBatchDecoder(1)
    try:
        batch = [_request(0, jpeg_bytes(smooth_image(16, 24, seed=1)))]
        snap, metrics = _telemetry_view(dec, [batch])
    finally:
        dec.close()
    assert snap.counters.decode_fallbacks_total == 0
    assert metrics['batchwire_decode_fallbacks_total{decoder="cpu"}'] == 0.0


def test_dali_cpu_backend_fallbacks_reach_the_stats() -> None:
    """A real GPU decoder class, on DALI's CPU backend: a PNG goes to the CPU decoder."""
    pytest.importorskip("nvidia.dali")
    from batchwire.pipeline.decode.dali import DaliBatchDecoder

    dec = DaliBatchDecoder("cpu", threads=1, max_batch=4)
    try:
        batch = [_request(0, jpeg_bytes(smooth_image(16, 24, seed=2))), _request(1, _png())]
        snap, metrics = _telemetry_view(dec, [batch])
    finally:
        dec.close()
    assert snap.counters.decode_fallbacks_total == 1
    assert metrics['batchwire_decode_fallbacks_total{decoder="dali"}'] == 1.0


def test_fallback_totals_never_go_down_and_sum_over_decoders() -> None:
    telemetry = Telemetry()
    telemetry.set_fallbacks("nvjpeg", 5)
    telemetry.set_fallbacks("nvjpeg", 4)  # a late report from another thread
    telemetry.set_fallbacks("cpu", 0)
    telemetry.set_fallbacks("dali", 2)
    assert telemetry.snapshot([], []).counters.decode_fallbacks_total == 7
    assert telemetry.fallbacks_by_decoder() == {"nvjpeg": 5, "cpu": 0, "dali": 2}


def test_a_producer_thread_that_dies_reports_why() -> None:
    """Anything the per-batch guard lets through (here SystemExit from the producer) ends the
    thread: `on_death` hears which thread and why (the server stops and exits non-zero)."""
    spec = BatchSpec(batch_size=1, height=2, width=2, dtype="uint8")
    deaths: list[str] = []
    r, w = os.pipe()
    threads = ProducerThreads(
        {"train": _Producer(SystemExit("library called sys.exit"))},  # type: ignore[dict-item]
        1,
        StageHook(),
        w,
        spec,
        on_death=deaths.append,
    )
    try:
        order = BatchOrder("train", _Sampler(), 0, 3, 1, 0)  # type: ignore[arg-type]
        threads.submit(Job(order, SimpleNamespace(tensor=torch.empty(1))))  # type: ignore[arg-type]
        threads._threads[0].join(10)
        assert not threads._threads[0].is_alive()
        assert deaths == ["producer thread bw-producer-0 died: SystemExit: library called sys.exit"]
    finally:
        threads.stop()
        os.close(r)
        os.close(w)


# ----------------------------------------------------------------------------- stage stats


def test_a_producer_thread_reports_its_batch_stats(tmp_path) -> None:
    """A real producer on a folder with a bad file: each result carries the batch's seconds
    per stats row, the decoder's fallback total and the bad file found (once), and the
    hook's depth is back to 0 once the batch is done."""
    root = write_image_folder(tmp_path / "tree", classes=2, good_per_class=3, bad={"c": ("text",)})
    dataset = open_dataset(root, cache_dir=tmp_path / "cache")
    config = AugmentConfig(image_size=8, train=False, output_dtype="uint8")
    sampler = ShardSampler(len(dataset), 4, seed=0, shuffle=False, drop_last=False)
    spec = config.batch_spec(4)
    hook = StageHook()
    results = []
    r, w = os.pipe()
    with CpuBatchDecoder(1) as dec:
        producer = BatchProducer(dataset, config, 0, dec)
        threads = ProducerThreads({"val": producer}, 1, hook, w, spec)
        try:
            for k in range(2):
                order = BatchOrder("val", sampler, 0, k, 1, 0)
                threads.submit(Job(order, SimpleNamespace(tensor=spec.empty())))  # type: ignore[arg-type]
                results.append(threads.results.get(timeout=30))
        finally:
            threads.stop()
            os.close(r)
            os.close(w)
    assert all(res.ok for res in results)
    for res in results:
        assert list(res.stats.seconds) == ["read", "decode", "augment"]
        assert (res.stats.decoder, res.stats.fallbacks) == ("cpu", 0)
    bad = [p for p in dataset.paths if "bad_text" in p]
    assert [p for res in results for p in res.stats.bad_files] == bad  # once
    assert hook.depth == {"read": 0, "decode": 0, "augment": 0}


def test_a_gpu_decoder_lends_its_cpu_threads_to_read_and_check_files(tmp_path) -> None:
    """The sample loader reads and checks a batch's files on its decoder's pool
    (`SampleLoader._each`). A GPU decoder lends its CPU fallback's threads, as a CPU decoder
    lends its own: it had no pool, so a GPU server read and checked one file at a time on each
    producer thread."""
    root = write_image_folder(tmp_path / "tree", classes=2, good_per_class=4, bad={})
    dataset = open_dataset(root, cache_dir=tmp_path / "cache")
    config = AugmentConfig(image_size=8, train=False, output_dtype="uint8")
    decoder = RefusingGpuDecoder(threads=2)
    try:
        loader = SampleLoader(dataset, config, 0, decoder)
        names = loader._each(lambda _: threading.current_thread().name, range(8))
        assert {n.rpartition("_")[0] for n in names} == {"bw-decode"}, names
        got = loader.load(0, list(range(8)))
        assert [s.index for s in got] == list(range(8))
    finally:
        decoder.close()
