"""server/housekeeping.py: which sessions go (stalled, silent, idle), what buffers stay, and
whom a drain may tell now (pure functions of a session and the time)."""

from __future__ import annotations

import numpy as np
import pytest
from batchwire.server.housekeeping import (
    BUFFERS_IDLE_S,
    STALL_S,
    buffers_to_keep,
    idle_without_progress,
    may_tell_shutdown,
    why_drop,
)
from batchwire.server.sessions import Produced, ReadyBatch
from coresim import FakeSlot, session

TIMEOUT = 30.0


def test_a_live_session_stays() -> None:
    s = session(asked=(0,), now=0.0)
    assert why_drop(s, waiting=0.0, held=0, now=10.0, timeout=TIMEOUT) is None


@pytest.mark.parametrize(
    ("waiting", "held", "last_seen", "asked", "why"),
    [
        (STALL_S + 0.1, 2, 100.0, (0,), "took none of its 2 sent batch(es)"),
        (0.0, 0, 100.0 - TIMEOUT - 1, (0,), "silent for 30 s"),
        (0.0, 0, 100.0, (), "asked for no batch for 30 s"),
    ],
)
def test_stalled_silent_and_idle_sessions_go(waiting, held, last_seen, asked, why) -> None:
    s = session(asked=asked, now=0.0)
    s.last_seen = last_seen
    text = why_drop(s, waiting=waiting, held=held, now=100.0, timeout=TIMEOUT)
    assert text is not None and why in text


def test_idle_counts_from_the_last_progress_and_not_while_anything_is_held() -> None:
    s = session(now=5.0)
    assert idle_without_progress(s, held=0, now=8.0) == 3.0  # since it opened
    assert idle_without_progress(s, held=1, now=8.0) == 0.0
    s.progress_at = 7.0
    assert idle_without_progress(s, held=0, now=8.0) == 1.0


def test_buffers_kept_for_the_clients_none_once_idle_or_alone() -> None:
    assert buffers_to_keep(2, 1.0, 3, 4, 100, 8) == 2 * 3 + 2 * 4 * 2 + 8
    assert buffers_to_keep(20, 1.0, 3, 4, 100, 8) == 100  # at most --max-buffers
    assert buffers_to_keep(0, 1.0, 3, 4, 100, 8) == 0
    assert buffers_to_keep(2, BUFFERS_IDLE_S + 1, 3, 4, 100, 8) == 0


def test_a_drain_tells_a_session_once_its_promised_batches_are_sent() -> None:
    s = session(asked=(0, 1))
    assert may_tell_shutdown(s, not_reading=False)  # nothing in production or ready
    pos, k = s.take_next()
    assert not may_tell_shutdown(s, not_reading=True)  # in production: it comes first
    s.completed(pos, ReadyBatch(k, Produced(FakeSlot(1), np.zeros(4, np.int64), [], 0, 0.0, 0.0)))
    assert not may_tell_shutdown(s, not_reading=False)  # ready, unsent
    assert may_tell_shutdown(s, not_reading=True)  # a peer that does not read is told at once
