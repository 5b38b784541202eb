"""ShardSampler: disjoint, complete, equal shards; determinism; direct addressing of any batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from batchwire.pipeline.sampler import BatchPlan, ShardSampler


def _all_ranks(n: int, b: int, world: int, *, train: bool, seed: int = 7) -> list[ShardSampler]:
    return [
        ShardSampler(n, b, seed=seed, shuffle=train, drop_last=train, rank=r, world_size=world)
        for r in range(world)
    ]


_TRAIN_CASES = [
    (world, n, b)
    for world in range(1, 9)
    for n, b in [(1000, 16), (257, 8), (64, 8)]
    if n >= b * world  # smaller ones are an error, tested below
]


@pytest.mark.parametrize("world,n,b", _TRAIN_CASES)
def test_train_shards_are_disjoint_equal_and_cover_whole_rounds(world: int, n: int, b: int) -> None:
    samplers = _all_ranks(n, b, world, train=True)
    counts = {s.num_batches for s in samplers}
    assert counts == {n // (b * world)}, "every rank must get the same number of batches"
    for epoch in (0, 3):
        seen = np.concatenate([p.indices for s in samplers for p in s.plans(epoch)])
        assert all(p.valid.all() for s in samplers for p in s.plans(epoch))
        assert len(seen) == len(np.unique(seen)), "ranks overlap"
        assert len(seen) == samplers[0].num_batches * b * world
        # Exactly the epoch order's first whole rounds: nothing skipped except the short tail.
        order = samplers[0].epoch_order(epoch)
        np.testing.assert_array_equal(np.sort(seen), np.sort(order[: len(seen)]))


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("n,b", [(1000, 16), (257, 8), (5, 4), (1, 3)])
def test_val_shards_cover_every_image_exactly_once(world: int, n: int, b: int) -> None:
    samplers = _all_ranks(n, b, world, train=False)
    expected = -(-n // (b * world))
    assert {s.num_batches for s in samplers} == {expected}
    valid_seen = []
    for s in samplers:
        for p in s.plans(0):
            assert p.indices.dtype == np.int64 and p.valid.dtype == np.bool_
            assert len(p.indices) == b, "batches stay full; padding is marked, not dropped"
            assert ((p.indices >= 0) & (p.indices < n)).all(), "padding holds a real index"
            valid_seen.append(p.indices[p.valid])
            np.testing.assert_array_equal(p.public_indices()[~p.valid], -1)
    np.testing.assert_array_equal(np.sort(np.concatenate(valid_seen)), np.arange(n))
    # Padding only in the last round (global batches are interleaved across ranks).
    for s in samplers:
        for p in s.plans(0):
            if p.batch_index < s.num_batches - 1:
                assert p.valid.all()


def test_val_order_is_sequential() -> None:
    s0, s1 = _all_ranks(10, 2, 2, train=False)
    assert s0.plan(0, 0).indices.tolist() == [0, 1]
    assert s1.plan(0, 0).indices.tolist() == [2, 3]
    assert s0.plan(0, 2).indices.tolist() == [8, 9]
    last = s1.plan(0, 2)
    assert last.valid.tolist() == [False, False]


def test_direct_plan_equals_iteration_and_resume() -> None:
    s = ShardSampler(5000, 32, seed=3, shuffle=True, drop_last=True, rank=2, world_size=4)
    it = list(s.plans(5))
    assert len(it) == s.num_batches == len(s)
    for k in (0, 1, 17, s.num_batches - 1):
        direct = s.plan(5, k)
        assert isinstance(direct, BatchPlan)
        assert (direct.epoch, direct.batch_index) == (5, k)
        np.testing.assert_array_equal(direct.indices, it[k].indices)
    tail = list(s.plans(5, start=20))
    assert len(tail) == s.num_batches - 20
    for a, b in zip(tail, it[20:], strict=True):
        np.testing.assert_array_equal(a.indices, b.indices)
    # A fresh sampler (say, after a restart) computes the same batch without iterating.
    fresh = ShardSampler(5000, 32, seed=3, shuffle=True, drop_last=True, rank=2, world_size=4)
    np.testing.assert_array_equal(fresh.plan(5, 30).indices, it[30].indices)


def test_order_depends_on_seed_and_epoch_only() -> None:
    a = ShardSampler(1000, 10, seed=1, shuffle=True, drop_last=True, rank=0, world_size=1)
    b = ShardSampler(1000, 25, seed=1, shuffle=True, drop_last=True, rank=3, world_size=4)
    np.testing.assert_array_equal(a.epoch_order(2), b.epoch_order(2))
    assert sorted(a.epoch_order(2).tolist()) == list(range(1000))
    assert not np.array_equal(a.epoch_order(2), a.epoch_order(3)), "each epoch reshuffles"
    assert not np.array_equal(a.epoch_order(2), np.arange(1000))
    c = ShardSampler(1000, 10, seed=2, shuffle=True, drop_last=True)
    assert not np.array_equal(a.epoch_order(2), c.epoch_order(2)), "the seed matters"
    with pytest.raises(ValueError):
        a.epoch_order(2)[0] = 5  # the cached order is read-only


_SCRIPT = """
import json, sys
from batchwire.pipeline.sampler import ShardSampler
s = ShardSampler(10007, 64, seed=11, shuffle=True, drop_last=True, rank=1, world_size=3)
print(json.dumps([s.plan(e, k).indices.tolist() for e in (0, 9) for k in (0, 51)]))
"""


def test_deterministic_across_processes() -> None:
    outs = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        res = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outs.append(json.loads(res.stdout))
    assert outs[0] == outs[1]
    here = ShardSampler(10007, 64, seed=11, shuffle=True, drop_last=True, rank=1, world_size=3)
    assert outs[0][0] == here.plan(0, 0).indices.tolist()


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="rank"):
        ShardSampler(10, 2, seed=0, shuffle=False, drop_last=False, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        ShardSampler(10, 2, seed=0, shuffle=False, drop_last=False, rank=-1, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        ShardSampler(10, 0, seed=0, shuffle=False, drop_last=False)
    with pytest.raises(ValueError, match="num_samples"):
        ShardSampler(0, 2, seed=0, shuffle=False, drop_last=False)
    with pytest.raises(ValueError, match="world_size"):
        ShardSampler(10, 2, seed=0, shuffle=False, drop_last=False, world_size=0)
    with pytest.raises(ValueError, match=r"batch_size \* world_size = 4 \* 3 = 12"):
        ShardSampler(10, 4, seed=0, shuffle=True, drop_last=True, rank=0, world_size=3)
    with pytest.raises(TypeError):
        ShardSampler(10.0, 2, seed=0, shuffle=False, drop_last=False)  # type: ignore[arg-type]
    s = ShardSampler(10, 2, seed=0, shuffle=True, drop_last=True)
    with pytest.raises(IndexError, match="5 batches"):
        s.plan(0, 5)
    with pytest.raises(ValueError, match="epoch"):
        s.plan(-1, 0)
