"""Server-side measurements: counters, sliding-window rates, stage latencies, Prometheus export.

The server's threads call the ``add_*``/``observe_stage`` methods on their hot paths, so each one
takes one short lock and does O(1) amortised work. Everything the outside world sees comes out of
:meth:`Telemetry.snapshot`, a `wire.ServerStats` (the schema lives in wire/stats.py): the ZeroMQ
``stats`` reply and the Prometheus scrape are both built from it, so the two views can never
disagree.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields, replace
from typing import Any

import numpy as np
from batchwire.common.rates import RateMeter
from batchwire.pipeline.mix_order import MixPlan
from batchwire.server.handshakes import REASONS as HANDSHAKE_REASONS
from batchwire.server.metrics_http import HealthCheck, start_metrics_server
from batchwire.wire.stats import (
    STATS_VERSION,
    BufferStats,
    ClientRow,
    Counters,
    MixPartStats,
    MixStats,
    ServerStats,
    StageStats,
    Throughput,
    UnlistedClients,
)
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

log = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "STATS_VERSION", "MetricsServer", "Telemetry"]

# Long enough to smooth batch-sized bursts, short enough that a stall shows within seconds.
THROUGHPUT_WINDOW_S = 5.0
# Latency is a per-batch property: average the batches of the last few seconds.
LATENCY_WINDOW_S = 10.0
# Keeps memory bounded when one stage is observed thousands of times per second.
LATENCY_MAX_SAMPLES = 1024
# From sub-millisecond (a cache-hot read) to seconds (a huge batch decoded on one core).
LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

#: The counters this class keeps: the fields of the schema's `Counters`.
COUNTER_NAMES = tuple(f.name for f in fields(Counters))
# `Counters` field -> (Prometheus name, help). The names end in _total as Prometheus expects.
_PROM_COUNTERS = {
    "images_total": ("batchwire_images_total", "Images sent to clients."),
    "batches_total": ("batchwire_batches_total", "Batches sent to clients."),
    "bytes_total": ("batchwire_bytes_total", "Payload bytes (images and labels) sent."),
    "replaced_total": (
        "batchwire_replaced_samples_total",
        "Samples replaced because their file was unusable.",
    ),
    "bad_total": ("batchwire_bad_samples_total", "Samples whose file failed to read or decode."),
    "errors_total": ("batchwire_errors_total", "Errors while serving (error replies, failures)."),
    "malformed_total": (
        "batchwire_malformed_messages_total",
        "Malformed or unknown messages received and dropped.",
    ),
    "batches_produced_total": (
        "batchwire_batches_produced_total",
        "Batches produced (decoded and augmented); batches_total / this is the share ratio.",
    ),
    "batches_shared_total": (
        "batchwire_batches_shared_total",
        "Sends of a batch produced once for several sessions, beyond its first send.",
    ),
    "samples_produced_total": (
        "batchwire_samples_produced_total",
        "Samples decoded and augmented: the produced batches' samples less those reused.",
    ),
    "samples_reused_total": (
        "batchwire_samples_reused_total",
        "Samples copied from the sample window into a batch of another batch size instead of "
        "produced again (sweeps mixing batch sizes).",
    ),
    "transform_errors_total": (
        "batchwire_transform_errors_total",
        "Samples a user transform (--transform) failed on, each replaced by a substitute.",
    ),
}
# Per decoder (label `decoder`), so it is exported by `_families` from the decoders' totals.
_PROM_FALLBACKS = (
    "batchwire_decode_fallbacks_total",
    "Images a GPU decoder handed to the CPU decoder (skipped or refused on the GPU).",
)
# A client is named by what outlives its connection: the job (hello.job: torchrun's run id,
# BATCHWIRE_JOB...), split and rank. The connection's id would start new series at every
# reconnect and restart. Not `job`: Prometheus sets `job` itself on every scraped series (the
# scrape job) and would rename ours `exported_job`.
_CLIENT_LABELS = ("train_job", "split", "rank")
# `ClientRow` field -> (Prometheus gauge name, help).
_CLIENT_GAUGES = {
    "ready": ("batchwire_client_ready", "Batches ready for a client, waiting for its credits."),
    "ready_capacity": ("batchwire_client_ready_capacity", "Bound of a client's ready queue."),
    "credits": ("batchwire_client_credits", "Credits a client has outstanding."),
    "in_flight": (
        "batchwire_client_in_flight",
        "Batches sent to a client and not yet credited back.",
    ),
}
# Rates come from counters (PromQL's rate()); the one per client is its session's batches sent.
# A new session (an epoch, a reconnect) starts it at 0 again: rate() treats that as a reset.
_CLIENT_SENT = (
    "batchwire_client_sent_batches_total",
    "Batches sent to a client in its current session (restarts at 0 with a new session).",
)
# From the client's own report (its LoaderReport): a ratio, 0..1.
_CLIENT_WAIT = (
    "batchwire_client_data_wait_ratio",
    "Share of wall time the client's trainer waited for data (as it reports), 0 to 1.",
)
# The same reports, one number per server: the signal an autoscaler scales the fleet on
# (deploy/kubernetes/base/hpa.yaml). Per-client series cannot drive a HorizontalPodAutoscaler
# without a recording rule; a mean of the connected trainers can, and it is 0 with none (a
# fleet with no trainers needs no more servers).
_TRAINER_WAIT = (
    "batchwire_trainer_data_wait_ratio",
    "Mean share of wall time the connected trainers waited for data (their loader reports), "
    "0 to 1; high means trainers are waiting on data: add servers.",
)
# Per mixture split and part: samples sent (a counter) and the part's planned share (a gauge):
# rate(batchwire_mix_part_samples_total[5m]) over its sum by split, against the weight.
_MIX_SERVED = (
    "batchwire_mix_part_samples_total",
    "Samples of a mixture's part sent to clients (valid slots), by split and part.",
)
_MIX_WEIGHT = (
    "batchwire_mix_part_weight",
    "A mixture part's planned share of the current epoch (its weight normalised), 0 to 1.",
)
# Epochs whose per-part counts are kept: ranks near an epoch's end and the next epoch's early
# batches interleave two or three epochs; a new run going back to epoch 0 starts its own.
_MIX_EPOCHS_KEPT = 4


class MixTally:
    """One mixture split's samples sent per part: in all, and per recent epoch.

    Fed at send from each batch's indices (`MixPlan.parts_of`); "this epoch" is the epoch of
    the split's most recently sent batch. Not thread-safe: `Telemetry` holds its lock.
    """

    def __init__(self, split: str, names: Sequence[str], plan: MixPlan) -> None:
        if len(names) != len(plan.sizes):
            raise ValueError(f"{len(plan.sizes)} parts but {len(names)} names")
        self.split, self.names, self.plan = split, tuple(names), plan
        self.total = np.zeros(len(self.names), dtype=np.int64)
        self.epochs: OrderedDict[int, np.ndarray] = OrderedDict()

    def counts(self, indices: Sequence[int]) -> np.ndarray:
        """Samples per part among ``indices`` (padding, index < 0, skipped); pure."""
        valid = np.asarray(indices, dtype=np.int64)
        valid = valid[valid >= 0]
        return np.bincount(self.plan.parts_of(valid), minlength=len(self.names))

    def add(self, epoch: int, counts: np.ndarray) -> None:
        self.total += counts
        mine = self.epochs.get(epoch)
        if mine is None:
            mine = self.epochs[epoch] = np.zeros(len(self.names), dtype=np.int64)
        mine += counts
        self.epochs.move_to_end(epoch)
        while len(self.epochs) > _MIX_EPOCHS_KEPT:
            self.epochs.popitem(last=False)

    def stats(self) -> MixStats:
        epoch = next(reversed(self.epochs), None)
        shares = self.plan.shares(0 if epoch is None else epoch)
        now = None if epoch is None else self.epochs[epoch]
        return MixStats(
            split=self.split,
            epoch=epoch,
            parts=tuple(
                MixPartStats(
                    name=name,
                    weight=shares[p],
                    served_total=int(self.total[p]),
                    served_this_epoch=None if now is None else int(now[p]),
                )
                for p, name in enumerate(self.names)
            ),
        )


class MetricsServer:
    """What ``serve_prometheus`` returns: call it to stop; ``port``/``url`` say where it is."""

    def __init__(self, httpd: Any, thread: threading.Thread, on_stop: Callable[[], None]):
        self._httpd = httpd
        self._thread = thread
        self._on_stop = on_stop
        self._stopped = False
        self._lock = threading.Lock()
        self.host = str(httpd.server_address[0])
        self.port = int(httpd.server_address[1])

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def __call__(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)
        self._on_stop()


class _SnapshotCollector:
    """Turns a fresh snapshot into Prometheus families at scrape time (never stale, no polling)."""

    def __init__(self, telemetry: Telemetry, snapshot_fn: Callable[[], ServerStats]):
        self._telemetry = telemetry
        self._snapshot_fn = snapshot_fn

    def collect(self) -> Iterable[Metric]:
        try:
            snap = self._snapshot_fn()
        except Exception:
            # A scrape racing the server's shutdown must not turn into an HTTP 500 loop:
            # our own counters and rates are still true without the stage/client parts.
            log.exception("stats snapshot failed during a metrics scrape")
            snap = self._telemetry.snapshot([], [])
        return list(_families(snap, self._telemetry.fallbacks_by_decoder()))


def _families(snap: ServerStats, fallbacks: dict[str, int] | None = None) -> Iterable[Metric]:
    for key, (name, doc) in _PROM_COUNTERS.items():
        family = CounterMetricFamily(name, doc)
        family.add_metric([], float(getattr(snap.counters, key) or 0))
        yield family
    if fallbacks:
        family = CounterMetricFamily(*_PROM_FALLBACKS, labels=["decoder"])
        for decoder, n in sorted(fallbacks.items()):
            family.add_metric([decoder], float(n))
    else:  # no decoder reported (yet): the total, without a decoder's name
        family = CounterMetricFamily(*_PROM_FALLBACKS)
        family.add_metric([], float(snap.counters.decode_fallbacks_total or 0))
    yield family

    depth = GaugeMetricFamily(
        "batchwire_queue_depth", "Items waiting in a stage's queue.", labels=["stage"]
    )
    capacity = GaugeMetricFamily(
        "batchwire_queue_capacity", "Bound of a stage's queue.", labels=["stage"]
    )
    for stage in snap.stages:
        depth.add_metric([stage.name], float(stage.depth))
        capacity.add_metric([stage.name], float(stage.capacity))
    yield depth
    yield capacity

    # No rate gauges (images, batches, bytes per second): rate(batchwire_images_total[1m]) and
    # friends give them over any window, where a gauge holds one fixed 5 s window sampled at
    # scrape times. The stats reply (pipeline-monitor) keeps its rates: it has no PromQL.
    yield GaugeMetricFamily(
        "batchwire_uptime_seconds", "Seconds since the server started.", value=snap.uptime_s
    )

    per_client: dict[str, Metric] = {
        key: GaugeMetricFamily(name, doc, labels=list(_CLIENT_LABELS))
        for key, (name, doc) in _CLIENT_GAUGES.items()
    }
    sent = CounterMetricFamily(*_CLIENT_SENT, labels=list(_CLIENT_LABELS))
    wait_ratio = GaugeMetricFamily(*_CLIENT_WAIT, labels=list(_CLIENT_LABELS))
    sharing = GaugeMetricFamily(
        "batchwire_client_sharing",
        "1 for a client's shared-production state (off, solo, shared, lagging: produced "
        "again because it asked after the share window let the batch go).",
        labels=[*_CLIENT_LABELS, "state"],
    )
    for labels, client in _named_clients(snap.clients).items():
        if client.sharing is not None:
            sharing.add_metric([*labels, client.sharing], 1.0)
        for key, family in per_client.items():
            family.add_metric(list(labels), float(getattr(client, key)))
        sent.add_metric(list(labels), float(client.sent))
        wait = None if client.loader is None else client.loader.data_wait_fraction
        if wait is not None:
            wait_ratio.add_metric(list(labels), wait)
    yield from per_client.values()
    yield sent
    yield wait_ratio
    yield sharing
    waits = [
        c.loader.data_wait_fraction
        for c in snap.clients
        if c.loader is not None and c.loader.data_wait_fraction is not None
    ]
    yield GaugeMetricFamily(*_TRAINER_WAIT, value=sum(waits) / len(waits) if waits else 0.0)

    unlisted = snap.clients_unlisted
    yield GaugeMetricFamily(
        "batchwire_clients",
        "Clients with a session (those beyond the per-client gauges' limit included).",
        value=float(len(snap.clients) + (0 if unlisted is None else unlisted.count)),
    )
    if unlisted is not None:
        yield GaugeMetricFamily(
            "batchwire_clients_unlisted",
            "Clients left out of the per-client gauges (the least recently active).",
            value=float(unlisted.count),
        )
    buffers = snap.buffers
    if buffers is not None:
        for value, name, doc in (
            (
                buffers.held,
                "batchwire_buffers_held",
                "Batch buffers in use (producing, ready, sent).",
            ),
            (buffers.allocated, "batchwire_buffers_allocated", "Batch buffers allocated now."),
            (buffers.max, "batchwire_buffers_max", "Batch buffers at most (--max-buffers)."),
            (buffers.batch_bytes, "batchwire_buffer_bytes", "Bytes of one batch buffer."),
            (
                buffers.window_bytes or 0,
                "batchwire_share_window_bytes",
                "Bytes of batches kept only to be shared (--share-window).",
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=float(value))
    if snap.mixes:
        served = CounterMetricFamily(*_MIX_SERVED, labels=["split", "part"])
        weight = GaugeMetricFamily(*_MIX_WEIGHT, labels=["split", "part"])
        for mix in snap.mixes:
            for part in mix.parts:
                served.add_metric([mix.split, part.name], float(part.served_total))
                weight.add_metric([mix.split, part.name], part.weight)
        yield served
        yield weight
    if snap.connections is not None:
        yield GaugeMetricFamily(
            "batchwire_connections",
            "Connections open to the server's socket.",
            value=float(snap.connections),
        )


def _named_clients(clients: Sequence[ClientRow]) -> dict[tuple[str, str, str], ClientRow]:
    """Each client under its labels (job, split, rank). Two sessions of one name (a trainer
    that reconnected while its old session lingers, two loaders of one rank) would be one
    series twice, which Prometheus rejects: the most recently heard-from one is kept."""
    named: dict[tuple[str, str, str], ClientRow] = {}
    for client in clients:
        key = (client.job or "", client.split, str(client.rank))
        kept = named.get(key)
        if kept is None or client.last_seen_s < kept.last_seen_s:
            named[key] = client
    return named


class Telemetry:
    """Thread-safe accumulator of everything the server measures about itself.

    One instance per server. Stage queues and clients belong to the server, which passes their
    current state to :meth:`snapshot`; this class adds what only it knows (counters, rates,
    latencies, uptime) and exports the result.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        # decode_fallbacks_total only once a decoder reported (None before: no decoder yet).
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        del self._counters["decode_fallbacks_total"]
        self._batch_images = 0  # samples of the produced batches (samples_produced_total)
        self._fallbacks: dict[str, int] = {}  # decoder name -> its images decoded on the CPU
        # Columns: batches, images, bytes sent. Its age counts from the server's start, so a
        # server that has sent nothing yet reports a true 0.
        self._sent = RateMeter(THROUGHPUT_WINDOW_S, columns=3, clock=clock)
        self._latency: dict[str, deque[tuple[float, float]]] = {}
        # Private registry: several servers (or tests) in one process must not collide in
        # prometheus_client's global one. No auto_describe: it would call snapshot_fn at
        # registration time, before the server is ready to answer it.
        self.registry = CollectorRegistry()
        self._histogram = Histogram(
            "batchwire_stage_latency_seconds",
            "Time one batch spends in a pipeline stage.",
            labelnames=["stage"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._handshakes = PromCounter(
            "batchwire_handshake_failures",
            "Connections rejected in the security handshake (--keys), by reason.",
            labelnames=["reason"],
            registry=self.registry,
        )
        for reason in HANDSHAKE_REASONS:  # every series from the start, at 0
            self._handshakes.labels(reason=reason)
        # The process's own figures (resident memory, CPU seconds, open descriptors...) and
        # the Python runtime's: what prometheus_client's default registry would show.
        self._runtime = (
            ProcessCollector(registry=self.registry),
            PlatformCollector(registry=self.registry),
            GCCollector(registry=self.registry),
        )
        self._collector: _SnapshotCollector | None = None
        self._mixes: dict[str, MixTally] = {}

    def add_mix(self, split: str, names: Sequence[str], plan: MixPlan) -> None:
        """Report ``split``'s mixture parts (``names``, ordered by ``plan``) per part: samples
        sent (`add_sent_samples`) against each one's weight."""
        tally = MixTally(split, names, plan)
        with self._lock:
            self._mixes[split] = tally

    # -- hot path -----------------------------------------------------------------------------

    def observe_stage(self, stage: str, seconds: float) -> None:
        """Record that one batch took ``seconds`` in ``stage`` (read, decode, augment, send...)."""
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0:
            return
        now = self._clock()
        with self._lock:
            samples = self._latency.get(stage)
            if samples is None:
                samples = self._latency[stage] = deque(maxlen=LATENCY_MAX_SAMPLES)
            samples.append((now, seconds))
        self._histogram.labels(stage=stage).observe(seconds)

    def sent_batch(
        self, images: int, nbytes: int, replaced: int, resent: bool, ready_s: float
    ) -> None:
        """One batch sent (the core's `SendBatch`, counted by the shell before the hand-off):
        ``images`` and ``nbytes`` of payload, ``replaced`` samples in it, ``resent`` when its
        buffer was sent before (a shared production), ``ready_s`` it waited ready. One lock."""
        with self._lock:
            counters = self._counters
            counters["batches_total"] += 1
            counters["images_total"] += images
            counters["bytes_total"] += nbytes
            counters["replaced_total"] += replaced
            if resent:
                counters["batches_shared_total"] += 1
            self._sent.add((1, images, nbytes))
        self.observe_stage("ready", ready_s)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (one of `COUNTER_NAMES`; a `Reply`'s ``counts``)."""
        self._add(name, n)

    def add_sent_samples(self, split: str, epoch: int, indices: Sequence[int]) -> None:
        """A batch of ``split`` and ``epoch`` sent with these sample ``indices`` (the header's:
        -1 for padding): counted per part for a mixture split (`add_mix`), else nothing."""
        tally = self._mixes.get(split)
        if tally is None:
            return
        counts = tally.counts(indices)  # outside the lock: pure
        with self._lock:
            tally.add(int(epoch), counts)

    def add_produced(self, images: int = 0) -> None:
        """One batch produced, of ``images`` samples (some may have been reused: the
        snapshot's samples_produced_total subtracts samples_reused_total)."""
        with self._lock:
            self._counters["batches_produced_total"] += 1
            self._batch_images += int(images)

    def add_bad(self, n: int) -> None:
        self._add("bad_total", n)

    def add_handshake_failure(self, reason: str) -> None:
        """Count one connection rejected in the security handshake (`server.handshakes`)."""
        self._handshakes.labels(reason=reason if reason in HANDSHAKE_REASONS else "other").inc()

    def set_fallbacks(self, decoder: str, total: int) -> None:
        """The `decoder`'s total of images decoded on the CPU instead (its `fallbacks`).

        A total, not an increment: several producer threads share one decoder, and a delta
        taken around one thread's call would count another's. Never goes down."""
        with self._lock:
            self._fallbacks[decoder] = max(self._fallbacks.get(decoder, 0), int(total))
            self._counters["decode_fallbacks_total"] = sum(self._fallbacks.values())

    def set_transform_errors(self, total: int) -> None:
        """The user transforms' total of failed samples (`TransformRunner.errors_total`,
        summed over splits). A total, not an increment, as `set_fallbacks`; never goes down."""
        with self._lock:
            now = self._counters["transform_errors_total"]
            self._counters["transform_errors_total"] = max(now, int(total))

    def set_samples(self, reused: int) -> None:
        """The sample window's total of reused samples (`SampleWindow.reused_total`); a
        total, not an increment, as `set_fallbacks`; never goes down."""
        with self._lock:
            now = self._counters["samples_reused_total"]
            self._counters["samples_reused_total"] = max(now, int(reused))

    def fallbacks_by_decoder(self) -> dict[str, int]:
        with self._lock:
            return dict(self._fallbacks)

    def _add(self, key: str, n: int) -> None:
        with self._lock:
            self._counters[key] += int(n)

    # -- views --------------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def stage_latency_ms(self, stage: str) -> float | None:
        """Mean of the recent observations of ``stage``; the last such mean if it went quiet;
        None if it was never observed.

        A stalled stage keeps showing how long its batches took, rather than a misleading 0.
        """
        with self._lock:
            samples = list(self._latency.get(stage, ()))
        if not samples:
            return None
        # The window ends at the latest observation: "now" for a busy stage, and the last
        # batch it handled for one that has gone quiet.
        horizon = samples[-1][0] - LATENCY_WINDOW_S
        recent = [s for t, s in samples if t >= horizon]
        return 1000.0 * sum(recent) / len(recent)

    def snapshot(
        self,
        stages: Sequence[StageStats],
        clients: Sequence[ClientRow],
        *,
        clients_unlisted: UnlistedClients | None = None,
        buffers: BufferStats | None = None,
        connections: int | None = None,
    ) -> ServerStats:
        """The server's `ServerStats`: its stage and client state plus what this object measured.

        Each stage's ``latency_ms`` comes from this object's observations of the stage of that
        name (the value the server gave is kept when nothing was observed). ``clients``,
        ``clients_unlisted`` (the clients summed rather than listed), ``buffers`` (the batch
        buffer pool) and ``connections`` (open connections) are the server's, taken as they are.
        """
        now = self._clock()
        with self._lock:
            counters = dict(self._counters)
            counters["samples_produced_total"] = max(
                0, self._batch_images - counters["samples_reused_total"]
            )
            batches_s, images_s, bytes_s = self._sent.rates()
            mixes = tuple(t.stats() for t in self._mixes.values()) or None
        return ServerStats(
            v=STATS_VERSION,
            uptime_s=now - self._started,
            time=time.time(),
            stages=tuple(self._with_latency(s) for s in stages),
            throughput=Throughput(
                images_per_s=images_s, batches_per_s=batches_s, bytes_per_s=bytes_s
            ),
            counters=Counters(**counters),
            clients=tuple(clients),
            clients_unlisted=clients_unlisted,
            buffers=buffers,
            connections=None if connections is None else int(connections),
            mixes=mixes,
        )

    def _with_latency(self, stage: StageStats) -> StageStats:
        latency = self.stage_latency_ms(stage.name)
        return stage if latency is None else replace(stage, latency_ms=latency)

    # -- Prometheus -----------------------------------------------------------------------------

    def prometheus_text(self, snapshot_fn: Callable[[], ServerStats] | None = None) -> bytes:
        """The exposition text a scrape would return (no HTTP server needed)."""
        registry = CollectorRegistry()
        for collector in (self._histogram, self._handshakes, *self._runtime):
            registry.register(collector)
        registry.register(_SnapshotCollector(self, snapshot_fn or (lambda: self.snapshot([], []))))
        return generate_latest(registry)

    def serve_prometheus(
        self,
        port: int,
        snapshot_fn: Callable[[], ServerStats],
        host: str = "127.0.0.1",
        health: HealthCheck | None = None,
    ) -> MetricsServer:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the stop callable.

        ``port=0`` binds a free port; the returned handle's ``port`` and ``url`` tell which.
        Gauges come from ``snapshot_fn()`` called at each scrape, so the server needs no timer.
        ``health`` answers the probes ``/healthz`` and ``/readyz`` on the same port.
        """
        collector = _SnapshotCollector(self, snapshot_fn)
        with self._lock:
            if self._collector is not None:
                raise RuntimeError("this Telemetry already serves Prometheus metrics")
            self._collector = collector
        self.registry.register(collector)
        try:
            httpd, thread = start_metrics_server(int(port), host, self.registry, health)
        except Exception:
            self._unregister(collector)
            raise
        handle = MetricsServer(httpd, thread, lambda: self._unregister(collector))
        log.info("Prometheus metrics on %s", handle.url)
        return handle

    def _unregister(self, collector: _SnapshotCollector) -> None:
        self.registry.unregister(collector)
        with self._lock:
            if self._collector is collector:
                self._collector = None
