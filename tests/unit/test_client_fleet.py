"""The client's sans-I/O core (`client.fleet.Fleet`) driven by events with a fake clock.

No sockets, no processes: `Shell` plays the receiver (it carries out the core's actions and
keeps a reorder buffer of batch indices) and the servers (each remembers what its session was
asked for and sends it back on `serve`). Every behaviour here also has an end-to-end test with
real server processes (tests/e2e/test_client_fleet_e2e.py and the RemoteLoader suites).
"""

from __future__ import annotations

import dataclasses

import pytest
from batchwire import wire
from batchwire.client import ProtocolError, ServerError, ServerUnavailable, rendezvous
from batchwire.client.fleet import (
    BACKOFF_MAX_S,
    ERROR_BACKOFF_S,
    ERRORS_BEFORE_RAISING,
    Connect,
    Disconnect,
    DropEarly,
    SendCredit,
    Verdict,
)
from batchwire.client.session import PeerState
from fleetsim import NUM_BATCHES, Shell, header_for, streaming, welcome_for

S = PeerState


# ---------------------------------------------------------------------- sessions and assignment


def test_a_hello_waits_for_the_connection_and_the_welcome_brings_credits() -> None:
    shell = Shell(1)
    shell.start()
    assert shell.hellos(0) == [] and shell.state(0) is S.DISCONNECTED
    shell.connect()
    shell.tick()
    (hello,) = shell.hellos(0)
    assert (hello.epoch, hello.batches, shell.state(0)) == (0, (), S.HELLO_SENT)
    assert not shell.fleet.peers[0].ever_welcomed
    shell.welcome()
    assert shell.state(0) is S.STREAMING and shell.fleet.peers[0].ever_welcomed
    assert shell.asked(0) == [0, 1, 2, 3]  # prefetch 4, lowest first
    assert shell.fleet.num_batches == NUM_BATCHES


def preferred(shell: Shell, k: int) -> int:
    """Batch ``k``'s preferred server (rendezvous hashing, see test_rendezvous.py)."""
    peers = [(p.endpoint, p) for p in shell.fleet.peers if p.assignable()]
    p = shell.fleet.preferred(k, peers)
    assert p is not None
    return p.index


def test_batches_are_spread_over_servers_and_handed_out_once_in_order() -> None:
    shell = streaming(2)
    assert shell.fleet.budget == 8  # at least 4 per server
    # Each batch of the budget is asked of its preferred server (both welcome at once).
    assert sorted(shell.asked(0) + shell.asked(1)) == list(range(8))
    for i in (0, 1):
        assert shell.asked(i) == [k for k in range(8) if preferred(shell, k) == i]
    assert shell.asked(0) and shell.asked(1)
    assert shell.run_epoch([1, 0]) == list(range(NUM_BATCHES))


def test_a_batch_waits_briefly_for_its_preferred_servers_welcome_then_goes_on() -> None:
    shell = Shell(2)
    shell.connect()
    shell.start()
    shell.welcome(0)
    mine = [k for k in range(8) if preferred(shell, k) == 0]
    first_other = min(k for k in range(8) if preferred(shell, k) == 1)
    assert shell.asked(0) == [k for k in mine if k < first_other]
    shell.later(0.6)  # server 1 has not welcomed within the grace: server 0 takes the budget
    assert shell.asked(0) == list(range(8))
    assert shell.run_epoch([0]) == list(range(NUM_BATCHES))


def test_a_lost_servers_batches_go_to_the_others() -> None:
    shell = streaming(2)
    owed = shell.asked(1)
    assert owed
    shell.carry_out(shell.fleet.on_disconnected(1))
    assert shell.state(1) is S.DISCONNECTED
    shell.tick()
    assert sorted(shell.asked(0)) == list(range(8))  # its batches taken back
    assert shell.run_epoch([0]) == list(range(NUM_BATCHES))
    assert len(shell.hellos(1)) == 1  # nothing is sent to a server without a connection


