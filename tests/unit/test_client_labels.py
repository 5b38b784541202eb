"""client.labels.multi_hot: padded class ids ([B, K], -1 after the ids, -100 for a padded slot)
become [B, C] 0/1 targets, and what is not ids is refused rather than read as ids.

tests/unit/test_multilabel.py covers the basic case (a padded batch, [B] labels, an id not below
the class count); these cover the rest of what the docstring promises."""

from __future__ import annotations

import pytest
import torch
from batchwire.client.labels import multi_hot


def test_an_id_written_twice_is_one_not_two() -> None:
    got = multi_hot(torch.tensor([[1, 1, 3], [0, 0, 0]]), 4)
    assert got.tolist() == [[0, 1, 0, 1], [1, 0, 0, 0]]


def test_any_negative_entry_sets_nothing_and_no_column_is_added() -> None:
    """-1 (padding), -100 (a padded slot) and any other negative: no class, and the result has
    exactly num_classes columns (the padding's scratch column is cut off)."""
    labels = torch.tensor([[-7, 2], [-1, -100], [-(2**62), 0]])
    got = multi_hot(labels, 3)
    assert got.shape == (3, 3)
    assert got.tolist() == [[0, 0, 1], [0, 0, 0], [1, 0, 0]]


def test_the_last_class_is_set_and_num_classes_is_refused() -> None:
    assert multi_hot(torch.tensor([[2, -1]]), 3).tolist() == [[0, 0, 1]]
    with pytest.raises(ValueError, match=r"label id 3 is not below num_classes=3"):
        multi_hot(torch.tensor([[0, 3]]), 3)
    with pytest.raises(ValueError, match=r"label id 1099511627776 is not below num_classes=3"):
        multi_hot(torch.tensor([2**40]), 3)


def test_empty_batches_and_rows() -> None:
    """No samples ([0, K]) and no ids in any row ([B, 0]): all-zero targets of the right shape."""
    none = multi_hot(torch.zeros(0, 4, dtype=torch.long), 3)
    assert none.shape == (0, 3)
    no_ids = multi_hot(torch.zeros(2, 0, dtype=torch.long), 3)
    assert no_ids.shape == (2, 3) and not no_ids.any()


def test_shapes_other_than_b_or_b_k_are_refused_naming_the_shape() -> None:
    with pytest.raises(ValueError, match=r"\[B\] or \[B, K\], got shape \[2, 2, 2\]"):
        multi_hot(torch.zeros(2, 2, 2, dtype=torch.long), 3)
    with pytest.raises(ValueError, match=r"got shape \[\]"):
        multi_hot(torch.tensor(1), 3)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float16, torch.bfloat16])
def test_the_dtype_asked_for(dtype: torch.dtype) -> None:
    got = multi_hot(torch.tensor([[1, 0], [2, -1]]), 3, dtype=dtype)
    assert got.dtype == dtype
    assert got.to(torch.int64).tolist() == [[1, 1, 0], [0, 0, 1]]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32])
def test_narrow_and_non_contiguous_ids(dtype: torch.dtype) -> None:
    """Ids of any integer type and layout (a transposed view): the same targets, contiguous."""
    ids = torch.tensor([[2, 1], [-1, 0]], dtype=dtype).t()  # rows [2, -1] and [1, 0]
    assert not ids.is_contiguous()
    got = multi_hot(ids, 3)
    assert got.tolist() == [[0, 0, 1], [1, 1, 0]] and got.is_contiguous()


def test_the_input_is_left_as_it_was() -> None:
    labels = torch.tensor([[2, -1], [-100, -100]])
    before = labels.clone()
    multi_hot(labels, 3)
    assert torch.equal(labels, before)


@pytest.mark.parametrize(
    "labels",
    [
        torch.tensor([[0.9, 2.2]]),  # would be truncated to ids 0 and 2
        torch.tensor([[True, False, True]]),  # a multi-hot row, not ids: would read as 1, 0, 1
    ],
    ids=["float", "bool"],
)
def test_labels_that_are_not_integer_ids_are_refused(labels: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=rf"integer class ids.*{labels.dtype}"):
        multi_hot(labels, 3)


def test_a_negative_class_count_is_refused_as_such() -> None:
    """Not "label id -1 is not below num_classes=-1" (nor torch's negative-size error)."""
    for labels in (torch.tensor([[-1, -1]]), torch.zeros(0, 2, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"num_classes must be >= 0, got -1"):
            multi_hot(labels, -1)
    assert multi_hot(torch.tensor([[-1, -1]]), 0).shape == (1, 0)
