"""RateMeter: the one sliding-window sum/rate behind every "per second" figure of batchwire.

Each test pins one edge case that a reader of the figures would notice if it went wrong: the
first second, the window boundary, a wait straddling the horizon, the tumbling (infinite) form.
"""

from __future__ import annotations

import math
import threading

import pytest
from batchwire.common.rates import RateMeter
from fakeclock import FakeClock


def test_full_window_rate_of_several_columns() -> None:
    clock = FakeClock()
    w = RateMeter(5.0, columns=3, clock=clock)
    clock.t += 100  # long past start: the whole window applies
    for _ in range(20):  # 4 events per second for 5 s, the last one now
        clock.t += 0.25
        w.add((1, 32, 1000))
    assert w.rates() == pytest.approx((4.0, 128.0, 4000.0))
    assert w.read().totals == (20.0, 640.0, 20_000.0)


def test_window_is_half_open_so_a_steady_stream_reads_exactly() -> None:
    clock = FakeClock()
    w = RateMeter(5.0, clock=clock)
    clock.t += 100
    for _ in range(11):  # events at 0, 1, ..., 10 s: the window (5, 10] holds 5 of them
        w.add(1)
        clock.t += 1.0
    clock.t -= 1.0
    assert w.read().totals == (5.0,)
    assert w.rate() == pytest.approx(1.0)


def test_young_window_divides_by_its_age_with_a_floor() -> None:
    clock = FakeClock()
    w = RateMeter(10.0, clock=clock)
    w.add(50)
    assert w.rate() == pytest.approx(50.0)  # 1 s floor, not 50 / 0 s
    clock.t += 4.0
    assert w.rate() == pytest.approx(50 / 4.0)  # 4 s old: not 50 / 10 s
    assert RateMeter(0.5, clock=clock).min_span_s == 0.5  # a short window is its own floor


def test_old_events_leave_and_sums_return_to_exact_zero() -> None:
    clock = FakeClock()
    w = RateMeter(2.0, columns=2, clock=clock)
    for _ in range(1000):
        w.add((0.1, 0.7))
        w.add_interval(0.001)
        clock.t += 0.001
    clock.t += 2.0
    r = w.read()
    assert r.totals == (0.0, 0.0)  # no float residue of 1000 subtractions
    assert r.interval_s == 0.0
    assert w.rate() == 0.0


def test_explicit_now_instead_of_the_clock() -> None:
    """The server's loop passes the time it already read (``meter.add(images, now)``)."""
    w = RateMeter(
        5.0, clock=lambda: pytest.fail("the clock must not be read"), start_at_first_event=True
    )
    w.add(10, 100.0)
    w.add(10, 102.0)
    assert w.rate(102.0) == pytest.approx(20 / 2.0)
    assert w.rate(106.5) == pytest.approx(10 / 5.0)  # the event at 100 s fell out


def test_intervals_are_clipped_to_the_window() -> None:
    clock = FakeClock(0.0)
    w = RateMeter(10.0, columns=2, clock=clock, start_at_first_event=True)
    clock.t = 6.0
    w.add_interval(6.0)  # one wait from 0 to 6 s
    w.add((1, 8))
    clock.t = 14.0  # the window (4, 14] holds 2 s of it
    r = w.read()
    assert r.interval_s == pytest.approx(2.0)
    assert r.interval_fraction() == pytest.approx(0.2)
    clock.t = 15.0
    assert w.read().interval_s == pytest.approx(1.0)  # fades out second by second


def test_window_starts_at_the_first_event_including_an_interval_start() -> None:
    clock = FakeClock(500.0)
    w = RateMeter(10.0, columns=2, clock=clock, start_at_first_event=True)
    clock.t += 100  # nothing recorded: still no span, nothing to report
    r = w.read()
    assert (r.span_s, r.rate(1), r.interval_fraction()) == (0.0, 0.0, 0.0)
    w.add_interval(2.0)  # began 2 s ago: that is when the loader started waiting
    w.add((1, 32))
    clock.t += 2.0
    r = w.read()
    assert r.span_s == pytest.approx(4.0)
    assert r.interval_fraction() == pytest.approx(0.5)
    assert r.rate(1) == pytest.approx(32 / 4.0)


def test_fraction_is_capped_and_negative_intervals_count_as_zero() -> None:
    clock = FakeClock()
    w = RateMeter(10.0, clock=clock, start_at_first_event=True)
    clock.t += 1.0
    w.add_interval(5.0)
    w.add_interval(3.0)  # overlapping waits claim more than all of the time
    assert w.read().interval_fraction() == 1.0
    w.add_interval(-7.0)
    assert w.read().interval_s == pytest.approx(8.0)


def test_infinite_window_is_tumbling_with_reset() -> None:
    clock = FakeClock(10.0)
    w = RateMeter(math.inf, clock=clock, min_span_s=1e-9)
    for _ in range(4):
        w.add(16)
        w.add_interval(0.05)
        clock.t += 0.1
    r = w.read()
    assert r.span_s == pytest.approx(0.4)  # no 1 s floor: a short log interval is real
    assert r.rate() == pytest.approx(64 / 0.4)
    assert r.interval_fraction() == pytest.approx(0.5)
    assert not w._events and not w._intervals  # nothing is stored for an infinite window
    w.reset()
    clock.t += 0.2
    r = w.read()
    assert (r.totals, r.interval_s, r.span_s) == ((0.0,), 0.0, pytest.approx(0.2))


def test_bad_arguments() -> None:
    for window in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="window_s"):
            RateMeter(window)
    with pytest.raises(ValueError, match="columns"):
        RateMeter(1.0, columns=0)
    with pytest.raises(ValueError, match="2 amounts"):
        RateMeter(1.0).add((1, 2))


def test_missing_trailing_columns_count_as_zero() -> None:
    clock = FakeClock()
    w = RateMeter(5.0, columns=3, clock=clock)
    w.add(2)
    assert w.read().totals == (2.0, 0.0, 0.0)


def test_one_thread_records_while_another_reads() -> None:
    clock = FakeClock()
    w = RateMeter(1.0, columns=2, clock=clock)
    stop = threading.Event()
    seen: list[tuple[float, ...]] = []

    def read() -> None:
        while not stop.is_set():
            seen.append(w.read().totals)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(20_000):
            w.add((1, 2))
            clock.t += 0.0001  # the window holds the last 10_000 events at most
    finally:
        stop.set()
        reader.join()
    assert w.read().totals == pytest.approx((10_000, 20_000), abs=1)
    assert all(b == 2 * a for a, b in seen)  # never half an event
