"""The loader's position policy (client/progress.py) driven alone: passes, epochs, restores.

RemoteLoader carries these out over real servers (tests/e2e/test_remote_loader*.py,
test_elastic.py); here each rule is one event sequence and its outcome.
"""

from __future__ import annotations

import pytest
from batchwire.client.progress import Progress

SHAPE = {"num_batches": 10, "batch_size": 4, "num_samples": 80}


def state(epoch: int, next_batch: int, world: int, **extra) -> dict:
    return {
        "epoch": epoch,
        "next_batch": next_batch,
        "split": "train",
        "rank": 0,
        "world_size": world,
        **extra,
    }


def run_pass(p: Progress, total: int) -> list[int]:
    """One pass handed out to its end: the batches taken."""
    taken = []
    if p.at_end(total):
        return taken
    while p.next_batch < total:
        taken.append(p.next_batch)
        p.handed_out(total)
    return taken


def test_every_pass_starts_at_zero_and_a_train_epoch_moves_on_by_itself() -> None:
    p = Progress()
    assert not p.begin_pass(repeats=False)
    assert (p.epoch, run_pass(p, 3)) == (0, [0, 1, 2])
    assert p.epoch_passed
    assert p.begin_pass(repeats=False)  # iterated again with no set_epoch: epoch 1
    assert (p.epoch, p.next_batch, p.epoch_passed) == (1, 0, False)


def test_a_val_loader_repeats_its_epoch_and_set_epoch_decides() -> None:
    p = Progress()
    p.begin_pass(repeats=True)
    run_pass(p, 3)
    assert not p.begin_pass(repeats=True) and p.epoch == 0
    run_pass(p, 3)
    p.set_epoch(0)  # an explicit set_epoch decides: no advance
    assert not p.begin_pass(repeats=False) and p.epoch == 0


def test_a_pass_left_midway_starts_again_at_zero() -> None:
    p = Progress()
    p.begin_pass(repeats=False)
    p.handed_out(10)
    p.handed_out(10)
    assert not p.begin_pass(repeats=False)
    assert (p.epoch, p.next_batch) == (0, 0)


def test_a_restore_at_the_same_world_size_resumes_once_and_set_epoch_keeps_it() -> None:
    p = Progress()
    p.restore(state(3, 5, 2, epoch_shape=SHAPE), world_size=2)
    p.set_epoch(3)  # "load state, then the usual set_epoch(epoch) loop"
    assert (p.start_batch(), p.pass_) == (5, (0, 0))
    p.begin_pass(repeats=False)
    assert run_pass(p, 10) == [5, 6, 7, 8, 9]
    p.set_epoch(3)
    p.begin_pass(repeats=False)
    assert p.next_batch == 0  # the restored position served one pass only


def test_set_epoch_to_another_epoch_drops_a_restored_position() -> None:
    p = Progress()
    p.restore(state(3, 5, 2), world_size=2)
    p.set_epoch(4)
    p.begin_pass(repeats=False)
    assert (p.epoch, p.next_batch, p.pass_) == (4, 0, (0, 0))


def test_a_restore_at_another_world_size_serves_the_rest_as_a_pass_of_its_own() -> None:
    p = Progress()
    p.restore(state(2, 3, 4, epoch_shape=SHAPE), world_size=2)
    # 3 batches x 4 ranks x 4 samples = sample 48 of the epoch order, started at 4 ranks.
    assert (p.epoch, p.next_batch, p.pass_, p.positioned) == (2, 0, (48, 4), True)
    assert p.resume_shape == {"batch_size": 4, "num_samples": 80}  # its length differs
    assert p.position(2) == {
        "epoch": 2,
        "next_batch": 0,
        "start_sample": 48,
        "epoch_world_size": 4,
    }
    # Saved again mid-pass and restored at yet another world size: positions add up.
    p.begin_pass(repeats=False)
    p.handed_out(5)
    saved = {**state(0, 0, 2, epoch_shape=SHAPE), **p.position(2)}
    assert (saved["epoch"], saved["next_batch"]) == (2, 1)
    q = Progress()
    q.restore(saved, world_size=3)
    assert q.pass_ == (48 + 1 * 2 * 4, 4)


def test_a_restore_at_the_epochs_end_makes_the_next_pass_the_next_epoch() -> None:
    p = Progress()
    p.restore(state(2, 10, 4, epoch_shape=SHAPE), world_size=2)
    assert (p.epoch_passed, p.positioned) == (True, False)
    assert p.begin_pass(repeats=False) and p.epoch == 3
    same = Progress()
    same.restore(state(2, 10, 2, epoch_shape=SHAPE), world_size=2)
    same.begin_pass(repeats=False)
    assert same.at_end(10) and same.epoch_passed  # an empty pass


def test_bad_states_are_refused() -> None:
    with pytest.raises(ValueError, match="invalid RemoteLoader state position"):
        Progress().restore(state(-1, 0, 1), world_size=1)
    with pytest.raises(ValueError, match="does not record the batch size"):
        Progress().restore(state(0, 3, 4), world_size=2)


def test_a_restored_position_meets_epochs_of_its_shape_or_stays() -> None:
    p = Progress()
    p.restore(state(1, 5, 2, epoch_shape=SHAPE), world_size=2)
    p.begin_pass(repeats=False)
    other = dict(SHAPE, batch_size=8)
    with pytest.raises(ValueError, match="cannot resume epoch 1 at batch 5"):
        p.check_resumed(other, world_size=2)
    assert p.positioned and p.start_batch() == 5  # asked again, it says the same
    p.begin_pass(repeats=False)
    with pytest.raises(ValueError, match="world_size 2, this loader runs with world_size 3"):
        p.check_resumed(SHAPE, world_size=3)
    p.begin_pass(repeats=False)
    p.check_resumed(SHAPE, world_size=2)
    assert p.resume_shape is None
    p.check_resumed(other, world_size=2)  # checked once: later epochs are not held to it
