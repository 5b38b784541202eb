"""Telemetry: counters, sliding windows, latencies, thread safety, and the Prometheus endpoint."""

from __future__ import annotations

import math
import threading
import urllib.error
import urllib.request
from dataclasses import fields, replace

import msgpack
import pytest
from batchwire import wire
from batchwire.common.rates import RateMeter
from batchwire.pipeline.mix_order import MixPlan
from batchwire.server.telemetry import (
    COUNTER_NAMES,
    LATENCY_WINDOW_S,
    THROUGHPUT_WINDOW_S,
    Telemetry,
)
from fakeclock import FakeClock
from promtext import parse_metrics

STAGES = [
    wire.StageStats(name="read", depth=3, capacity=8, latency_ms=0.0),
    wire.StageStats(name="decode", depth=0, capacity=8, latency_ms=0.0),
    wire.StageStats(name="augment", depth=1, capacity=4, latency_ms=0.0),
]
CLIENT_MAP = {
    "id": "c1",
    "split": "train",
    "rank": 0,
    "world_size": 1,
    "epoch": 0,
    "credits": 2,
    "ready": 1,
    "ready_capacity": 4,
    "in_flight": 2,
    "sent": 2,
    "images_per_s": 1.0,
    "last_seen_s": 0.0,
    "loader": None,
}
CLIENT = wire.ClientRow(**CLIENT_MAP)


def test_snapshot_schema_and_counters() -> None:
    tel = Telemetry()
    tel.sent_batch(64, 64 * 3 * 32 * 32, 0, False, 0.0)
    tel.sent_batch(64, 64 * 3 * 32 * 32, 3, True, 0.0)  # 3 replaced samples, a shared buffer
    tel.add_bad(2)
    tel.count("errors_total")
    tel.count("malformed_total")
    tel.count("malformed_total")
    snap = tel.snapshot(STAGES, [CLIENT])
    assert isinstance(snap, wire.ServerStats) and snap.v == wire.STATS_VERSION == 1
    assert snap.counters == wire.Counters(
        images_total=128,
        batches_total=2,
        bytes_total=2 * 64 * 3 * 32 * 32,
        replaced_total=3,
        bad_total=2,
        errors_total=1,
        malformed_total=2,
        batches_produced_total=0,
        batches_shared_total=1,
        transform_errors_total=0,
        samples_reused_total=0,
        samples_produced_total=0,
    )
    assert [s.name for s in snap.stages] == ["read", "decode", "augment"]
    assert all(isinstance(s.latency_ms, float) for s in snap.stages)
    assert snap.clients == (CLIENT,)
    assert snap.uptime_s >= 0
    # Without the server's own parts, the map has the schema's required keys only.
    m = snap.to_map()
    assert set(m) == {"v", "uptime_s", "time", "stages", "throughput", "counters", "clients"}
    assert m["clients"] == [CLIENT_MAP]
    # The map travels in a msgpack frame as it is, and reads back as the same record.
    assert wire.ServerStats.from_map(msgpack.unpackb(msgpack.packb(m))) == snap


def test_snapshot_takes_the_servers_records_as_they_are() -> None:
    """The server's parts (client rows with their loader reports, the unlisted clients, the
    buffers, the connections) pass through unchanged; only a stage's latency is this
    object's."""
    tel = Telemetry()
    loader = wire.LoaderReport(prefetch_depth=2, data_wait_fraction=0.5, extra={"figure": 3})
    row = replace(CLIENT, loader=loader)
    unlisted = wire.UnlistedClients(
        count=1, credits=0, ready=0, in_flight=0, sent=4, images_per_s=2.0
    )
    buffers = wire.BufferStats(held=1, allocated=2, max=8, batch_bytes=1024)
    stages = [replace(STAGES[0], latency_ms=7.0), *STAGES[1:]]
    tel.observe_stage("decode", 0.004)
    snap = tel.snapshot(stages, [row], clients_unlisted=unlisted, buffers=buffers, connections=3)
    assert snap.clients == (row,)
    assert snap.clients_unlisted is unlisted and snap.buffers is buffers
    assert snap.connections == 3
    latency = {s.name: s.latency_ms for s in snap.stages}
    assert latency == {"read": 7.0, "decode": pytest.approx(4.0), "augment": 0.0}
    m = snap.to_map()
    assert m["clients"][0]["loader"] == {
        "prefetch_depth": 2,
        "data_wait_fraction": 0.5,
        "figure": 3,
    }
    assert m["clients_unlisted"]["count"] == 1 and m["buffers"]["max"] == 8
    assert wire.ServerStats.from_map(msgpack.unpackb(msgpack.packb(m))) == snap


