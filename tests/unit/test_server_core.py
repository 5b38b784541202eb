"""The server's protocol core driven by events with a fake clock: no sockets, threads or sleeps.

Each test plays a scene (hellos, credits, finished jobs, batches ZeroMQ lets go of, peers gone,
time passing) and reads the actions the core returns: admission and world-size agreement,
max-clients, credit limits, round-robin scheduling, fair share of the buffers, failures and
transient errors replied with their session, buffers released when a peer goes, stalled peers
dropped, silent clients reaped and idle buffers trimmed, and clients that re-send their hello
and never read kept from starving a trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from batchwire.server import core as core_mod
from batchwire.server import peers
from batchwire.server.core import ReplyStats
from batchwire.wire import (
    MAX_PREFETCH,
    Bye,
    Credit,
    ErrorReply,
    LoaderReport,
    StatsRequest,
    UnlistedClients,
    Welcome,
)
from batchwire.wire.stats import MAX_FIGURE_NAME, MAX_LOADER_FIGURES
from coresim import BATCH, SAMPLES, Server, error_of, split_info

# ------------------------------------------------------------------------------ admission


def test_a_hello_is_welcomed_and_its_batches_come_in_the_order_asked() -> None:
    s = Server()
    welcome = s.hello(b"a", batches=(7, 3, 5), session=4)
    assert isinstance(welcome, Welcome) and welcome.session == 4
    assert (welcome.num_batches, welcome.batch_size, welcome.num_classes) == (1000, BATCH, 10)
    s.tick()
    orders = [j.order for j in s.jobs]
    assert [o.batch_index for o in orders] == [7, 3, 5]
    s.jobs.reverse()  # producers finish out of order; batches still go out in order asked
    s.turn()
    assert s.sent_to(b"a") == [7, 3, 5]
    assert {snd.header.session for snd in s.sends} == {4}


def test_the_job_carries_the_plan_not_the_session() -> None:
    """A producer gets the sampler, epoch and batch index: the plan it computes is the split's."""
    s = Server()
    s.hello(b"a", rank=1, world_size=2, epoch=3, batches=(5,))
    s.tick()
    (job,) = s.jobs
    order = job.order
    expected = split_info().sampler(BATCH, s.cfg.seed, 1, 2).plan(3, 5)
    assert (order.split, order.epoch, order.batch_index) == ("train", 3, 5)
    np.testing.assert_array_equal(order.sampler.plan(order.epoch, order.batch_index).indices,
                                  expected.indices)  # fmt: skip
    assert not order.cancelled.is_set()
    actions = s.send(b"a", Bye())
    # Cancellation is an action the shell carries out (it sets the flag the producers read).
    assert [a for a in actions if isinstance(a, core_mod.Cancel)] == [
        core_mod.Cancel(order.production)
    ]
    assert order.cancelled.is_set()  # the one thing a producer reads: skip the job


def test_telemetry_is_data_the_core_returns() -> None:
    """The core records nothing itself: a send says what the shell counts (images, bytes,
    resent, time ready) and an error reply names its counter."""
    s = Server()
    s.hello(b"a", batches=(0,))
    s.tick()
    s.clock.t += 0.25
    s.finish()
    s.clock.t += 0.5
    (send,) = [a for a in s.tick() if isinstance(a, core_mod.SendBatch)]
    spec = s.cfg.batch_spec()
    assert (send.images, send.nbytes) == (BATCH, spec.nbytes + send.header.labels_nbytes)
    assert send.resent is False and send.ready_s == pytest.approx(0.5)
    (reply,) = s.run(s.core.on_frames(b"z", [b"garbage"], s.clock()))
    assert reply.counts == "malformed_total"
    assert error_of(s.hello(b"x", split="nope")) and s.replies[b"x"]
    counters = s.telemetry.counters()
    assert counters["batches_total"] == 1 and counters["images_total"] == BATCH
    assert counters["malformed_total"] == 1 and counters["errors_total"] == 1


