"""client/unasked.py: the batches of an epoch no server has been asked for yet, handed out
lowest first (so the batch the trainer needs next is the one asked for earliest), a lost
server's batches coming back to go to the others."""

from __future__ import annotations

from batchwire.client.unasked import UnaskedBatches


def batches(start: int, total: int | None) -> UnaskedBatches:
    u = UnaskedBatches()
    u.reset(start, total)
    return u


def take_all(u: UnaskedBatches) -> list[int]:
    out = []
    while u:
        out.append(u.take())
    return out


def test_nothing_is_left_before_the_epochs_length_is_known() -> None:
    assert UnaskedBatches().total is None and not UnaskedBatches()
    assert not batches(0, None)


def test_an_epoch_hands_out_its_batches_from_the_start_lowest_first() -> None:
    u = batches(3, 7)
    assert take_all(u) == [3, 4, 5, 6]
    assert not u


def test_an_epoch_with_no_batch_left_at_its_start_hands_out_none() -> None:
    assert not batches(0, 0)
    assert not batches(5, 5)
    assert not batches(7, 5)


def test_batches_given_back_come_before_higher_ones_never_asked() -> None:
    u = batches(0, 10)
    assert [u.take() for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    u.give_back([4, 1])
    assert take_all(u) == [1, 4, 6, 7, 8, 9]


def test_batches_given_back_after_the_last_was_asked_are_handed_out_again() -> None:
    u = batches(0, 3)
    assert take_all(u) == [0, 1, 2]
    u.give_back([])
    assert not u
    u.give_back([2, 0])
    assert take_all(u) == [0, 2]


def test_before_the_length_is_known_only_batches_given_back_come_out() -> None:
    u = batches(0, None)
    u.give_back([3])
    assert u and u.take() == 3
    assert not u


def test_the_length_drops_batches_given_back_past_the_end_and_keeps_the_rest_in_order() -> None:
    u = batches(0, 12)
    take_all(u)
    u.give_back([1, 4, 2, 3, 11, 0, 5, 6])
    u.set_total(8)
    assert u.total == 8
    assert take_all(u) == [0, 1, 2, 3, 4, 5, 6]


def test_the_length_once_known_lets_the_fresh_batches_out() -> None:
    u = batches(2, None)
    u.set_total(5)
    assert take_all(u) == [2, 3, 4]


def test_reset_forgets_the_batches_given_back() -> None:
    u = batches(0, 10)
    u.take()
    u.give_back([0])
    u.reset(5, 7)
    assert take_all(u) == [5, 6]
