"""The per-server state machine (client/session.py): `TRANSITIONS` is the only way a state moves.

Table-driven: every legal (state, event) pair leads where the table says, every other pair raises
`IllegalTransition` naming server, state and event and leaves the state as it was. The core's
own use of it is driven through `fleetsim.Shell` (a connection dropped while idle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from batchwire.client import ProtocolError
from batchwire.client.session import TRANSITIONS, Event, IllegalTransition, Peer, PeerState
from fleetsim import Shell

S, E = PeerState, Event
CLIENT = Path(__file__).resolve().parents[2] / "client"

#: The diagram of session.py's docstring, written out: every legal move and nothing else.
LEGAL = {
    (S.DISCONNECTED, E.CONNECTED): S.IDLE,
    (S.DISCONNECTED, E.DISCONNECTED): S.DISCONNECTED,
    (S.DISCONNECTED, E.LEFT): S.REMOVED,
    (S.IDLE, E.HELLO): S.HELLO_SENT,
    (S.IDLE, E.HELLO_AHEAD): S.SPECULATING,
    (S.IDLE, E.DISCONNECTED): S.DISCONNECTED,
    (S.IDLE, E.SHUTDOWN): S.DRAINING,
    (S.IDLE, E.LEFT): S.REMOVED,
    (S.HELLO_SENT, E.WELCOMED): S.STREAMING,
    (S.HELLO_SENT, E.REFUSED): S.REFUSED,
    (S.HELLO_SENT, E.ENDED): S.IDLE,
    (S.HELLO_SENT, E.DISCONNECTED): S.DISCONNECTED,
    (S.HELLO_SENT, E.ERROR): S.BACKING_OFF,
    (S.HELLO_SENT, E.SHUTDOWN): S.DRAINING,
    (S.STREAMING, E.HELLO_AHEAD): S.SPECULATING,
    (S.STREAMING, E.ENDED): S.IDLE,
    (S.STREAMING, E.DISCONNECTED): S.DISCONNECTED,
    (S.STREAMING, E.ERROR): S.BACKING_OFF,
    (S.STREAMING, E.SHUTDOWN): S.DRAINING,
    (S.SPECULATING, E.ADOPTED): S.STREAMING,
    (S.SPECULATING, E.ADOPTED_UNWELCOMED): S.HELLO_SENT,
    (S.SPECULATING, E.ENDED): S.IDLE,
    (S.SPECULATING, E.DISCONNECTED): S.DISCONNECTED,
    (S.SPECULATING, E.ERROR): S.BACKING_OFF,
    (S.SPECULATING, E.SHUTDOWN): S.DRAINING,
    (S.BACKING_OFF, E.RETRY_DUE): S.IDLE,
    (S.BACKING_OFF, E.RETRY_DUE_DISCONNECTED): S.DISCONNECTED,
    (S.BACKING_OFF, E.CONNECTED): S.BACKING_OFF,
    (S.BACKING_OFF, E.DISCONNECTED): S.BACKING_OFF,
    (S.BACKING_OFF, E.SHUTDOWN): S.DRAINING,
    (S.BACKING_OFF, E.LEFT): S.REMOVED,
    (S.REFUSED, E.RETRY_DUE): S.IDLE,
    (S.REFUSED, E.RETRY_DUE_DISCONNECTED): S.DISCONNECTED,
    (S.REFUSED, E.CONNECTED): S.REFUSED,
    (S.REFUSED, E.DISCONNECTED): S.REFUSED,
    (S.REFUSED, E.SHUTDOWN): S.DRAINING,
    (S.REFUSED, E.LEFT): S.REMOVED,
    (S.DRAINING, E.DISCONNECTED): S.DISCONNECTED,
    (S.DRAINING, E.SHUTDOWN): S.DRAINING,
    (S.DRAINING, E.LEFT): S.REMOVED,
    (S.REMOVED, E.DISCONNECTED): S.REMOVED,
}
ILLEGAL = [(s, e) for s in S for e in E if (s, e) not in LEGAL]


def peer(state: PeerState) -> Peer:
    p = Peer(0, "tcp://server-0:5555", heartbeat=1.0, last_heard=0.0, prev_heard=0.0)
    p.state = state  # a test sets the starting point directly; the core moves by events only
    return p


def test_the_table_is_the_diagram() -> None:
    assert TRANSITIONS == LEGAL


@pytest.mark.parametrize(("state", "event"), sorted(LEGAL, key=str))
def test_each_legal_transition(state: PeerState, event: Event) -> None:
    p = peer(state)
    assert p.move(event) is LEGAL[state, event]
    assert p.state is LEGAL[state, event]


@pytest.mark.parametrize(("state", "event"), sorted(ILLEGAL, key=str))
def test_each_illegal_event_raises_naming_state_and_event(state: PeerState, event: Event) -> None:
    p = peer(state)
    with pytest.raises(IllegalTransition) as raised:
        p.move(event)
    assert isinstance(raised.value, ProtocolError)
    assert raised.value.transition == (state, event)
    assert f"event {event.value!r} is not allowed in state {state.value!r}" in str(raised.value)
    assert "tcp://server-0:5555" in str(raised.value)
    assert p.state is state  # unchanged


def test_no_client_module_assigns_a_state_but_the_table() -> None:
    """Every state change goes through `Peer.move`: no ``X.state = ...`` elsewhere in client/."""
    writes = []
    for path in sorted(CLIENT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
            for t in targets:
                for leaf in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(leaf, ast.Attribute) and leaf.attr == "state":
                        writes.append(f"{path.name}:{node.lineno}")
    assert writes == ["session.py:" + str(_move_line())]


def _move_line() -> int:
    """The line of `Peer.move`'s one assignment."""
    src = (CLIENT / "session.py").read_text().splitlines()
    return next(i for i, line in enumerate(src, 1) if "self.state = TRANSITIONS[" in line)


def test_a_connection_dropped_while_idle_is_disconnected_and_gets_no_hello() -> None:
    """IDLE means connected: a server that drops before the loader starts is DISCONNECTED, and
    the start sends it no hello (it waits for the connection to come back)."""
    shell = Shell(1)
    shell.connect()
    assert shell.state(0) is S.IDLE
    shell.carry_out(shell.fleet.on_disconnected(0))
    assert shell.state(0) is S.DISCONNECTED
    shell.start()
    assert shell.hellos(0) == []
    shell.connect()
    shell.tick()
    assert len(shell.hellos(0)) == 1 and shell.state(0) is S.HELLO_SENT


CORES = ("fleet", "_progress")  # the shells' names for their cores


def test_the_shells_write_no_attribute_of_the_core() -> None:
    """receiver.py and remote_loader.py tell the core (``fleet``, ``_progress``) by its events
    and requests: no assignment reaches into it."""
    writes = []
    for name in ("receiver.py", "remote_loader.py"):
        path = CLIENT / name
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
            for t in targets:
                for leaf in t.elts if isinstance(t, ast.Tuple) else [t]:
                    inner = leaf.value if isinstance(leaf, ast.Attribute | ast.Subscript) else None
                    while isinstance(inner, ast.Attribute | ast.Subscript):
                        if isinstance(inner, ast.Attribute) and inner.attr in CORES:
                            writes.append(f"{name}:{node.lineno}")
                        inner = inner.value
    assert writes == []
