"""server/sizing.py: how --max-buffers divides between batch buffers and the sample window,
and the stages' capacities in the stats (the shell only applies these)."""

from __future__ import annotations

from batchwire.pipeline.sample_window import CHUNK
from batchwire.server.config import ServerConfig
from batchwire.server.sizing import plan_buffers, stage_capacities


def _config(**kw) -> ServerConfig:
    return ServerConfig(**{"batch_size": 8, "image_size": 16, "producers": 2, **kw})


def test_one_batch_size_keeps_every_buffer_for_batches() -> None:
    config = _config(max_buffers=40)
    plan = plan_buffers(config, config.capacity_spec())
    assert (plan.buffers, plan.sample_batches, plan.sample_window_nbytes) == (40, 0, 0)
    assert plan.reserve == 2  # one per producer


def test_mixed_batch_sizes_carve_the_sample_window_out_of_max_buffers() -> None:
    config = _config(max_buffers=40, max_batch_size=32, share_window=16)
    capacity = config.capacity_spec()
    plan = plan_buffers(config, capacity)
    window = min(16, 40 // 4) // 2  # half the batch window's bound
    assert plan.sample_batches == window and plan.buffers == 40 - window
    pinned = 2 * (2 * CHUNK - 1) * (capacity.nbytes // capacity.batch_size)
    assert plan.sample_window_nbytes == max(0, window * capacity.nbytes - pinned)
    assert plan.buffers + plan.sample_batches == config.buffer_cap  # the bound holds


def test_no_sample_window_where_it_does_not_apply() -> None:
    for kw in ({"device": "cuda"}, {"views": "2x16:0.4-1.0"}, {"share_window": 0}):
        config = _config(max_buffers=40, max_batch_size=32, **kw)
        assert plan_buffers(config, config.capacity_spec()).sample_batches == 0, kw


def test_stage_capacities() -> None:
    assert stage_capacities(3, 0, 4) == {"read": 6, "decode": 3, "augment": 3, "ready": 4}
    assert stage_capacities(3, 5, 4)["ready"] == 20
