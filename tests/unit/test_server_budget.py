"""server/budget.py: the batch-buffer budget as counting: at most ``max_buffers`` lent, a
``reserve`` of them for clients holding none, the rest shared by the others up to their share.
"""

from __future__ import annotations

import pytest
from batchwire.server.budget import BufferBudget


def lent(max_buffers: int, reserve: int, held: int) -> BufferBudget:
    budget = BufferBudget(max_buffers, reserve)
    for _ in range(held):
        budget.lend()
    return budget


@pytest.mark.parametrize("max_buffers", [0, -3])
def test_a_cap_below_one_buffer_is_refused(max_buffers: int) -> None:
    with pytest.raises(ValueError, match="max_buffers"):
        BufferBudget(max_buffers)


def test_the_reserve_is_one_by_default_and_kept_within_the_cap() -> None:
    assert (BufferBudget(8).reserve, BufferBudget(8).shared) == (1, 7)
    assert (BufferBudget(4, 9).reserve, BufferBudget(4, 9).shared) == (4, 0)
    assert (BufferBudget(4, -2).reserve, BufferBudget(4, -2).shared) == (0, 4)


def test_share_divides_the_shared_part_and_is_never_below_one() -> None:
    budget = BufferBudget(11, 1)  # 10 shared
    assert [budget.share(n) for n in (1, 3, 20)] == [10, 3, 1]
    assert budget.share(0) == 10  # no sharing client: as one
    assert budget.share(2, available=5) == 2
    assert budget.share(2, available=0) == 1
    assert budget.share(2, available=-4) == 1


def test_a_client_holding_none_may_take_a_reserved_buffer() -> None:
    budget = lent(4, 1, 3)  # the shared part is all lent
    assert budget.may_lend(holding=0, share=1)
    assert not budget.may_lend(holding=1, share=10)


def test_a_client_holding_some_takes_from_the_shared_part_below_its_share() -> None:
    budget = BufferBudget(10, 2)
    assert budget.may_lend(holding=2, share=3)
    assert not budget.may_lend(holding=3, share=3)  # at its share: keeps what it holds
    assert not lent(10, 2, 8).may_lend(holding=1, share=5)  # the shared part is all lent


def test_nobody_is_lent_a_buffer_past_the_cap() -> None:
    budget = lent(3, 1, 3)
    assert budget.full
    assert not budget.may_lend(holding=0, share=3)
    with pytest.raises(RuntimeError, match="all 3 batch buffers are held"):
        budget.lend()
    assert budget.held == 3


def test_a_returned_buffer_may_be_lent_again() -> None:
    budget = lent(2, 0, 2)
    budget.returned()
    assert budget.held == 1 and not budget.full
    assert budget.may_lend(holding=0, share=1)
    budget.lend()
    assert budget.full


def test_a_buffer_given_back_that_was_never_lent_is_a_bug_not_room_past_the_cap() -> None:
    budget = lent(1, 0, 1)
    budget.returned()
    with pytest.raises(RuntimeError, match="never lent"):
        budget.returned()
    assert budget.held == 0
    budget.lend()
    assert budget.full
