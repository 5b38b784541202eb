"""The core's drain (`ServerCore.begin_drain`), with a fake clock: what SIGTERM with
--drain-timeout decides. New hellos are refused as ``transient`` (the client's fleet asks
its other servers and keeps this one as a maybe-later, never a refusal for good); nothing new
is produced; what is in production is sent in order, then `Shutdown`; a peer that does not
read is told at once; `drained` waits for ZeroMQ to let go of what readers were sent.
"""

from __future__ import annotations

from batchwire.server.core import NOT_READING_S, Submit
from batchwire.wire import Credit, Shutdown, Welcome
from coresim import Server, error_of


def test_drain_sends_what_is_in_production_then_shutdown_and_produces_nothing_new() -> None:
    s = Server()
    assert isinstance(s.hello(b"a", batches=tuple(range(10))), Welcome)
    s.tick()
    in_production = [j.order.batch_index for j in s.jobs]
    assert in_production == [0, 1, 2, 3]  # --prefetch-depth 4 ahead
    assert s.run(s.core.begin_drain(s.clock())) == []  # nothing sent yet: wait for them
    assert not s.core.drained(s.clock())
    s.finish()
    actions = s.tick()
    assert not any(isinstance(a, Submit) for a in actions)  # batches 4.. are not started
    assert s.sent_to(b"a") == [0, 1, 2, 3]
    assert isinstance(s.replies[b"a"][-1], Shutdown)  # after the batches: same pipe, in order
    assert b"a" not in s.core.sessions
    assert not s.core.drained(s.clock())  # ZeroMQ still holds them for a reader
    s.deliver(b"a")
    assert s.core.drained(s.clock())
    assert s.budget.held == 0


def test_draining_refuses_hellos_as_transient() -> None:
    s = Server()
    s.hello(b"a", batches=(0,))
    s.run(s.core.begin_drain(s.clock()))
    err = error_of(s.hello(b"b", session=7))
    assert (err.reason, err.session) == ("transient", 7) and "draining" in err.message
    # A client that sent a new hello dropped its old session (it asks elsewhere): not waited for.
    err = error_of(s.hello(b"a", epoch=1, session=8))
    assert err.reason == "transient" and b"a" not in s.core.sessions
    s.finish()  # its job comes back to a session that is gone: the buffer is released
    s.tick()
    assert s.core.drained(s.clock()) and s.budget.held == 0


def test_credits_while_draining_start_nothing() -> None:
    s = Server()
    s.hello(b"a", batches=(0,))
    s.tick()
    s.run(s.core.begin_drain(s.clock()))
    s.send(b"a", Credit(batches=(1, 2, 3)))
    s.finish()
    s.tick()
    assert len(s.jobs) == 0 and s.sent_to(b"a") == [0]
    assert isinstance(s.replies[b"a"][-1], Shutdown)


def test_a_peer_that_does_not_read_is_told_at_once_and_not_waited_for() -> None:
    s = Server()
    s.hello(b"a", batches=tuple(range(12)))
    for _ in range(3):  # 4 sent and held by ZeroMQ, 4 more ready: it takes none
        s.turn()
    assert s.core.sessions[b"a"].ready > 0
    s.run(s.core.begin_drain(s.clock()))
    assert b"a" in s.core.sessions  # reading, as far as anyone knows yet
    s.tick(NOT_READING_S + 0.1)
    assert isinstance(s.replies[b"a"][-1], Shutdown) and b"a" not in s.core.sessions
    assert s.core.drained(s.clock())  # what ZeroMQ holds for it comes back when it closes


def test_drain_with_no_clients_is_done_at_once() -> None:
    s = Server()
    assert not s.core.drained(s.clock())  # not draining
    s.run(s.core.begin_drain(s.clock()))
    assert s.core.drained(s.clock())


def test_the_drain_is_over_when_drained_or_after_drain_timeout() -> None:
    """The core decides when a drain ends (the shell then stops): once drained, or once
    --drain-timeout has passed since `begin_drain` with a client still owed batches."""
    s = Server(config=dict(drain_timeout=2.0))
    s.hello(b"a", batches=tuple(range(10)))
    s.tick()
    assert s.core.drain_over(s.clock()) is None  # not draining
    s.run(s.core.begin_drain(s.clock()))
    s.tick(1.9)
    assert s.core.drain_over(s.clock()) is None  # its batches are still in production
    s.tick(0.1)
    assert s.core.drain_over(s.clock()) == "timed out"
    s.finish()
    s.tick()
    s.deliver(b"a")
    assert s.core.drain_over(s.clock()) == "drained"