def test_a_restarted_server_gets_a_new_session_and_rejoins() -> None:
    shell = streaming(2)
    first = shell.session(1)
    shell.carry_out(shell.fleet.on_disconnected(1))
    shell.connect(1)
    shell.tick()
    hello = shell.hellos(1)[-1]
    assert hello.session != first and shell.state(1) is S.HELLO_SENT
    # Frames of the old session (already in flight) are dropped.
    verdict, _ = shell.fleet.on_batch(1, header_for(first, 0, 1), True, shell.clock())
    assert verdict is Verdict.DROP
    shell.welcome(1)
    assert shell.state(1) is S.STREAMING
    assert shell.run_epoch([0, 1]) == list(range(NUM_BATCHES))


def test_shutdown_waits_for_the_old_process_to_go_before_the_next_hello() -> None:
    shell = streaming(1)
    shell.reply(0, wire.Shutdown())
    shell.later(5.0)
    assert shell.state(0) is S.DRAINING and len(shell.hellos(0)) == 1
    shell.carry_out(shell.fleet.on_disconnected(0))
    shell.connect(0)
    shell.tick()
    assert len(shell.hellos(0)) == 2 and shell.state(0) is S.HELLO_SENT


def test_duplicates_and_batches_not_asked_for() -> None:
    shell = streaming(1)
    session = shell.session(0)
    with pytest.raises(ProtocolError, match="sent batch 2 where its session was to send 0"):
        shell.fleet.on_batch(0, header_for(session, 0, 2), True, shell.clock())
    shell = streaming(1)
    bad = header_for(shell.session(0), 0, 0, shape=[2, 3, 8, 8])
    with pytest.raises(ProtocolError, match="welcome promised"):
        shell.fleet.on_batch(0, bad, True, shell.clock())


def test_a_server_unlike_the_first_is_a_protocol_error() -> None:
    shell = Shell(2)
    shell.connect()
    shell.start()
    shell.welcome(0)
    with pytest.raises(ProtocolError, match="unlike the first server"):
        shell.reply(1, welcome_for(shell.session(1), num_batches=5))


def test_a_server_with_other_class_names_is_a_protocol_error() -> None:
    shell = Shell(2)
    shell.connect()
    shell.start()
    shell.welcome(0)
    renamed = dataclasses.replace(welcome_for(shell.session(1)), classes=["ant", "bee", "cat"])
    with pytest.raises(ProtocolError, match="unlike the first server"):
        shell.reply(1, renamed)


def test_a_failed_send_is_undone_and_tried_again() -> None:
    shell = Shell(1)
    shell.connect()
    shell.fail_sends_to.add(0)
    shell.start()
    assert shell.state(0) is S.IDLE  # the hello did not go out
    shell.fail_sends_to.clear()
    shell.tick()
    shell.welcome()
    assert shell.asked(0) == [0, 1, 2, 3]


# ---------------------------------------------------------------------- refusals (item 6b)


def test_one_refusing_server_leaves_the_epoch_to_the_others_and_is_asked_again() -> None:
    shell = Shell(2)
    shell.connect()
    shell.start()
    shell.welcome(0)
    shell.error(1, "this server serves at most 1 clients (--max-clients)", session=shell.session(1))
    assert shell.state(1) is S.REFUSED
    assert shell.asked(0) == list(range(8))  # the whole budget goes to the server that serves
    shell.later(ERROR_BACKOFF_S / 2)
    assert len(shell.hellos(1)) == 1  # backing off
    shell.later(ERROR_BACKOFF_S)
    assert len(shell.hellos(1)) == 2 and shell.state(1) is S.HELLO_SENT
    shell.welcome(1)  # room again: it rejoins
    assert shell.state(1) is S.STREAMING
    assert shell.run_epoch([0, 1]) == list(range(NUM_BATCHES))


def test_refusals_back_off_doubling_up_to_a_limit() -> None:
    shell = Shell(2)
    shell.connect()
    shell.start()
    shell.welcome(0)
    waits = []
    for _ in range(7):
        shell.error(1, "full", session=shell.session(1))
        waits.append(shell.fleet.peers[1].retry_at - shell.clock())
        shell.later(waits[-1])
    assert waits == [0.25, 0.5, 1.0, 2.0, BACKOFF_MAX_S, BACKOFF_MAX_S, BACKOFF_MAX_S]