def test_refused_hellos_carry_their_session() -> None:
    """And their reason: ``busy`` for --max-clients (it clears as clients leave: a loader asks
    again until its timeout), ``refused`` for what does not clear (an unknown split)."""
    s = Server(config=dict(max_clients=2))
    err = error_of(s.hello(b"x", split="test", session=11))
    assert err.session == 11 and "unknown split 'test'" in err.message
    assert err.reason == "refused"
    s.hello(b"a", session=1)
    s.hello(b"b", session=2)
    err = error_of(s.hello(b"c", session=3))
    assert err.session == 3 and "at most 2 clients (--max-clients)" in err.message
    assert err.reason == "busy"
    assert isinstance(s.hello(b"b", epoch=1, session=5), Welcome)  # a served client may replace
    s.send(b"b", Bye())
    assert isinstance(s.hello(b"c", session=3), Welcome)
    err = error_of(s.hello(b"d", world_size=10_000, session=9))
    assert err.session is None or err.session == 9  # max clients or unservable: its session


def test_an_unservable_hello_names_the_cause_with_its_session() -> None:
    s = Server()
    err = error_of(s.hello(b"g", world_size=10_000, session=9))
    assert err.session == 9 and "cannot serve this hello" in err.message
    assert err.reason == "refused"


def test_credit_limits_are_refused_with_the_session() -> None:
    s = Server()
    s.hello(b"a", batches=(1,), session=6)
    s.send(b"a", Credit(batches=(1000,)))
    err = error_of(s.replies[b"a"][-1])
    assert err.session == 6 and "out of range" in err.message
    s.send(b"a", Credit(batches=(1,)))
    assert "asked for already" in error_of(s.replies[b"a"][-1]).message
    s.send(b"a", Credit(batches=tuple(range(2, 2 + MAX_PREFETCH))))
    assert "more than" in error_of(s.replies[b"a"][-1]).message
    s.send(b"z", Credit(batches=(1,)))  # no session: ignored, the client will say hello
    assert s.replies[b"z"] == []


def test_malformed_frames_get_a_bad_request_without_session() -> None:
    s = Server()
    s.run(s.core.on_frames(b"m", [b"a", b"b"], s.clock()))
    s.run(s.core.on_frames(b"m", [b"\x00garbage"], s.clock()))
    assert [(r.reason, r.session) for r in s.replies[b"m"]] == [("bad-request", None)] * 2
    assert "expected 1 control frame, got 2" in s.replies[b"m"][0].message
    s.run(s.core.on_frames(b"m", [StatsRequest().pack()], s.clock()))
    assert s.replies[b"m"][2:] == []  # the stats are the shell's to build
    assert s.core.on_frames(b"m", [StatsRequest().pack()], s.clock()) == [ReplyStats(b"m")]


def test_garbage_past_the_log_budget_is_counted_and_the_budget_comes_back(caplog) -> None:
    """A burst of malformed frames logs its first lines, then only counts; a minute later the
    next one is said again (before, the first 20 of the server's life were the only ones)."""
    from batchwire.server.lograte import MALFORMED_LINES_PER_WINDOW, PEER_FAULT_WINDOW_S

    s = Server()
    with caplog.at_level("INFO", logger="batchwire.server"):
        for _ in range(MALFORMED_LINES_PER_WINDOW + 30):
            s.run(s.core.on_frames(b"m", [b"\x00garbage"], s.clock()))
        warned = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == MALFORMED_LINES_PER_WINDOW
        assert "only counted" in warned[-1].getMessage()
        caplog.clear()
        s.clock.t += PEER_FAULT_WINDOW_S + 1
        s.run(s.core.on_frames(b"m", [b"\x00garbage"], s.clock()))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("30 more malformed messages") for line in lines), lines
    assert any(line.startswith("malformed message from") for line in lines), lines


# ------------------------------------------------------------------------------ world sizes


def test_world_sizes_agree_within_a_split_and_job() -> None:
    s = Server()
    assert isinstance(s.hello(b"a", world_size=2, session=1), Welcome)
    err = error_of(s.hello(b"b", world_size=4, rank=1, session=2))
    assert err.session == 2 and "world_size mismatch on split 'train'" in err.message
    assert err.reason == "busy"  # it clears once a leaves or falls silent
    assert f"client {b'a'.hex()} (rank 0 of world_size=2" in err.message
    assert isinstance(s.hello(b"c", world_size=4, job="other"), Welcome)  # another job
    assert isinstance(s.hello(b"d", world_size=4, split="val"), Welcome)  # another split
    s.send(b"a", Bye())
    assert isinstance(s.hello(b"b", world_size=4, rank=1, session=2), Welcome)


