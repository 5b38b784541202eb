"""Pacing (server/pacing.py): a session far ahead of another on its split waits for it, within
reach, while the other keeps asking, and never longer than its hold allowance."""

from __future__ import annotations

from batchwire.server.pacing import (
    PACE_BURST_S,
    PACE_IDLE_S,
    PACE_SHARE,
    Pacing,
    sample_position,
)
from batchwire.server.sessions import ClientSession
from coresim import BATCH, SAMPLES, session

SPAN = 8 * BATCH  # a share window of 8 batches, in samples


def pacing() -> Pacing:
    return Pacing(SPAN, lambda s: sample_position(s, BATCH, SAMPLES))


def at(identity: bytes, k: int, now: float = 0.0, **hello: object) -> ClientSession:
    """A session whose next batch to start is its batch ``k`` (serials told apart by name)."""
    s = session(identity, asked=(k, k + 1), now=now, **hello)
    s.serial = int.from_bytes(identity, "big")
    return s


def test_positions_count_samples_across_ranks_world_sizes_and_epochs() -> None:
    assert sample_position(at(b"a", 3), BATCH, SAMPLES) == 3 * BATCH
    two_ranks = at(b"b", 3, rank=1, world_size=2)
    assert sample_position(two_ranks, BATCH, SAMPLES) == (3 * 2 + 1) * BATCH
    assert sample_position(at(b"c", 0, epoch=2), BATCH, SAMPLES) == 2 * SAMPLES
    waiting = at(b"d", 5)
    waiting.take_next()
    waiting.take_next()  # both asked batches started: it will ask for batch 7 next
    assert sample_position(waiting, BATCH, SAMPLES) == 7 * BATCH
    assert sample_position(at(b"e", 0, start_sample=100), BATCH, SAMPLES) is None  # resumed


def test_a_leader_past_the_window_waits_for_a_job_in_reach() -> None:
    p, lead, lag = pacing(), at(b"lead", 7), at(b"lag", 0)  # 7 batches ahead > 0.75 x 8
    laggards = p.laggards([lead, lag], 0.0)
    assert p.holds(lead, laggards, 0.0) and not p.holds(lag, laggards, 0.0)
    close = at(b"close", 6)  # 6 batches ahead: within 0.75 of the window
    assert not p.holds(close, p.laggards([close, lag], 0.0), 0.0)


def test_a_job_beyond_reach_or_silent_holds_nobody() -> None:
    p, lead = pacing(), at(b"lead", 40)
    far = at(b"far", 0)  # 40 batches = 5 windows behind: a late start, it produces its own
    assert not p.holds(lead, p.laggards([lead, far], 0.0), 0.0)
    near = at(b"near", 30, now=0.0)  # 10 batches behind, in reach, but silent since t=0
    assert p.holds(lead, p.laggards([lead, near], 0.0), 0.0)
    later = PACE_IDLE_S + 0.1
    assert p.laggards([lead, near], later) == {}  # neither asked for anything lately
    assert not p.holds(lead, p.laggards([lead, near], later), later)


def test_other_splits_do_not_hold() -> None:
    p, lead, val = pacing(), at(b"lead", 7), at(b"val", 0, split="val")
    assert not p.holds(lead, p.laggards([lead, val], 0.0), 0.0)


def test_holds_last_no_longer_than_the_allowance() -> None:
    p, lead, lag = pacing(), at(b"lead", 7), at(b"lag", 0)
    now, held = 0.0, 0.0
    step = 0.01
    while now < 20.0:
        lag.progress_at = now  # the laggard keeps asking, never catching up
        if p.holds(lead, p.laggards([lead, lag], now), now):
            held += step
        now += step
    # A burst first, then PACE_SHARE of the time.
    assert held <= PACE_BURST_S + PACE_SHARE * 20.0 + 0.1
    assert held >= 0.8 * (PACE_BURST_S + PACE_SHARE * (20.0 - PACE_BURST_S))


def test_a_started_batch_ends_the_hold_and_the_allowance_refills() -> None:
    p, lead, lag = pacing(), at(b"lead", 7), at(b"lag", 0)
    assert p.holds(lead, p.laggards([lead, lag], 0.0), 0.0)
    p.started(lead, 1.5)  # held 1.5 s (spent 1.5 s, earned 0.375 s), then it started
    lag.progress_at = 1.6
    assert p.holds(lead, p.laggards([lead, lag], 1.6), 1.6)
    lag.progress_at = 3.0  # held since 1.6: spent 1.4 s, earned 0.375 s: nothing left
    assert not p.holds(lead, p.laggards([lead, lag], 3.0), 3.0)
    lag.progress_at = 3.0 + 4 / PACE_SHARE
    later = lag.progress_at
    assert p.holds(lead, p.laggards([lead, lag], later), later)  # earned back at PACE_SHARE


def test_allowances_of_sessions_gone_are_dropped() -> None:
    p, lead, lag = pacing(), at(b"lead", 7), at(b"lag", 0)
    p.holds(lead, p.laggards([lead, lag], 0.0), 0.0)
    p.laggards([lag], 1.0)
    assert not p._allowances


def test_ranks_of_one_job_never_hold_each_other() -> None:
    """Ranks of a job are apart by design ((kW + r) B) and never share a batch."""
    p = pacing()
    ranks = [at(bytes([65 + r]), 0, rank=r, world_size=16, job="run-1") for r in range(16)]
    laggards = p.laggards(ranks, 0.0)
    assert not any(p.holds(s, laggards, 0.0) for s in ranks)
    unnamed = [at(bytes([97 + r]), 0, rank=r, world_size=16) for r in range(16)]
    laggards = p.laggards(unnamed, 0.0)
    assert not any(p.holds(s, laggards, 0.0) for s in unnamed)
    other = at(b"other", 0, rank=0, world_size=16, job="run-2")  # another job, behind rank 15
    assert p.holds(ranks[15], p.laggards([*ranks, other], 0.0), 0.0)


def test_a_session_is_never_held_by_its_own_earlier_place() -> None:
    p, lead = pacing(), session(b"lead", asked=tuple(range(12)))
    lead.serial = 1
    laggards = p.laggards([lead], 0.0)  # taken at the start of a turn
    for _ in range(10):  # it starts 10 batches in that turn: 10 batches past its own entry
        assert not p.holds(lead, laggards, 0.0)
        lead.take_next()