def test_every_server_refusing_is_an_error_naming_each() -> None:
    shell = Shell(2)
    shell.connect()
    shell.start()
    shell.error(0, "world_size 2 clashes with 4", session=shell.session(0))
    with pytest.raises(ServerError) as info:
        shell.error(1, "serves at most 1 clients", session=shell.session(1))
    text = str(info.value)
    assert "every pipeline-server refused" in text
    assert f"{shell.endpoints[0]} refused: world_size 2 clashes with 4" in text
    assert f"{shell.endpoints[1]} refused: serves at most 1 clients" in text


def test_a_single_refusing_server_raises_at_once_with_its_words() -> None:
    shell = Shell(1)
    shell.connect()
    shell.start()
    with pytest.raises(ServerError, match="refused: no split 'nope'") as info:
        shell.error(0, "no split 'nope'")  # an old server: no session in the reply
    assert info.value.endpoint == shell.endpoints[0]


def test_a_refused_server_counts_in_the_timeout_message() -> None:
    shell = Shell(2)
    shell.connect(0)
    shell.start()
    shell.connect(1)
    shell.tick()
    shell.error(1, "full", session=shell.session(1))
    with pytest.raises(ServerUnavailable) as info:
        shell.later(11.0, waiting_since=0.0)
    assert "server-0" in str(info.value) and "server-1:5555 refused: full" in str(info.value)


def test_a_busy_server_is_asked_again_until_the_timeout_and_then_serves() -> None:
    """``busy`` (issue 28: another world size held by a session going away, --max-clients
    full) clears by itself: the loader's only server says it again and again and the loader
    asks again, backing off, says so while it waits, and streams once it is welcomed."""
    shell = Shell(1, timeout=30.0)
    shell.connect()
    shell.start()
    text = "world_size mismatch on split 'train': ... it is dropped ... in 4.4 s"
    waits = []
    for _ in range(7):  # 7.75 s of refusals: longer than the stale session's 4.4 s
        shell.error(0, text, reason="busy", session=shell.session(0))
        assert shell.state(0) is S.BACKING_OFF
        waits.append(shell.fleet.peers[0].retry_at - shell.clock())
        shell.later(waits[-1], waiting_since=0.0)
        assert shell.state(0) is S.HELLO_SENT and len(shell.hellos(0)) == len(waits) + 1
    assert waits == [0.25, 0.5, 1.0, 2.0, BACKOFF_MAX_S, BACKOFF_MAX_S, BACKOFF_MAX_S]
    shell.error(0, text, reason="busy", session=shell.session(0))
    note = shell.fleet.waiting_note(shell.clock(), 0.0)
    assert f"cannot serve this loader until this clears ({text}); asking again" in note
    shell.later(BACKOFF_MAX_S, waiting_since=0.0)
    shell.welcome()
    assert shell.run_epoch([0]) == list(range(NUM_BATCHES))


def test_a_busy_server_past_the_timeout_is_unavailable_with_its_words() -> None:
    shell = Shell(1, timeout=10.0)
    shell.connect()
    shell.start()
    with pytest.raises(ServerUnavailable) as info:
        for _ in range(20):
            shell.error(
                0, "at most 2 clients (--max-clients)", reason="busy", session=shell.session(0)
            )
            shell.later(shell.fleet.peers[0].retry_at - shell.clock(), waiting_since=0.0)
    text = str(info.value)
    assert "could not serve this loader for 10 s, for a reason it said would clear" in text
    assert "its last error: at most 2 clients (--max-clients)" in text