def test_an_anonymous_client_cannot_lock_a_split_without_asking_for_batches() -> None:
    """A hello at world size 7 that asks for nothing, kept up with empty credits every 2 s,
    holds no world size: a real job of the default job name is served at once. It is reaped
    after --client-timeout without progress, although it is never silent."""
    s = Server(config=dict(client_timeout=60.0))
    assert isinstance(s.hello(b"anon", world_size=7, batches=()), Welcome)
    for _ in range(10):
        s.send(b"anon", Credit(batches=(), stats={"x": 1.0}))
        s.tick(2.0)
    assert isinstance(s.hello(b"job", world_size=1, session=3), Welcome)
    s.send(b"job", Bye())
    for _ in range(25):
        s.send(b"anon", Credit())
        s.tick(2.0)
    assert b"anon" not in s.core.sessions  # 70 s without asking for anything


def test_a_loader_that_made_progress_holds_its_world_size_between_epochs() -> None:
    s = Server()
    s.hello(b"a", world_size=2, batches=(0,))
    s.turn(readers=(b"a",))
    assert s.sent_to(b"a") == [0]  # done with its epoch; the next hello has not come yet
    s.tick(4.0)
    assert isinstance(s.hello(b"b", world_size=3), ErrorReply)  # progress 4 s ago: held
    s.tick(1.5)
    assert isinstance(s.hello(b"b", world_size=3), Welcome)  # idle past the agreement window


def test_a_loader_waiting_for_its_batches_holds_its_world_size() -> None:
    """Owing batches is progress however long production takes (the buffers may be busy)."""
    s = Server()
    s.hello(b"a", world_size=2, batches=(0, 1))
    s.tick(30.0)
    assert isinstance(s.hello(b"b", world_size=3), ErrorReply)


# ------------------------------------------------------------------------------ scheduling


def test_scheduling_is_round_robin_and_bounded_by_the_producers() -> None:
    s = Server()
    for identity in (b"a", b"b", b"c"):
        s.hello(identity, batches=tuple(range(10)))
    s.tick()
    owners = [s.core._by_serial[j.order.session_serial].identity for j in s.jobs]
    assert owners == [b"a", b"b", b"c", b"a", b"b", b"c"]  # 2 x producers jobs at once
    s.tick()
    assert len(s.jobs) == 6
    s.finish(1)
    s.tick()
    assert len(s.jobs) == 6  # one more as one came back


def test_in_flight_per_peer_never_exceeds_the_depth() -> None:
    s = Server()
    s.hello(b"a", batches=tuple(range(20)))
    for _ in range(10):
        s.turn()  # a has not taken anything
    assert len(s.in_flight[b"a"]) == 4 and s.core.sessions[b"a"].ready == 4
    assert s.holding(b"a") == 8
    s.deliver(b"a")
    s.tick()
    assert len(s.in_flight[b"a"]) == 4 and len(s.sent_to(b"a")) == 8


# ------------------------------------------------------------------------------ failures


def test_a_failed_batch_is_replied_with_the_session_and_ends_that_session() -> None:
    s = Server()
    s.hello(b"a", batches=(0, 1), session=12)
    s.tick()
    s.finish(1, error="OSError: /data/x.jpg: I/O error", reason="failed")
    err = error_of(s.replies[b"a"][-1])
    assert (err.session, err.reason) == (12, "failed")
    assert "producing train batch 0 failed (OSError, failed)" in err.message
    assert "/data" not in err.message  # paths stay in the log
    assert b"a" not in s.core.sessions
    s.finish()  # the other job comes back: its buffer too, no second reply
    assert len(s.replies[b"a"]) == 2 and len(s.released) == 2 and s.budget.held == 0


