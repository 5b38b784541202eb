"""A first-week user's slips with RemoteLoader's position, as the user's own code.

`set_epoch` or `load_state_dict` called while a pass is under way (meant for after the loop):
the pass stops with a LoaderError that names the call (its batches came from the old position,
which is no longer the loader's), unless it had handed out its last batch; the call decides the
next `iter(loader)`. Before, the open iterator failed with an internal "batches are handed out
in order: asked 0, next is 2".
"""

from __future__ import annotations

import pytest
from batchwire.client import LoaderError, RemoteLoader
from serverproc import running_server, small_server_args


@pytest.fixture(scope="module")
def server():
    with running_server(*small_server_args(seed=11)) as srv:
        yield srv


def indices_of(batches) -> list[list[int]]:
    return [batch[2].tolist() for batch in batches]


def epoch_indices(endpoint: str, epoch: int) -> list[list[int]]:
    loader = RemoteLoader(endpoint, "train", device="cpu", with_indices=True)
    try:
        loader.set_epoch(epoch)
        return indices_of(loader)
    finally:
        loader.close()


def finish(it, call: str) -> None:
    """The pass under way stops at its next batch with an error naming ``call``."""
    with pytest.raises(LoaderError, match=rf"{call}\(\) during a pass ended it"):
        next(it)


def test_set_epoch_during_a_pass_decides_the_next_pass(server) -> None:
    loader = RemoteLoader(server.endpoint, "train", device="cpu", with_indices=True)
    try:
        loader.set_epoch(2)
        it = iter(loader)
        next(it)
        loader.set_epoch(3)  # meant for after the loop
        finish(it, "set_epoch")
        next_pass = list(loader)
    finally:
        loader.close()
    assert indices_of(next_pass) == epoch_indices(server.endpoint, 3)


def test_set_epoch_after_the_last_batch_ends_the_loop_quietly(server) -> None:
    loader = RemoteLoader(server.endpoint, "train", device="cpu", with_indices=True)
    try:
        seen = []
        for k, batch in enumerate(loader):
            seen.append(batch)
            if k == len(loader) - 1:
                loader.set_epoch(1)  # on the last batch: nothing of the pass is lost
        assert indices_of(seen) == epoch_indices(server.endpoint, 0)
        assert indices_of(loader) == epoch_indices(server.endpoint, 1)
    finally:
        loader.close()


def test_load_state_dict_during_a_pass_decides_the_next_pass(server) -> None:
    loader = RemoteLoader(server.endpoint, "train", device="cpu", with_indices=True)
    try:
        loader.set_epoch(1)
        state = loader.state_dict()  # epoch 1, batch 0
        it = iter(loader)
        next(it), next(it)
        loader.load_state_dict(state)  # a restore, meant for the next pass
        finish(it, "load_state_dict")
        next_pass = list(loader)
    finally:
        loader.close()
    assert indices_of(next_pass) == epoch_indices(server.endpoint, 1)


def test_a_state_loaded_between_iter_and_the_first_batch_positions_that_pass(server) -> None:
    """What Lightning does on resume: the iterator made, then the state loaded, then batches."""
    loader = RemoteLoader(server.endpoint, "train", device="cpu", with_indices=True)
    try:
        loader.set_epoch(1)
        it = iter(loader)
        next(it)
        state = loader.state_dict()  # epoch 1, batch 1
        it = iter(loader)  # a fresh pass of epoch 1 (batch 0), not begun yet
        loader.load_state_dict(state)
        rest = list(it)
    finally:
        loader.close()
    assert indices_of(rest) == epoch_indices(server.endpoint, 1)[1:]
