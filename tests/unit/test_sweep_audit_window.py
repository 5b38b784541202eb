"""Sweep audit: pacing keeps a sweep's jobs within what the sample window really holds.

docs/sweeps.md: jobs of batch sizes 64 and 128 decode each sample once because pacing holds a
job more than 3/4 of the window ahead of another. The window's bytes (server/sizing.py) are its
batches less what the producers may pin past them; the pace span must not count those, or jobs
drift past the samples the window still has (a server of --max-buffers 40, batches of 16 and
32 at 32 px, reused 31 of 384 samples on loopback).
"""

from __future__ import annotations

import pytest
from batchwire.server.config import ServerConfig
from batchwire.server.sharing import sample_window_samples, window_statement
from batchwire.server.sizing import plan_buffers
from coresim import Server

SETTINGS = dict(batch_size=16, max_batch_size=32, image_size=32, max_buffers=40, producers=3)


def _window_holds(config: ServerConfig) -> int:
    """The samples the sample window's bytes hold, as the server allocates them."""
    capacity = config.capacity_spec()
    plan = plan_buffers(config, capacity)
    return plan.sample_window_nbytes // (capacity.nbytes // capacity.batch_size)


@pytest.mark.parametrize("max_buffers", [16, 40, 70, 200])
def test_sample_window_samples_is_what_the_server_allocates(max_buffers: int) -> None:
    config = ServerConfig(**{**SETTINGS, "max_buffers": max_buffers})
    assert sample_window_samples(config, config.buffer_cap) == _window_holds(config)


@pytest.mark.parametrize("max_buffers", [16, 40])
def test_the_pace_span_is_no_more_than_the_sample_window_holds(max_buffers: int) -> None:
    config = ServerConfig(**{**SETTINGS, "max_buffers": max_buffers})
    buffers = plan_buffers(config, config.capacity_spec()).buffers
    s = Server(
        max_buffers=buffers, config={**SETTINGS, "max_buffers": max_buffers, "share_window": None}
    )
    assert s.core.scheduling.share_samples
    assert s.core.scheduling.pacing.span <= _window_holds(config)


def test_the_start_line_names_the_max_buffers_the_operator_set() -> None:
    """--max-buffers 16 on a server with a sample window (2 batches' bytes): the window is a
    quarter of the 14 batch buffers left, and the line says where 14 comes from."""
    assert window_statement(None, 14, 2) == (
        "share window: 3 batches, capped from 16 at a quarter of the 14 batch buffers "
        "(--max-buffers 16 less 2 for the sample window) (raise --max-buffers for more)"
    )
    assert window_statement(None, 7, 1) == (
        "share window: 1 batch, capped from 16 at a quarter of the 7 batch buffers "
        "(--max-buffers 8 less 1 for the sample window) (raise --max-buffers for more)"
    )
    assert window_statement(1, 70) == "share window: 1 batch (--share-window)"