def test_a_transient_failure_says_transient_with_its_session() -> None:
    s = Server()
    s.hello(b"a", batches=(0,), session=3)
    s.tick()
    s.finish(error="TransientReadError: [Errno 24] Too many open files", reason="transient")
    err = error_of(s.replies[b"a"][-1])
    assert (err.reason, err.session) == ("transient", 3)
    # the client asks again in a new session and is served
    assert isinstance(s.hello(b"a", batches=(0,), session=4), Welcome)
    s.turn()
    assert s.sends[-1].header.session == 4


DENIED = (
    "AccessDeniedError: [Errno 13] reading s3://bucket/secret-prefix/x.jpg?X-Amz-Signature=abc: "
    "most reads are denied"
)


def test_a_failure_with_public_words_tells_the_client_why() -> None:
    """Expired credentials: the loader's log must say why its batches fail, not only the type."""
    s = Server()
    s.hello(b"a", batches=(0,), session=5)
    s.tick()
    why = "most reads are denied (HTTP 401/403 or EACCES: 40 of the last 64): credentials expired"
    s.finish(error=DENIED, reason="transient", public=why)
    err = error_of(s.replies[b"a"][-1])
    assert err.message == f"producing train batch 0 failed (AccessDeniedError, transient): {why}"
    assert "s3://" not in err.message and "Signature" not in err.message


def test_a_failure_without_public_words_tells_its_type_only() -> None:
    s = Server()
    s.hello(b"a", batches=(0,), session=5)
    s.tick()
    s.finish(error=DENIED, reason="transient")
    err = error_of(s.replies[b"a"][-1])
    assert err.message == (
        "producing train batch 0 failed (AccessDeniedError, transient); "
        "the server's log has the details"
    )


def test_a_failure_of_a_replaced_session_tells_nobody() -> None:
    """The client re-helloed (say its silence limit passed while the read was retried): the
    old session's failure must not reach it as a refusal of the new one."""
    s = Server()
    s.hello(b"a", batches=(0,), session=1)
    s.tick()
    assert isinstance(s.hello(b"a", batches=(0,), session=2), Welcome)
    s.finish(1, error="TransientReadError: EMFILE", reason="transient")
    assert not any(isinstance(r, ErrorReply) for r in s.replies[b"a"])
    s.turn()
    assert [snd.header.session for snd in s.sends] == [2]
    assert s.budget.held == 1  # the new session's batch, in flight


# ------------------------------------------------------------------------------ peers gone


def test_a_peer_gone_releases_its_ready_batches_now_and_the_rest_as_they_come_back() -> None:
    s = Server()
    s.hello(b"a", batches=tuple(range(10)))
    s.tick()
    s.finish(2)
    s.tick()  # two sent, two in production
    s.finish(1)  # one ready behind the in-flight ones? (room left: sent at the next tick)
    assert s.budget.held == 6
    s.run(s.core.on_peer_gone(b"a", "disconnected", s.clock()))
    assert b"a" not in s.core.sessions
    assert s.budget.held == 5  # the ready batch came back at once
    s.finish()  # in production: back as they finish
    assert s.budget.held == 2  # the two sent: ZeroMQ lets go when the connection closes
    s.deliver(b"a")
    assert s.budget.held == 0 and len(s.released) == 6


def test_a_silent_client_is_reaped_after_the_client_timeout() -> None:
    s = Server(config=dict(client_timeout=10.0))
    s.hello(b"a", batches=(0,))
    s.turn(readers=(b"a",))
    s.tick(9.0)
    assert b"a" in s.core.sessions
    s.tick(1.5)
    assert b"a" not in s.core.sessions


# ------------------------------------------------------------------------------ stalls


def test_a_stalled_peer_gets_no_more_buffers_then_loses_its_session() -> None:
    """A frozen client with batches in transit: after NOT_READING_S it is lent nothing more,
    after STALL_S its session is dropped with its ready batches; what ZeroMQ holds for it stays
    counted until ZeroMQ lets go (the peer reads or its connection closes)."""
    s = Server()
    s.hello(b"f", batches=tuple(range(20)))
    s.tick()
    s.finish()
    s.tick()  # 4 sent (the depth), nothing taken
    s.finish()
    s.tick()
    assert len(s.in_flight[b"f"]) == 4 and s.core.sessions[b"f"].ready == 4
    s.tick(core_mod.NOT_READING_S + 0.1)
    assert s.jobs == [] and not s.core.sessions[b"f"].has_room()
    s.tick(core_mod.STALL_S)
    assert b"f" not in s.core.sessions
    assert s.budget.held == 4  # the ready ones came back, the sent ones are ZeroMQ's
    s.deliver(b"f")  # its connection closes (--stall-timeout) or it reads
    assert s.budget.held == 0