def test_every_counter_has_a_prometheus_name() -> None:
    """A counter is a `Counters` field, an ``add_*`` here and a Prometheus name: no more."""
    assert tuple(f.name for f in fields(wire.Counters)) == COUNTER_NAMES
    metrics = parse_metrics(Telemetry().prometheus_text().decode())
    ours = [k for k in metrics if k.startswith("batchwire_") and k.endswith("_total")]
    assert len(ours) == len(COUNTER_NAMES)


def test_transform_errors_are_a_total_that_never_goes_down() -> None:
    tel = Telemetry()
    assert tel.snapshot([], []).counters.transform_errors_total == 0
    tel.set_transform_errors(3)
    tel.set_transform_errors(2)  # a stale read of the total: ignored
    assert tel.snapshot([], []).counters.transform_errors_total == 3
    metrics = parse_metrics(tel.prometheus_text().decode())
    assert metrics["batchwire_transform_errors_total"] == 3.0


def test_prometheus_follows_the_conventions() -> None:
    """Rates come from counters (no per-second gauges), fractions are _ratio, the process's
    own figures are there, and rejected handshakes are counted by reason from the start."""
    tel = Telemetry()
    tel.add_handshake_failure("no_keys")
    tel.add_handshake_failure("something new")  # an unknown reason counts as "other"
    text = tel.prometheus_text().decode()
    metrics = parse_metrics(text)
    assert "_per_second" not in text and "_fraction" not in text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"):
        assert any(k.split("{")[0] == name for k in metrics), name
    failures = {
        k: v for k, v in metrics.items() if k.startswith("batchwire_handshake_failures_total")
    }
    assert failures == {
        'batchwire_handshake_failures_total{reason="no_keys"}': 1,
        'batchwire_handshake_failures_total{reason="wrong_server_key"}': 0,
        'batchwire_handshake_failures_total{reason="unauthorized_key"}': 0,
        'batchwire_handshake_failures_total{reason="other"}': 1,
    }


def test_clients_are_labelled_by_job_split_and_rank_once_each() -> None:
    """The connection id would start new series at every reconnect; two sessions of one
    (job, split, rank) would be a duplicate series: the most recently heard-from one is kept."""
    old = replace(CLIENT, id="aa", job="run7", rank=1, credits=5, last_seen_s=2.0, sent=3)
    new = replace(CLIENT, id="bb", job="run7", rank=1, credits=1, last_seen_s=0.1, sent=9)
    other = replace(CLIENT, id="cc", job=None, rank=0, credits=2)
    metrics = parse_metrics(tel_text(Telemetry(), [old, new, other]))
    labels = 'rank="1",split="train",train_job="run7"'
    assert metrics[f"batchwire_client_credits{{{labels}}}"] == 1
    assert metrics[f"batchwire_client_sent_batches_total{{{labels}}}"] == 9
    assert metrics['batchwire_client_credits{rank="0",split="train",train_job=""}'] == 2
    assert len([k for k in metrics if k.startswith("batchwire_client_credits{")]) == 2
    assert not any('client="' in k for k in metrics)


def tel_text(tel: Telemetry, clients: list[wire.ClientRow]) -> str:
    return tel.prometheus_text(lambda: tel.snapshot(STAGES, clients)).decode()


def test_throughput_is_a_sliding_window() -> None:
    clock = FakeClock()
    tel = Telemetry(clock=clock)
    clock.t += 10  # well past start-up, so the full window applies
    for _ in range(10):  # 10 batches of 32 images over 2.5 s
        tel.sent_batch(32, 1000, 0, False, 0.0)
        clock.t += 0.25
    tp = tel.snapshot([], []).throughput
    assert tp.batches_per_s == pytest.approx(10 / THROUGHPUT_WINDOW_S)
    assert tp.images_per_s == pytest.approx(320 / THROUGHPUT_WINDOW_S)
    assert tp.bytes_per_s == pytest.approx(10_000 / THROUGHPUT_WINDOW_S)
    clock.t += THROUGHPUT_WINDOW_S  # nothing new: the window empties, the counters stay
    snap = tel.snapshot([], [])
    assert snap.throughput.images_per_s == 0.0
    assert snap.counters.images_total == 320


