"""The coalescing rule of ranged reads (`storage.coalesce`): which GETs read a set of byte ranges
of one object, and the bytes cut back out of them equal separate reads of each range."""

from __future__ import annotations

import os
import random
from pathlib import Path

from batchwire.pipeline.storage import LocalStore
from batchwire.pipeline.storage.coalesce import (
    GAP_BYTES,
    MAX_REQUEST_BYTES,
    plan_requests,
    slice_members,
)

MB = 1_000_000


def spans(ranges, **kw) -> list[tuple[int, int, tuple[int, ...]]]:
    return [(r.start, r.end, r.members) for r in plan_requests(ranges, **kw)]


def test_a_gap_cheaper_than_a_request_is_read_a_wider_one_is_not():
    # 110 kB members of a 16 MB shard, in a shuffled batch's order
    ranges = [(9 * MB, 9 * MB + 110_000), (0, 110_000), (200_000, 310_000), (3 * MB, 3_110_000)]
    assert 310_000 - 110_000 < GAP_BYTES < 3 * MB - 310_000
    assert spans(ranges) == [
        (0, 310_000, (1, 2)),
        (3 * MB, 3_110_000, (3,)),
        (9 * MB, 9_110_000, (0,)),
    ]
    # obstore's own rule (1 MiB) merged a 0.8 MB gap: it costs more CPU than a GET (0.84 ms
    # of bytes against 0.70 ms), so it is read as two
    far = [(0, 110_000), (910_000, 1_020_000)]
    assert len(plan_requests(far)) == 2
    assert len(plan_requests(far, gap_bytes=1 << 20)) == 1


def test_overlaps_touching_and_empty_ranges():
    ranges = [(50, 50), (0, 100), (80, 120), (120, 130), (10, 20), (7, 7)]
    assert spans(ranges, gap_bytes=0) == [(0, 130, (1, 4, 2, 3))]
    assert plan_requests([(5, 5), (9, 3)]) == []  # nothing to ask for


def test_no_request_grows_past_the_cap_but_a_large_range_is_read_whole():
    members = [(k * 1_000_000, k * 1_000_000 + 990_000) for k in range(40)]  # 10 kB gaps
    plan = plan_requests(members)
    assert all(r.end - r.start <= MAX_REQUEST_BYTES for r in plan)
    assert len(plan) == 3 and sorted(i for r in plan for i in r.members) == list(range(40))
    assert spans([(0, 40 << 20), (40 << 20, (40 << 20) + 5)]) == [(0, (40 << 20) + 5, (0, 1))]


def test_sliced_bytes_equal_separate_reads_of_a_real_file(tmp_path: Path):
    blob = os.urandom(3_000_000)
    (tmp_path / "shard.tar").write_bytes(blob)
    store = LocalStore(tmp_path)
    rng = random.Random(7)
    for gap in (0, 1000, GAP_BYTES, 1 << 30):
        ranges = []
        for _ in range(40):
            a = rng.randrange(0, 3_100_000)  # some past the end: read short, as alone
            ranges.append((a, a + rng.choice([0, 1, 500, 110_000])))
        ranges += ranges[:3]  # the same range twice
        plan = plan_requests(ranges, gap_bytes=gap, max_bytes=400_000)
        answers = store.read_ranges("shard.tar", [(r.start, r.end) for r in plan])
        got = slice_members(ranges, plan, answers)
        want = [store.read_ranges("shard.tar", [r])[0] for r in ranges]
        assert got == want and got == [blob[s:e] for s, e in ranges]
