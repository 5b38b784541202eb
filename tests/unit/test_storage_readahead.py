"""`storage.readahead.ReadAhead`: members read for upcoming batches stay within the byte budget
(the oldest dropped for room), a member in flight is awaited by its batch rather than fetched
twice, what a failed read-along holds is its batch's error, and nothing outlives being taken or
its epoch."""

from __future__ import annotations

import threading

import pytest
from batchwire.pipeline.storage.readahead import ReadAhead

SIZE = 300


def _size(i: int) -> int:
    return SIZE


def _batches(members: list[int]) -> list[list[int]]:
    """Upcoming members as one batch (the window a fetch reads along)."""
    return [members] if members else []


def _any(fetch) -> object:
    return lambda i: True


def _read(ahead: ReadAhead, epoch: int, own: list[int], upcoming: list[int]) -> dict[int, object]:
    """One batch's read as a reader does it: claim, fetch (bytes naming the member), settle,
    await."""
    claim = ahead.claim(epoch, own, _batches(upcoming), _size, _any)
    fetched = {i: f"m{i}".encode() for i in claim.fetch + claim.along}
    ahead.settle(claim, fetched)
    got = {**claim.taken, **{i: fetched[i] for i in claim.fetch}, **ahead.await_claimed(claim)}
    return got


def test_upcoming_members_are_read_along_within_the_budget_and_taken_once() -> None:
    ahead = ReadAhead(budget=3 * SIZE + 10)
    claim = ahead.claim(0, [1], _batches([2, 3, 4, 5, 6]), _size, _any)
    assert claim.fetch == [1] and claim.along == [2, 3, 4]  # 5 and 6 do not fit
    ahead.settle(claim, {i: b"x" for i in [1, 2, 3, 4]})
    assert ahead.counters()["held_bytes"] == 3 * SIZE
    second = ahead.claim(0, [2, 5], _batches([3, 4, 6]), _size, _any)
    assert second.taken == {2: b"x"} and second.fetch == [5]
    assert second.along == [6]  # 3 and 4 are held already: not read twice
    ahead.settle(second, {5: b"y", 6: b"z"})
    third = ahead.claim(0, [2], _batches([]), _size, _any)
    assert third.fetch == [2]  # taken once: gone


def test_a_batch_whose_members_are_all_held_reads_nothing_itself() -> None:
    ahead = ReadAhead()
    assert _read(ahead, 0, [1], [2, 3]) == {1: b"m1"}
    claim = ahead.claim(0, [2, 3], [], _size, _any)
    assert claim.fetch == [] and claim.along == [] and claim.later is None
    assert set(claim.taken) == {2, 3}


def test_the_next_window_is_read_in_the_background_once_the_held_ones_run_short() -> None:
    ahead = ReadAhead(batches=4)  # windows of 4 batches, the next one from 2 batches ahead
    first = ahead.claim(0, [1], [[2], [3], [4], [5], [6], [7]], _size, _any)
    assert first.along == [2] and first.later is None  # waited for: half a window in all
    ahead.settle(first, {i: b"x" for i in (1, 2)})
    late = ahead.claim(0, [2], [[3], [4], [5], [6], [7], [8]], _size, _any)
    assert late.fetch == [] and late.along == []
    assert late.later is not None and late.later.along == [3, 4, 5, 6]  # 4 batches from 3
    ahead.settle(late.later, {i: b"y" for i in (3, 4, 5, 6)})
    early = ahead.claim(0, [3], [[4], [5], [6], [7], [8], [9]], _size, _any)
    assert early.later is None  # the next 2 batches (4, 5) are held
    assert ahead.claim(0, [4], [[5], [6], [7]], _size, _any).later is None  # 5, 6 held
    again = ahead.claim(0, [5], [[6], [7], [8], [9], [10]], _size, _any)
    assert again.later is not None and again.later.along == [7, 8, 9, 10]
    assert set(ahead.claim(0, [7], [], _size, _any).waits) == {7}  # in flight: awaited
    ahead.settle(again.later, {i: b"z" for i in (7, 8, 9, 10)})