def test_rate_right_after_start_uses_elapsed_time_with_a_floor() -> None:
    clock = FakeClock()
    window = RateMeter(5.0, clock=clock)
    window.add(100)
    assert window.rate() == pytest.approx(100.0)  # 1 s floor, not 100 / 1e-6
    clock.t += 2.0
    window.add(100)
    assert window.rate() == pytest.approx(200 / 2.0)  # 2 s elapsed, window not full yet


def test_stage_latency_mean_over_recent_window_then_last_known() -> None:
    clock = FakeClock()
    tel = Telemetry(clock=clock)
    tel.observe_stage("decode", 0.100)
    clock.t += LATENCY_WINDOW_S + 1
    tel.observe_stage("decode", 0.010)
    tel.observe_stage("decode", 0.030)
    stages = {s.name: s for s in tel.snapshot(STAGES, []).stages}
    assert stages["decode"].latency_ms == pytest.approx(20.0)  # the old 100 ms fell out
    assert stages["read"].latency_ms == 0.0  # never observed
    clock.t += 10 * LATENCY_WINDOW_S  # stage went quiet: keep showing what batches took
    stages = {s.name: s for s in tel.snapshot(STAGES, []).stages}
    assert stages["decode"].latency_ms == pytest.approx(20.0)


def test_bad_latency_values_are_ignored() -> None:
    tel = Telemetry()
    tel.observe_stage("augment", float("nan"))
    tel.observe_stage("augment", -1.0)
    tel.observe_stage("augment", 0.004)
    assert tel.stage_latency_ms("augment") == pytest.approx(4.0)


def test_concurrent_updates_are_not_lost() -> None:
    tel = Telemetry()
    threads_n, per_thread = 8, 2000
    barrier = threading.Barrier(threads_n + 1)
    snapshots: list[wire.ServerStats] = []

    def work() -> None:
        barrier.wait()
        for _ in range(per_thread):
            tel.sent_batch(2, 10, 1, False, 0.0)
            tel.observe_stage("decode", 0.001)

    def read() -> None:
        barrier.wait()
        for _ in range(200):
            snapshots.append(tel.snapshot(STAGES, []))

    threads = [threading.Thread(target=work) for _ in range(threads_n)]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = threads_n * per_thread
    assert tel.counters()["batches_total"] == total
    assert tel.counters()["images_total"] == 2 * total
    assert tel.counters()["bytes_total"] == 10 * total
    assert tel.counters()["replaced_total"] == total
    # Every snapshot taken meanwhile was internally consistent (one lock, one read).
    for snap in snapshots:
        c = snap.counters
        assert c.images_total == 2 * c.batches_total == c.bytes_total / 5
    metrics = parse_metrics(tel.prometheus_text().decode())
    assert metrics['batchwire_stage_latency_seconds_count{stage="decode"}'] == total


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        return parse_metrics(resp.read().decode())


@pytest.mark.timeout(30)
def test_serve_prometheus_on_a_free_port_and_stop() -> None:
    tel = Telemetry()
    client = replace(
        CLIENT,
        rank=1,
        world_size=2,
        ready=3,
        credits=2,
        in_flight=1,
        images_per_s=12.5,
        loader=wire.LoaderReport(
            prefetch_depth=2, wait_s_per_batch=0.1, data_wait_fraction=0.25, images_per_s=12.0
        ),
    )
    stages = list(STAGES)
    stop = tel.serve_prometheus(0, lambda: tel.snapshot(stages, [client]), host="127.0.0.1")
    try:
        assert stop.port > 0
        tel.sent_batch(16, 4096, 0, False, 0.0)
        tel.observe_stage("read", 0.002)
        first = _scrape(stop.url)
        assert first["batchwire_images_total"] == 16
        assert first["batchwire_bytes_total"] == 4096
        assert first['batchwire_queue_depth{stage="read"}'] == 3
        assert first['batchwire_queue_capacity{stage="augment"}'] == 4
        labels = 'rank="1",split="train",train_job=""'
        assert first[f"batchwire_client_ready{{{labels}}}"] == 3
        assert first[f"batchwire_client_credits{{{labels}}}"] == 2
        assert first[f"batchwire_client_data_wait_ratio{{{labels}}}"] == 0.25
        assert first[f"batchwire_client_sent_batches_total{{{labels}}}"] == client.sent
        assert first['batchwire_stage_latency_seconds_count{stage="read"}'] == 1
        assert first["batchwire_uptime_seconds"] >= 0
        for name in (
            "batchwire_batches_total",
            "batchwire_replaced_samples_total",
            "batchwire_bad_samples_total",
            "batchwire_errors_total",
            "batchwire_malformed_messages_total",
            "process_resident_memory_bytes",
        ):
            assert name in first
        # Gauges are read at scrape time: a change shows on the next scrape.
        tel.sent_batch(16, 4096, 0, False, 0.0)
        stages[0] = replace(stages[0], depth=7)
        second = _scrape(stop.url)
        assert second["batchwire_images_total"] == 32
        assert second['batchwire_queue_depth{stage="read"}'] == 7
        with pytest.raises(RuntimeError, match="already serves"):
            tel.serve_prometheus(0, lambda: tel.snapshot([], []), host="127.0.0.1")
    finally:
        stop()
    stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(stop.url, timeout=2)
    again = tel.serve_prometheus(0, lambda: tel.snapshot([], []), host="127.0.0.1")
    try:
        assert _scrape(again.url)["batchwire_images_total"] == 32
    finally:
        again()


