"""server/peers.py: what the server remembers of a peer across its hellos, so that a client
re-sending its hello without reading does not start afresh each time (issue 28).

A peer's debt is ``unacked + owed - advance``: sends and credits leave it as it is, a hello
that asks again for batches the peer was sent raises it. Over `SLACK` the peer is in debt
until its credits pay it back, or a hello after a served session wipes it (another pass, or
the same pass once credits asked for its window).
"""

from __future__ import annotations

from batchwire.server.peers import SLACK, PeerLedger, pass_of
from batchwire.wire import Hello

WINDOW = 4


def hello(batches: range | tuple[int, ...] = range(WINDOW), **fields: object) -> Hello:
    """A hello of split train, rank 0 of 1, epoch 0 (``fields``: others), asking ``batches``."""
    base = dict(split="train", rank=0, world_size=1, epoch=0, session=1)
    return Hello(batches=tuple(batches), **{**base, **fields})  # type: ignore[arg-type]


def served(ledger: PeerLedger, batches: int, credits: int = 0) -> None:
    """The peer is sent ``batches``, and its credits ask for ``credits`` more, each sent too."""
    for _ in range(batches):
        ledger.sent(b"a")
    for _ in range(credits):
        ledger.acknowledged(b"a", 1, owed=1)
        ledger.sent(b"a")


def asked_again(ledger: PeerLedger, now: float = 1.0, **fields: object) -> bool:
    """The session ends served and the peer sends a hello for the same window again."""
    ledger.closed(b"a", finished=True)
    return ledger.opened(b"a", hello(**fields), now)


def test_a_peer_never_opened_owes_nothing_and_leaves_no_record() -> None:
    ledger = PeerLedger()
    ledger.sent(b"x")
    ledger.acknowledged(b"x", 3, owed=0)
    ledger.closed(b"x", finished=True)
    ledger.seen(b"x", 5.0)
    assert ledger.debt(b"x", 10) == 0 and ledger.get(b"x") is None and len(ledger) == 0


def test_the_pass_of_a_hello_ignores_its_batches_session_and_metadata() -> None:
    assert pass_of(hello()) == pass_of(hello((9,), session=7, metadata=True))
    for other in ({"epoch": 1}, {"rank": 1, "world_size": 2}, {"batch_size": 8}, {"job": "j"}):
        assert pass_of(hello(**other)) != pass_of(hello())


def test_a_trainer_crediting_what_it_takes_never_owes() -> None:
    ledger = PeerLedger()
    assert not ledger.opened(b"a", hello(), 0.0)
    assert ledger.get(b"a").advance == WINDOW
    for _ in range(WINDOW):
        ledger.sent(b"a")
    for _ in range(20):
        ledger.acknowledged(b"a", 1, owed=1)
        assert ledger.debt(b"a", 1) == 0
        ledger.sent(b"a")
        assert ledger.debt(b"a", 0) == 0
    assert not asked_again(ledger, epoch=1)  # its next epoch
    assert ledger.debt(b"a", WINDOW) == 0


def test_a_re_sent_hello_may_ask_again_up_to_slack_batches_in_good_standing() -> None:
    ledger = PeerLedger()
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW)
    assert not asked_again(ledger, batches=range(WINDOW - SLACK, WINDOW))
    assert ledger.debt(b"a", SLACK) == SLACK
    assert ledger.get(b"a").in_debt_since is None


def test_asking_again_for_more_than_slack_puts_the_peer_in_debt_once() -> None:
    ledger = PeerLedger()
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW)
    assert asked_again(ledger, now=1.0)  # the whole window again: the core logs it
    assert ledger.debt(b"a", WINDOW) == WINDOW
    served(ledger, WINDOW)
    assert not asked_again(ledger, now=2.0)  # still in debt: said once
    assert ledger.debt(b"a", WINDOW) == 2 * WINDOW
    assert ledger.get(b"a").in_debt_since == 1.0


def test_the_slack_is_the_ledgers_to_set() -> None:
    ledger = PeerLedger(slack=0)
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW)
    assert asked_again(ledger, batches=(WINDOW - 1,))


def test_credits_covering_the_window_and_the_debt_pay_it_back() -> None:
    ledger = PeerLedger()
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW)
    asked_again(ledger)
    served(ledger, WINDOW)  # its debt: the window asked again
    served(ledger, 0, credits=2 * WINDOW - 1)
    assert ledger.get(b"a").in_debt_since is not None
    assert ledger.debt(b"a", 0) == WINDOW
    ledger.acknowledged(b"a", 1, owed=1)
    assert ledger.get(b"a").in_debt_since is None
    assert ledger.debt(b"a", 1) == 0


def test_a_hello_of_another_pass_after_a_served_session_wipes_the_debt() -> None:
    ledger = PeerLedger()
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW)
    asked_again(ledger)
    served(ledger, WINDOW)
    assert not asked_again(ledger, epoch=1)
    assert ledger.debt(b"a", WINDOW) == 0
    assert ledger.get(b"a").in_debt_since is None


def test_a_session_ended_before_it_was_served_carries_the_debt_into_another_pass() -> None:
    ledger = PeerLedger()
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW)
    asked_again(ledger)
    served(ledger, WINDOW - 1)  # one batch still owed when the session ends
    ledger.closed(b"a", finished=False)
    ledger.opened(b"a", hello(epoch=1), 2.0)
    assert ledger.debt(b"a", WINDOW) == 2 * WINDOW - 1
    assert ledger.get(b"a").in_debt_since == 1.0


def test_the_same_pass_starts_afresh_once_credits_asked_for_its_window() -> None:
    ledger = PeerLedger()  # a validation loader evaluating the same epoch again
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW, credits=WINDOW)
    assert not asked_again(ledger)
    assert ledger.debt(b"a", WINDOW) == 0


def test_the_same_pass_with_fewer_credits_than_its_window_carries_what_was_sent() -> None:
    ledger = PeerLedger()
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW, credits=WINDOW - 1)
    assert asked_again(ledger)
    assert ledger.debt(b"a", WINDOW) == WINDOW


def test_credits_ahead_of_the_sends_are_forgotten_when_the_session_ends() -> None:
    ledger = PeerLedger()
    ledger.opened(b"a", hello(), 0.0)
    ledger.acknowledged(b"a", 3, owed=WINDOW + 3)  # asked for, never sent
    assert ledger.get(b"a").unacked == -3
    ledger.closed(b"a", finished=False)
    assert ledger.get(b"a").unacked == 0


def test_forget_drops_the_record_and_a_new_connection_starts_afresh() -> None:
    ledger = PeerLedger()
    ledger.opened(b"a", hello(), 0.0)
    served(ledger, WINDOW)
    asked_again(ledger)
    ledger.forget(b"a")
    ledger.forget(b"a")  # twice: nothing left to forget
    assert len(ledger) == 0 and ledger.debt(b"a", WINDOW) == 0
    assert not ledger.opened(b"a", hello(), 2.0)


def test_expire_forgets_only_peers_without_a_session_unheard_of_past_the_timeout() -> None:
    ledger, peers = PeerLedger(), (b"live", b"quiet", b"heard", b"recent")
    for identity in peers:
        ledger.opened(identity, hello(), 0.0)
    ledger.seen(b"heard", 6.0)
    ledger.opened(b"recent", hello(), 5.0)  # unheard of for exactly the timeout: kept
    ledger.expire(10.0, 5.0, live={b"live"})
    assert {i for i in peers if ledger.get(i) is not None} == {b"live", b"heard", b"recent"}
    assert len(ledger) == 3