def test_a_slow_reader_that_keeps_taking_batches_is_not_stalled() -> None:
    s = Server()
    s.hello(b"s", batches=tuple(range(40)))
    for k in range(20):
        s.turn(dt=0.5)
        first = s.in_flight[b"s"][:1]  # it takes one batch every half second
        for ticket in first:
            s.in_flight[b"s"].remove(ticket)
            s.run(s.core.on_sent(ticket, s.clock()))
        s.send(b"s", Credit(batches=(20 + k,)))
    assert b"s" in s.core.sessions


# ------------------------------------------------------------------------------ fair share


def test_clients_that_do_not_read_leave_their_share_to_those_that_do() -> None:
    """20 clients that never read and about 50 that say hello and vanish at any time, beside
    an honest trainer: it gets its full work-ahead, where an even split of the buffers among
    all of them would leave it one (67 shared buffers / 71 clients)."""
    s = Server()
    depth = s.cfg.prefetch_depth
    for i in range(20):  # raw clients: a hello asking for two batches, none ever taken
        s.hello(b"stuck-%02d" % i, batches=(0, 1))
    s.hello(b"honest", batches=tuple(range(200)))
    gone: list[bytes] = []
    most = 0
    for turn in range(60):
        for i in range(5):  # ~50 present at any time: hello, then gone 10 turns later
            identity = b"gone-%02d-%d" % (turn, i)
            s.hello(identity, batches=(0, 1))
            gone.append(identity)
        while len(gone) > 50:
            identity = gone.pop(0)
            s.run(s.core.on_peer_gone(identity, "disconnected", s.clock()))
            s.deliver(identity)  # the connection closed: ZeroMQ lets go of its frames
        s.turn(readers=(b"honest",), dt=0.05)
        most = max(most, s.holding(b"honest"))
    assert s.core.share(s.clock()) >= 2 * depth  # not 67 // 71 = 1
    assert most == depth  # its whole work-ahead in production at once
    for i in range(20):  # the clients that never read hold what they were sent, no more
        assert s.holding(b"stuck-%02d" % i) <= 2
    assert s.budget.held <= s.budget.max_buffers


def test_share_is_divided_among_readers_when_buffers_are_short() -> None:
    s = Server(max_buffers=12, reserve=2)  # 10 shared, 4 clients that want 8 each
    readers = tuple(b"r%d" % i for i in range(4))
    for identity in readers:
        s.hello(identity, batches=tuple(range(40)))
    for _ in range(10):
        s.turn(readers=readers)
        assert s.core.share(s.clock()) == 10 // 4
        for identity in readers:
            assert s.holding(identity) <= 3  # its share, or one from the reserve on top
    assert all(len(s.sent_to(i)) >= 8 for i in readers)


def test_a_new_client_is_served_from_the_reserve_while_others_hold_everything() -> None:
    s = Server(max_buffers=8, reserve=2)
    for i in range(6):  # they take one batch each and never read
        s.hello(b"stalled-%d" % i, batches=tuple(range(6)))
    s.turn()
    assert s.budget.held == 6
    s.hello(b"fresh", batches=(0, 1))
    s.turn(readers=(b"fresh",))
    s.turn(readers=(b"fresh",))
    assert s.sent_to(b"fresh") == [0, 1]


# ------------------------------------------------------------------------------ buffers


def test_idle_buffers_are_trimmed_as_clients_leave_or_stop_asking() -> None:
    s = Server()
    s.hello(b"a", batches=(0,))
    s.turn(readers=(b"a",), dt=1.0)
    assert s.trims[-1] == 2 * 3 + 2 * 4 * 1
    s.tick(core_mod.BUFFERS_IDLE_S + 1)
    assert s.trims[-1] == 0  # nobody took a buffer for 30 s
    s.send(b"a", Bye())
    s.tick(1.0)
    assert s.trims[-1] == 0