def test_busy_servers_never_make_every_server_refuse() -> None:
    """One server refusing for good and the other busy: not `ServerError`, the busy one is
    waited for; an older client reads ``busy`` as ``refused`` (wire.ERROR_REASONS)."""
    shell = Shell(2)
    shell.connect()
    shell.start()
    shell.error(0, "another world size", reason="busy", session=shell.session(0))
    shell.error(1, "unknown split 'train'", session=shell.session(1))  # no raise
    assert (shell.state(0), shell.state(1)) == (S.BACKING_OFF, S.REFUSED)
    shell.later(ERROR_BACKOFF_S)
    shell.welcome(0)
    shell.later(1.0)  # server 1's new hello goes unanswered: its batches come to server 0
    assert shell.state(0) is S.STREAMING and len(shell.asked(0)) == shell.fleet.budget
    frame = wire.ErrorReply("full", "busy", session=3).to_map()
    assert wire.ErrorReply.from_map({**frame, "reason": "some-newer-reason"}).reason == "refused"
    assert wire.ErrorReply.from_map(frame).reason == "busy"


# ---------------------------------------------------------------------- errors (item 6a)


def test_an_error_about_an_older_session_is_dropped() -> None:
    """The issue's failure: the server retried a read for longer than the silence limit, the
    loader re-sent its hello, and the old session's error arrived after it."""
    shell = streaming(1)
    old = shell.session(0)
    shell.later(1.5, waiting_since=0.0)  # silent while owing batches: a new hello
    assert len(shell.hellos(0)) == 2 and shell.state(0) is S.HELLO_SENT
    shell.error(0, "batch 0 failed: too many open files", reason="transient", session=old)
    shell.error(0, "batch 1 failed", reason="failed", session=old)
    assert shell.state(0) is S.HELLO_SENT  # neither a refusal nor a back-off
    shell.welcome()
    assert shell.run_epoch([0]) == list(range(NUM_BATCHES))


def test_an_error_while_no_session_is_open_is_stale() -> None:
    shell = streaming(1)
    shell.carry_out(shell.fleet.on_disconnected(0))
    shell.error(0, "late news")  # no raise: it cannot concern a hello we have out
    assert shell.state(0) is S.DISCONNECTED


def test_a_transient_error_before_the_welcome_is_not_a_refusal() -> None:
    shell = Shell(1)
    shell.connect()
    shell.start()
    shell.error(0, "too many open files", reason="transient", session=shell.session(0))
    assert shell.state(0) is S.BACKING_OFF


def test_transient_errors_back_off_and_never_raise() -> None:
    shell = streaming(2)
    waits = []
    for _ in range(ERRORS_BEFORE_RAISING + 3):
        shell.error(1, "batch 1 failed: too many open files", reason="transient")
        assert shell.state(1) is S.BACKING_OFF
        waits.append(shell.fleet.peers[1].retry_at - shell.clock())
        shell.later(waits[-1])
        shell.welcome(1)
    assert waits == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0]
    # The batches it owed went to server 0 and back; nothing is lost or repeated.
    assert shell.run_epoch([0, 1]) == list(range(NUM_BATCHES))
    assert shell.fleet.peers[1].transient_streak == 0  # a batch resets the streak


def test_the_same_error_after_the_welcome_raises_after_a_few_backed_off_tries() -> None:
    shell = streaming(1)
    for attempt in range(1, ERRORS_BEFORE_RAISING):
        shell.error(0, "disk on fire")
        assert shell.state(0) is S.BACKING_OFF
        shell.later(ERROR_BACKOFF_S * 2 ** (attempt - 1))
        shell.welcome()
    with pytest.raises(ServerError, match=r"disk on fire.*3 times in a row"):
        shell.error(0, "disk on fire")


# ---------------------------------------------------------------------- silence and timeout


def test_silence_while_owing_batches_ends_the_session_and_doubles_the_heartbeat() -> None:
    shell = streaming(2, timeout=30.0)
    assert shell.asked(0) and shell.asked(1)
    shell.later(0.9, waiting_since=0.0)
    assert shell.state(1) is S.STREAMING
    shell.later(0.2, waiting_since=0.0)  # 1.1 s without a word from either
    assert [shell.state(i) for i in (0, 1)] == [S.HELLO_SENT, S.HELLO_SENT]
    assert len(shell.hellos(1)) == 2 and shell.fleet.peers[1].heartbeat == 2.0
    shell.welcome()
    assert shell.run_epoch([0, 1]) == list(range(NUM_BATCHES))


