"""AccessWatch: most reads denied (credentials expired or revoked) told apart from a few
forbidden files, and over once reads succeed again or the denials grow old."""

from __future__ import annotations

import pytest
from batchwire.pipeline.access import MAX_AGE_S, MIN_READS, WINDOW, AccessWatch


def feed(watch: AccessWatch, pattern: list[bool], now: float = 0.0) -> list[bool]:
    """Record `pattern`; the `most_denied` after each read."""
    return [watch.record(denied, now)[0].most_denied for denied in pattern]


def test_a_few_forbidden_files_are_not_expired_credentials() -> None:
    watch = AccessWatch()
    # One read in three denied, for ever: bad files, never "most reads are denied".
    assert not any(feed(watch, [i % 3 == 0 for i in range(10 * WINDOW)]))


def test_most_reads_denied_needs_enough_reads_and_half_of_them() -> None:
    watch = AccessWatch()
    states = feed(watch, [True] * MIN_READS)
    assert states == [False] * (MIN_READS - 1) + [True]  # fewer than MIN_READS say nothing
    state = watch.state(0.0)
    assert (state.reads, state.denied, state.most_denied) == (MIN_READS, MIN_READS, True)
    assert "most reads are denied (HTTP 401/403 or EACCES: 32 of the last 32)" in state.message()
    assert "credentials expired or revoked?" in state.message()
    half = AccessWatch()
    assert feed(half, [True, False] * (MIN_READS // 2))[-1]  # exactly half is most


def test_reads_that_succeed_again_end_it_and_record_says_when_it_changes() -> None:
    watch = AccessWatch()
    changes = [watch.record(True, 0.0)[1] for _ in range(WINDOW)]
    assert changes.count(True) == 1  # said once, when it started
    # Renewed credentials: successes push the denials out of the window.
    after = [watch.record(False, 1.0) for _ in range(WINDOW)]
    assert [changed for _, changed in after].count(True) == 1
    first_ok = next(k for k, (state, _) in enumerate(after) if not state.most_denied)
    assert first_ok == WINDOW // 2  # 32 successes of 64 reads: denied fewer than half
    assert not watch.state(1.0).most_denied


def test_denials_grow_old() -> None:
    """A server out of its Service gets no reads: after MAX_AGE_S its old denials no longer
    count, /readyz passes again and it is asked again (and finds out again)."""
    watch = AccessWatch()
    feed(watch, [True] * WINDOW, now=100.0)
    assert watch.state(100.0 + MAX_AGE_S - 1).most_denied
    later = watch.state(100.0 + MAX_AGE_S + 1)
    assert (later.reads, later.denied, later.most_denied) == (0, 0, False)
    state, changed = watch.record(True, 100.0 + MAX_AGE_S + 1)
    assert not state.most_denied and changed  # one read says nothing: changed back


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="min_reads"):
        AccessWatch(window=8, min_reads=16)
