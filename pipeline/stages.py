"""The producer's stages, declared once: read -> verify -> plan -> decode -> augment -> label.

A batch goes through them in this order: `SampleLoader` (pipeline/samples.py) runs the first
four over a `SampleBatch`, `BatchProducer` (pipeline/producer.py) the last two. A file that
verify or decode finds bad sends its sample back to read, for its next substitute; a decode
that failed transiently (out of memory) is decoded again.

One hook times and counts them (spdl's ``TaskStatsHook`` is the model): `StageHook` knows how
many batches are in each stats row now (`depth`), and a `StageClock` per batch is told when
the batch enters a stage and returns the seconds it spent in each row (`StageClock.stop`).
Both are data: nothing here calls the caller's code or the server's telemetry. The producer
threads put a batch's `BatchStats` (those seconds, its decoder's fallback total and the bad
files found) with the batch's result; the server's shell records them.

The server's stats keep three rows for the producer's work (`ROWS`: its stage table, the
latency histogram's labels, the monitor): read (reading, checking and planning, from the
batch's start), decode, and augment (the fused op or user transform, then the batch's
labels, and a device batch's copy back to the host).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

READ, VERIFY, PLAN, DECODE, AUGMENT, LABEL = "read", "verify", "plan", "decode", "augment", "label"


@dataclass(frozen=True)
class Stage:
    """One stage: its ``name``, the stats ``row`` its time counts under, and what it ``does``."""

    name: str
    row: str
    does: str


STAGES = (
    Stage(READ, "read", "the sampler's plan, then each sample's bytes (retried if transient)"),
    Stage(VERIFY, "read", "checksum and header; a bad file goes back to read (a substitute)"),
    Stage(PLAN, "read", "each sample's augmentation draws: box, flip, jitter (per view)"),
    Stage(DECODE, "decode", "the crop's pixels; a file that fails goes back to read"),
    Stage(AUGMENT, "augment", "the fused op (or a user transform) into the output"),
    Stage(LABEL, "augment", "labels, padding and provenance (`BatchMeta`)"),
)
#: The stats rows, in order (the server's stage table and its latency labels).
ROWS = ("read", "decode", "augment")
_ROW = {stage.name: stage.row for stage in STAGES}


@dataclass(frozen=True)
class BatchStats:
    """What a producer thread reports with a batch, produced or failed: ``seconds`` in each
    stats row (`ROWS`), its ``decoder``'s name and total of images decoded on the CPU
    instead (``fallbacks``: a total, never an increment), and the split's ``bad_files``
    found since the last report (paths; another thread's batch may have found them)."""

    seconds: dict[str, float]
    decoder: str
    fallbacks: int
    bad_files: tuple[str, ...] = ()


class StageHook:
    """Batches in each stats row now (`depth`: read without a lock by the server's stats from
    any thread, at worst a batch stale) and a clock for each batch (`start`). One per server,
    over every split's producer. ``now``: the seconds counter the clocks read (tests pass
    their own)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.depth = dict.fromkeys(ROWS, 0)
        self.now = now
        self._lock = threading.Lock()

    def start(self) -> StageClock:
        """A new batch's clock, in the read stage from now."""
        return StageClock(self)

    def _move(self, left: str | None, entered: str | None) -> None:
        with self._lock:
            if left is not None:
                self.depth[left] -= 1
            if entered is not None:
                self.depth[entered] += 1


class StageClock:
    """One batch's way through the stages: `enter` each stage as it starts, `stop` at the end.

    Not thread-safe: one batch, one thread. `UNTIMED` is the clock of a batch nobody times
    (the in-process loader): entering a stage does nothing."""

    __slots__ = ("_hook", "_stage", "_t0", "seconds")

    def __init__(self, hook: StageHook | None) -> None:
        self._hook = hook
        self.seconds: dict[str, float] = {}  # stage name -> seconds spent in it
        self._stage: str | None = None
        self._t0 = 0.0
        if hook is not None:
            self.enter(READ)

    def enter(self, stage: str) -> None:
        """The batch starts ``stage`` (a `STAGES` name) now."""
        if self._hook is not None:
            self._switch(stage)

    def stop(self) -> dict[str, float]:
        """End the batch's timing: the seconds it spent in each stats row (`ROWS`) it
        entered (its stages' `seconds` summed by row)."""
        if self._hook is not None and self._stage is not None:
            self._switch(None)
        return rows(self.seconds)

    def _switch(self, stage: str | None) -> None:
        assert self._hook is not None
        now = self._hook.now()
        left = self._stage
        if left is not None:
            self.seconds[left] = self.seconds.get(left, 0.0) + now - self._t0
        row_left = None if left is None else _ROW[left]
        row = None if stage is None else _ROW[stage]
        if row != row_left:
            self._hook._move(row_left, row)
        self._stage, self._t0 = stage, now


def rows(seconds: dict[str, float]) -> dict[str, float]:
    """Seconds per stage summed into seconds per stats row (`ROWS` order)."""
    out: dict[str, float] = {}
    for stage in STAGES:
        if stage.name in seconds:
            out[stage.row] = out.get(stage.row, 0.0) + seconds[stage.name]
    return out


UNTIMED = StageClock(None)
