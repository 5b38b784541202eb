"""The trainer's side of monitoring: how long it waits for data, and how fast it consumes.

RemoteLoader calls ``record_wait``/``record_batch`` once per batch and sends ``as_dict()`` with
each credit, so the server (and ``pipeline-monitor``) can tell a starving trainer from a busy one.
Waits are kept as intervals, so a figure over "the last 10 s" counts only the part of a long wait
that falls inside those 10 s.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

# Long enough to average over a handful of steps of a slow model, short enough to follow a change.
WINDOW_S = 10.0


class LoaderStats:
    """Sliding-window wait and throughput figures of one loader.

    The lock is uncontended in practice (the training loop records; a send path may read); it
    keeps ``as_dict`` consistent when the two do run in different threads.
    """

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = float(window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._waits: deque[tuple[float, float]] = deque()  # (end time, seconds waited)
        self._batches: deque[tuple[float, int]] = deque()  # (time, images)
        self._first: float | None = None  # start of the first recorded activity
        self._prefetch_depth = 0

    def record_wait(self, seconds: float) -> None:
        """The trainer just spent ``seconds`` blocked waiting for its next batch."""
        seconds = max(0.0, float(seconds))
        now = self._clock()
        with self._lock:
            self._waits.append((now, seconds))
            self._mark_start(now - seconds)
            self._prune(now)

    def record_batch(self, images: int) -> None:
        """The trainer received a batch of ``images`` images."""
        now = self._clock()
        with self._lock:
            self._batches.append((now, int(images)))
            self._mark_start(now)
            self._prune(now)

    def set_prefetch_depth(self, n: int) -> None:
        """Batches received and buffered ahead of the trainer right now."""
        self._prefetch_depth = int(n)

    def as_dict(self) -> dict:
        """``{prefetch_depth, wait_s_per_batch, data_wait_fraction, images_per_s}`` (last window).

        ``data_wait_fraction`` is the share of wall time spent waiting, over the window (or since
        the first record, when that is more recent): 0 = never starved, 1 = always starved.
        """
        now = self._clock()
        with self._lock:
            self._prune(now)
            horizon = now - self.window_s
            waited = sum(min(end, now) - max(end - s, horizon) for end, s in self._waits)
            batches = len(self._batches)
            images = sum(n for _, n in self._batches)
            first = self._first
            depth = self._prefetch_depth
        if first is None:
            return {
                "prefetch_depth": depth,
                "wait_s_per_batch": 0.0,
                "data_wait_fraction": 0.0,
                "images_per_s": 0.0,
            }
        span = min(self.window_s, now - first)
        # A span of a few microseconds (first batch just arrived) would make rates meaningless.
        rate_span = max(span, min(1.0, self.window_s))
        return {
            "prefetch_depth": depth,
            "wait_s_per_batch": waited / batches if batches else 0.0,
            "data_wait_fraction": min(1.0, waited / span) if span > 0 else 0.0,
            "images_per_s": images / rate_span,
        }

    def _mark_start(self, t: float) -> None:
        if self._first is None or t < self._first:
            self._first = t

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._waits and self._waits[0][0] <= horizon:
            self._waits.popleft()
        while self._batches and self._batches[0][0] <= horizon:
            self._batches.popleft()
