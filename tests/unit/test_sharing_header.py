"""What a client is told of shared production: `BatchHeader.shared` and `Welcome.share_window`.

A batch's header says ``shared`` when another connected peer waited for the same production
or took it before this send; the trainer counts those (pipeline-train's epoch line), so the
flag must never say "shared" to a job that is alone: not when its own new hello finds its
earlier batches in the window, nor when a socket of its own that left did (pipeline-train's
probe loader, a restarted process).
"""

from __future__ import annotations

from batchwire.wire import Bye, Welcome
from coresim import Server


def _server(window: int | None = None) -> Server:
    return Server(config={"share_window": window})


def _shared(s: Server, identity: bytes) -> list[bool]:
    return [snd.header.shared for snd in s.sends if snd.identity == identity]


def test_the_welcome_says_the_window_and_zero_when_sharing_is_off() -> None:
    welcome = _server(window=8).hello(b"a")
    assert isinstance(welcome, Welcome) and welcome.share_window == 8
    welcome = _server(window=0).hello(b"a")
    assert isinstance(welcome, Welcome) and welcome.share_window == 0


def test_jobs_waiting_for_one_production_are_both_told_shared() -> None:
    s = _server()
    s.hello(b"a", batches=(0, 1), session=1)
    s.hello(b"b", batches=(0,), session=2)
    s.turn(readers=(b"a", b"b"))
    assert _shared(s, b"a") == [True, False]  # batch 1: nobody else asked for it
    assert _shared(s, b"b") == [True]


def test_a_job_served_from_the_window_is_told_shared_the_one_sent_before_is_not() -> None:
    s = _server()
    s.hello(b"a", batches=(0, 1))
    s.turn(readers=(b"a",))
    s.hello(b"b", batches=(0, 1))
    s.turn(readers=(b"b",))
    assert s.sent_to(b"b") == [0, 1] and len(s.jobs) == 0  # nothing produced again
    assert _shared(s, b"a") == [False, False]  # sent before b asked: a lower bound
    assert _shared(s, b"b") == [True, True]


def test_a_lone_job_asking_its_batches_again_shares_nothing() -> None:
    """A new hello of the same peer (a reconnect, a re-iterated epoch) served from the window
    shares the batch with nobody but itself."""
    s = _server()
    s.hello(b"a", batches=(0, 1), session=1)
    s.turn(readers=(b"a",))
    s.hello(b"a", batches=(0, 1), session=2)
    s.turn(readers=(b"a",))
    assert s.sent_to(b"a") == [0, 1, 0, 1]
    assert s.telemetry.counters()["batches_produced_total"] == 2  # from the window
    assert _shared(s, b"a") == [False, False, False, False]


def test_batches_of_a_peer_that_left_are_shared_with_nobody() -> None:
    """pipeline-train's probe loader asks for the epoch's first batches and closes; the
    trainer's loader (another socket) finds them in the window: the trainer is still alone."""
    s = _server()
    s.hello(b"probe", batches=(0, 1))
    s.turn(readers=(b"probe",))
    s.send(b"probe", Bye())
    s.hello(b"trainer", batches=(0, 1))
    s.turn(readers=(b"trainer",))
    assert s.sent_to(b"trainer") == [0, 1] and len(s.jobs) == 0  # served from the window
    assert _shared(s, b"trainer") == [False, False]
