"""Audit of a mix's epoch plan against counts made here (docs/mixtures.md): the weights hold in
every window of 256 positions, repeat and choose draw exactly what the docs say, each part is
drawn without replacement through its own epochs, and hostile values (huge weights, a huge
repeat or choose) stop the start with a clear ValueError instead of a wrong epoch, an
OverflowError or a start that never ends."""

from __future__ import annotations

import time

import numpy as np
import pytest
from batchwire.pipeline.mix_order import MixPlan
from batchwire.pipeline.sources.mix import parse_mix


def _samples_of(plan: MixPlan, part: int, indices: np.ndarray) -> list[int]:
    """The part's own sample number of each mix index (its block's offset)."""
    starts = sorted(at for at, p, _ in plan.blocks if p == part)
    return [int(i) - max(s for s in starts if s <= i) for i in indices]


@pytest.mark.parametrize(
    ("sizes", "weights"),
    [((1000, 300, 50), (0.7, 0.2, 0.1)), ((100, 1000), (0.9, 0.1)), ((400,) * 4, (3, 1, 1, 1))],
)
def test_every_window_of_256_holds_the_weights_within_two(sizes, weights):
    plan = MixPlan(sizes, "weight", weights)
    share = np.asarray(weights, dtype=np.float64) / sum(weights)
    for epoch in range(3):
        parts = plan.parts_of(plan.epoch_order(5, epoch))
        for p, w in enumerate(share):
            in_window = np.convolve((parts == p).astype(np.int64), np.ones(256, np.int64), "valid")
            assert np.abs(in_window - 256 * w).max() <= 2, (p, epoch)


@pytest.mark.parametrize(
    ("mode", "values", "draws"),
    [("repeat", (1, 2.5), (50, 92)), ("choose", (20, 30), (20, 30)), ("weight", (1, 3), (22, 65))],
)
def test_repeat_choose_and_weight_draw_what_the_docs_say(mode, values, draws):
    plan = MixPlan((50, 37), mode, values)
    assert plan.epoch_length == sum(draws)
    for epoch in range(4):
        parts = plan.parts_of(plan.epoch_order(1, epoch))
        assert np.bincount(parts, minlength=2).tolist() == list(draws)


@pytest.mark.parametrize("mode", ["weight", "repeat", "choose"])
def test_each_part_goes_through_its_own_epochs_without_replacement(mode):
    values = {"weight": (0.5, 0.5), "repeat": (1, 2.5), "choose": (20, 30)}[mode]
    plan = MixPlan((50, 37), mode, values)
    for part, size in enumerate(plan.sizes):
        drawn: list[int] = []
        for epoch in range(6):
            order = plan.epoch_order(3, epoch)
            mine = order[plan.parts_of(order) == part]
            if len(mine) > size:  # each pass of the epoch under its own indices
                assert len(set(mine.tolist())) == len(mine)
            drawn += _samples_of(plan, part, mine)
        for k in range(len(drawn) // size):
            assert sorted(drawn[k * size : (k + 1) * size]) == list(range(size)), (part, k)


def test_huge_equal_weights_are_still_half_and_half():
    """`a=1e308,b=1e308` is `a=1,b=1` (weights are relative): the epoch is both parts, and
    each part's planned share is a half."""
    plan = parse_mix("mix:a=1e308@/x,b=1e308@/y").plan([10, 10], train=True)
    assert plan.epoch_length == 20
    assert plan.counts(0).tolist() == [10, 10]
    assert plan.shares(0) == (0.5, 0.5)  # the stats' and pipeline-monitor's "w 0.50"


@pytest.mark.parametrize(
    "text", ["mix:a=repeat:1e308@/x", "mix:a=choose:1e19@/x", "mix:a=repeat:1e12@/x,b=repeat:1@/y"]
)
def test_a_huge_repeat_or_choose_is_a_clear_error(text):
    with pytest.raises(ValueError, match="mix epoch"):
        parse_mix(text)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("mode", "value"), [("repeat", 1e9), ("weight", 1.0)])
def test_a_mix_too_large_to_lay_out_is_refused_at_once(mode, value):
    """repeat:1e9 of a 16-sample part parses (the parse knows no sizes), but laying out its
    index blocks would take minutes and gigabytes (`MixPlan.blocks`): the plan over the real
    sizes refuses it when it is made. So does a 1-sample part weighted like a 4-million-sample
    one (two million copies of it)."""
    start = time.monotonic()
    sizes, values = ((16,), (value,)) if mode == "repeat" else ((1, 4_000_000), (1.0, 1.0))
    with pytest.raises(ValueError, match=r"mix epoch"):
        MixPlan(sizes, mode, values)
    assert time.monotonic() - start < 5
