"""Expired or revoked credentials: most reads denied, told apart from a few forbidden files.

An object store answers a read it does not allow with 401 or 403, which reaches the sample
loader as a PermissionError (errno EACCES; a local file without read permission is the same).
One forbidden object is a bad sample like any other: counted, logged and replaced. But when
most reads are denied, the credentials expired or were revoked: replacing each denied sample by
a substitute (itself most likely denied) would train the run on the few samples still readable,
or fail every batch with "the dataset looks broken". `AccessWatch` keeps the outcome of the
last reads (`WINDOW`) and says when most of them (`DENIED_SHARE`, over at least `MIN_READS`)
were denied: the loader then fails the batch as transient (its loaders back off and ask other
servers) instead of substituting, and the server's `/readyz` fails, until reads succeed again.

Reads older than `MAX_AGE_S` no longer count: a server taken out of its Service by the failed
readiness probe gets no more asks, hence no reads; after that time it reports ready again, is
asked again, and either reads (the credentials were renewed) or finds out again.

Pure: the time comes in as ``now``, nothing is logged here (the loader logs the changes the
watch returns); thread-safe, since producer threads record and the probe's thread reads.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

WINDOW = 64  # the reads looked at
MIN_READS = 32  # fewer say nothing
DENIED_SHARE = 0.5  # denied among them, at least, for "most reads are denied"
MAX_AGE_S = 60.0  # older reads no longer count


@dataclass(frozen=True)
class AccessState:
    """The reads in the window, how many were denied, and whether that is most of them (at
    least the watch's share, over at least its `min_reads`)."""

    reads: int
    denied: int
    most_denied: bool

    def message(self) -> str:
        """What the log, the failed batch's error and the probe say while `most_denied`."""
        return (
            f"most reads are denied (HTTP 401/403 or EACCES: {self.denied} of the last "
            f"{self.reads}): credentials expired or revoked? Batches fail as transient "
            "instead of being filled with substitutes, until reads succeed again"
        )


class AccessWatch:
    """The outcome of the last `window` reads (each denied or not) of one sample loader."""

    def __init__(
        self,
        window: int = WINDOW,
        min_reads: int = MIN_READS,
        share: float = DENIED_SHARE,
        max_age_s: float = MAX_AGE_S,
    ) -> None:
        if not 0 < min_reads <= window:
            raise ValueError(f"min_reads must be in [1, window={window}], got {min_reads}")
        self.min_reads = int(min_reads)
        self.share = float(share)
        self.max_age_s = float(max_age_s)
        self._reads: deque[tuple[float, bool]] = deque(maxlen=int(window))
        self._denied = 0  # denied reads in `_reads`
        self._most_denied = False  # as of the last `record`
        self._lock = threading.Lock()

    def record(self, denied: bool, now: float) -> tuple[AccessState, bool]:
        """Note one read; the state after it, and whether `most_denied` changed with it."""
        with self._lock:
            if len(self._reads) == self._reads.maxlen and self._reads[0][1]:
                self._denied -= 1
            self._reads.append((now, denied))
            self._denied += denied
            state = self._state(now)
            changed = state.most_denied != self._most_denied
            self._most_denied = state.most_denied
        return state, changed

    def state(self, now: float) -> AccessState:
        """The reads of the window no older than `max_age_s`, and the denied among them."""
        with self._lock:
            return self._state(now)

    def _state(self, now: float) -> AccessState:
        while self._reads and self._reads[0][0] < now - self.max_age_s:
            _, denied = self._reads.popleft()
            self._denied -= denied
        reads = len(self._reads)
        most = reads >= self.min_reads and self._denied >= self.share * reads
        return AccessState(reads, self._denied, most)