def test_a_server_owing_nothing_may_stay_silent() -> None:
    shell = streaming(2)
    shell.serve(0), shell.serve(1)  # the budget is in the reorder buffer: nothing owed
    shell.later(5.0, waiting_since=0.0)
    assert shell.state(1) is S.STREAMING and len(shell.hellos(1)) == 1


def test_no_batch_within_the_timeout_raises_server_unavailable_naming_the_server() -> None:
    shell = Shell(1, timeout=2.0)
    shell.connect()
    shell.start()
    shell.later(1.0, waiting_since=0.0)
    with pytest.raises(ServerUnavailable, match="did not answer the hello") as info:
        shell.later(1.5, waiting_since=0.0)
    assert info.value.endpoint == shell.endpoints[0]
    never = Shell(1, timeout=2.0)
    never.start()
    with pytest.raises(ServerUnavailable, match="no pipeline-server answered at"):
        never.later(3.0, waiting_since=0.0)


def test_refused_connections_and_silence_are_told_apart() -> None:
    """Nothing listening (every connect refused: a wrong port) is not a host that never
    answers (down, a firewall dropping packets); neither advises starting a server there."""
    refused = Shell(1, timeout=2.0)
    refused.start()
    refused.fleet.on_connect_failed(0)
    assert "nothing is listening there (connection refused)" in refused.fleet.waiting_note(1, 0)
    with pytest.raises(ServerUnavailable, match="nothing is listening there, every connection"):
        refused.later(3.0, waiting_since=0.0)
    silent = Shell(1, timeout=2.0)
    silent.start()
    assert "no answer yet; connecting" in silent.fleet.waiting_note(1, 0)
    with pytest.raises(ServerUnavailable, match="the connection never completed") as info:
        silent.later(3.0, waiting_since=0.0)
    assert "pipeline-server --bind" not in str(info.value)


def test_the_waiting_note_says_where_how_long_and_what_the_server_does() -> None:
    shell = Shell(1, timeout=60.0)
    shell.connect()
    shell.start()
    note = shell.fleet.waiting_note(5.2, 0.0)
    assert note.startswith(f"waiting for pipeline-server at {shell.endpoints[0]} for 5 s")
    assert "(giving up after 60 s): connected, waiting for its answer to our hello" in note
    streaming_shell = streaming(2)
    note = streaming_shell.fleet.waiting_note(10.0, 0.0)
    assert "(and 1 other server(s))" in note and "connected, producing batch 0" in note


def test_a_server_that_went_away_is_named_as_such() -> None:
    shell = streaming(1, timeout=2.0)
    shell.carry_out(shell.fleet.on_disconnected(0))
    with pytest.raises(ServerUnavailable, match="went away"):
        shell.later(3.0, waiting_since=0.0)


# ---------------------------------------------------------------------- next epoch early


def speculated(**kw) -> Shell:
    """Epoch 0 asked for entirely and delivered; both servers then start on epoch 1."""
    shell = streaming(2, **kw)
    for i in (0, 1):
        shell.serve(i)
    while shell.fleet.cursor < NUM_BATCHES - 4:
        shell.take()
        for i in (0, 1):
            shell.serve(i)
    return shell


def test_once_the_epoch_is_asked_for_idle_servers_start_the_next() -> None:
    shell = speculated()
    assert [shell.state(i) for i in (0, 1)] == [S.SPECULATING, S.SPECULATING]
    early = [h for i in (0, 1) for h in shell.hellos(i) if h.epoch == 1]
    assert sorted(k for h in early for k in h.batches) == list(range(8))  # share 4 each
    shell.welcome()
    for i in (0, 1):
        shell.serve(i)
    assert sorted(k for ks in shell.early.values() for k in ks) == list(range(8))
    while shell.fleet.cursor < NUM_BATCHES:
        shell.take()
    shell.handed.clear()
    shell.start(1, 0)  # adopts: the batches received ahead are in the reorder buffer
    assert shell.held == set(range(8)) and shell.fleet.adopted == 8
    assert [shell.state(i) for i in (0, 1)] == [S.STREAMING, S.STREAMING]
    assert shell.run_epoch([0, 1]) == list(range(NUM_BATCHES))


