"""Sweep audit: pacing (server/pacing.py) against what docs/sweeps.md promises a sweep's jobs.

"A job waits at most a quarter of its time (after a first 2 s)": a job's allowance must outlive
its own new hellos (each epoch, a resume), which the core turns into new sessions (new serials)
of the same peer. "Jobs of another image size share nothing": a job must not be held for one it
can share no batch and no sample with.
"""

from __future__ import annotations

import dataclasses

from batchwire.server.pacing import PACE_BURST_S, PACE_SHARE, Pacing, sample_position
from batchwire.server.sessions import ClientSession
from batchwire.wire import BatchSpec
from coresim import BATCH, SAMPLES, Server, session

SPAN = 8 * BATCH  # a share window of 8 batches, in samples
EPOCH_BATCHES = SAMPLES // BATCH


def pacing() -> Pacing:
    return Pacing(SPAN, lambda s: sample_position(s, BATCH, SAMPLES))


def at(identity: bytes, k: int, serial: int, now: float = 0.0, **hello: object) -> ClientSession:
    """The session the core makes of a hello: its next batch is ``k``; ``serial`` as the core
    numbers hellos (each new hello of a peer is a new session)."""
    s = session(identity, asked=(k, k + 1), now=now, **hello)
    s.serial = serial
    return s


def test_a_job_held_across_its_epochs_waits_at_most_a_quarter_of_its_time() -> None:
    """A fast job and a slower one, epochs of a few seconds: at each epoch's start the fast job
    (a new hello, so a new session) is just past the slow one's end of the epoch before, in
    reach. Over 10 epochs of 2 s it may be held 2 s + a quarter of 20 s, not every second."""
    p = pacing()
    now, step, held, serial = 0.0, 0.01, 0.0, 0
    for epoch in range(10):
        serial += 2
        lead = at(b"lead", 4, serial, epoch=epoch + 1)  # 9 batches ahead: > 0.75, < 2 windows
        lag = at(b"lag", EPOCH_BATCHES - 5, serial + 1, epoch=epoch)
        end = now + 2.0
        while now < end - step / 2:
            lag.progress_at = now  # the slow job keeps asking
            if p.holds(lead, p.laggards([lead, lag], now), now):
                held += step
            now += step
    assert held <= PACE_BURST_S + PACE_SHARE * now + 0.1, f"held {held:.1f} s of {now:.0f} s"


def _sized(s: ClientSession, height: int, width: int) -> ClientSession:
    s.spec = BatchSpec(BATCH, height, width, "uint8")
    return s


def test_a_job_of_another_image_size_holds_nobody() -> None:
    """Jobs at 32 px and 64 px on one split share no batch and no sample (the bytes differ):
    the one ahead reads at its own pace; jobs of one size are still paced."""
    p = pacing()
    lead = _sized(at(b"lead", 7, 1), 32, 32)  # 7 batches ahead > 0.75 x 8
    other_size = _sized(at(b"big", 0, 2), 64, 64)
    assert not p.holds(lead, p.laggards([lead, other_size], 0.0), 0.0)
    same_size = _sized(at(b"lag", 0, 3), 32, 32)
    assert p.holds(lead, p.laggards([lead, other_size, same_size], 0.0), 0.0)


def test_batch_sizes_of_one_image_size_still_pace_each_other() -> None:
    """Batch sizes share samples through the sample window: they stay paced."""
    p = pacing()
    lead = _sized(at(b"lead", 7, 1), 32, 32)
    lag = at(b"lag", 0, 2)
    lag.spec = dataclasses.replace(lead.spec, batch_size=2 * BATCH)  # type: ignore[arg-type]
    lag.batches[:] = [0, 1]  # at sample 0 either way
    assert p.holds(lead, p.laggards([lead, lag], 0.0), 0.0)


def test_without_a_sample_window_batch_sizes_do_not_pace_each_other() -> None:
    """Where batch sizes share nothing (no sample window), they are other groups."""
    p = Pacing(SPAN, lambda s: sample_position(s, BATCH, SAMPLES), batch_sizes_share=False)
    lead = _sized(at(b"lead", 7, 1), 32, 32)
    lag = at(b"lag", 0, 2)
    lag.spec = dataclasses.replace(lead.spec, batch_size=2 * BATCH)  # type: ignore[arg-type]
    assert not p.holds(lead, p.laggards([lead, lag], 0.0), 0.0)
    same = _sized(at(b"same", 0, 3), 32, 32)
    assert p.holds(lead, p.laggards([lead, lag, same], 0.0), 0.0)


def test_a_server_without_a_sample_window_does_not_hold_a_job_for_another_batch_size() -> None:
    """A server with a user transform and --max-batch-size above --batch-size: jobs of batch
    sizes 4 and 8 share no batch and no sample, so the one ahead is not held for the other."""
    from batchwire.server.core import Submit

    s = Server(config=dict(share_window=16, max_batch_size=8, transform="aug.py:crop"))
    assert not s.core.scheduling.share_samples
    s.hello(b"eight", batches=(0, 1), batch_size=8, session=2)  # at sample 0
    s.hello(b"four", batches=(20, 21), session=1)  # at sample 80: 1.25 windows of 64 ahead
    submitted = [s.core._by_serial[a.order.session_serial].identity for a in s.tick()
                 if isinstance(a, Submit)]  # fmt: skip
    assert b"four" in submitted


def test_groups_reading_at_once_each_keep_within_their_share_of_the_window() -> None:
    """The window holds the batches of every split and image size read at the time: with a
    second pair of jobs at another size, each pair has half of it. A lead 5 batches ahead is
    within 3/4 of the whole window (6) but past 3/4 of its half (3): it waits."""
    p = pacing()
    lead, lag = _sized(at(b"lead", 5, 1), 32, 32), _sized(at(b"lag", 0, 2), 32, 32)
    assert not p.holds(lead, p.laggards([lead, lag], 0.0), 0.0)
    big_lead, big_lag = _sized(at(b"bl", 1, 3), 48, 48), _sized(at(b"bg", 0, 4), 48, 48)
    everyone = [lead, lag, big_lead, big_lag]
    assert p.holds(lead, p.laggards(everyone, 0.0), 0.0)
    assert not p.holds(big_lead, p.laggards(everyone, 0.0), 0.0)  # 1 batch: within its half
