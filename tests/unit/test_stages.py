"""The producer's declared stages (pipeline/stages.py): their order, the stats row each counts
under, and the one hook that times them (`StageHook`, `StageClock`): pure, no server."""

from __future__ import annotations

import threading

from batchwire.pipeline.stages import (
    AUGMENT,
    DECODE,
    LABEL,
    PLAN,
    READ,
    ROWS,
    STAGES,
    UNTIMED,
    VERIFY,
    StageHook,
    rows,
)


class Ticks:
    """A seconds counter that moves only when told (`StageHook(now=...)`)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_stages_in_order_and_their_rows() -> None:
    assert [s.name for s in STAGES] == [READ, VERIFY, PLAN, DECODE, AUGMENT, LABEL]
    assert [s.row for s in STAGES] == ["read", "read", "read", "decode", "augment", "augment"]
    assert ROWS == ("read", "decode", "augment")
    assert all(s.does for s in STAGES)


def test_a_clock_times_each_stage_and_sums_them_by_row() -> None:
    ticks = Ticks()
    hook = StageHook(now=ticks)
    clock = hook.start()  # in read from now
    for stage, seconds in [(VERIFY, 1.0), (PLAN, 2.0), (DECODE, 4.0), (READ, 8.0)]:
        ticks.t += seconds
        clock.enter(stage)
    ticks.t += 16.0  # in read again (a substitute): read's row
    clock.enter(DECODE)
    ticks.t += 32.0
    clock.enter(AUGMENT)
    ticks.t += 64.0
    clock.enter(LABEL)
    ticks.t += 128.0
    assert clock.stop() == {"read": 1 + 2 + 4 + 16.0, "decode": 8 + 32.0, "augment": 64 + 128.0}
    assert clock.seconds == {
        READ: 1 + 16.0,
        VERIFY: 2.0,
        PLAN: 4.0,
        DECODE: 8 + 32.0,
        AUGMENT: 64.0,
        LABEL: 128.0,
    }


def test_depth_counts_batches_per_row_now() -> None:
    hook = StageHook(now=Ticks())
    a, b = hook.start(), hook.start()
    assert hook.depth == {"read": 2, "decode": 0, "augment": 0}
    a.enter(VERIFY)  # the same row: no move
    a.enter(DECODE)
    assert hook.depth == {"read": 1, "decode": 1, "augment": 0}
    b.enter(LABEL)
    assert hook.depth == {"read": 0, "decode": 1, "augment": 1}
    a.stop()
    b.stop()
    assert hook.depth == dict.fromkeys(ROWS, 0)
    assert a.stop() == rows(a.seconds)  # stopping twice changes nothing
    assert hook.depth == dict.fromkeys(ROWS, 0)


def test_depth_holds_over_many_threads() -> None:
    hook = StageHook()

    def batches() -> None:
        for _ in range(2000):
            clock = hook.start()
            for stage in STAGES:
                clock.enter(stage.name)
            clock.stop()

    threads = [threading.Thread(target=batches) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hook.depth == dict.fromkeys(ROWS, 0)


def test_an_untimed_batch_records_nothing() -> None:
    UNTIMED.enter(DECODE)
    UNTIMED.enter(LABEL)
    assert UNTIMED.stop() == {} and UNTIMED.seconds == {}


def test_rows_keep_their_order_whatever_the_stages_order() -> None:
    assert list(rows({LABEL: 1.0, DECODE: 2.0, VERIFY: 3.0})) == ["read", "decode", "augment"]
