"""A session's state machine (server/sessions.py `TRANSITIONS`), table-driven: every (state,
event) pair either moves where the table says or raises `IllegalSessionEvent`, and the
session's methods fire the events they name."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from batchwire.server.sessions import (
    TRANSITIONS,
    IllegalSessionEvent,
    Produced,
    ReadyBatch,
    SessionEvent,
    SessionState,
    next_state,
)
from coresim import FakeSlot, session

E, S = SessionEvent, SessionState
EXPECTED = {
    (S.OPEN, E.ASK): S.OPEN,
    (S.OPEN, E.TAKE): S.OPEN,
    (S.OPEN, E.COMPLETE): S.OPEN,
    (S.OPEN, E.ABANDON): S.OPEN,
    (S.OPEN, E.SEND): S.OPEN,
    (S.OPEN, E.CLOSE): S.CLOSED,
}


@pytest.mark.parametrize(("state", "event"), list(itertools.product(S, E)))
def test_every_pair_moves_as_the_table_says_or_raises(state, event) -> None:
    want = EXPECTED.get((state, event))
    if want is None:
        with pytest.raises(IllegalSessionEvent, match=f"{event.name} in state {state.name}"):
            next_state(state, event)
    else:
        assert next_state(state, event) is want


def test_the_table_is_the_one_above() -> None:
    table = {(s, e): to for s, moves in TRANSITIONS.items() for e, to in moves.items()}
    assert table == EXPECTED


def _ready(k: int) -> ReadyBatch:
    return ReadyBatch(k, Produced(FakeSlot(k), np.zeros(4, np.int64), [], 0, 0.0, 0.0))


def test_a_session_lives_open_and_takes_nothing_once_closed() -> None:
    s = session(asked=(0, 1))
    pos, k = s.take_next()
    s.completed(pos, _ready(k))
    assert [b.batch_index for b in s.pop_sendable(4)] == [0]
    assert s.state is S.OPEN and not s.closed
    s.drain()
    assert s.state is S.CLOSED and s.closed and not s.has_room()
    for illegal in (lambda: s.ask((1,), 0.0), s.take_next, s.drain, s.abandoned):
        with pytest.raises(IllegalSessionEvent):
            illegal()
    with pytest.raises(IllegalSessionEvent):
        s.completed(1, _ready(1))