def test_shutdown_tells_every_client_and_releases_what_is_queued() -> None:
    s = Server()
    s.hello(b"a", batches=(0, 1, 2, 3, 4, 5))
    s.tick()
    s.finish()
    s.run(s.core.shutdown(s.clock()))
    assert type(s.replies[b"a"][-1]).__name__ == "Shutdown"
    assert s.core.sessions == {}


@pytest.mark.parametrize("stats", [None, {"a": 1.0, "b": "x", "c": float("nan"), "d": True}])
def test_loader_stats_keep_finite_numbers_only(stats) -> None:
    s = Server()
    s.hello(b"a", batches=())
    s.send(b"a", Credit(stats=stats))
    rows, unlisted = s.core.client_rows(s.clock())
    assert rows[0].loader == (None if stats is None else LoaderReport(extra={"a": 1.0}))
    assert unlisted == UnlistedClients(
        count=0, credits=0, ready=0, in_flight=0, sent=0, images_per_s=0.0
    )


def test_loader_stats_are_bounded() -> None:
    """A credit's report keeps the first `MAX_LOADER_FIGURES` figures, names cut to
    `MAX_FIGURE_NAME` characters: a row stays small whatever a trainer sends."""
    s = Server()
    s.hello(b"a", batches=())
    figures = {f"{i:03d}" + "x" * 100: float(i) for i in range(MAX_LOADER_FIGURES + 8)}
    s.send(b"a", Credit(stats={"data_wait_fraction": 0.25, **figures}))
    (row,), _ = s.core.client_rows(s.clock())
    assert row.loader is not None and row.loader.data_wait_fraction == 0.25
    assert len(row.loader.extra) == MAX_LOADER_FIGURES - 1
    assert all(len(name) == MAX_FIGURE_NAME for name in row.loader.extra)


# ------------------------------------------------------------------------------ re-hellos

REHELLOS = tuple(b"rehello-%02d" % i for i in range(30))


def _rehello(s: Server, second: int) -> None:
    """Each of `REHELLOS` sends a new hello of its stream (an epoch of its own: nothing shared
    with the others) for 4 batches, and a credit carrying stats only."""
    for i, identity in enumerate(REHELLOS):
        s.hello(identity, epoch=100 + i, batches=(0, 1, 2, 3), session=1 + second)
        s.send(identity, Credit(stats={"images_per_s": 0.0}))


@dataclass
class Loader:
    """An honest loader over the core: a window of 4 batches, a credit for each batch it takes,
    and a new hello once its session was sent all of this pass (passes of ``batches``: world
    size 1000 / batches, in a job of its own), for the next epoch or, with ``step`` 0, the
    same again (a validation loader evaluating its epoch again)."""

    s: Server
    identity: bytes = b"honest"
    split: str = "train"
    step: int = 1
    batches: int = 10
    window: int = 4
    epoch: int = 0
    session: int = 1
    passes: int = 0
    asked: list[int] = field(default_factory=list)  # this pass's, in order
    received: int = 0  # of this pass
    taken: int = 0  # over the run
    _seen: int = 0  # sends looked at

    def hello(self, batches: list[int]) -> None:
        self.asked += batches
        reply = self.s.hello(
            self.identity, split=self.split, job="j", world_size=SAMPLES // BATCH // self.batches,
            epoch=self.epoch, batches=tuple(batches), session=self.session,
        )  # fmt: skip
        assert isinstance(reply, Welcome), reply
        self.session += 1

    def start(self) -> None:
        self.hello(list(range(self.window)))

    def take(self) -> None:
        """Take what came this turn (as its libzmq and consumer do) and ask for as many."""
        got = [a for a in self.s.sends[self._seen :] if a.identity == self.identity]
        self._seen = len(self.s.sends)
        self.s.deliver(self.identity)
        self.received += len(got)
        self.taken += len(got)
        more = list(range(len(self.asked), self.batches))[: len(got)]
        if more:
            self.asked += more
            self.s.send(self.identity, Credit(batches=tuple(more)))
        elif self.received == self.batches:  # the pass is all here: the next one
            self.epoch, self.asked, self.received = self.epoch + self.step, [], 0
            self.passes += 1
            self.start()

    def reconnect(self, lost: int = 0) -> None:
        """A re-sent hello of the same epoch for what it asked and did not get (as after a
        silence); ``lost``: the last batches it was sent reached it after, and were dropped."""
        self.s.deliver(self.identity)
        self.received -= lost
        self.taken -= lost
        pending = self.asked[self.received :]
        self.asked = self.asked[: self.received]
        self.hello(pending)


