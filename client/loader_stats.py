"""The trainer's side of monitoring: how long it waits for data, and how fast it consumes.

RemoteLoader calls ``record_wait``/``record_batch`` once per batch and sends ``as_dict()`` (the
map of a `wire.LoaderReport`, the schema's trainer part) with each credit, so the server (and
``pipeline-monitor``) can tell a starving trainer from a busy one.
Waits are kept as intervals, so a figure over "the last 10 s" counts only the part of a long wait
that falls inside those 10 s.

Two totals since the loader was made ride along (a report's extra figures, which servers pass
on to ``pipeline-monitor --json`` as they are): batches received, and those of them the server
produced for another client too (`BatchHeader.shared`: a sweep's shared production). A trainer
tells its per-epoch share from their differences (pipeline-train's epoch line).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from batchwire.common.rates import RateMeter
from batchwire.wire.stats import LoaderReport

# Long enough to average over a handful of steps of a slow model, short enough to follow a change.
WINDOW_S = 10.0


class LoaderStats:
    """Sliding-window wait and throughput figures of one loader.

    The window counts from the loader's first activity (the start of its first wait), not from
    its creation: a loader built long before training starts is not "idle" meanwhile. It is
    thread-safe (the window's lock), as the training loop records while a send path may read.
    """

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        # Columns: batches, images. Waits are intervals, so a long one is clipped to the window.
        self._window = RateMeter(window_s, columns=2, clock=clock, start_at_first_event=True)
        self.window_s = self._window.window_s
        self._prefetch_depth = 0
        self._totals_lock = threading.Lock()  # the two totals move together
        self.batches_received = 0  # totals since the loader was made (module doc)
        self.batches_shared = 0

    def record_wait(self, seconds: float) -> None:
        """The trainer just spent ``seconds`` blocked waiting for its next batch."""
        self._window.add_interval(seconds)

    def record_batch(self, images: int, shared: bool = False) -> None:
        """The trainer received a batch of ``images`` images (``shared``: produced for another
        client too)."""
        self._window.add((1, int(images)))
        with self._totals_lock:
            self.batches_received += 1
            self.batches_shared += bool(shared)

    def set_prefetch_depth(self, n: int) -> None:
        """Batches received and buffered ahead of the trainer right now."""
        self._prefetch_depth = int(n)

    def report(self) -> LoaderReport:
        """Prefetch depth, wait per batch, data-wait fraction and images/s (last window), and
        the totals of batches received and shared (extra figures).

        ``data_wait_fraction`` is the share of wall time spent waiting, over the window (or since
        the first record, when that is more recent): 0 = never starved, 1 = always starved.
        """
        r = self._window.read()
        batches = r.totals[0]
        with self._totals_lock:
            totals = {
                "batches_received_total": self.batches_received,
                "batches_shared_total": self.batches_shared,
            }
        return LoaderReport(
            prefetch_depth=self._prefetch_depth,
            wait_s_per_batch=r.interval_s / batches if batches else 0.0,
            data_wait_fraction=r.interval_fraction(),
            images_per_s=r.rate(1),
            extra=totals,
        )

    def as_dict(self) -> dict[str, float]:
        """`report` as the map a credit carries (``Credit.stats``)."""
        return self.report().to_map()

    def figures(self) -> dict[str, float]:
        """The four figures of `report` (what `RemoteLoader.stats()` has always returned),
        without the totals that ride along on the wire: see `totals`."""
        report = self.report()
        return {
            "prefetch_depth": report.prefetch_depth,
            "wait_s_per_batch": report.wait_s_per_batch,
            "data_wait_fraction": report.data_wait_fraction,
            "images_per_s": report.images_per_s,
        }

    def totals(self) -> tuple[int, int]:
        """(batches received, batches of them shared with another client) since the loader
        was made."""
        with self._totals_lock:
            return self.batches_received, self.batches_shared
