"""Producer threads: each turns a scheduled job into a finished batch in a buffer.

A few workers each produce whole batches (`BatchProducer.produce`: the declared stages of
pipeline/stages.py, read -> verify -> plan -> decode -> augment -> label). Decoding and the
augment op release the GIL, so batches in production keep the cores busy: one is augmented
while others are read and decoded. Decoding runs in the worker itself when the workers fill the
cores (CPU decoding's default: `ServerConfig.decode_threads`), else on the decoder's thread
pool, which spreads one batch over more cores. Each batch carries a `StageClock` of the
threads' one `StageHook` through its stages: the hook's `depth` (batches in each stats row
now) is read by the server's stats, and the batch's `BatchStats` (seconds per row, the
decoder's fallback total, the bad files found) is data the loop records.

Workers never touch the ROUTER socket: results go back through a queue, and a byte on a pipe
wakes the loop (`os.write` is safe from any thread; zmq sockets are not).

A failed batch is an error reply and the server goes on, except after a CUDA error that
poisons the process's CUDA context (an illegal memory access, a device-side assert, an
unspecified launch failure...: `sticky_cuda_error`). Every later CUDA call of the process fails
too, so a server that stayed up would look healthy and fail every batch; it exits instead, with
`EXIT_CUDA_BROKEN` and a log line naming the error, so that its supervisor restarts it and the
loaders fail over to the other servers at once (a closed connection).

A producer thread that dies (anything its per-batch guard does not catch: a SystemExit or
KeyboardInterrupt raised by library code, a bug in the thread's own bookkeeping) would leave a
server that accepts clients and never produces their batches (the job it held never comes
back). Its death is logged with the traceback and reported (`on_death`): the server stops and
exits with `EXIT_PRODUCER_DIED`, and `/healthz` fails meanwhile, so its supervisor restarts it.
Ending the process rather than restarting the thread: what broke it may have broken shared
state (the decoder, a half-written buffer), and a fresh process is what a supervisor knows how
to make.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from batchwire.common.cuda_events import BufferFence
from batchwire.pipeline.producer import BatchMeta, BatchProducer
from batchwire.pipeline.sample_window import SampleWindow
from batchwire.pipeline.samples import AccessDeniedError, batch_may_pass, next_batches
from batchwire.pipeline.stages import BatchStats, StageClock, StageHook
from batchwire.server.jobs import BatchOrder, Job, JobResult
from batchwire.wire import BatchSpec

if TYPE_CHECKING:
    from batchwire.pipeline.sampler import BatchPlan

log = logging.getLogger("batchwire.server")

#: The exit code of a server whose CUDA context a sticky error broke (`sticky_cuda_error`).
EXIT_CUDA_BROKEN = 3
#: The exit code of a server one of whose producer threads died (`ProducerThreads.on_death`).
EXIT_PRODUCER_DIED = 4

# What cudaGetErrorString says (and DALI's/nvJPEG's wrappers name) for the errors that leave
# the context unusable: every later call of the process returns the same error. Out of memory,
# an invalid argument or "no kernel image" leave the context usable and are not here.
_STICKY_CUDA = (
    "an illegal memory access was encountered",  # cudaErrorIllegalAddress (700)
    "the launch timed out and was terminated",  # cudaErrorLaunchTimeout (702)
    "device-side assert triggered",  # cudaErrorAssert (710)
    "hardware stack error",  # cudaErrorHardwareStackError (714)
    "an illegal instruction was encountered",  # cudaErrorIllegalInstruction (715)
    "misaligned address",  # cudaErrorMisalignedAddress (716)
    "operation not supported on global/shared address space",  # (717)
    "invalid program counter",  # cudaErrorInvalidPc (718)
    "unspecified launch failure",  # cudaErrorLaunchFailure (719)
    "uncorrectable ecc error encountered",  # cudaErrorECCUncorrectable (214)
    "context is destroyed",  # cudaErrorContextIsDestroyed (709)
    "cudaerrorillegaladdress",
    "cudaerrorlaunchfailure",
    "cudaerrorassert",
    "cudaerrorillegalinstruction",
    "cudaerrormisalignedaddress",
    "cudaerrorhardwarestackerror",
    "cudaerrorinvalidpc",
    "cudaerrorlaunchtimeout",
    "cudaerroreccuncorrectable",
    "cuda_error_illegal_address",
    "cuda_error_launch_failed",
    "cuda_error_assert",
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling (at most 16)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def sticky_cuda_error(exc: BaseException) -> str | None:
    """The first line of the CUDA error in `exc`'s chain that broke the process's CUDA context
    (see `_STICKY_CUDA`), or None. Only RuntimeErrors (torch's `AcceleratorError` included, and
    what DALI and torchvision raise) that name CUDA count: a decode error about a misaligned
    JPEG segment is not a GPU fault."""
    for link in _chain(exc):
        if not isinstance(link, RuntimeError):
            continue
        text = str(link)
        lowered = text.lower()
        if "cuda" in lowered and any(phrase in lowered for phrase in _STICKY_CUDA):
            first = next((line.strip() for line in text.splitlines() if line.strip()), text)
            return f"{type(link).__name__}: {first}"[:300]
    return None


def exit_for_broken_cuda(reason: str) -> None:
    """Log why, flush the logs, and end the process with `EXIT_CUDA_BROKEN` at once.

    `os._exit`, not an orderly stop: the orderly stop synchronises streams and frees CUDA
    memory, and each of those calls fails (or hangs) in a broken context."""
    log.critical(
        "CUDA context broken by a sticky error (%s): every later CUDA call of this process "
        "would fail, so the server exits with code %d for its supervisor to restart it "
        "(loaders fail over to the other servers)",
        reason,
        EXIT_CUDA_BROKEN,
    )
    _exit_now(EXIT_CUDA_BROKEN)


def exit_for_dead_producer(reason: str) -> None:
    """`ProducerThreads`' default `on_death`: end the process with `EXIT_PRODUCER_DIED` at
    once (the server passes its own, an orderly stop with that code)."""
    log.critical("the server exits with code %d: %s", EXIT_PRODUCER_DIED, reason)
    _exit_now(EXIT_PRODUCER_DIED)


def _exit_now(code: int) -> None:
    """Flush the logs and end the process with ``code`` (no orderly stop)."""
    for handler in [*logging.getLogger().handlers, *log.handlers]:
        with contextlib.suppress(Exception):  # a broken handler must not keep the server up
            handler.flush()
    os._exit(code)


def _batch_in(spec: BatchSpec, buffer: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """What `BatchProducer.produce` writes for ``spec`` in a batch buffer: the buffer itself
    (shaped as the server's batches), or views of a flat uint8 buffer's first bytes (a
    multi-view batch's tensors, or a batch smaller than the buffer: progressive resizing)."""
    flat = buffer.dim() == 1 and buffer.dtype == torch.uint8 and buffer.numel() >= spec.nbytes
    return spec.view_bytes(buffer) if flat else buffer


def _sized(order: BatchOrder) -> dict[str, tuple[int, int]]:
    """`BatchProducer.produce`'s ``image_size`` for an order with a spec of its own."""
    spec = order.spec
    return {} if spec is None else {"image_size": (spec.height, spec.width)}


class ProducerThreads:
    """``n`` producer threads fed by a job queue; results come back via `results`.

    The queue is not bounded here: the core submits at most two jobs per producer at a time
    (`ServerCore.max_jobs`: one in production and one queued each), so a job never waits long
    behind others for a client that has left.
    """

    def __init__(
        self,
        producers: dict[str, BatchProducer],
        n: int,
        phases: StageHook,
        wake_fd: int,
        spec: BatchSpec,
        device: str = "cpu",
        on_broken_cuda: Callable[[str], None] = exit_for_broken_cuda,
        capacity: BatchSpec | None = None,
        samples: SampleWindow | None = None,
        on_death: Callable[[str], None] = exit_for_dead_producer,
    ) -> None:
        self.producers = producers  # split -> BatchProducer
        # Told why (one line) when a producer thread dies (module doc); exits by default.
        self.on_death = on_death
        # Samples of recent batches for orders that mix batch sizes (`BatchOrder.share_samples`).
        self.samples = samples
        self.on_broken_cuda = on_broken_cuda  # a sticky CUDA error's reason; exits by default
        self.spec = spec  # the server's batches (an order without a spec of its own)
        # The largest batch (--max-image-size): the device buffer is allocated from it.
        self.capacity = capacity or spec
        self.device = device
        self.n = n
        self.phases = phases
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.results: queue.Queue[JobResult] = queue.Queue()
        self._wake_fd = wake_fd
        self._stop = threading.Event()
        self._local = threading.local()
        self._threads = [
            threading.Thread(target=self._run, name=f"bw-producer-{i}", daemon=True)
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    def submit(self, job: Job) -> None:
        """Queue a job (only the loop thread submits)."""
        self.jobs.put_nowait(job)

    def _run(self) -> None:
        """The thread's body: `_serve`, and a report of its death should anything escape."""
        try:
            self._serve()
        except BaseException as exc:  # any death is reported, SystemExit too
            name = threading.current_thread().name
            log.critical(
                "producer thread %s died: %s: %s; production cannot go on",
                name,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
            self.on_death(f"producer thread {name} died: {type(exc).__name__}: {exc}")

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                job = self.jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            if job is None:
                return
            self.results.put(self._produce(job))
            # Not kept while idle: the job's slot would keep its buffer ring alive after the
            # pool freed it (the memory would not return to the system).
            del job
            try:
                os.write(self._wake_fd, b"w")
            except BlockingIOError:  # the pipe is full: the loop has plenty of wake-ups queued
                pass
            except OSError:  # closed during shutdown
                return

    def _produce(self, job: Job) -> JobResult:
        order = job.order
        if order.cancelled.is_set() or self._stop.is_set():
            return JobResult(job, 0.0, error="cancelled", reason="cancelled")
        t0 = time.perf_counter()
        clock = self.phases.start()
        try:
            try:
                meta = self._batch(job, clock)
            finally:  # a failed batch reports too: bad files it found count
                stats = self._stats(self.producers.get(order.split), clock)
        except Exception as exc:  # travels to the loop as data; it tells the client
            log.exception("producing %s batch %d failed", order.split, order.batch_index)
            broken = sticky_cuda_error(exc)
            if broken is not None:
                self.on_broken_cuda(broken)  # by default the process ends here
            # Out of descriptors or memory anywhere (a read after its retries, but also, say, a
            # lazy import on the first plan of an epoch) may pass: the client asks again.
            reason = "transient" if batch_may_pass(exc) else "failed"
            return JobResult(
                job,
                0.0,
                error=f"{type(exc).__name__}: {exc}",
                reason=reason,
                public=self._public_reason(order.split, exc),
                stats=stats,
            )
        return JobResult(
            job,
            time.perf_counter() - t0,
            labels=meta.labels,
            indices=tuple(meta.indices.tolist()),
            replaced=int(meta.replaced),
            stats=stats,
        )

    def _batch(self, job: Job, clock: StageClock) -> BatchMeta:
        """Plan and produce the job's batch into its slot (through this worker's device
        buffer for ``--device cuda``)."""
        order = job.order
        plan = order.sampler.plan(order.epoch, order.batch_index)
        spec = order.spec or self.spec
        kw = self._produce_kwargs(order, plan, spec)
        if self.device != "cpu":
            return self._produce_on_device(order.split, plan, spec, job.slot.tensor, kw, clock)
        out = _batch_in(spec, job.slot.tensor)
        return self.producers[order.split].produce(plan, out, clock=clock, **kw)

    def _produce_kwargs(self, order: BatchOrder, plan: BatchPlan, spec: BatchSpec) -> dict:
        """`BatchProducer.produce`'s options for the order, one set for both devices: its size,
        the next batches a source may read along (`next_batches`: tar shards in a bucket), and
        the sample window where the core marked the order for it (CPU servers only:
        `server.sharing.sample_window_applies`)."""
        kw: dict = dict(_sized(order), upcoming=next_batches(order.sampler, plan))
        if order.share_samples and self.samples is not None:
            key = (order.split, spec.height, spec.width, spec.dtype, spec.layout)
            kw["reuse"] = (self.samples, key)
        return kw

    @staticmethod
    def _stats(producer: BatchProducer | None, clock: StageClock) -> BatchStats | None:
        """The batch's `BatchStats`, produced or failed (None for a split nobody serves)."""
        if producer is None:
            clock.stop()
            return None
        return producer.batch_stats(clock)

    def _public_reason(self, split: str, exc: Exception) -> str | None:
        """Why the batch failed, in words a client may see (no path, URL or key), where that
        is known: most reads denied, as the split's `AccessWatch` says (the exception's own
        text names the object whose read found it out: for the log only)."""
        if not isinstance(exc, AccessDeniedError):
            return None
        return self.producers[split].samples.access.state(time.monotonic()).message()

    def _produce_on_device(
        self,
        split: str,
        plan: BatchPlan,
        spec: BatchSpec,
        host_out: torch.Tensor,
        kw: dict,
        clock: StageClock,
    ) -> BatchMeta:
        """Augment into this worker's device buffer, then copy into the pinned host buffer.

        Each worker has its own CUDA stream, so one batch's device-to-host copy overlaps the
        other worker's decode and augment; the worker waits for its copy (not the loop). A
        flat host buffer (multi-view, or buffers sized for --max-image-size) gets a flat
        device buffer of the same capacity, and only the batch's bytes are copied.
        """
        local = self._local
        flat = host_out.dim() == 1
        if getattr(local, "device_out", None) is None:
            if flat:
                local.device_out = torch.empty(
                    self.capacity.nbytes, dtype=torch.uint8, device=self.device
                )
            else:
                local.device_out = self.spec.empty(device=self.device)
            local.cuda_stream = torch.cuda.Stream(device=self.device)
            # device_out came from the caching allocator on this thread's current stream: the
            # worker's stream, which writes it, waits for what is queued there first.
            local.cuda_stream.wait_stream(torch.cuda.current_stream(self.device))
            local.copied = BufferFence()
        with torch.cuda.stream(local.cuda_stream):
            out = _batch_in(spec, local.device_out)
            meta = self.producers[split].produce(plan, out, clock=clock, **kw)
            if flat:
                n = spec.nbytes
                host_out[:n].copy_(local.device_out[:n], non_blocking=True)
            else:
                host_out.copy_(local.device_out, non_blocking=True)
            local.copied.record(local.cuda_stream)
        # The loop sends host_out next, and this worker's next batch rewrites device_out.
        local.copied.synchronize()
        return meta

    def stop(self, timeout: float = 5.0) -> bool:
        """Ask workers to stop after their current batch and wait up to ``timeout`` in total;
        True if every worker has stopped (the others are daemon threads, left to the exit)."""
        self._stop.set()
        while True:  # drop queued jobs so workers see the sentinels at once
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            try:
                self.jobs.put_nowait(None)
            except queue.Full:
                break
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        busy = [t.name for t in self._threads if t.is_alive()]
        if busy:
            log.warning("producer threads still busy at shutdown: %s", ", ".join(busy))
        return not busy
