"""SIGTERM on one server of a fleet while a RemoteLoader is mid-epoch: nothing lost, no error.

Two real pipeline-server processes serve one loader. The first is sent SIGTERM after a few
batches: it drains (refuses new hellos as ``transient``, sends the batches it has in
production, then `shutdown`, and exits 0 well within --drain-timeout); the loader hands what
it had asked of it to the second server. The trainer sees every sample of the epoch exactly
once, in the epoch's order, and no exception and no error log.
"""

from __future__ import annotations

import logging
import signal
import time

import pytest
from batchwire.client import RemoteLoader
from batchwire.pipeline.sampler import ShardSampler
from serverproc import running_servers, small_server_args

SEED = 3
BATCH = 16
SAMPLES = 400  # the embedded val folder, served as the train split


def epoch_plan(epoch: int) -> list[list[int]]:
    sampler = ShardSampler(SAMPLES, BATCH, seed=SEED, shuffle=True, drop_last=True)
    return [list(sampler.plan(epoch, k).indices) for k in range(sampler.num_batches)]


@pytest.mark.timeout(120)
def test_sigterm_mid_epoch_loses_nothing_and_the_trainer_sees_no_error(caplog) -> None:
    caplog.set_level(logging.WARNING)
    args = (*small_server_args(seed=SEED), "--drain-timeout", "10")
    with running_servers(2, *args) as (a, b):
        loader = RemoteLoader(
            [a.endpoint, b.endpoint], "train", rank=0, world_size=1, device="cpu",
            with_indices=True, prefetch=4, timeout=60.0,
        )  # fmt: skip
        with loader:
            it = iter(loader)
            got = [next(it)[2].tolist() for _ in range(6)]
            assert a.stats()["clients"], "the first server serves this loader"
            started = time.monotonic()
            a._proc.send_signal(signal.SIGTERM)
            got += [batch[2].tolist() for batch in it]
            assert a._proc.wait(15) == 0, a.log()
            drain_s = time.monotonic() - started
            log = a.log()  # (gone with the server's folder)
    assert got == epoch_plan(0), "batches lost, repeated or out of order"
    flat = [i for batch in got for i in batch]
    assert sorted(flat) == sorted(set(flat)) and len(flat) == SAMPLES
    assert "drained in" in log, log
    assert drain_s < 10.0, drain_s
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