def test_another_start_drops_what_came_early() -> None:
    shell = speculated()
    shell.welcome()
    shell.serve(0)
    while shell.fleet.cursor < NUM_BATCHES:
        shell.take()
    shell.start(5, 0)
    assert DropEarly(0) in shell.log and shell.early == {}
    assert all(h.epoch == 5 for h in (shell.hellos(0)[-1], shell.hellos(1)[-1]))


def test_an_early_session_too_old_to_trust_is_replaced_on_adoption() -> None:
    shell = speculated()
    shell.welcome()
    (early,) = [h for h in shell.hellos(0) if h.epoch == 1]
    shell.serve(0, 2)
    while shell.fleet.cursor < NUM_BATCHES:
        shell.take()
    shell.clock.t += shell.fleet.ahead_max_age + 1
    shell.start(1, 0)
    assert shell.held == set(early.batches[:2])  # what arrived is used
    assert all(h.epoch == 1 and h.batches == () for h in (shell.hellos(0)[-1], shell.hellos(1)[-1]))


def test_a_refused_early_hello_stops_guessing_for_the_epoch() -> None:
    shell = speculated()
    shell.error(0, "not yet", session=shell.session(0))
    shell.tick()
    assert shell.state(0) is S.HELLO_SENT and shell.hellos(0)[-1].epoch == 0  # plain hello
    shell.welcome(0)
    shell.tick()
    assert shell.hellos(0)[-1].epoch == 0  # no second guess this epoch


def test_no_speculation_when_turned_off() -> None:
    shell = Shell(1, speculate=False)
    shell.connect()
    shell.start()
    shell.welcome()
    assert shell.run_epoch([0]) == list(range(NUM_BATCHES))
    assert all(h.epoch == 0 for h in shell.hellos(0))


def test_another_image_size_drops_what_came_early_and_asks_at_that_size() -> None:
    shell = speculated()
    shell.welcome()
    shell.serve(0)
    while shell.fleet.cursor < NUM_BATCHES:
        shell.take()
    shell.fleet.ask_image_size((48, 48))  # progressive resizing: the next epoch at 48 px
    shell.start(1, 0)
    assert DropEarly(0) in shell.log and shell.early == {} and shell.fleet.adopted == 0
    assert shell.fleet.welcome is None  # the new size's welcome says the new shape
    for i in (0, 1):
        assert shell.hellos(i)[-1].epoch == 1 and shell.hellos(i)[-1].image_size == (48, 48)


def test_a_pending_image_size_asks_nothing_of_the_next_epoch_early() -> None:
    shell = streaming(2)
    shell.fleet.ask_image_size((16, 16))
    for i in (0, 1):
        shell.serve(i)
    while shell.fleet.cursor < NUM_BATCHES - 4:
        shell.take()
        for i in (0, 1):
            shell.serve(i)
    assert all(h.epoch == 0 for i in (0, 1) for h in shell.hellos(i))


def test_a_resumed_position_ends_the_early_sessions() -> None:
    shell = speculated()  # both servers on epoch 1, batches 8..11 of epoch 0 still owed
    assert shell.fleet.cursor == NUM_BATCHES - 4
    # A resumed position re-asks for the current epoch: every early session ends.
    shell.start(0, NUM_BATCHES - 2)
    assert all(shell.state(i) is S.HELLO_SENT for i in (0, 1))


# ---------------------------------------------------------------------- servers joining and leaving


def test_a_server_joining_the_fleet_is_connected_and_gets_its_batches() -> None:
    total = 40
    shell = Shell(2)
    shell.connect()
    shell.start()
    for i in (0, 1):
        shell.welcomed.add(shell.session(i))
        shell.reply(i, welcome_for(shell.session(i), num_batches=total))
    new = "tcp://server-2:5555"
    shell.carry_out(shell.fleet.on_endpoints([*shell.endpoints, new], shell.clock()))
    assert Connect(2, new) in shell.log and shell.fleet.budget == 12
    assert shell.state(2) is S.DISCONNECTED
    shell.connect(2)
    shell.tick()
    shell.welcomed.add(shell.session(2))
    shell.reply(2, welcome_for(shell.session(2), num_batches=total))
    assert shell.state(2) is S.STREAMING
    while shell.fleet.cursor < total:
        for i in (0, 1, 2):
            shell.serve(i)
        while shell.fleet.cursor in shell.held:
            shell.take()
    assert shell.handed == list(range(total))
    got = [k for a in shell.log if isinstance(a, SendCredit) and a.server == 2 for k in a.batches]
    assert len(got) >= total // 5, got


