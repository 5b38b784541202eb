"""Sliding-window sums and rates: "images per second over the last few seconds" and the like.

One implementation serves every figure of that kind: the server's throughput (`Telemetry`), its
per-client send rate (`ClientSession.meter`), the loader's wait and throughput figures that ride on
credits (`LoaderStats`) and the trainer's log lines (`pipeline-train`). They used to be four
copies, each with its own take on the edge cases a reader of the figures cares about:

- the first seconds: the window is not full yet, so sums are divided by the time actually
  covered (never by the full window, which would under-report a young server), with a floor
  (``min_span_s``) so that the very first batch does not read as millions per second;
- the boundary: the window is the half-open interval ``(now - window_s, now]``, so a steady
  stream of one event per period shows exactly ``window_s / period`` events;
- intervals (time spent waiting): only the part inside the window counts, so one long wait
  fades out of the figure second by second rather than all at once.

Cost: O(1) amortised per event (running sums; each event is stored once and dropped once), and
a read is O(number of columns). With ``window_s=math.inf`` nothing is stored at all: the window
then holds everything since the start or the last `reset`, which is what a "since the last log
line" or "this epoch" figure wants.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["MeterReading", "RateMeter"]


@dataclass(frozen=True)
class MeterReading:
    """What a `RateMeter` holds at one instant; every figure below comes from the same ``now``.

    ``span_s`` is the time the window covers: ``window_s``, or less while the window is younger
    than that (0 before the first event when the window starts at its first event).
    ``totals`` are the column sums of the events inside it, ``interval_s`` the part of the
    recorded intervals inside it.
    """

    span_s: float
    totals: tuple[float, ...]
    interval_s: float
    min_span_s: float

    def rate(self, column: int = 0) -> float:
        """Per-second rate of one column: its sum over the span, the span floored at
        ``min_span_s`` so that a window a few microseconds old reports no absurd rate."""
        span = max(self.span_s, self.min_span_s)
        return self.totals[column] / span if span > 0 else 0.0

    def rates(self) -> tuple[float, ...]:
        return tuple(self.rate(i) for i in range(len(self.totals)))

    def interval_fraction(self) -> float:
        """Share of the span covered by recorded intervals, in [0, 1] (e.g. time spent waiting
        for data); 0 while the span is empty. Capped at 1: overlapping or over-long intervals
        must not report more than all of the time."""
        if self.span_s <= 0:
            return 0.0
        return min(1.0, self.interval_s / self.span_s)


class RateMeter:
    """Sums of timestamped amounts over the last ``window_s`` seconds, and rates from them.

    Two kinds of records, both stamped with ``now`` (the clock, or the time the caller passes,
    e.g. the one it already read for its own bookkeeping):

    - `add`: an event carrying one amount per column (say batches, images, bytes);
    - `add_interval`: a stretch of time that ends now (say a wait for data).

    ``start_at_first_event``: by default the window's age counts from its creation (or `reset`),
    which suits a server (a quiet start is a real zero). A window that measures something which
    only begins with its first record (a loader before its first batch) counts from the earliest
    recorded moment instead, the start of an interval included.

    Thread-safe (one short lock per call), so one thread may record while another reads, as a
    server's loop does while a Prometheus scrape reads its figures. The clock must be monotonic.
    """

    def __init__(
        self,
        window_s: float,
        *,
        columns: int = 1,
        clock: Callable[[], float] = time.monotonic,
        min_span_s: float | None = None,
        start_at_first_event: bool = False,
    ) -> None:
        if not window_s > 0:  # also refuses NaN
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if columns < 1:
            raise ValueError(f"columns must be >= 1, got {columns}")
        self.window_s = float(window_s)
        self.columns = int(columns)
        # One second smooths the first batch of a window of seconds; a shorter window would
        # otherwise never report its own full rate, hence the min().
        self.min_span_s = min(1.0, self.window_s) if min_span_s is None else float(min_span_s)
        self._clock = clock
        self._start_at_first_event = start_at_first_event
        # An infinite window never drops anything, so it keeps the sums and not the events.
        self._keep_events = math.isfinite(self.window_s)
        self._lock = threading.Lock()
        self._events: deque[tuple[float, tuple[float, ...]]] = deque()  # (time, amounts)
        self._intervals: deque[tuple[float, float]] = deque()  # (end time, seconds)
        self._totals = [0.0] * self.columns
        self._interval_total = 0.0
        self._start: float | None = None
        self.reset()

    # -- recording ----------------------------------------------------------------------------

    def add(self, amounts: float | Sequence[float] = 1.0, now: float | None = None) -> None:
        """Record an event of ``amounts`` (one number per column; a single number for one
        column, missing trailing columns count as 0) at ``now`` (default: the clock)."""
        values = tuple(map(float, amounts)) if isinstance(amounts, Sequence) else (float(amounts),)
        if len(values) > self.columns:
            raise ValueError(f"{len(values)} amounts for a window of {self.columns} column(s)")
        with self._lock:
            now = self._now(now)
            self._mark(now)
            for i, v in enumerate(values):
                self._totals[i] += v
            if self._keep_events:
                self._events.append((now, values))
            self._prune(now)

    def add_interval(self, seconds: float, now: float | None = None) -> None:
        """Record ``seconds`` of time ending at ``now`` (negative durations count as 0)."""
        seconds = max(0.0, float(seconds))
        with self._lock:
            now = self._now(now)
            self._mark(now - seconds)
            self._interval_total += seconds
            if self._keep_events:
                self._intervals.append((now, seconds))
            self._prune(now)

    def reset(self, now: float | None = None) -> None:
        """Forget everything; the window starts again at ``now`` (or at its next record)."""
        with self._lock:
            self._events.clear()
            self._intervals.clear()
            self._totals = [0.0] * self.columns
            self._interval_total = 0.0
            self._start = None if self._start_at_first_event else self._now(now)

    # -- reading ------------------------------------------------------------------------------

    def read(self, now: float | None = None) -> MeterReading:
        """All figures of the window at ``now`` (default: the clock), consistently."""
        with self._lock:
            now = self._now(now)
            self._prune(now)
            horizon = now - self.window_s
            # An interval that began before the horizon counts only from the horizon on. Waits
            # are recorded in the order they began (one waiter waits for one thing at a time),
            # so those straddling the horizon are the oldest ones: the scan stops at the first
            # that began inside the window and stays O(1) amortised.
            clipped = 0.0
            for end, seconds in self._intervals:
                began = end - seconds
                if began >= horizon:
                    break
                clipped += horizon - began
            span = 0.0 if self._start is None else max(0.0, min(self.window_s, now - self._start))
            return MeterReading(
                span_s=span,
                totals=tuple(self._totals),
                interval_s=max(0.0, self._interval_total - clipped),
                min_span_s=self.min_span_s,
            )

    def rates(self, now: float | None = None) -> tuple[float, ...]:
        """Per-second rate of every column (see `MeterReading.rate`)."""
        return self.read(now).rates()

    def rate(self, now: float | None = None) -> float:
        """Per-second rate of the first column."""
        return self.read(now).rate(0)

    # -- internals (lock held) ------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else float(now)

    def _mark(self, t: float) -> None:
        if self._start is None or (self._start_at_first_event and t < self._start):
            self._start = t

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        events = self._events
        if events and events[0][0] <= horizon:
            while events and events[0][0] <= horizon:
                _, values = events.popleft()
                for i, v in enumerate(values):
                    self._totals[i] -= v
            if not events:  # exact zeros once empty: no float residue from the subtractions
                self._totals = [0.0] * self.columns
        intervals = self._intervals
        if intervals and intervals[0][0] <= horizon:
            while intervals and intervals[0][0] <= horizon:
                self._interval_total -= intervals.popleft()[1]
            if not intervals:
                self._interval_total = 0.0
