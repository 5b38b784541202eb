"""The server's shell: one loop thread that owns the ROUTER socket and carries out the core's
actions.

Every decision (admission, sessions, buffers, fair share, scheduling, drops) is the core's
(`core.py`, no I/O); this module feeds it events (messages, finished jobs, sent batches whose
frames ZeroMQ let go of, peers gone, the time) and does what it answers: reply, send a batch,
lend a buffer and queue a job, release a buffer, trim idle ones. Only this thread touches the
ROUTER socket (zmq sockets are not thread-safe) and the core; producer threads report back
through a queue and a wake-up pipe. Nothing here blocks for long: the loop polls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from batchwire.pipeline.sample_window import SampleWindow
from batchwire.pipeline.samples import BadFileTally
from batchwire.pipeline.sources.mix import MixDataset
from batchwire.pipeline.split import Split
from batchwire.pipeline.stages import StageHook
from batchwire.server.budget import BufferBudget
from batchwire.server.bufpool import BufferPool
from batchwire.server.config import ServerConfig
from batchwire.server.core import (
    Action,
    Cancel,
    Release,
    Reply,
    ReplyStats,
    SendBatch,
    ServerCore,
    SplitInfo,
    Submit,
    TrimBuffers,
)
from batchwire.server.footprint import expected_rss_statement, median_pixels, resident_mib
from batchwire.server.jobs import Job, JobResult
from batchwire.server.memory import gpu_memory_statement, host_memory_statement
from batchwire.server.peer_names import shown
from batchwire.server.router_socket import RouterSocket, check_ipc_endpoint
from batchwire.server.security import bind_policy
from batchwire.server.sharing import window_statement
from batchwire.server.sizing import plan_buffers, stage_capacities
from batchwire.server.splits import StartupError, make_decoder, open_splits
from batchwire.server.telemetry import Telemetry
from batchwire.server.workers import EXIT_PRODUCER_DIED, ProducerThreads
from batchwire.wire import BufferStats, ServerStats, StageStats, StatsReply, tensor_bytes
from batchwire.wire.keys import KeysError, ServerKeys

__all__ = ["ServerApp", "StartupError"]

log = logging.getLogger("batchwire.server")

_TRACKER_POLL_MAX_MS = 100
_IDLE_POLL_MS = 250
# SIGTERM/SIGINT: the process exits this long after the signal at the latest, whatever a
# thread is doing (producer threads are daemons; a stuck read is not waited for).
STOP_DEADLINE_S = 1.5
_STOP_LINGER_MS = 300  # of the deadline, for shutdown replies still queued
_STOP_JOIN_S = 0.3  # of the deadline, for producers to finish the batch they are on
# /healthz fails once the loop has not turned for this long: it turns at least every
# _IDLE_POLL_MS and nothing in it blocks, so this is a loop that is stuck, not a busy one.
LIVENESS_STALE_S = 10.0


class ServerApp:
    """`pipeline-server` as an object: build it from a `ServerConfig`, then `run()`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        refused = bind_policy(config.bind, config.keys, config.insecure)
        if refused is not None:
            raise StartupError(refused)
        for endpoint in config.bind:  # before the expensive part: a clash fails at once
            check_ipc_endpoint(endpoint)
        try:
            self.keys = None if config.keys is None else ServerKeys(config.keys)
        except (KeysError, OSError) as exc:
            raise StartupError(f"--keys {config.keys}: {exc}") from None
        self.telemetry = Telemetry()
        self.decoder = make_decoder(config)
        # The decoder's fallback total from the start (a CPU decoder's 0); then each batch's.
        self.telemetry.set_fallbacks(self.decoder.name, int(getattr(self.decoder, "fallbacks", 0)))
        self.phases = StageHook()  # the producers' stages: depth now, each batch's clock
        try:
            self.splits: dict[str, Split] = open_splits(config, self.decoder)
        except ValueError as exc:
            self._close_decoder()
            raise StartupError(str(exc)) from None
        except BaseException:
            self._close_decoder()
            raise
        for name, split in self.splits.items():  # per-part samples sent (stats, /metrics)
            if isinstance(split.dataset, MixDataset) and split.dataset.plan is not None:
                self.telemetry.add_mix(name, split.dataset.names, split.dataset.plan)
        # Every split writes the same batches (one image size, dtype and layout): one spec;
        # a client may ask for another batch size or output size, up to --max-batch-size and
        # --max-image-size (`capacity`, what a buffer holds). Buffers are flat bytes, so a
        # batch of any allowed size views their first bytes (smaller asks need no flag).
        self.spec = config.batch_spec()
        self.capacity = config.capacity_spec()
        # --max-buffers divided between batch buffers and the samples shared across batch
        # sizes (pipeline/sample_window.py): server/sizing.py decides, this allocates.
        plan = plan_buffers(config, self.capacity)
        self._sample_batches = plan.sample_batches
        self.samples = SampleWindow(plan.sample_window_nbytes) if plan.sample_batches else None
        # Pinned only where a GPU copy reads them (a --device cuda server's device-to-host
        # copies): a CPU server on a training node must not open a CUDA context on GPU 0.
        self.buffers = BufferPool(
            self.capacity, plan.buffers, pin=config.device != "cpu", flat=True, device=config.device
        )
        self._bad_files = BadFileTally()  # bad_total: distinct files over all splits
        # The splits' user transforms: their error totals feed transform_errors_total.
        self._transforms = [
            s.producer.transform for s in self.splits.values() if s.producer.transform is not None
        ]
        try:
            self.socket = RouterSocket(config, self.keys, self.telemetry.add_handshake_failure)
        except BaseException:
            self._close_decoder()
            if self.keys is not None:
                self.keys.stop()
            raise
        self.endpoints = self.socket.endpoints
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        producers = {name: s.producer for name, s in self.splits.items()}
        self.producers = ProducerThreads(
            producers,
            config.producers,
            self.phases,
            self._wake_w,
            self.spec,
            config.device,
            capacity=self.capacity,
            samples=self.samples,
            on_death=self._producer_died,
        )
        self.core = ServerCore(
            config,
            {name: SplitInfo.of(s) for name, s in self.splits.items()},
            self.spec,
            BufferBudget(plan.buffers, plan.reserve),
            time.monotonic(),
        )
        # The cancellation flag of each job out (by production): set on the core's `Cancel`.
        self._cancels: dict[int, threading.Event] = {}
        # Sent batches ZeroMQ still holds: each tracker and the core's ticket for it.
        self._in_flight: deque[tuple[zmq.MessageTracker, int]] = deque()
        self._tracker_wait_ms = 1
        # This turn's stats reply, packed once for every peer asking before anything changes.
        self._stats_packed: bytes | None = None
        self._stopping = False
        self._stop_requested = threading.Event()  # set by the signal handler
        self._stopped = threading.Event()  # set once shut down
        self._stop_deadline = math.inf
        self._metrics: Callable[[], None] | None = None
        # SIGTERM with --drain-timeout > 0 asks for a drain first (the loop starts it: the core
        # is the loop's alone); the HTTP thread reads these and `_heartbeat` without a lock:
        # single attribute reads and writes, at worst one loop turn stale.
        self._drain_requested = False
        self._heartbeat: float | None = None  # monotonic time of the loop's last turn
        # Why production cannot go on (a producer thread died), else None: set once, by that
        # thread; /healthz fails from then on and the process exits with EXIT_PRODUCER_DIED.
        self._fatal: str | None = None

    # ----------------------------------------------------------------------------- lifecycle

    def request_stop(self, *_: object) -> None:
        """Ask the loop to shut down (signal handler; safe to call from any thread)."""
        now = time.monotonic()
        self._stop_deadline = min(self._stop_deadline, now + STOP_DEADLINE_S)
        self._stopping = True
        self._stop_requested.set()
        self._wake()

    def request_drain(self, *_: object) -> None:
        """SIGTERM: drain for up to --drain-timeout, then stop (`request_stop` at once when
        it is 0, or when a drain is already under way: a second SIGTERM means now). Safe to
        call from any thread; the loop starts the drain (`ServerCore.begin_drain`)."""
        timeout = self.config.drain_timeout
        if timeout <= 0 or self._drain_requested or self._stopping:
            self.request_stop()
            return
        # The watchdog's bound covers the drain (the core's --drain-timeout) and the stop after.
        self._stop_deadline = time.monotonic() + timeout + STOP_DEADLINE_S
        self._drain_requested = True
        self._stop_requested.set()
        self._wake()

    def _producer_died(self, reason: str) -> None:
        """`ProducerThreads.on_death` (a producer thread; it logged the traceback): fail
        /healthz and stop, so that the process exits with `EXIT_PRODUCER_DIED` and its
        supervisor starts a new one (clients are told `shutdown` and ask other servers)."""
        self._fatal = reason
        log.critical(
            "%s: stopping; the server exits with code %d for its supervisor to restart it",
            reason,
            EXIT_PRODUCER_DIED,
        )
        self.request_stop()

    @property
    def exit_code(self) -> int:
        """0 after a requested stop; `EXIT_PRODUCER_DIED` once a producer thread died."""
        return 0 if self._fatal is None else EXIT_PRODUCER_DIED

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # pipe full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"s")

    def health(self, path: str) -> tuple[int, bytes]:
        """The probes on the metrics port (any thread: reads single attributes, and the
        splits' `AccessWatch`, under its own short lock; never the loop's state).

        ``/healthz``: alive, the loop turned within `LIVENESS_STALE_S` (a liveness probe
        restarts a server whose loop is stuck), and no producer thread died (production cannot
        go on; the process is on its way out, see `_producer_died`). ``/readyz``: alive,
        splits open, every producer thread running, accepting clients (not draining or
        stopping), and reads not mostly denied (`pipeline.access`: credentials expired or
        revoked; ``denied`` names the splits and why): a readiness probe takes such a server
        out of the Service's DNS name.
        """
        now = time.monotonic()
        beat = self._heartbeat
        checks: dict[str, bool] = {
            "loop": beat is not None and now - beat < LIVENESS_STALE_S,
            "production": self._fatal is None,
        }
        denied: dict[str, str] = {}  # split -> why most of its reads are denied
        if path == "/readyz":
            # Producer threads by name: ProducerThreads starts them at construction and a
            # thread that died (an uncaught error) is gone from the enumeration.
            running = sum(t.name.startswith("bw-producer-") for t in threading.enumerate())
            checks["splits"] = bool(self.splits)
            checks["producers"] = running >= self.producers.n
            checks["accepting"] = not (self._drain_requested or self._stopping)
            for name, split in self.splits.items():
                state = split.samples.access.state(now)
                if state.most_denied:
                    denied[name] = state.message()
            checks["reads"] = not denied
        ok = all(checks.values())
        body = {
            "status": "ok" if ok else "fail",
            "checks": checks,
            "draining": self._drain_requested and not self._stopping,
            "stopping": self._stopping,
            "loop_age_s": None if beat is None else round(now - beat, 3),
        }
        if denied:
            body["denied"] = denied
        return (200 if ok else 503), json.dumps(body).encode() + b"\n"

    def run(self, exit_by_deadline: bool = False) -> int:
        """Serve until SIGINT/SIGTERM or `request_stop()`; returns the exit code (`exit_code`:
        0, or `EXIT_PRODUCER_DIED` when a producer thread died).

        ``exit_by_deadline`` (the console script): should the orderly shutdown not be over
        `STOP_DEADLINE_S` after the stop request (a thread stuck in a read, a decoder that does
        not let go), the process exits then anyway, with `exit_code` (``os._exit``). Embedded use
        leaves it off: the host process is not ours to end.
        """
        try:
            # SIGTERM (Kubernetes, Slurm, docker stop, systemd) drains; SIGINT (Ctrl-C, an
            # operator at a terminal) stops at once.
            signal.signal(signal.SIGTERM, self.request_drain)
            signal.signal(signal.SIGINT, self.request_stop)
        except ValueError:  # not the main thread (embedded use): the caller stops us
            pass
        if exit_by_deadline:
            watchdog = threading.Thread(target=self._stop_watchdog, name="bw-stop-watchdog")
            watchdog.daemon = True
            watchdog.start()
        try:
            if self.config.metrics_port is not None:
                self._serve_metrics(self.config.metrics_port)
            threads = self.config.decode_threads()
            log.info(
                "serving %s on %s: batch %s, %s px, %s %s, %d producers, %s, "
                "work-ahead %d per client",
                "/".join(self.splits),
                ", ".join(self.endpoints),
                (
                    str(self.config.batch_size)
                    if self.config.batch_size_cap == self.config.batch_size
                    else f"{self.config.batch_size} (clients may ask up to "
                    f"{self.config.batch_size_cap})"
                ),
                self._size_text(),
                self.spec.dtype,
                self.spec.layout,
                self.config.producers,
                f"{threads} decode threads" if threads > 1 else "each decoding its own batch",
                self.config.prefetch_depth,
            )
            for line in self.transform_statements():
                log.info("%s", line)
            log.info("%s", self.keys_statement())
            log.info("%s", self.memory_statement())
            expected = self.rss_statement()
            if expected is not None:
                log.info("%s", expected)
            if self.config.device != "cpu":
                bound = gpu_memory_statement(
                    self.config.producers,
                    getattr(self.decoder, "max_batch", self.config.batch_size),
                    getattr(self.decoder, "max_image_pixels", None),
                    self.capacity.nbytes,
                )
                log.info("%s", bound)
            self._loop()
        finally:
            self._shutdown()
        if self._fatal is not None:
            log.critical("stopped: %s (exit code %d)", self._fatal, self.exit_code)
        else:
            log.info("stopped")
        return self.exit_code

    def _size_text(self) -> str:
        """The output size(s) for the start line: "224x224", "224x224 (clients may ask up to
        320x320)" or "views 224x224+224x224+96x96+...": the px that follows reads right."""
        if self.spec.multi_view:
            return "views " + "+".join(f"{h}x{w}" for h, w in self.spec.views)
        size = "x".join(map(str, self.config.image_hw))
        if self.config.max_image_hw != self.config.image_hw:
            most = "x".join(map(str, self.config.max_image_hw))
            return f"{size} (clients may ask up to {most})"
        return size

    def transform_statements(self) -> list[str]:
        """One line per split a user transform augments (--transform, --val-transform): the
        fused op's own start line says it is ready, which alone would read as if it augmented
        every split."""
        return [
            f"{name}: augmenting with the user transform {split.producer.transform.name} "
            f"(the native fused op is not used for {name})"
            for name, split in self.splits.items()
            if split.producer.transform is not None
        ]

    def keys_statement(self) -> str:
        """Whether clients need keys, said at every start (a rejected client sees silence)."""
        if self.keys is None:
            plain = "plain sockets, no client keys needed"
            if self.config.insecure:
                return f"keys: off ({plain}; --insecure)"
            return f"keys: off ({plain}: loopback and ipc:// only)"
        return (
            f"keys: on (--keys {self.config.keys}): CURVE on every endpoint, "
            f"{len(self.keys.allowed)} client key(s) admitted; clients without them are "
            "rejected in the handshake (logged, batchwire_handshake_failures_total)"
        )

    def memory_statement(self) -> str:
        """The host memory the batch buffers can ever hold, said at start (the docs' formula)."""
        budget = self.core.budget
        batch_bytes = self.capacity.nbytes + self.capacity.labels_nbytes
        statement = host_memory_statement(
            budget.max_buffers + self._sample_batches,
            batch_bytes,
            budget.reserve,
            self.config.max_clients,
        )
        statement += "; " + window_statement(
            self.config.share_window, budget.max_buffers, self._sample_batches
        )
        if self._sample_batches:
            statement += (
                f"; {self._sample_batches} of those buffers' bytes "
                f"({self._sample_batches * batch_bytes / 2**20:.0f} MiB) hold the sample window "
                "(samples shared across batch sizes)"
            )
        return statement

    def rss_statement(self) -> str | None:
        """The whole expected resident memory (server/footprint.py), said at start after the
        buffers' bound; None where this process's RSS cannot be read (no /proc)."""
        base = resident_mib()
        if base is None:
            return None
        batch_bytes = self.capacity.nbytes + self.capacity.labels_nbytes
        buffers = (self.core.budget.max_buffers + self._sample_batches) * batch_bytes
        return expected_rss_statement(
            base,
            buffers / 2**20,
            self.config.producers,
            self.capacity.batch_size,
            median_pixels([s.dataset for s in self.splits.values()]),
            self.capacity.height * self.capacity.width,
            sum(s.dataset.read_ahead_bytes for s in self.splits.values()),
        )

    def _stop_watchdog(self) -> None:
        self._stop_requested.wait()
        # The deadline can move closer (a drain over early, a second signal): look again often.
        while not self._stopped.wait(min(0.1, max(0.0, self._stop_deadline - time.monotonic()))):
            if time.monotonic() >= self._stop_deadline:
                break
        else:
            return
        busy = [
            t.name
            for t in threading.enumerate()
            if t.name.startswith("bw-") and t is not threading.current_thread()
        ]
        log.warning(
            "shutdown not done %.1f s after the stop request (busy threads: %s): exiting now",
            STOP_DEADLINE_S + (self.config.drain_timeout if self._drain_requested else 0.0),
            ", ".join(busy) or "none",
        )
        logging.shutdown()
        os._exit(self.exit_code)

    def _serve_metrics(self, port: int) -> None:
        try:
            self._metrics = self.telemetry.serve_prometheus(
                port, self.stats_snapshot, host=self.config.metrics_host, health=self.health
            )
        except OSError as exc:  # port taken, no permission: a start-up error like a bad --bind
            raise StartupError(f"cannot serve metrics on --metrics-port {port}: {exc}") from None

    def _shutdown(self) -> None:
        """Tell the clients, stop the producers and close everything, within the stop deadline.

        Producer threads get `_STOP_JOIN_S` to finish their batch; one still busy (a read that
        blocks, a huge image) is a daemon and is not waited for, nor is the decoder it may be
        using closed (closing joins its threads).
        """
        if self._stop_deadline == math.inf:  # the loop ended without a stop request
            self._stop_deadline = time.monotonic() + STOP_DEADLINE_S
        log.info("shutting down: telling %d client(s)", len(self.core.sessions))
        self._carry_out(self.core.shutdown(time.monotonic()))
        idle = self.producers.stop(timeout=_STOP_JOIN_S)
        if self._metrics is not None:
            self._metrics()
        left_ms = int(1000 * (self._stop_deadline - time.monotonic())) - 200
        self.socket.close(linger_ms=max(0, min(_STOP_LINGER_MS, left_ms)))
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        if idle:
            self._close_decoder()
        else:
            log.warning("producers still busy at shutdown: not waiting for them")
        self._stopped.set()

    def _close_decoder(self) -> None:
        close = getattr(self.decoder, "close", None)
        if close is not None:
            close()

    # ----------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self.socket.monitor, zmq.POLLIN)
        while not self._stopping:
            self._heartbeat = time.monotonic()
            self._stats_packed = None
            # Trackers have no file descriptor: poll them with a timeout that backs off while
            # nothing completes (a stalled client's buffers may stay with ZeroMQ for long).
            timeout = self._tracker_wait_ms if self._in_flight else _IDLE_POLL_MS
            events = dict(poller.poll(timeout))
            if self._wake_r in events:
                self._drain_wakeups()
            if self.socket.monitor in events:
                self.socket.peer_events()
            self.socket.log_handshake_summary()
            self._peers_gone()
            if self.socket.router in events:
                self._receive()
            self._collect_results()
            self._release_sent()
            self._carry_out(self.core.tick(time.monotonic()))
            if self._drain_requested and self._drain_turn():
                return

    def _drain_turn(self) -> bool:
        """Start the drain once asked; True once it is over (done, or --drain-timeout)."""
        now = time.monotonic()
        if not self.core.draining:
            log.info(
                "SIGTERM: draining for up to %g s (--drain-timeout)", self.config.drain_timeout
            )
            self._carry_out(self.core.begin_drain(now))
        over = self.core.drain_over(now)
        if over == "drained":
            log.info("drained in %.2f s", now - self.core.drain_started)
        elif over == "timed out":
            log.warning(
                "drain not done after %g s (--drain-timeout): %d client(s) still owed batches, "
                "%d batch(es) in production; stopping now (their clients ask other servers)",
                self.config.drain_timeout,
                len(self.core.sessions),
                self.core.jobs_out,
            )
        else:
            return False
        # What is left is the usual stop, bounded as after a plain stop request.
        self._stop_deadline = min(self._stop_deadline, now + STOP_DEADLINE_S)
        return True

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _peers_gone(self) -> None:
        for identity, why in self.socket.gone_peers():
            self._carry_out(self.core.on_peer_gone(identity, why, time.monotonic()))

    def _receive(self) -> None:
        for identity, frames in self.socket.receive():
            parts = [f.buffer for f in frames]
            actions = self.core.on_frames(identity, parts, time.monotonic())
            if not (len(actions) == 1 and isinstance(actions[0], ReplyStats)):
                self._stats_packed = None  # e.g. a credit's loader report: the stats change
            self._carry_out(actions)
            if len(frames) == 1 and self.core.has_session(identity):
                self.socket.track(identity, frames[0])
                self._peers_gone()

    def _collect_results(self) -> None:
        while not self.producers.results.empty():
            result = self.producers.results.get_nowait()
            self._cancels.pop(result.job.order.production, None)
            # Before the core sees a failure: bad files found by a batch that failed count too.
            self._record(result)
            self._carry_out(self.core.on_result(result, time.monotonic()))

    def _record(self, result: JobResult) -> None:
        """What a finished (or failed) job tells the telemetry: the shell's one hook for the
        producers' figures (the batch produced, its `BatchStats`: seconds per stats row and
        its decoder's fallback total), and the totals the loop reads of the splits."""
        if result.ok:
            order = result.job.order
            self.telemetry.add_produced((order.spec or self.spec).batch_size)
        stats = result.stats
        if stats is not None:
            for row, seconds in stats.seconds.items():
                self.telemetry.observe_stage(row, seconds)
            self.telemetry.set_fallbacks(stats.decoder, stats.fallbacks)
            new_bad = self._bad_files.add(stats.bad_files)
            if new_bad:
                self.telemetry.add_bad(new_bad)
        if self._transforms:
            self.telemetry.set_transform_errors(sum(t.errors_total for t in self._transforms))
        if self.samples is not None:
            self.telemetry.set_samples(self.samples.reused_total)

    def _release_sent(self) -> None:
        """Tell the core of batches whose frames ZeroMQ no longer holds (never blocks)."""
        pending: deque[tuple[zmq.MessageTracker, int]] = deque()
        released = False
        now = time.monotonic()
        while self._in_flight:
            tracker, ticket = self._in_flight.popleft()
            if tracker.done:
                self._carry_out(self.core.on_sent(ticket, now))
                released = True
            else:
                pending.append((tracker, ticket))
        self._in_flight = pending
        if released:
            self._tracker_wait_ms = 1
        else:
            self._tracker_wait_ms = min(2 * self._tracker_wait_ms, _TRACKER_POLL_MAX_MS)

    def _carry_out(self, actions: list[Action]) -> None:
        """Do what the core said, in its order."""
        for action in actions:
            if isinstance(action, SendBatch):
                header = action.header
                # Counted before the hand-off: ZeroMQ's I/O thread can deliver the batch before
                # the loop runs again, and a scrape must never show fewer batches than a
                # client received.
                self.telemetry.sent_batch(
                    action.images, action.nbytes, header.replaced, action.resent, action.ready_s
                )
                # A flat buffer sends its batch's bytes only (the batch may be smaller).
                images = tensor_bytes(action.slot.tensor)[: header.nbytes]
                tracker = self.socket.send_batch(
                    action.identity, action.header, images, action.labels
                )
                self._in_flight.append((tracker, action.ticket))
                self._tracker_wait_ms = 1
                self.telemetry.add_sent_samples(header.split, header.epoch, header.indices)
            elif isinstance(action, Submit):
                cancelled = self._cancels[action.order.production] = threading.Event()
                action.order.attach(cancelled)
                self.producers.submit(Job(action.order, self.buffers.acquire()))
            elif isinstance(action, Cancel):
                cancelled = self._cancels.get(action.production)
                if cancelled is not None:
                    cancelled.set()
            elif isinstance(action, Release):
                self.buffers.release(action.slot)
            elif isinstance(action, Reply):
                if action.counts:
                    self.telemetry.count(action.counts)
                self.socket.reply(action.identity, action.message)
            elif isinstance(action, ReplyStats):
                self._reply_stats(action.identity)
                continue
            elif isinstance(action, TrimBuffers) and self.buffers.capacity:
                self.buffers.trim(action.keep)
                if action.keep == 0 and self.samples is not None:  # nobody left to share with
                    self.samples.clear()

            self._stats_packed = None  # what the next stats reply says may have changed

    def _reply_stats(self, identity: bytes) -> None:
        """Answer a stats request, unless ZeroMQ still holds this peer's last answer (a peer
        asking again and again without reading) or too many answers: then it is dropped. One
        snapshot serves every request of a turn (a flood costs one, not one per request)."""
        if not self.socket.may_reply_stats(identity):
            log.debug("stats request from %s dropped: its last reply is unread", shown(identity))
            return
        if self._stats_packed is None:
            self._stats_packed = StatsReply(self.stats_snapshot()).pack()
        self.socket.reply_stats(identity, self._stats_packed)

    # ----------------------------------------------------------------------------- stats

    def stats_snapshot(self) -> ServerStats:
        """The Stats schema (wire/stats.py, built by `Telemetry.snapshot`); safe to call from
        another thread (Prometheus)."""
        now = time.monotonic()
        depth = dict(self.phases.depth)
        depth["read"] += self.producers.queued
        depth["ready"] = self.core.ready
        capacity = stage_capacities(
            self.producers.n, len(self.core.sessions), self.config.prefetch_depth
        )
        # latency_ms: the telemetry's recent mean for each stage replaces it (0 until observed).
        stages = [
            StageStats(name=name, depth=depth[name], capacity=capacity[name], latency_ms=0.0)
            for name in ("read", "decode", "augment", "ready")
        ]
        rows, unlisted = self.core.client_rows(now)
        buffers = BufferStats(
            # In use: the share window's idle buffers are not (they are window_bytes).
            held=max(0, self.buffers.held - self.core.shared.idle),
            allocated=self.buffers.capacity,
            max=self.buffers.max_buffers,
            batch_bytes=self.capacity.nbytes + self.capacity.labels_nbytes,
            window_bytes=self.core.shared.idle
            * (self.capacity.nbytes + self.capacity.labels_nbytes),
        )
        return self.telemetry.snapshot(
            stages,
            rows,
            clients_unlisted=unlisted,
            buffers=buffers,
            connections=self.socket.connections,
        )
