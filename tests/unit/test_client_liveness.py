"""Liveness (client/liveness.py), driven alone: silence, heartbeats, pace, the wait's words.

test_client_fleet.py drives the same through the fleet (a silent server's batches go to the
others; ServerUnavailable past the timeout).
"""

from __future__ import annotations

from collections import deque

import pytest
from batchwire.client import ServerUnavailable
from batchwire.client.liveness import (
    PACE_SMOOTHING,
    Waiting,
    delivered,
    silent,
    unavailable,
    waiting_note,
)
from batchwire.client.session import Peer, PeerState, Session

S = PeerState


def owing(i: int = 0, *, heartbeat: float = 1.0) -> Peer:
    """A server streaming and owing batch 0, last heard and sent to at t = 0."""
    p = Peer(i, f"tcp://server-{i}:5555", heartbeat=heartbeat, last_heard=0.0, prev_heard=0.0)
    p.state, p.connected, p.ever_connected = S.STREAMING, True, True
    p.session = Session(100 + i, 0, deque([0]), welcomed=True)
    return p


def test_a_server_owing_something_and_silent_past_its_heartbeat_is_named_and_waits_longer() -> None:
    p, idle = owing(0), owing(1)
    idle.session.pending.clear()  # owes nothing: never silent
    assert silent([p, idle], since=0.0, now=1.0, timeout=10.0) == []
    assert silent([p, idle], since=0.0, now=1.5, timeout=10.0) == [p]
    assert p.heartbeat == 2.0  # doubled
    for _ in range(5):
        silent([p], since=0.0, now=100.0, timeout=10.0)
    assert p.heartbeat == 5.0  # up to max(timeout / 2, 1 s)


def test_silence_counts_from_when_the_consumer_started_waiting() -> None:
    p = owing()
    assert silent([p], since=5.0, now=5.9, timeout=10.0) == []
    assert silent([p], since=5.0, now=6.1, timeout=10.0) == [p]


def test_a_batch_lowers_the_heartbeat_to_a_few_gaps_and_smooths_the_pace() -> None:
    p = owing(heartbeat=8.0)
    p.error_streak = p.transient_streak = 2
    p.last_sent, p.busy_since = 1.0, 1.0
    p.prev_heard, p.last_heard = 0.0, 1.5  # a batch 0.5 s after the credit
    delivered(p, heartbeat=1.0)
    assert (p.error_streak, p.transient_streak) == (0, 0)
    assert p.heartbeat == 2.0  # 4 x the gap, not below the loader's 1 s
    assert p.pace == 0.5
    p.prev_heard, p.last_heard = 1.5, 3.5
    delivered(p, heartbeat=1.0)
    assert p.heartbeat == 2.0  # never raised by a batch
    assert p.pace == pytest.approx(0.5 + PACE_SMOOTHING * (2.0 - 0.5))


def test_the_wait_names_the_server_at_fault_and_what_it_does() -> None:
    p, other = owing(0), owing(1)
    p.session.welcomed = False
    p.state = S.HELLO_SENT
    waiting = Waiting([other, p], cursor=3, epoch=1, split="train", timeout=60.0)
    note = waiting_note(waiting, now=12.0, since=2.0)
    assert note.startswith("waiting for pipeline-server at tcp://server-0:5555 (and 1 other")
    assert "for 10 s (giving up after 60 s): connected, waiting for its answer" in note
    p.connected = False
    p.connect_failures = 1
    assert "connection refused" in waiting_note(waiting, now=12.0, since=2.0)


def test_past_the_timeout_the_error_says_why_and_names_the_others() -> None:
    p, other = owing(0), owing(1)
    p.connected, p.last_heard = False, 50.0
    p.last_error = "disk full"
    other.refusal = "no split 'val'"
    err = unavailable(Waiting([p, other], 3, 1, "train", 60.0), now=62.5)
    assert isinstance(err, ServerUnavailable) and err.endpoint == "tcp://server-0:5555"
    text = str(err)
    assert "went away (last heard 12.5 s ago) and did not come back within 60 s" in text
    assert "nor did tcp://server-1:5555 deliver it" in text
    assert "tcp://server-1:5555 refused: no split 'val'" in text
    assert text.endswith("its last error: disk full")


def test_a_server_that_served_before_and_then_stopped_answering_is_not_called_a_mismatch() -> None:
    """A server paused mid-run (SIGSTOP, overload): the re-sent hello goes unanswered, but it
    welcomed this loader before, so the protocol is not in question."""
    p = owing(0)
    p.session.welcomed = False
    p.state = S.HELLO_SENT
    waiting = Waiting([p], 3, 1, "train", 60.0)
    assert "speaking protocol" in str(unavailable(waiting, now=62.0))  # never welcomed
    p.ever_welcomed = True
    text = str(unavailable(waiting, now=62.0))
    assert "served this loader before, but did not answer its hello within 60 s" in text
    assert "protocol" not in text