@pytest.mark.timeout(30)
def test_a_failing_snapshot_still_scrapes_own_counters() -> None:
    tel = Telemetry()
    tel.count("errors_total")

    def broken() -> wire.ServerStats:
        raise RuntimeError("server is shutting down")

    stop = tel.serve_prometheus(0, broken, host="127.0.0.1")
    try:
        metrics = _scrape(stop.url)
    finally:
        stop()
    assert metrics["batchwire_errors_total"] == 1
    assert not any(k.startswith("batchwire_queue_depth{") for k in metrics)
    assert math.isfinite(metrics["batchwire_uptime_seconds"])


def test_mix_parts_are_counted_at_send_per_epoch_and_exported() -> None:
    """A mixture split's samples sent, per part, from the batch headers' indices (padding
    skipped): in all, and in the epoch of the split's latest batch, against each part's
    weight; Prometheus carries the totals and weights by (split, part). No mix: no section."""
    assert Telemetry().snapshot([], []).mixes is None
    plan = MixPlan((700, 300), "weight", (7.0, 3.0), schedule=((3, (1.0, 1.0)),))
    tel = Telemetry()
    tel.add_mix("train", ["web", "curated"], plan)
    order = plan.epoch_order(0, 2)
    for k in range(10):
        tel.add_sent_samples("train", 2, order[64 * k : 64 * (k + 1)].tolist())
    tel.add_sent_samples("val", 0, [1, 2, 3])  # not a mix: nothing
    (mix,) = tel.snapshot([], []).mixes
    assert (mix.split, mix.epoch) == ("train", 2)
    web, curated = mix.parts
    assert (web.name, web.weight, curated.name, curated.weight) == ("web", 0.7, "curated", 0.3)
    assert (web.served_total, curated.served_total) == (448, 192)  # the stride interleave
    assert (web.served_this_epoch, curated.served_this_epoch) == (448, 192)
    # Epoch 3 (the schedule's 1:1 from there): padding is not a sample; epoch 2 goes on
    # counting in the totals and in its own tally (a rank finishing it).
    tel.add_sent_samples("train", 3, [0, 699, 700, -1, -1])
    (mix,) = tel.snapshot([], []).mixes
    assert mix.epoch == 3 and [p.weight for p in mix.parts] == [0.5, 0.5]
    assert [(p.served_this_epoch, p.served_total) for p in mix.parts] == [(2, 450), (1, 193)]
    tel.add_sent_samples("train", 2, [1, 2])
    (mix,) = tel.snapshot([], []).mixes
    assert mix.epoch == 2 and [p.served_this_epoch for p in mix.parts] == [450, 192]
    metrics = parse_metrics(tel.prometheus_text().decode())
    assert metrics['batchwire_mix_part_samples_total{part="web",split="train"}'] == 452
    assert metrics['batchwire_mix_part_samples_total{part="curated",split="train"}'] == 193
    assert metrics['batchwire_mix_part_weight{part="web",split="train"}'] == 0.7


def test_a_mix_before_any_send_reports_its_weights_and_no_epoch() -> None:
    tel = Telemetry()
    tel.add_mix("train", ["a", "b"], MixPlan((10, 30), "repeat", (2.0, 1.0)))
    (mix,) = tel.snapshot([], []).mixes
    assert mix.epoch is None
    assert [(p.weight, p.served_total, p.served_this_epoch) for p in mix.parts] == [
        (0.4, 0, None),
        (0.6, 0, None),
    ]
    with pytest.raises(ValueError, match="2 parts but 1 names"):
        tel.add_mix("val", ["a"], MixPlan((10, 30)))
