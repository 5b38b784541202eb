"""LoaderStats: the trainer-side wait and throughput figures that ride on credit messages."""

from __future__ import annotations

import threading

import pytest
from batchwire import wire
from batchwire.client.loader_stats import WINDOW_S, LoaderStats
from fakeclock import FakeClock


def test_fresh_stats_are_zero_and_keys_match_the_schema() -> None:
    stats = LoaderStats()
    stats.set_prefetch_depth(3)
    assert stats.as_dict() == {
        "prefetch_depth": 3,
        "wait_s_per_batch": 0.0,
        "data_wait_fraction": 0.0,
        "images_per_s": 0.0,
        "batches_received_total": 0,
        "batches_shared_total": 0,
    }


def test_what_rides_on_a_credit_is_the_schemas_loader_report() -> None:
    """``as_dict`` is `LoaderReport.to_map`: what the server keeps of it (`LoaderReport.clean`)
    and what a monitor reads back (`from_map`) are the same report."""
    stats = LoaderStats()
    stats.set_prefetch_depth(2)
    report = stats.report()
    assert stats.as_dict() == report.to_map()
    assert wire.LoaderReport.clean(stats.as_dict()) == report
    assert wire.LoaderReport.from_map(stats.as_dict()) == report
    assert None not in (report.wait_s_per_batch, report.data_wait_fraction, report.images_per_s)


def test_batches_received_and_shared_are_totals_that_ride_as_extra_figures() -> None:
    """Totals since the loader was made, not the window's: a trainer differences them per
    epoch; a server passes them on as a report's extra figures (older servers too)."""
    clock = FakeClock(500.0)
    stats = LoaderStats(window_s=10.0, clock=clock)
    for shared in (False, True, True):
        stats.record_batch(16, shared)
    stats.record_batch(16)  # a caller that knows nothing of sharing: not shared
    clock.t += 60.0  # long past the window: the totals stay
    report = stats.report()
    assert report.extra == {"batches_received_total": 4, "batches_shared_total": 2}
    assert (stats.batches_received, stats.batches_shared) == (4, 2)
    assert wire.LoaderReport.clean(stats.as_dict()) == report


def test_half_starved_trainer() -> None:
    clock = FakeClock(500.0)
    stats = LoaderStats(clock=clock)
    for _ in range(8):  # each step: wait 0.25 s for data, then compute 0.25 s
        clock.t += 0.25
        stats.record_wait(0.25)
        stats.record_batch(32)
        clock.t += 0.25
    d = stats.as_dict()
    assert d["data_wait_fraction"] == pytest.approx(0.5)
    assert d["wait_s_per_batch"] == pytest.approx(0.25)
    assert d["images_per_s"] == pytest.approx(32 / 0.5)


def test_window_forgets_old_waits_and_clips_a_straddling_one() -> None:
    clock = FakeClock(500.0)
    stats = LoaderStats(window_s=10.0, clock=clock)
    clock.t += 6.0
    stats.record_wait(6.0)  # one long wait from t0 to t0+6
    stats.record_batch(8)
    clock.t += 8.0  # 8 s of work without waiting: the window [t0+4, t0+14] holds 2 s of wait
    d = stats.as_dict()
    assert d["data_wait_fraction"] == pytest.approx(2.0 / 10.0)
    assert d["wait_s_per_batch"] == pytest.approx(2.0)
    clock.t += WINDOW_S
    d = stats.as_dict()
    assert d["data_wait_fraction"] == 0.0
    assert d["images_per_s"] == 0.0


def test_fraction_never_exceeds_one() -> None:
    clock = FakeClock(500.0)
    stats = LoaderStats(clock=clock)
    clock.t += 1.0
    stats.record_wait(5.0)  # claims more waiting than wall time since the loader started
    stats.record_batch(1)
    assert stats.as_dict()["data_wait_fraction"] == 1.0
    stats.record_wait(-3.0)  # nonsense is clamped, not propagated
    assert stats.as_dict()["data_wait_fraction"] == 1.0


def test_concurrent_recording_and_reading() -> None:
    clock = FakeClock(500.0)  # frozen: every record lands in the window, the rate divides by 1 s
    stats = LoaderStats(clock=clock)
    n_threads, per_thread = 4, 3000
    barrier = threading.Barrier(n_threads + 1)
    seen: list[dict] = []

    def record() -> None:
        barrier.wait()
        for _ in range(per_thread):
            stats.record_wait(0.001)
            stats.record_batch(2)

    def read() -> None:
        barrier.wait()
        for _ in range(300):
            seen.append(stats.as_dict())

    threads = [threading.Thread(target=record) for _ in range(n_threads)]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(0.0 <= d["data_wait_fraction"] <= 1.0 for d in seen)
    d = stats.as_dict()
    assert d["images_per_s"] == 2 * n_threads * per_thread  # no record lost
    assert d["wait_s_per_batch"] == pytest.approx(0.001)  # waits and batches both complete


def test_window_must_be_positive() -> None:
    for window in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="window_s"):
            LoaderStats(window_s=window)


def test_the_loaders_figures_keep_their_four_keys_and_totals_come_apart() -> None:
    """`RemoteLoader.stats()` returns `figures()`: the four keys it always had (code that checks
    them keeps working); the totals are `totals()` (`RemoteLoader.batch_totals()`)."""
    stats = LoaderStats()
    stats.record_batch(8, shared=True)
    stats.record_batch(8)
    assert set(stats.figures()) == {
        "prefetch_depth",
        "wait_s_per_batch",
        "data_wait_fraction",
        "images_per_s",
    }
    assert stats.totals() == (2, 1)