def test_a_server_leaving_the_fleet_delivers_what_it_owes_then_is_disconnected() -> None:
    """Drained, not a fault: asked for nothing more, no new hello, closed once it owes none."""
    shell = streaming(2)
    owed = shell.asked(1)
    assert owed
    shell.carry_out(shell.fleet.on_endpoints(shell.endpoints[:1], shell.clock()))
    assert shell.closed == [] and shell.fleet.peers[1].retiring
    assert shell.fleet.budget == 8  # never shrinks (batches beyond the cursor may fill it)
    shell.serve(1, len(owed) - 1)
    assert shell.closed == []
    shell.serve(1)  # the last batch it owed
    assert shell.closed == [1] and shell.state(1) is S.REMOVED
    assert Disconnect(1, bye=True) in shell.log
    credits = [
        k for a in shell.log if isinstance(a, SendCredit) and a.server == 1 for k in a.batches
    ]
    assert len(shell.hellos(1)) == 1 and credits == owed  # nothing asked of it after it left
    assert shell.run_epoch([0]) == list(range(NUM_BATCHES))
    shell.later(10.0)
    assert len(shell.hellos(1)) == 1  # never asked again


def test_a_leaving_server_lost_meanwhile_has_its_batches_taken_back() -> None:
    shell = streaming(2)
    assert shell.asked(1)
    shell.carry_out(shell.fleet.on_endpoints(shell.endpoints[:1], shell.clock()))
    shell.carry_out(shell.fleet.on_disconnected(1))
    assert shell.closed == [1] and Disconnect(1, bye=False) in shell.log
    shell.tick()
    assert shell.run_epoch([0]) == list(range(NUM_BATCHES))


def test_a_server_back_in_the_fleet_before_it_drained_stays_and_one_removed_comes_back_new() -> (
    None
):
    shell = streaming(2)
    eps = list(shell.endpoints)
    shell.carry_out(shell.fleet.on_endpoints(eps[:1], shell.clock()))
    shell.carry_out(shell.fleet.on_endpoints(eps, shell.clock()))
    assert not shell.fleet.peers[1].retiring and shell.closed == []
    shell.carry_out(shell.fleet.on_endpoints(eps[:1], shell.clock()))
    shell.serve(1)
    assert shell.closed == [1]
    shell.carry_out(shell.fleet.on_endpoints(eps, shell.clock()))
    assert shell.log[-1] == Connect(2, eps[1])  # a new peer: index 2, same endpoint
    shell.connect(2)
    shell.tick()
    shell.welcome(2)
    assert shell.run_epoch([0, 2]) == list(range(NUM_BATCHES))


def test_a_fleet_never_becomes_empty() -> None:
    shell = streaming(1)
    with pytest.raises(ValueError, match="at least one server"):
        shell.fleet.on_endpoints([], shell.clock())


def preferred_of_all(shell: Shell, k: int, epoch: int = 0) -> int:
    """Batch k's preferred server among every server of the loader, connected or not."""
    key = rendezvous.batch_key("train", epoch, 1, 0, k)
    return rendezvous.preferred(key, [(ep, i) for i, ep in enumerate(shell.endpoints)])


def test_a_batch_waits_briefly_for_its_preferred_server_to_connect() -> None:
    """At a loader's start connections complete one by one: the first server to welcome does
    not become every batch's preferred one (the other jobs of a sweep would ask elsewhere)."""
    shell = Shell(2)
    shell.start()
    shell.connect(0)
    shell.tick()
    shell.welcome(0)
    mine = [k for k in range(8) if preferred_of_all(shell, k) == 0]
    first_other = min(k for k in range(8) if preferred_of_all(shell, k) == 1)
    assert shell.asked(0) == [k for k in mine if k < first_other]
    shell.connect(1)
    shell.tick()
    shell.welcome(1)
    for i in (0, 1):
        assert shell.asked(i) == [k for k in range(8) if preferred_of_all(shell, k) == i]
    assert shell.run_epoch([0, 1]) == list(range(NUM_BATCHES))