def _run_among_rehellos(
    s: Server, loader: Loader, seconds: int, reconnect_at: int = -1, lost: int = 0
) -> float:
    """``seconds`` of 10 turns (0.1 s each: at most 2 x producers jobs start per turn) with
    `REHELLOS` re-sending hellos every second; every peer's libzmq takes what it is sent (the
    shell reports every send done). The loader's share of the jobs after the first 3 s (by
    then each of them has asked again for more than `peers.SLACK` batches it was sent)."""
    loader.start()
    start = 0
    for second in range(seconds):
        _rehello(s, second)
        if second == 3:
            start = len(s.submitted)
        for _ in range(10):
            if second == reconnect_at and loader.received > lost:  # mid-pass
                loader.reconnect(lost)
                reconnect_at = -1
            s.tick(0.1)
            s.finish()
            s.tick()
            for identity in REHELLOS:
                s.deliver(identity)
            loader.take()
    jobs = s.submitted[start:]
    return jobs.count(loader.identity) / len(jobs)


def test_clients_that_re_hello_and_never_read_cannot_starve_a_trainer() -> None:
    """30 clients send a new hello (the same pass, 4 batches) and an empty credit every second
    and never read; their libzmq takes the frames off the socket all the same, so ZeroMQ's
    hand-over says they read. Each hello used to start them afresh, and round-robin gave the
    trainer one job in 31. What they were sent and never acknowledged now follows them across
    hellos (server/peers.py): the trainer is served first, and they get one job at a time."""
    s = Server()
    loader = Loader(s)
    share = _run_among_rehellos(s, loader, seconds=12)
    assert share >= 0.9, share
    theirs = [i for i in s.submitted[-340:] if i != b"honest"]  # about the last 10 s
    assert len(theirs) <= 11  # one job a second between them (core.DEBTOR_EVERY_S)
    for identity in REHELLOS:
        assert not s.core.in_good_standing(s.core.sessions[identity])
    assert s.core.debt(s.core.sessions[b"honest"]) == 0


@pytest.mark.parametrize("step", [1, 0], ids=["next-epoch", "same-epoch-again"])
def test_a_loaders_own_re_hellos_cost_it_nothing(step: int) -> None:
    """A loader's hello for each pass (its next epoch, or, as a validation loader does, the
    same epoch again) and a hello re-sent mid-pass for what it did not get (as after a
    silence) leave it owing nothing, served first among the clients that re-hello."""
    s = Server()
    loader = Loader(s, step=step)
    share = _run_among_rehellos(s, loader, seconds=10, reconnect_at=7)
    assert share >= 0.9, share
    assert loader.passes >= 20
    assert s.core.debt(s.core.sessions[b"honest"]) == 0


def test_a_loader_that_lost_batches_in_flight_pays_its_debt_back_in_a_few_batches() -> None:
    """A hello re-sent for the same epoch asks again for 4 batches it was sent (they reached
    the loader after it gave up on the session): over `peers.SLACK`, it is in debt, and its
    credits pay the debt back (its window and the debt: 8 batches) within seconds (no client
    in good standing is busy meanwhile: it competes with the others by debt, the least
    first); then it is served first again."""
    s = Server()
    loader = Loader(s, batches=500)
    _run_among_rehellos(s, loader, seconds=10, reconnect_at=4, lost=4)
    record = s.core.peers.get(b"honest")
    assert record.repaid >= 8 and record.in_debt_since is None  # in debt, then paid back
    assert s.core.debt(s.core.sessions[b"honest"]) == 0
    recent = s.submitted[-100:]  # about the last 3 s
    assert recent.count(b"honest") >= 90, recent.count(b"honest")


