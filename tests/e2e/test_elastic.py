"""Elastic trainers (issue 24 item 5): a checkpoint taken at world size 2 in the middle of
epoch 1 resumes at 3 ranks and at 1 rank exactly: the samples seen in the epoch before and
after the checkpoint are the epoch's samples, each once; each sample's tensor is the one an
uninterrupted 2-rank run gets (augmentation depends on seed, epoch and sample only).

Ranks are RemoteLoaders in this process (rank r of W, one job name per world size: a server
holds one world size per job): enough for the contract, which is the loaders' and the
server's, not the process group's.
"""

from __future__ import annotations

import pytest
import torch
from batchwire.client import RemoteLoader
from batchwire.wire import PADDING_INDEX, PADDING_LABEL
from serverproc import running_server, small_server_args

EPOCH = 1
B = 16  # small_server_args


@pytest.fixture(scope="module")
def server():
    with running_server(*small_server_args(seed=3)) as srv:
        yield srv


def ranks(srv, world: int, job: str) -> list[RemoteLoader]:
    return [
        RemoteLoader(
            srv.endpoint,
            "train",
            rank=r,
            world_size=world,
            device="cpu",
            with_indices=True,
            job=job,
            prefetch_next_epoch=False,
            timeout=30.0,
        )
        for r in range(world)
    ]


def samples(batches) -> dict[int, torch.Tensor]:
    """index -> image of every valid slot; padding slots have label -100."""
    out: dict[int, torch.Tensor] = {}
    for images, labels, indices in batches:
        for img, label, i in zip(images, labels.tolist(), indices.tolist(), strict=True):
            if i == PADDING_INDEX:
                assert label == PADDING_LABEL
                continue
            assert i not in out, f"sample {i} served twice"
            out[i] = img.clone()
    return out


@pytest.fixture(scope="module")
def uninterrupted(server):
    loaders = ranks(server, 2, "full")
    got: dict[int, torch.Tensor] = {}
    for loader in loaders:
        loader.set_epoch(EPOCH)
        part = samples([tuple(t.clone() for t in b) for b in loader])
        assert not set(part) & set(got), "ranks overlap"
        got.update(part)
        loader.close()
    assert len(got) == (400 // (2 * B)) * 2 * B
    return got


@pytest.fixture(scope="module")
def checkpoint(server):
    """Both ranks take 5 batches of epoch 1; rank 0's state is the checkpoint."""
    loaders = ranks(server, 2, "before")
    seen: dict[int, torch.Tensor] = {}
    for loader in loaders:
        loader.set_epoch(EPOCH)
        it = iter(loader)
        part = samples([tuple(t.clone() for t in next(it)) for _ in range(5)])
        assert not set(part) & set(seen)
        seen.update(part)
    state = loaders[0].state_dict()
    for loader in loaders:
        loader.close()
    assert (state["epoch"], state["next_batch"], state["world_size"]) == (EPOCH, 5, 2)
    return state, seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3, 1])
def test_a_checkpoint_of_2_ranks_resumes_exactly_at_another_world_size(
    server, uninterrupted, checkpoint, world
):
    state, before = checkpoint
    loaders = ranks(server, world, f"after-{world}")
    after: dict[int, torch.Tensor] = {}
    lengths = []
    for loader in loaders:
        loader.load_state_dict(state)
        loader.set_epoch(EPOCH)  # the trainer's usual loop keeps the restored position
        batches = [tuple(t.clone() for t in b) for b in loader]
        lengths.append(len(batches))
        part = samples(batches)
        assert not set(part) & set(after), "resumed ranks overlap"
        after.update(part)
    assert len(set(lengths)) == 1, f"ranks got unequal batch counts: {lengths}"
    assert not set(before) & set(after), "a sample seen before the checkpoint came again"
    assert set(before) | set(after) == set(uninterrupted), "samples skipped or foreign"
    for i, img in {**before, **after}.items():
        assert torch.equal(img, uninterrupted[i]), f"sample {i} differs from the full run"
    # A checkpoint inside the resumed pass resumes too (its position composes).
    mid = loaders[0].state_dict()
    assert mid["start_sample"] == 5 * 2 * B and mid["epoch_world_size"] == 2
    # After the resumed pass, the next epoch is a whole one at the new world size.
    nxt = [tuple(t.clone() for t in b) for b in loaders[0]]
    assert loaders[0].state_dict()["epoch"] == EPOCH + 1
    assert len(nxt) == 400 // (world * B)
    for loader in loaders:
        loader.close()


@pytest.mark.timeout(120)
def test_a_resumed_pass_checkpointed_again_resumes_exactly(server, uninterrupted, checkpoint):
    """2 ranks -> 3 ranks (2 batches each, checkpoint) -> 1 rank: still every sample once."""
    state, before = checkpoint
    three = ranks(server, 3, "again-3")
    seen = dict(before)
    for loader in three:
        loader.load_state_dict(state)
        loader.set_epoch(EPOCH)
        it = iter(loader)
        part = samples([tuple(t.clone() for t in next(it)) for _ in range(2)])
        assert not set(part) & set(seen)
        seen.update(part)
    state3 = three[0].state_dict()
    for loader in three:
        loader.close()
    (one,) = ranks(server, 1, "again-1")
    one.load_state_dict(state3)
    one.set_epoch(EPOCH)
    part = samples([tuple(t.clone() for t in b) for b in one])
    one.close()
    assert not set(part) & set(seen)
    seen.update(part)
    assert set(seen) == set(uninterrupted)
    assert all(torch.equal(img, uninterrupted[i]) for i, img in seen.items())