def test_a_member_read_this_epoch_is_not_read_along_again() -> None:
    ahead = ReadAhead()
    _read(ahead, 0, [5, 6], [])  # a producer ahead of the others read batch [5, 6] first
    assert _read(ahead, 0, [1], [2, 5, 6, 7]) == {1: b"m1"}
    assert ahead.counters()["held_bytes"] == 2 * SIZE  # 2 and 7: not 5 and 6 again
    assert ahead.claim(1, [8], _batches([5]), _size, _any).along == [5]  # a new epoch: again


def test_only_members_the_reader_accepts_are_read_along() -> None:
    ahead = ReadAhead()
    claim = ahead.claim(0, [1], _batches([2, 3, 4]), _size, lambda fetch: lambda i: i % 2 == 0)
    assert claim.along == [2, 4]


def test_the_oldest_held_members_are_dropped_for_room() -> None:
    ahead = ReadAhead(budget=3 * SIZE)
    _read(ahead, 0, [1], [2, 3, 4])
    claim = ahead.claim(0, [10], _batches([11]), _size, _any)
    assert claim.along == [11]
    counters = ahead.counters()
    assert counters["dropped"] == 1 and counters["held_bytes"] + counters["flight_bytes"] <= 900
    assert ahead.claim(0, [2], _batches([]), _size, _any).fetch == [2]  # the oldest went
    assert set(ahead.claim(0, [3, 4], _batches([]), _size, _any).taken) == {3, 4}


def test_a_member_in_flight_is_awaited_not_fetched_twice() -> None:
    ahead = ReadAhead()
    first = ahead.claim(0, [1], _batches([2, 3]), _size, _any)
    second = ahead.claim(0, [2, 3, 7], _batches([]), _size, _any)
    assert second.fetch == [7] and set(second.waits) == {2, 3}
    got: dict[int, object] = {}
    waiter = threading.Thread(target=lambda: got.update(ahead.await_claimed(second)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waits for the first read to settle
    ahead.settle(first, {1: b"a", 2: b"b", 3: FileNotFoundError(2, "gone")})
    waiter.join(5)
    assert not waiter.is_alive()
    assert got[2] == b"b" and isinstance(got[3], FileNotFoundError)  # its batch's error
    assert ahead.counters()["held_bytes"] == 0


def test_a_read_along_that_failed_as_a_whole_leaves_its_members_to_their_batch() -> None:
    ahead = ReadAhead()
    first = ahead.claim(0, [1], _batches([2]), _size, _any)
    second = ahead.claim(0, [2], _batches([]), _size, _any)
    ahead.settle(first, {})  # the read raised: nothing came back
    assert ahead.await_claimed(second) == {}  # the batch reads member 2 itself
    assert ahead.counters() == {
        "taken": 0, "along": 0, "dropped": 0, "held_bytes": 0, "flight_bytes": 0,
    }  # fmt: skip


def test_a_newer_epoch_drops_what_is_held_and_what_lands_late() -> None:
    ahead = ReadAhead()
    _read(ahead, 0, [1], [2, 3])
    late = ahead.claim(0, [4], _batches([5]), _size, _any)
    claim = ahead.claim(1, [2], _batches([6]), _size, _any)
    assert claim.fetch == [2] and claim.along == [6]  # epoch 0's 2 and 3 are gone
    ahead.settle(late, {4: b"d", 5: b"e"})  # epoch 0's read lands after epoch 1 began
    ahead.settle(claim, {2: b"b", 6: b"f"})
    assert ahead.counters()["held_bytes"] == SIZE  # only epoch 1's member 6
    assert ahead.counters()["dropped"] == 3
    older = ahead.claim(0, [9], _batches([10]), _size, _any)
    assert older.along == []  # a batch of an older epoch reads nothing along


def test_a_budget_below_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        ReadAhead(budget=-1)
