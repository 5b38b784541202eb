"""The server: one ROUTER loop thread that owns the socket and every client's stream.

The loop receives control messages, hands production jobs to the worker pool (round-robin over
clients with room), sends finished batches as credits allow, and returns buffers to the pool
once ZeroMQ's tracker says it has let go. Only this thread touches the ROUTER socket (zmq
sockets are not thread-safe) and the streams; workers report back through a queue and a wake-up
pipe. Nothing here blocks for long: the loop polls, and a bad message costs one error reply.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import stat
import threading
import time
from collections import Counter, deque
from typing import Any

import zmq
from batchwire import wire
from batchwire.pipeline.samples import BadFileTally
from batchwire.pipeline.split import Split
from batchwire.server.bufpool import BufferPool, Slot, default_reserve
from batchwire.server.config import ServerConfig
from batchwire.server.security import bind_policy, owner_only
from batchwire.server.splits import StartupError, make_decoder, open_splits
from batchwire.server.streams import ClientStream, Produced, Scheduler
from batchwire.server.telemetry import Telemetry
from batchwire.server.workers import Job, JobResult, ProducerPool, StageTimingDecoder, _Phases
from batchwire.wire import (
    BatchHeader,
    Bye,
    Credit,
    ErrorReply,
    Hello,
    ProtocolError,
    StatsReply,
    StatsRequest,
    VersionMismatch,
    Welcome,
    send_batch,
    tensor_bytes,
)
from batchwire.wire.keys import KeysError, ServerKeys
from zmq.utils.monitor import parse_monitor_message

__all__ = ["ServerApp", "StartupError"]

log = logging.getLogger("batchwire.server")

# A peer that never reads cannot make us queue replies without bound (batches are bounded by
# credits, which are capped at MAX_PREFETCH per client).
_SNDHWM = 4 * wire.MAX_PREFETCH + 64
# Frames above this are refused by ZeroMQ itself (the peer is disconnected); smaller oversized
# frames reach us and are counted as malformed.
_MAXMSGSIZE = 16 * 1024 * 1024
_MAX_RECV_PER_TURN = 256  # then do other work: a flood cannot starve sending
_TRACKER_POLL_MAX_MS = 100
_IDLE_POLL_MS = 250
_LOADER_STATS_KEYS = 32
_MALFORMED_LOGGED = 20
_ERRORS_LOGGED = 100
_MESSAGE_MAX = 1000  # characters of an error reply or log line about a peer's message
# ZMTP heartbeats: the server pings every peer each second and closes a connection that answers
# nothing for 3 s (a trainer host that vanished without closing its sockets). A client's libzmq
# answers pings in its I/O thread, whatever its Python code is doing, and credits keep its
# receive queue short, so a live client always answers. No HEARTBEAT_TTL: it would make a client
# drop a connection on which one large batch takes longer than the TTL to arrive (a peer counts
# only whole messages as traffic). A closed connection is a DISCONNECTED monitor event.
# A stream that owes nothing and has been quiet this long (a notebook done iterating) no longer
# holds its split's world size: a training loader asks for batches every step.
_AGREEMENT_IDLE_S = 5.0
_HEARTBEAT_IVL_MS = 1000
_HEARTBEAT_TIMEOUT_MS = 3000
_PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPT_FAILED
_LISTEN_BACKLOG = 1024  # the kernel caps it at net.core.somaxconn
_ACCEPT_FAILED_LOG_S = 10.0  # one warning per this long while accepts fail (e.g. EMFILE)
# Stats list this many clients in full, the most recently heard from first; the others are
# summed in "clients_unlisted", so a stats reply stays far below wire.MAX_SERVER_FRAME_BYTES
# (a row is at most ~4 KB: a 255-byte identity, a 32-key loader map) whatever the client count.
STATS_CLIENTS_LISTED = 256
# SIGTERM/SIGINT: the process exits this long after the signal at the latest, whatever a
# thread is doing (producer threads are daemons; a stuck read is not waited for).
STOP_DEADLINE_S = 1.5
_STOP_LINGER_MS = 300  # of the deadline, for shutdown replies still queued
_STOP_JOIN_S = 0.3  # of the deadline, for producers to finish the batch they are on
# A chunk of batch buffers nobody has needed for this long is freed even if clients remain.
_BUFFERS_IDLE_S = 30.0


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
        self._phases = _Phases(self.telemetry.observe_stage)
        try:
            self.splits: dict[str, Split] = open_splits(
                config, StageTimingDecoder(self.decoder, self._phases)
            )
        except ValueError as exc:
            self._close_decoder()
            raise StartupError(str(exc)) from None
        except BaseException:
            self._close_decoder()
            raise
        # Every split writes the same batches (one image size, dtype and layout): one spec.
        self.spec = config.batch_spec()
        cap = config.buffer_cap
        # Pinned only where a GPU copy reads them (a --device cuda server's device-to-host
        # copies): a CPU server on a training node must not open a CUDA context on GPU 0.
        self.buffers = BufferPool(
            self.spec, cap, default_reserve(cap, config.producers), pin=config.device != "cpu"
        )
        self._buffers_used_at = time.monotonic()  # last time a buffer was lent
        self._bad_files = BadFileTally()  # bad_total: distinct files over all splits

        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.sndhwm = _SNDHWM
        self.router.maxmsgsize = _MAXMSGSIZE
        self.router.linger = 0
        self.router.heartbeat_ivl = _HEARTBEAT_IVL_MS
        self.router.heartbeat_timeout = _HEARTBEAT_TIMEOUT_MS
        # A connection that does not complete the ZMTP greeting and handshake in time is closed
        # by libzmq (a bare TCP connection that sends nothing never does): silent connections
        # cannot pile up and use up file descriptors. (A peer that did complete it is a ZeroMQ
        # socket, kept alive by its own libzmq's heartbeat answers; ROUTER has no call to close
        # one peer, see the report in issue 12; it holds no stream and no buffer.)
        self.router.handshake_ivl = max(1, int(config.handshake_timeout * 1000))
        # Connections the kernel queues while none can be accepted (a burst of trainers, or
        # descriptors used up for a moment): queued, they are accepted as soon as descriptors
        # free up, instead of waiting out SYN retransmission back-off (1, 3, 7, 15 s...).
        self.router.backlog = _LISTEN_BACKLOG
        # A peer that takes nothing of what was sent (its socket full: a stopped process, a
        # peer that never reads, a host gone while data was in flight) answers no heartbeat,
        # but libzmq only pings between messages, so the heartbeat never fires while a batch
        # is stuck half-written. TCP_USER_TIMEOUT (ZMQ_TCP_MAXRT) makes the kernel close such
        # a connection, which frees the buffers ZeroMQ holds for it. A RemoteLoader's socket
        # always takes what it asked for, so a live trainer is never cut. tcp:// only.
        self.router.tcp_maxrt = max(1, int(config.stall_timeout * 1000))
        if self.keys is not None:  # before any bind: no peer ever talks to a plain socket
            self.keys.guard(self.ctx, self.router)
        # Which peers left: ROUTER_NOTIFY would say it in-band, but it is a draft option that
        # pyzmq's bundled libzmq lacks; the socket monitor reports every connection accepted and
        # closed by its file descriptor, and each received frame says which descriptor it came
        # in on (SRCFD), so a stream is tied to its connection (see `_track_peer`).
        self.monitor = self.router.get_monitor_socket(_PEER_EVENTS)
        self._peer_fd: dict[bytes, int] = {}  # identity with a stream -> its connection's fd
        self._fd_open: dict[int, bool] = {}  # fd -> last event was ACCEPTED (not DISCONNECTED)
        self._accept_failed_at = -math.inf  # last warning about failing accepts
        self._accept_failures = 0
        self.endpoints: list[str] = []
        for endpoint in config.bind:
            try:
                with owner_only(endpoint):
                    self.router.bind(endpoint)
            except zmq.ZMQError as exc:
                self._close_monitor()
                self.router.close(0)
                self.ctx.term()
                self._close_decoder()
                if self.keys is not None:
                    self.keys.stop()
                raise StartupError(f"cannot bind {endpoint}: {exc}") from None
            self.endpoints.append(self.router.last_endpoint.decode())

        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        producers = {name: s.producer for name, s in self.splits.items()}
        self.pool = ProducerPool(
            producers, config.producers, self._phases, self._wake_w, self.spec, config.device
        )
        self.streams: dict[bytes, ClientStream] = {}
        self.scheduler = Scheduler()
        self._in_flight: deque[tuple[zmq.MessageTracker, Slot, ClientStream]] = deque()
        # Sent batches ZeroMQ still holds, per peer and across its streams: a peer that sends
        # credits (or new hellos) but never reads would otherwise pin a buffer per credit.
        self._held: Counter[bytes] = Counter()
        self._tracker_wait_ms = 1
        self._stopping = False
        self._stop_requested = threading.Event()  # set by the signal handler
        self._stopped = threading.Event()  # set once shut down
        self._stop_deadline = math.inf
        self._malformed_seen = 0
        self._errors_seen = 0
        self._metrics: Any = None

    # ----------------------------------------------------------------------------- lifecycle

    def request_stop(self, *_: object) -> None:
        """Ask the loop to shut down (signal handler; safe to call from any thread)."""
        if not self._stopping:
            self._stop_deadline = time.monotonic() + STOP_DEADLINE_S
        self._stopping = True
        self._stop_requested.set()
        with contextlib.suppress(OSError):  # pipe full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"s")

    def run(self, exit_by_deadline: bool = False) -> int:
        """Serve until SIGINT/SIGTERM or `request_stop()`; returns the exit code (0).

        ``exit_by_deadline`` (the console script): should the orderly shutdown not be over
        `STOP_DEADLINE_S` after the stop request (a thread stuck in a read, a decoder that does
        not let go), the process exits with code 0 then anyway (``os._exit``). Embedded use
        leaves it off: the host process is not ours to end.
        """
        try:
            signal.signal(signal.SIGTERM, self.request_stop)
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
                "serving %s on %s: batch %d, %dpx, %s %s, %d producers, %s, "
                "work-ahead %d per client",
                "/".join(self.splits),
                ", ".join(self.endpoints),
                self.config.batch_size,
                self.config.image_size,
                self.spec.dtype,
                self.spec.layout,
                self.config.producers,
                f"{threads} decode threads" if threads > 1 else "each decoding its own batch",
                self.config.prefetch_depth,
            )
            log.info("%s", self.memory_statement())
            if self.config.device != "cpu":
                bound = gpu_memory_statement(
                    self.config.producers,
                    getattr(self.decoder, "max_batch", self.config.batch_size),
                    getattr(self.decoder, "max_image_pixels", None),
                    self.spec.nbytes,
                )
                log.info("%s", bound)
            self._loop()
        finally:
            self._shutdown()
        log.info("stopped")
        return 0

    def memory_statement(self) -> str:
        """The host memory the batch buffers can ever hold, said at start (README's formula)."""
        return host_memory_statement(
            self.buffers.max_buffers,
            self.spec.nbytes + self.spec.labels_nbytes,
            self.buffers.reserve,
            self.config.max_clients,
        )

    def _stop_watchdog(self) -> None:
        self._stop_requested.wait()
        if self._stopped.wait(max(0.0, self._stop_deadline - time.monotonic())):
            return
        busy = [
            t.name
            for t in threading.enumerate()
            if t.name.startswith("bw-") and t is not threading.current_thread()
        ]
        log.warning(
            "shutdown not done %.1f s after the stop request (busy threads: %s): exiting now",
            STOP_DEADLINE_S,
            ", ".join(busy) or "none",
        )
        logging.shutdown()
        os._exit(0)

    def _serve_metrics(self, port: int) -> None:
        try:
            self._metrics = self.telemetry.serve_prometheus(
                port, self.stats_snapshot, host=self.config.metrics_host
            )
        except OSError as exc:  # port taken, no permission: a start-up error like a bad --bind
            raise StartupError(f"cannot serve metrics on --metrics-port {port}: {exc}") from None

    def _shutdown(self) -> None:
        """Tell the clients, stop the workers and close everything, within the stop deadline.

        Producer threads get `_STOP_JOIN_S` to finish their batch; one still busy (a read that
        blocks, a huge image) is a daemon and is not waited for, nor is the decoder it may be
        using closed (closing joins its threads).
        """
        if self._stop_deadline == math.inf:  # the loop ended without a stop request
            self._stop_deadline = time.monotonic() + STOP_DEADLINE_S
        log.info("shutting down: telling %d client(s)", len(self.streams))
        for identity in list(self.streams):
            self._reply(identity, wire.Shutdown())
            self._drop(identity)
        idle = self.pool.stop(timeout=_STOP_JOIN_S)
        if self._metrics is not None:
            self._metrics()
        self._close_monitor()
        left_ms = int(1000 * (self._stop_deadline - time.monotonic())) - 200
        self.router.close(linger=max(0, min(_STOP_LINGER_MS, left_ms)))
        if self.keys is not None:
            self.keys.stop()  # the ZAP authenticator's socket, before the context ends
        self.ctx.term()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        if idle:
            self._close_decoder()
        else:
            log.warning("producers still busy at shutdown: not waiting for them")
        self._stopped.set()

    def _close_monitor(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.router.disable_monitor()
        self.monitor.close(0)

    def _close_decoder(self) -> None:
        close = getattr(self.decoder, "close", None)
        if close is not None:
            close()

    # ----------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        next_reap = time.monotonic() + 1.0
        while not self._stopping:
            # Trackers have no file descriptor: poll them with a timeout that backs off while
            # nothing completes (a stalled client's buffers may stay with ZeroMQ for long).
            timeout = self._tracker_wait_ms if self._in_flight else _IDLE_POLL_MS
            events = dict(poller.poll(timeout))
            if self._wake_r in events:
                self._drain_wakeups()
            if self.monitor in events:
                self._peer_events()
            if self.router in events:
                self._receive()
            self._collect_results()
            self._release_sent()
            self._send_ready()
            self._schedule()
            now = time.monotonic()
            if now >= next_reap:
                self._reap(now)
                next_reap = now + 1.0

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _receive(self) -> None:
        for _ in range(_MAX_RECV_PER_TURN):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if len(frames) != 2:
                self._malformed(identity, f"expected 1 control frame, got {len(frames) - 1}")
                continue
            try:
                msg = wire.decode_client_message(frames[1].buffer)
            except VersionMismatch as exc:
                self._malformed(
                    identity,
                    f"protocol version mismatch: client speaks v{wire.show(exc.peer_version)}, "
                    f"server speaks v{wire.PROTOCOL_VERSION}",
                )
                continue
            except ProtocolError as exc:
                self._malformed(identity, str(exc))
                continue
            self._dispatch(identity, msg)
            if identity in self.streams:
                self._track_peer(identity, frames[1])

    # ----------------------------------------------------------------------------- peers

    def _track_peer(self, identity: bytes, frame: zmq.Frame) -> None:
        """Tie a client's stream to the connection its message came in on.

        Events are handled before a new tie is made: a connection's ACCEPTED event precedes
        its first message, and the DISCONNECTED event of an earlier connection on the same
        descriptor number precedes that ACCEPTED, so neither can be mistaken for this one's.
        """
        try:
            fd = int(frame.get(zmq.SRCFD))
        except (zmq.ZMQError, TypeError, ValueError):  # a libzmq without SRCFD: timeouts only
            return
        if self._peer_fd.get(identity) == fd:
            return
        self._peer_events()
        if not self._fd_open.get(fd, True):  # the connection closed since it sent this
            self._peer_gone(identity, "disconnected")
            return
        self._peer_fd[identity] = fd

    def _peer_events(self) -> None:
        """Handle the monitor's connection events; a closed connection drops its streams."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(frames)
            except Exception:  # not ours to fail on: the monitor format is libzmq's
                continue
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPT_FAILED:
                self._accept_failed(fd)  # the value is errno here
            elif event["event"] == zmq.EVENT_ACCEPTED:
                self._fd_open[fd] = True
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._fd_open[fd] = False
                for identity in [i for i, f in self._peer_fd.items() if f == fd]:
                    self._peer_gone(identity, "disconnected (closed, or no heartbeat answer)")

    def _accept_failed(self, errno_value: int) -> None:
        """libzmq could not accept a connection (out of descriptors?): warn now and then."""
        self._accept_failures += 1
        now = time.monotonic()
        if now - self._accept_failed_at < _ACCEPT_FAILED_LOG_S:
            return
        self._accept_failed_at = now
        log.warning(
            "cannot accept connections: %s (%d failed accepts; %d connections open, "
            "descriptor limit %s); silent ones are closed after --handshake-timeout %g s",
            os.strerror(errno_value),
            self._accept_failures,
            self.connections,
            _nofile_limit(),
            self.config.handshake_timeout,
        )
        self._accept_failures = 0

    @property
    def connections(self) -> int:
        """Connections open now (accepted and not yet closed), by the monitor's events."""
        return sum(self._fd_open.values())

    def _peer_gone(self, identity: bytes, why: str) -> None:
        stream = self.streams.get(identity)
        if stream is not None:
            h = stream.hello
            log.info(
                "client %s (%s rank %d/%d) %s: its stream and queued batches dropped",
                identity.hex(),
                h.split,
                h.rank,
                h.world_size,
                why,
            )
        self._drop(identity)

    def _dispatch(self, identity: bytes, msg: wire.ClientMessage) -> None:
        stream = self.streams.get(identity)
        if stream is not None:
            stream.last_seen = time.monotonic()
        if isinstance(msg, Credit):
            if stream is None:  # e.g. after a restart or a drop: the client will re-send hello
                log.debug("credit from unknown client %s ignored", identity.hex())
                return
            stream.loader_stats = _clean_loader_stats(msg.stats)
            refused = stream.ask(msg.batches)
            if refused is not None:
                self._error(identity, f"credit refused: {refused}")
        elif isinstance(msg, Hello):
            self._on_hello(identity, msg)
        elif isinstance(msg, Bye):
            if stream is not None:
                log.info("client %s said bye", identity.hex())
                self._drop(identity)
        elif isinstance(msg, StatsRequest):
            self._reply(identity, StatsReply(self.stats_snapshot()))

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        split = self.splits.get(hello.split)
        if split is None:
            self._error(
                identity,
                f"unknown split {wire.show(hello.split)}: this server serves {sorted(self.splits)}",
            )
            return
        now = time.monotonic()
        for other in self.streams.values():
            if (
                other.identity != identity
                and other.hello.split == hello.split
                and other.hello.job == hello.job
                and other.hello.world_size != hello.world_size
                and (not other.done or now - other.last_seen < _AGREEMENT_IDLE_S)
            ):
                self._error(identity, self._world_size_conflict(hello, other))
                return
        limit = self.config.max_clients
        if identity not in self.streams and len(self.streams) >= limit:
            self._error(
                identity,
                f"this server serves at most {limit} clients (--max-clients) and has "
                f"{len(self.streams)}; try again when one leaves, or use another server",
            )
            return
        if identity in self.streams:  # next epoch, resume or reconnect: replace the stream
            self._drop(identity)
        try:  # e.g. more ranks x batch than the split has samples: this client's problem alone
            sampler = split.sampler(
                self.config.batch_size, self.config.seed, hello.rank, hello.world_size
            )
        except ValueError as exc:
            self._error(identity, f"cannot serve this hello: {exc}")
            return
        stream = ClientStream(
            identity, hello, sampler.num_batches, self.config.prefetch_depth, sampler
        )
        refused = stream.ask(hello.batches)
        if refused is not None:
            self._error(identity, f"cannot serve this hello: {refused}")
            return
        self.streams[identity] = stream
        self.scheduler.add(identity)
        aug = split.augment
        self._reply(
            identity,
            Welcome(
                session=hello.session,
                num_batches=sampler.num_batches,
                num_samples=len(split.dataset),
                batch_size=self.spec.batch_size,
                shape=self.spec.shape,
                dtype=self.spec.dtype,
                layout=self.spec.layout,
                mean=list(aug.mean),
                std=list(aug.std),
                num_classes=split.dataset.num_classes,
            ),
        )
        asks = f"batch {hello.batches[0]}" if hello.batches else "nothing yet"
        log.info(
            "client %s%s: %s epoch %d rank %d/%d, asks for %s (%d asked, %d in the epoch)",
            identity.hex(),
            f" (job {wire.show(hello.job)})" if hello.job else "",
            hello.split,
            hello.epoch,
            hello.rank,
            hello.world_size,
            asks,
            len(hello.batches),
            sampler.num_batches,
        )

    def _world_size_conflict(self, hello: Hello, other: ClientStream) -> str:
        """The refusal of a hello whose world size differs from a live stream's: who holds the
        split, when it was last heard from and when it stops counting."""
        silent = time.monotonic() - other.last_seen
        timeout = self.config.client_timeout
        o = other.hello
        job = f" of job {wire.show(hello.job)}" if hello.job else ""
        return (
            f"world_size mismatch on split {hello.split!r}{job}: this client says "
            f"world_size={hello.world_size}, but client {other.id} (rank {o.rank} of "
            f"world_size={o.world_size}, epoch {o.epoch}) is streaming it, last heard from "
            f"{silent:.1f} s ago; it is dropped when it disconnects or says bye, else after "
            f"--client-timeout {timeout:g} s of silence, in {max(0.0, timeout - silent):.1f} s "
            "if it stays silent (a loader of another job, BATCHWIRE_JOB or torchrun's run id, "
            "is not refused)"
        )

    def _drop(self, identity: bytes) -> None:
        """Forget a client's stream and release its queued batches (in-flight ones: later)."""
        self._peer_fd.pop(identity, None)
        stream = self.streams.pop(identity, None)
        self.scheduler.remove(identity)
        if stream is not None:
            for batch in stream.drain():
                self.buffers.release(batch.slot)

    def _reap(self, now: float) -> None:
        limit = self.config.client_timeout
        for identity, stream in list(self.streams.items()):
            if now - stream.last_seen > limit:
                log.warning("client %s silent for %.0f s: dropped", identity.hex(), limit)
                self._drop(identity)
        self._trim_buffers(now)

    def _trim_buffers(self, now: float) -> None:
        """Give back chunks of free buffers the current clients cannot need.

        The clients present may need at most their full share each (2 x prefetch-depth) and
        the producers' jobs (2 x producers); once nobody has taken a buffer for
        `_BUFFERS_IDLE_S`, or no client is left, none is kept. Only chunks whose buffers are
        all free go, so this never waits for anything.
        """
        if self.buffers.capacity == 0:
            return
        n = len(self.streams)
        if n == 0 or now - self._buffers_used_at > _BUFFERS_IDLE_S:
            keep = 0
        else:
            need = 2 * self.config.producers + 2 * self.config.prefetch_depth * n
            keep = min(self.buffers.max_buffers, need)
        self.buffers.trim(keep)

    # ----------------------------------------------------------------------------- replies

    def _reply(self, identity: bytes, msg: wire._Message) -> None:
        try:
            self.router.send_multipart([identity, msg.pack()], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("reply to %s dropped: %s", identity.hex(), exc)

    def _error(
        self, identity: bytes, message: str, reason: str = "refused", detail: str = ""
    ) -> None:
        """Refuse with ``message`` (what the client sees: never a path or file content) and
        log ``detail`` beside it (paths, the exception: for the operator only)."""
        message = _clip(message)
        self._errors_seen += 1
        # Refused hellos are rare from real trainers; a peer repeating one must not fill the log.
        level = logging.WARNING if self._errors_seen <= _ERRORS_LOGGED else logging.DEBUG
        log.log(level, "client %s: %s%s", identity.hex(), message, _clip(detail))
        self.telemetry.add_error()
        self._reply(identity, ErrorReply(message, reason))

    def _malformed(self, identity: bytes, message: str) -> None:
        message = _clip(message)
        self._malformed_seen += 1
        # A flood of garbage must not flood the log too: the counter in stats tells the rest.
        if self._malformed_seen <= _MALFORMED_LOGGED:
            log.warning(
                "malformed message from %s: %s%s",
                identity.hex(),
                message,
                " (further ones are only counted)"
                if self._malformed_seen == _MALFORMED_LOGGED
                else "",
            )
        else:
            log.debug("malformed message from %s: %s", identity.hex(), message)
        self.telemetry.add_malformed()
        self._reply(identity, ErrorReply(f"malformed message: {message}", "bad-request"))

    # ----------------------------------------------------------------------------- batches

    def _holding(self, stream: ClientStream) -> int:
        """Buffers a client holds: in production, ready, and sent but still with ZeroMQ."""
        return stream.in_production + stream.ready + self._held.get(stream.identity, 0)

    def _schedule(self) -> None:
        if not self.pool.has_room() or self.buffers.held >= self.buffers.max_buffers:
            return
        if len(self.streams) * 2 * self.config.prefetch_depth <= self.buffers.shared:
            share = self.buffers.shared  # every client can have its full work-ahead
        else:  # shared by the clients holding some or wanting one
            sharing = sum(1 for s in self.streams.values() if s.has_room() or self._holding(s))
            share = self.buffers.share(sharing)

        def may_lend(stream: ClientStream) -> bool:
            return self.buffers.may_lend(self._holding(stream), share)

        while self.pool.has_room():
            stream = self.scheduler.next(self.streams, may_lend)
            if stream is None:
                return
            pos, batch_index = stream.take_next()
            self._buffers_used_at = time.monotonic()
            self.pool.submit(
                Job(stream, pos, batch_index, self.buffers.acquire(), self._buffers_used_at)
            )

    def _collect_results(self) -> None:
        while not self.pool.results.empty():
            result: JobResult = self.pool.results.get_nowait()
            self._on_result(result)

    def _on_result(self, result: JobResult) -> None:
        job, stream = result.job, result.job.stream
        # Before the failure branch: bad files found by a batch that then failed count too.
        new_bad = self._bad_files.update(s.producer.samples for s in self.splits.values())
        if new_bad:
            self.telemetry.add_bad(new_bad)
        if result.meta is None or stream.closed:
            self.buffers.release(job.slot)
            if not stream.closed:
                stream.abandoned()
                if result.error != "cancelled":
                    kind = (result.error or "").split(":", 1)[0]
                    self._error(
                        stream.identity,
                        f"producing {stream.hello.split} batch {job.batch_index} failed "
                        f"({kind}, {result.reason}); the server's log has the details",
                        result.reason,
                        detail=f": {result.error}",
                    )
                    self._drop(stream.identity)
            return
        meta = result.meta
        if meta.replaced:
            self.telemetry.add_replaced(meta.replaced)
        stream.completed(
            job.pos,
            Produced(
                batch_index=job.batch_index,
                slot=job.slot,
                labels=meta.labels,
                indices=meta.indices.tolist(),
                replaced=int(meta.replaced),
                produce_s=result.seconds,
            ),
        )

    def _send_ready(self) -> None:
        now = time.monotonic()
        for stream in self.streams.values():
            # At most --prefetch-depth batches of a peer in ZeroMQ's hands: a peer that asks
            # for many and reads none pins no more (memory is bounded by the server's setting).
            room = self.config.prefetch_depth - self._held[stream.identity]
            for batch in stream.pop_sendable(room):
                self._send(stream, batch, now)

    def _send(self, stream: ClientStream, batch: Produced, now: float) -> None:
        h = stream.hello
        header = BatchHeader(
            session=h.session,
            split=h.split,
            epoch=h.epoch,
            batch_index=batch.batch_index,
            shape=self.spec.shape,
            dtype=self.spec.dtype,
            layout=self.spec.layout,
            indices=batch.indices,
            replaced=batch.replaced,
            nbytes=self.spec.nbytes,
        )
        # Counted before the hand-off: ZeroMQ's I/O thread can deliver the batch before this
        # thread runs again, and a scrape must never show fewer batches than a client received.
        self.telemetry.add_batch(self.spec.batch_size, self.spec.nbytes + self.spec.labels_nbytes)
        tracker = send_batch(
            self.router,
            header,
            tensor_bytes(batch.slot.tensor),
            batch.labels,
            identity=stream.identity,
        )
        self._in_flight.append((tracker, batch.slot, stream))
        self._held[stream.identity] += 1
        self._tracker_wait_ms = 1
        self.telemetry.observe_stage("ready", now - batch.done_at)
        stream.meter.add(self.spec.batch_size, now)

    def _release_sent(self) -> None:
        """Return buffers whose frames ZeroMQ no longer holds (never blocks)."""
        released = False
        pending: deque[tuple[zmq.MessageTracker, Slot, ClientStream]] = deque()
        while self._in_flight:
            item = self._in_flight.popleft()
            if item[0].done:
                self.buffers.release(item[1])
                self._held[item[2].identity] -= 1
                if self._held[item[2].identity] <= 0:
                    del self._held[item[2].identity]
                released = True
            else:
                pending.append(item)
        self._in_flight = pending
        if released:
            self._tracker_wait_ms = 1
        else:
            self._tracker_wait_ms = min(2 * self._tracker_wait_ms, _TRACKER_POLL_MAX_MS)

    # ----------------------------------------------------------------------------- stats

    def stats_snapshot(self) -> dict[str, Any]:
        """The Stats schema (ARCHITECTURE.md); safe to call from another thread (Prometheus)."""
        now = time.monotonic()
        streams = list(self.streams.values())
        depth = self._phases.depth
        n = self.pool.n
        stages = [
            {"name": "read", "depth": self.pool.queued + depth["read"], "capacity": 2 * n},
            {"name": "decode", "depth": depth["decode"], "capacity": n},
            {"name": "augment", "depth": depth["augment"], "capacity": n},
            {
                "name": "ready",
                "depth": sum(s.ready for s in streams),
                "capacity": max(1, len(streams)) * self.config.prefetch_depth,
            },
        ]
        held = dict(self._held)  # this may run on the Prometheus thread
        # The most recently heard from in full, the rest summed: the reply stays small.
        streams.sort(key=lambda s: s.last_seen, reverse=True)
        rows = [s.row(now, held.get(s.identity, 0)) for s in streams[:STATS_CLIENTS_LISTED]]
        rest = streams[STATS_CLIENTS_LISTED:]
        unlisted = {
            "count": len(rest),
            "credits": sum(s.credits for s in rest),
            "ready": sum(s.ready for s in rest),
            "in_flight": sum(held.get(s.identity, 0) for s in rest),
            "sent": sum(s.sent for s in rest),
            "images_per_s": sum(s.meter.rate(now) for s in rest),
        }
        buffers = {
            "held": self.buffers.held,
            "allocated": self.buffers.capacity,
            "max": self.buffers.max_buffers,
            "batch_bytes": self.spec.nbytes + self.spec.labels_nbytes,
        }
        return self.telemetry.snapshot(
            stages,
            rows,
            clients_unlisted=unlisted,
            buffers=buffers,
            connections=self.connections,
        )


def _clean_loader_stats(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """Keep only finite numbers under string keys: these travel on into stats and Prometheus."""
    if stats is None:
        return None
    out: dict[str, Any] = {}
    for key, value in list(stats.items())[:_LOADER_STATS_KEYS]:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        out[str(key)[:64]] = value
    return out


def gpu_memory_statement(
    producers: int, max_batch: int, max_image_pixels: int | None, batch_nbytes: int
) -> str:
    """The device memory the server's batches can hold at once, said at start.

    Each producer holds at most one batch's decode output (``max_batch`` images of at most
    ``max_image_pixels``: the decoder sends larger ones to the CPU) and its own output batch.
    """
    decode_mib = max_batch * (max_image_pixels or 0) * 3 / 2**20
    batch_mib = batch_nbytes / 2**20
    total = producers * (decode_mib + batch_mib)
    return (
        f"GPU memory bound: {producers} producers x (decode output {decode_mib:.0f} MiB + "
        f"batch {batch_mib:.0f} MiB) = {total:.0f} MiB; --producers and --batch-size scale it"
    )


def host_memory_statement(
    max_buffers: int, batch_bytes: int, reserve: int, max_clients: int
) -> str:
    """What the batch buffers can hold at most, in host memory, said at start."""
    total = max_buffers * batch_bytes
    return (
        f"host memory bound for batches: {max_buffers} buffers (--max-buffers) x "
        f"{batch_bytes / 2**20:.1f} MiB a batch = {total / 2**20:.0f} MiB, shared by up to "
        f"{max_clients} clients (--max-clients; {reserve} kept for clients holding none); "
        "plus the process itself and the producers' decoded images"
    )


def check_ipc_endpoint(endpoint: str) -> None:
    """Refuse to bind an ipc:// path another process listens on, or that is not a socket.

    libzmq unlinks whatever is at the path before binding: another server's socket (that server
    keeps running, unreachable) or any file. A socket file nobody listens on (a server that
    was killed) is stale and is replaced.
    """
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    if path.startswith("@"):  # Linux abstract namespace: no file; bind fails if taken
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StartupError(f"cannot bind {endpoint}: {exc}") from None
    if not stat.S_ISSOCK(mode):
        raise StartupError(
            f"cannot bind {endpoint}: {path} exists and is not a socket (binding would delete it)"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # stale: nobody listens; libzmq replaces it
    except OSError as exc:
        raise StartupError(f"cannot bind {endpoint}: {path}: {exc}") from None
    finally:
        probe.close()
    raise StartupError(f"another server is listening on {endpoint}; stop it or bind another path")


def _nofile_limit() -> str:
    try:
        import resource

        return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):
        return "unknown"


def _clip(message: str) -> str:
    """An error text short enough for any client to read and for the log."""
    if len(message) <= _MESSAGE_MAX:
        return message
    return f"{message[: _MESSAGE_MAX - 20]}... ({len(message)} characters)"