def test_a_trainer_between_two_steps_keeps_the_producers_from_clients_in_debt() -> None:
    """A trainer whose batches all went out owes and holds nothing until its next credit; a
    client in debt may not fill the producers meanwhile (its jobs would hold them for a whole
    batch when the credit comes): one job a second, until the trainer has been idle that
    long."""
    s = Server()
    for n in range(3):  # the same 8 batches asked again and again: in debt
        s.hello(b"r", batches=tuple(range(8)), session=n)
        for _ in range(3):
            s.turn(readers=(b"r",))
    s.tick(core_mod.DEBTOR_EVERY_S)
    s.hello(b"r", batches=tuple(range(8)), session=9)
    assert not s.core.in_good_standing(s.core.sessions[b"r"])
    s.submitted.clear()
    s.hello(b"t", batches=(0, 1, 2, 3))
    s.turn(readers=(b"t",))  # its 4 batches made, sent and taken: it waits for its consumer
    assert s.sent_to(b"t") == [0, 1, 2, 3] and not s.core.sessions[b"t"].has_room()
    for _ in range(5):
        s.turn(readers=(b"r",), dt=0.1)
    assert s.submitted.count(b"r") == 1  # one job in 0.5 s, the trainer's 4 beside it
    s.tick(core_mod.DEBTOR_EVERY_S)  # idle for a second: the producers are free for all
    assert s.submitted.count(b"r") > 2


def test_a_validation_pass_asking_everything_in_the_hello_owes_nothing() -> None:
    """Passes of another epoch each, all of its (few) batches asked in the hello, no credit."""
    s = Server()
    for epoch in range(20):
        s.hello(b"val", split="val", world_size=400, epoch=epoch, batches=(0, 1), session=epoch)
        s.turn(readers=(b"val",))
        assert s.core.debt(s.core.sessions[b"val"]) == 0
    assert len(s.sent_to(b"val")) == 40


def test_a_re_hello_of_the_same_stream_carries_what_it_was_sent() -> None:
    """The same epoch asked again and again, nothing credited: it owes what it was sent beyond
    its window, more than `peers.SLACK` after two hellos; neither a credit nor a bye wipes it,
    a finished session followed by another pass or a closed connection does."""
    s = Server()
    for n in range(4):
        s.hello(b"r", batches=(0, 1, 2, 3), session=n)
        s.turn(readers=(b"r",))
    session = s.core.sessions[b"r"]
    debt = len(s.sent_to(b"r")) - 4  # all but its first window
    assert s.core.debt(session) == debt > peers.SLACK
    assert not s.core.in_good_standing(session)
    s.send(b"r", Credit(batches=(4, 5)))  # asks for more: owes as much once they are sent
    assert s.core.debt(session) == debt
    s.send(b"r", Bye())  # the 2 asked go with the session, its hello asks 4 again
    s.hello(b"r", batches=(0, 1, 2, 3), session=9)
    assert s.core.debt(s.core.sessions[b"r"]) == debt + 2
    s.turn(readers=(b"r",))  # all 4 sent: finished
    s.hello(b"r", epoch=1, batches=(0, 1, 2, 3), session=10)
    assert s.core.debt(s.core.sessions[b"r"]) == 0
    s.turn(readers=(b"r",))
    s.hello(b"r", epoch=1, batches=(0, 1, 2, 3), session=11)
    assert s.core.debt(s.core.sessions[b"r"]) == 4
    s.run(s.core.on_peer_gone(b"r", "disconnected", s.clock()))
    assert s.core.peers.get(b"r") is None


@pytest.mark.parametrize(
    ("settings", "through_window"),
    [
        (dict(max_batch_size=2 * BATCH), True),  # batch sizes may mix: samples are shared
        ({}, False),  # one batch size: no sample window to go through
        (dict(max_batch_size=2 * BATCH, device="cuda"), False),
    ],
)
def test_orders_go_through_the_sample_window_only_where_it_applies(settings, through_window):
    """One place decides (`sharing.sample_window_applies`); an order says so as data."""
    s = Server(config=dict(share_window=8, **settings))
    s.hello(b"a", batches=(0,))
    s.tick()
    (job,) = s.jobs
    assert job.order.share_samples is through_window