def test_a_server_that_never_connects_is_waited_for_only_briefly() -> None:
    shell = Shell(2)
    shell.start()
    shell.connect(0)
    shell.tick()
    shell.welcome(0)
    assert shell.state(1) is S.DISCONNECTED
    shell.later(0.6)  # server 1 never answered within the grace: server 0 takes the budget
    assert shell.asked(0) == list(range(8))
    assert shell.run_epoch([0]) == list(range(NUM_BATCHES))


def test_next_epoch_batches_asked_early_go_to_their_preferred_server() -> None:
    shell = speculated()
    for i in (0, 1):
        (early,) = [h for h in shell.hellos(i) if h.epoch == 1]
        assert early.batches and all(preferred_of_all(shell, k, 1) == i for k in early.batches)
        mine = [k for k in range(NUM_BATCHES) if preferred_of_all(shell, k, 1) == i]
        assert list(early.batches) == mine[: shell.fleet.assignment.share]  # its lowest share


def test_a_header_with_another_label_width_is_a_protocol_error() -> None:
    """[B, K] labels are shaped by the header: K must be the welcome's (0: one label)."""
    shell = streaming(1)
    session, epoch, queue = shell.sessions[0]
    wide = dataclasses.replace(header_for(session, epoch, queue[0]), label_width=5)
    with pytest.raises(ProtocolError, match="welcome promised"):
        shell.fleet.on_batch(0, wide, True, shell.clock())


def test_a_welcome_unlike_what_the_hello_asked_is_a_protocol_error() -> None:
    """An older server ignores batch_size/image_size in the hello and welcomes at its own
    sizes: the loader says so instead of training on batches it did not ask for."""
    shell = Shell(1)
    shell.fleet.ask_batch_size(64)
    shell.connect()
    shell.start()
    assert shell.hellos(0)[-1].batch_size == 64
    with pytest.raises(ProtocolError, match=r"batches of \d+ where 64 were asked for"):
        shell.welcome()
    shell = Shell(1)
    shell.fleet.ask_image_size((96, 96))
    shell.connect()
    shell.start()
    with pytest.raises(ProtocolError, match="where 96x96 were asked for"):
        shell.welcome()


def test_servers_of_other_mixes_are_a_protocol_error_naming_it() -> None:
    """Two mixes of equal batch and class counts still draw other samples: the welcomes'
    `mix_fingerprint` must match too, and the error names the field that differs."""
    for first, second in (("0123456789abcdef", "fedcba9876543210"), ("0123456789abcdef", "")):
        shell = Shell(2)
        shell.connect()
        shell.start()
        shell.reply(0, dataclasses.replace(welcome_for(shell.session(0)), mix_fingerprint=first))
        other = dataclasses.replace(welcome_for(shell.session(1)), mix_fingerprint=second)
        with pytest.raises(ProtocolError, match=f"mix_fingerprint {second or '.not a mix.'} vs"):
            shell.reply(1, other)
    shell = Shell(2)
    shell.connect()
    shell.start()
    for server in (0, 1):
        same = dataclasses.replace(welcome_for(shell.session(server)), mix_fingerprint=first)
        shell.welcomed.add(shell.session(server))
        shell.reply(server, same)
    assert shell.serve(0) and shell.serve(1)  # both stream: one mix


def test_a_mismatch_names_each_field_that_differs() -> None:
    shell = Shell(2)
    shell.connect()
    shell.start()
    shell.welcome(0)
    other = dataclasses.replace(welcome_for(shell.session(1), num_batches=5), num_samples=77)
    with pytest.raises(ProtocolError, match="num_batches 5 vs 12, num_samples 77 vs"):
        shell.reply(1, other)
