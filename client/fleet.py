"""The client's core, without I/O: sessions with every server and who produces which batch.

Sans-I/O in the style of h11 and wsproto: `Fleet` holds the whole protocol state of one loader
and changes it only when told what happened (events, each with ``now``: it never reads a
clock), and says what to do about it (actions, returned as a list, in order). The receiver
(`receiver.BatchReceiver`) owns the sockets and the reorder buffer, feeds the events in and
carries the actions out; unit tests drive the core alone with a fake clock.

Events in: `start` (iterate epoch e from batch c), `on_connected` / `on_disconnected` (socket
monitor), `on_message` (welcome, error reply, shutdown), `on_batch` (a batch header arrived:
the verdict says whether to receive it into the reorder buffer, keep it for the next epoch, or
drop it), `on_handed_out` (the consumer took batch k), `on_send_failed` (a send would have
blocked), `tick` (time passed; with ``waiting_since`` while the consumer waits for a batch).
Requests: `ask_image_size`, `ask_batch_size`, `ask_ahead`, `cap_budget` (the shell's staging is
sized).
Actions out: `SendHello`, `SendCredit`, `AdoptEarly` (next-epoch batches received ahead join
the reorder buffer), `DropEarly` (discard them), `Connect`, `Disconnect`. Errors the user
must see are raised: `ServerError` (refused by every server, or the same error again and
again), `ServerUnavailable` (no batch within the timeout), `ProtocolError` (a server broke the
protocol; `session.IllegalTransition` is one).

Fleet composes four parts, each a module of its own with its own unit tests:
- sessions (`session`): each server's `Peer` and its `PeerState`, moved only by the
  transition table `session.TRANSITIONS`; Fleet opens and ends the sessions (hello, take-back,
  back-off, adoption) and answers the servers' replies (below; `welcomes` checks each welcome).
- assignment (`assignment.Assignment`): the budget, each batch's preferred server (rendezvous
  hashing) and who has room; a server whose session ends has what it owed taken back
  (`UnaskedBatches`) and handed to the others.
- speculation (`speculation.Speculation`): the next epoch's batches asked ahead, adopted by
  the `start` of that epoch and ended by any other.
- liveness (`liveness`): silence, heartbeats and pace; what the loader says while it waits,
  and `ServerUnavailable` past its timeout.

Servers come and go (`on_endpoints`, from DNS discovery in the shell): a new endpoint gets a
`Connect` and joins the assignment once welcomed; one that left is *retiring*: asked for
nothing more, it delivers what it owes (or, lost meanwhile, has it taken back, as any lost
server), then it is REMOVED with a `Disconnect`. Leaving is not a fault: nothing is retried
and nothing raised. Peers keep their index for life (actions name servers by index), so a
server that comes back is a new peer.

Replies: an error reply about a session that is no longer the server's current one is stale
(the server answered an older hello) and dropped; a ``transient`` one (the batch failed for a
reason that may pass) and a ``busy`` one (the hello cannot be served now, for a reason that
clears by itself: another world size held by a session going away, --max-clients reached)
back off and ask again, however often, within the loader's timeout, never counting as a
refusal; any other error before the welcome is a refusal: that server is left out of the
assignment and asked again later with back-off, and only when every server refuses is it the
user's error; an error after the welcome restarts the session with back-off, and the same
message `ERRORS_BEFORE_RAISING` times in a row raises `ServerError`.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from batchwire import wire
from batchwire.client import liveness, welcomes
from batchwire.client.assignment import Assignment
from batchwire.client.errors import ProtocolError, ServerError
from batchwire.client.liveness import Waiting, in_fleet
from batchwire.client.session import WAITING, Event, Peer, PeerState, Session
from batchwire.client.speculation import Speculation
from batchwire.client.unasked import UnaskedBatches

log = logging.getLogger(__name__)

S = PeerState
E = Event

# The same error reply this many times in a row (with no batch between) is the server's answer,
# not a hiccup: it is raised as ServerError. Before that, each retry waits twice as long.
ERRORS_BEFORE_RAISING = 3
ERROR_BACKOFF_S = 0.25
BACKOFF_MAX_S = 4.0  # transient errors and refusals: the longest wait between hellos


# ---------------------------------------------------------------------- actions


@dataclass(frozen=True)
class SendHello:
    """Send ``hello`` to server ``server`` (report a failed send with `Fleet.on_send_failed`)."""

    server: int
    hello: wire.Hello


@dataclass(frozen=True)
class SendCredit:
    """Ask server ``server`` for ``batches`` in its current session (the shell adds stats)."""

    server: int
    batches: tuple[int, ...]


@dataclass(frozen=True)
class AdoptEarly:
    """The next-epoch batches kept for server ``server`` join the reorder buffer now."""

    server: int


@dataclass(frozen=True)
class DropEarly:
    """Discard the next-epoch batches kept for server ``server`` (its session ended)."""

    server: int


@dataclass(frozen=True)
class Connect:
    """Open a connection to ``endpoint``, server ``server`` from now on (it joined the fleet)."""

    server: int
    endpoint: str


@dataclass(frozen=True)
class Disconnect:
    """Close server ``server``'s connection for good (it left the fleet and owes nothing);
    ``bye``: it still holds a session of ours, say bye first so it frees its buffers."""

    server: int
    bye: bool


Action = SendHello | SendCredit | AdoptEarly | DropEarly | Connect | Disconnect


class Verdict(Enum):
    """What to do with the frames of a batch whose header just arrived."""

    DELIVER = "deliver"  # receive it into the reorder buffer
    KEEP_EARLY = "keep early"  # a next-epoch batch: keep its frames aside until adopted
    DROP = "drop"  # a stale session's or a duplicate: discard the frames


# ---------------------------------------------------------------------- the core


@dataclass(frozen=True)
class FleetConfig:
    """What one loader asks of every server, set when it connects: one rank's batches of one
    split (the hellos' fields), how many ahead (`prefetch`, the budget with one server), how
    long silence may last (`timeout`, `heartbeat`), whether to ask for the next epoch early
    (`speculate`). `batch_size` (None: the servers') is the first; `Fleet.ask_batch_size`
    changes it later. `RemoteLoader` builds it, `BatchReceiver` hands it to the `Fleet`."""

    split: str
    rank: int
    world_size: int
    prefetch: int
    timeout: float
    heartbeat: float
    speculate: bool = True
    job: str = ""
    batch_size: int | None = None
    metadata: bool = False


class Fleet:
    """Sessions with ``endpoints`` and the assignment of one rank's batches of one split."""

    def __init__(
        self, endpoints: Sequence[str], config: FleetConfig, *, now: float, first_session: int = 1
    ) -> None:
        self.config = config
        #: The parts: who produces which batch, and what is asked of the next epoch early.
        self.assignment = Assignment(
            split=config.split,
            rank=config.rank,
            world_size=config.world_size,
            prefetch=config.prefetch,
        )
        self.speculation = Speculation(config.speculate)
        self.peers: list[Peer] = []
        for ep in endpoints:
            self._add_peer(ep, now)
        self._size_budget()
        self._session_ids = itertools.count(first_session)
        self.welcome: wire.Welcome | None = None
        self.epoch = -1
        self.cursor = 0  # next batch index to hand out
        self.unasked = UnaskedBatches()  # this epoch's batches nobody was asked for
        self.unasked_next = UnaskedBatches()  # the next epoch's, for early sessions
        self.held: set[int] = set()  # batches in the receiver's reorder buffer
        self.adopted = 0  # batches of a next-epoch session that the epoch then used
        self._started = False
        #: A resumed pass's first sample in the epoch order (0: the epoch's own batches) and
        #: the world size the epoch was started at (elastic trainers, `wire.Hello`); part of
        #: each batch's rendezvous key, since such a pass's batch k is another batch.
        self.pass_start = 0
        self.pass_world = 0
        #: The output size this loader's hellos ask for (progressive resizing; None: the
        #: servers' --image-size), and the one the next `start` applies (`wire.Hello`).
        self.image_size: tuple[int, int] | None = None
        self.next_image_size: tuple[int, int] | None = None
        #: The batch size this loader's hellos ask for (None: the servers' --batch-size).
        self.batch_size = config.batch_size
        self._actions: list[Action] = []

    # ------------------------------------------------------------------ queries

    @property
    def budget(self) -> int:
        """Batches asked for or in the reorder buffer at most (`Assignment.size`)."""
        return self.assignment.budget

    @property
    def ahead_max_age(self) -> float:
        """Seconds a next-epoch session may go unspoken to and still be trusted on adoption."""
        return self.speculation.ahead_max_age

    @ahead_max_age.setter
    def ahead_max_age(self, seconds: float) -> None:
        self.speculation.ahead_max_age = seconds

    @property
    def num_batches(self) -> int | None:
        return None if self.welcome is None else self.welcome.num_batches

    def is_at(self, epoch: int, cursor: int, resume: tuple[int, int] = (0, 0)) -> bool:
        """Was the loader started at ``(epoch, cursor)`` (of the pass ``resume``) and has it
        handed out nothing since?"""
        return (
            self._started
            and epoch == self.epoch
            and cursor == self.cursor
            and resume == (self.pass_start, self.pass_world)
        )

    def is_current(self, server: int, session: int) -> bool:
        """Is ``session`` server ``server``'s open session? (Its welcome is then news.)"""
        s = self.peers[server].session
        return s is not None and s.id == session

    def has_session(self, server: int) -> bool:
        """Does server ``server`` hold a session of ours (so a bye frees something)?"""
        return self.peers[server].session is not None

    # ------------------------------------------------------------------ events

    def start(
        self, epoch: int, cursor: int, now: float, resume: tuple[int, int] = (0, 0)
    ) -> list[Action]:
        """Iterate ``epoch`` from batch ``cursor``; a no-op if already there.

        ``resume`` = (start sample, epoch world size): a pass resumed at another world size
        (`wire.Hello.start_sample`); (0, 0) is the epoch's own batches. The receiver empties
        its reorder buffer first. The next epoch from its start adopts the early sessions; any
        other position ends every session and asks afresh; another pass also forgets the
        welcome (its length differs).
        """
        resize = self.next_image_size != self.image_size
        if self.is_at(epoch, cursor, resume) and not resize:
            return []
        if resume != (self.pass_start, self.pass_world):
            self.pass_start, self.pass_world = resume
            self.welcome = None
        if resize:  # another output size: new welcomes (another shape), no early batches
            self.image_size = self.next_image_size
            self.welcome = None
        adopt = cursor == 0 and epoch == self.epoch + 1 and self.welcome is not None
        self.held.clear()
        if adopt:
            self.unasked, self.unasked_next = self.unasked_next, UnaskedBatches()
        else:
            for p in self.peers:  # their sessions serve another epoch or position
                self._end_session(p)
            self.unasked.reset(cursor, self.num_batches)
        self.unasked_next.reset(0, self.num_batches)
        self.epoch, self.cursor, self._started = epoch, cursor, True
        for p in self.peers:
            if adopt and p.state is S.SPECULATING:  # the early session of this epoch
                self._adopt(p, now)
            else:
                self._end_session(p)
            p.heartbeat = self.config.heartbeat
        self._service(now)
        return self._flush()

    def on_handed_out(self, k: int, now: float) -> list[Action]:
        """The consumer took batch ``k`` (the cursor) from the reorder buffer: ask for another."""
        if k != self.cursor:
            raise RuntimeError(f"batches are handed out in order: asked {k}, next is {self.cursor}")
        self.held.discard(k)
        self.cursor = k + 1
        self._refill(now)
        return self._flush()

    def ask_image_size(self, image_size: tuple[int, int] | None) -> None:
        """The loader asks for ``image_size`` (None: the servers') from its next `start` on
        (progressive resizing); until then nothing of the next epoch is asked ahead."""
        self.next_image_size = image_size

    def ask_batch_size(self, batch_size: int | None) -> None:
        """Hellos from now on ask for batches of ``batch_size`` (None: the servers')."""
        self.batch_size = batch_size

    def ask_ahead(self, enabled: bool) -> None:
        """Whether the next epoch is asked for early from now on (the loader's
        ``prefetch_next_epoch``; off for a last epoch, whose next one would be made for
        nothing). Batches already asked ahead are kept."""
        self.speculation.enabled = bool(enabled)

    def cap_budget(self) -> None:
        """The shell's staging has as many slots as the budget now: it grows no more as
        servers join (`Assignment.cap`)."""
        self.assignment.cap()

    def on_endpoints(self, endpoints: Sequence[str], now: float) -> list[Action]:
        """The fleet is now ``endpoints`` (DNS discovery): new ones are connected to, the
        others retire (they deliver what they owe, are asked nothing more, then disconnect)."""
        wanted = list(dict.fromkeys(endpoints))
        if not wanted:
            raise ValueError("a fleet needs at least one server (keep the old ones instead)")
        here = {p.endpoint: p for p in self.peers if p.state is not S.REMOVED}
        for p in here.values():
            leaving = p.endpoint not in wanted
            if leaving and not p.retiring:
                log.info("pipeline-server at %s left the fleet; draining it", p.endpoint)
            elif not leaving and p.retiring:
                log.info("pipeline-server at %s is back in the fleet", p.endpoint)
            p.retiring = leaving
        for ep in wanted:
            if ep not in here:
                log.info("pipeline-server at %s joined the fleet", ep)
                p = self._add_peer(ep, now)
                self._actions.append(Connect(p.index, ep))
        self._size_budget()
        self._service(now)
        return self._flush()

    def on_connect_failed(self, server: int) -> None:
        """A connection attempt to ``server`` failed at once (refused, no such ipc path)."""
        self.peers[server].connect_failures += 1

    def on_connected(self, server: int) -> list[Action]:
        """The connection to ``server`` completed its handshake (first time or after a restart)."""
        p = self.peers[server]
        p.connect_failures = 0
        p.connected = p.ever_connected = True
        if p.state is S.DISCONNECTED:
            p.move(E.CONNECTED)
            log.debug("connected to %s", p.endpoint)
        return self._flush()

    def on_disconnected(self, server: int) -> list[Action]:
        """The connection to ``server`` dropped: its session ends, its batches are taken back."""
        p = self.peers[server]
        if p.connected and not p.retiring:
            log.warning("lost pipeline-server at %s; will re-send hello", p.endpoint)
        p.connected = False
        self._forget_session(p)
        p.move(E.DISCONNECTED)
        return self._flush()

    def on_message(self, server: int, msg: wire.ServerMessage, now: float) -> list[Action]:
        """A control message (not a batch) from ``server``."""
        p = self.peers[server]
        p.prev_heard, p.last_heard = p.last_heard, now
        if isinstance(msg, wire.Welcome):
            self._on_welcome(p, msg, now)
        elif isinstance(msg, wire.ErrorReply):
            self._on_error(p, msg, now)
            self._refill(now)  # batches that waited for its welcome go to the others
        elif isinstance(msg, wire.Shutdown):
            log.warning("pipeline-server at %s is shutting down; waiting for it", p.endpoint)
            self._end_session(p)
            if p.connected:  # hello again only once the exiting process has gone
                p.move(E.SHUTDOWN)
        return self._flush()

    def on_batch(
        self, server: int, h: wire.BatchHeader, more: bool, now: float
    ) -> tuple[Verdict, list[Action]]:
        """A batch header from ``server``; ``more``: frames follow it. Raises `ProtocolError`
        for a batch not asked for, of another epoch or split, or unlike the welcome."""
        p = self.peers[server]
        p.prev_heard, p.last_heard = p.last_heard, now
        s = p.session
        if s is None or h.session != s.id or not s.welcomed:
            return Verdict.DROP, self._flush()  # a stale session's frames
        if not s.pending or h.batch_index != s.pending[0]:
            expected = s.pending[0] if s.pending else "nothing"
            raise ProtocolError(
                f"pipeline-server at {p.endpoint} sent batch {h.batch_index} where its session "
                f"was to send {expected}"
            )
        s.pending.popleft()
        if h.epoch != s.epoch or h.split != self.config.split:
            raise ProtocolError(
                f"pipeline-server at {p.endpoint} sent {h.split!r} batch {h.batch_index} of "
                f"epoch {h.epoch} in a session of {self.config.split!r} epoch {s.epoch}"
            )
        self._check_shape(p, h, more)
        if p.state is S.SPECULATING:
            s.early.append(h.batch_index)
            return Verdict.KEEP_EARLY, self._flush()
        assert self.welcome is not None
        k = h.batch_index
        if not self.cursor <= k < self.welcome.num_batches or k in self.held:
            self._refill(now)  # e.g. asked again after a reconnect and delivered twice
            return Verdict.DROP, self._flush()
        self.held.add(k)
        liveness.delivered(p, self.config.heartbeat)
        if not self.unasked:
            self._speculate(p, now)
        return Verdict.DELIVER, self._flush()

    def on_send_failed(self, action: Action) -> list[Action]:
        """A send would have blocked (no connected peer): undo what it stood for."""
        if isinstance(action, SendHello):
            if self.is_current(action.server, action.hello.session):
                self._end_session(self.peers[action.server])
        elif isinstance(action, SendCredit):
            s = self.peers[action.server].session
            if s is not None:
                for k in action.batches:
                    s.pending.remove(k)
                self.unasked.give_back(action.batches)
        return self._flush()  # the next tick tries again

    def tick(self, now: float, waiting_since: float | None = None) -> list[Action]:
        """Time passed: retries fall due, hellos go out, free budget is asked for.

        ``waiting_since``: the consumer has waited for a batch since then. A server silent for
        longer than its heartbeat while it owes something loses its session; past the loader's
        timeout this raises `ServerUnavailable`.
        """
        if waiting_since is not None:
            if now > waiting_since + self.config.timeout:
                raise liveness.unavailable(self._waiting(), now)
            for p in liveness.silent(self.peers, waiting_since, now, self.config.timeout):
                self._end_session(p)
        self._service(now)
        return self._flush()

    # ------------------------------------------------------------------ sessions

    def _flush(self) -> list[Action]:
        self._remove_retired()
        actions, self._actions = self._actions, []
        return actions

    def _add_peer(self, endpoint: str, now: float) -> Peer:
        p = Peer(len(self.peers), endpoint, self.config.heartbeat, last_heard=now, prev_heard=now)
        self.peers.append(p)
        return p

    def _members(self) -> list[Peer]:
        """The servers of the fleet now (not removed, not retiring)."""
        return in_fleet(self.peers)

    def _size_budget(self) -> None:
        """Budget and next-epoch share for the servers in the fleet now (`Assignment.size`)."""
        self.assignment.size(len(self._members()))

    def _remove_retired(self) -> None:
        """A retiring server that owes no batch of this epoch is done: its connection closes.

        What it owes a next epoch (early batches) is given back to that epoch's unasked ones.
        """
        for p in self.peers:
            if not p.retiring or p.state is S.REMOVED:
                continue
            if p.state is S.STREAMING and p.session is not None and p.session.pending:
                continue  # still delivering
            bye = p.connected and p.session is not None
            self._end_session(p)
            p.move(E.LEFT)
            p.retiring, p.connected = False, False
            self._actions.append(Disconnect(p.index, bye))
            log.info("pipeline-server at %s drained; disconnected", p.endpoint)
            self._size_budget()

    def _hello(self, p: Peer, epoch: int, batches: list[int], now: float) -> None:
        c = self.config
        hello = wire.Hello(
            split=c.split,
            rank=c.rank,
            world_size=c.world_size,
            epoch=epoch,
            batches=tuple(batches),
            session=next(self._session_ids),
            job=c.job,
            # Only this epoch's hellos are of a resumed pass; the next epoch is a whole one.
            start_sample=self.pass_start if epoch == self.epoch else 0,
            epoch_world_size=self.pass_world if epoch == self.epoch else 0,
            image_size=self.image_size,
            metadata=c.metadata,
            batch_size=self.batch_size,
        )
        p.session = Session(hello.session, epoch, deque(batches))
        p.busy_since = now
        p.move(E.HELLO if epoch == self.epoch else E.HELLO_AHEAD)
        p.last_sent = now
        self._actions.append(SendHello(p.index, hello))
        log.debug("hello to %s: %s", p.endpoint, hello)

    def _end_session(self, p: Peer, event: Event = E.ENDED) -> None:
        """End ``p``'s session, if it has one, by ``event`` (`_forget_session`)."""
        if p.session is not None:
            self._forget_session(p)
            p.move(event)

    def _forget_session(self, p: Peer) -> None:
        """Forget ``p``'s session (no state change: the caller's event makes it); the batches
        it owes go back to the unasked ones of its epoch."""
        s = p.session
        if s is None:
            return
        p.session = None
        if s.early:
            self._actions.append(DropEarly(p.index))
        owed = s.owed()
        if not owed:
            return
        if s.epoch == self.epoch:
            self.unasked.give_back(owed)
        elif s.epoch == self.epoch + 1:
            self.unasked_next.give_back(owed)
        log.debug("%s: %d batch(es) of epoch %d taken back", p.endpoint, len(owed), s.epoch)

    def _back_off(self, p: Peer, event: Event, delay: float, now: float) -> None:
        """End ``p``'s session by ``event`` (an error, a refusal): no hello for ``delay``."""
        self._end_session(p, event)
        p.retry_at = now + delay

    def _adopt(self, p: Peer, now: float) -> None:
        """Make ``p``'s next-epoch session the current one: its early batches join the buffer.

        A session we have not spoken to for long may have been dropped by the server: its
        batches are used, the rest of what it owes is taken back.
        """
        s = p.session
        assert s is not None
        early, s.early = s.early, []
        if early:
            self.held.update(early)
            self.adopted += len(early)
            self._actions.append(AdoptEarly(p.index))
            log.debug("%s: %d batch(es) of epoch %d here already", p.endpoint, len(early), s.epoch)
        p.move(E.ADOPTED if s.welcomed else E.ADOPTED_UNWELCOMED)
        if self.speculation.stale(p, now):
            self._end_session(p)

    def _service(self, now: float) -> None:
        """Retries that fell due, hellos to servers without a session, then the refill."""
        for p in self.peers:
            if p.state in WAITING and now >= p.retry_at:
                p.move(E.RETRY_DUE if p.connected else E.RETRY_DUE_DISCONNECTED)
            if p.state is S.IDLE and self._started and not p.retiring:
                if not self.unasked and self.welcome is not None:
                    self._speculate(p, now)  # nothing of this epoch left to ask for
                if p.state is S.IDLE:
                    # An empty hello: batches follow its welcome, so a server that is not
                    # really there (stopped, hung) never sits on any.
                    self._hello(p, max(self.epoch, 0), [], now)
        self._refill(now)

    # ------------------------------------------------------------------ who produces what

    def _in_use(self) -> int:
        """Batches of this epoch asked for or held: what the budget bounds."""
        pending = sum(p.outstanding() for p in self.peers if p.state is not S.SPECULATING)
        return len(self.held) + pending

    def _refill(self, now: float) -> None:
        """Ask for the lowest unasked batches while the budget allows: each of its preferred
        server (rendezvous), unless that one is slow or not streaming; then fewest outstanding
        first."""
        takers = [p for p in self.peers if p.state is S.STREAMING and not p.retiring]
        if takers and all(p.silences for p in takers):
            # Each fell silent while it owed batches and has delivered none since (a server
            # that welcomes every hello and then sends nothing): while another member has
            # not, the batches wait for that one, which leaves the next epoch for them.
            healthy = [p for p in self._members() if not p.silences]
            if any(p.state is not S.STREAMING for p in healthy):
                takers = []
        if self.unasked and not takers:
            # Lost batches came back, but every live server is busy with the next epoch.
            for p in self.peers:
                if p.state is S.SPECULATING:
                    self._end_session(p)
            return
        asks = self.assignment.assign(
            self.unasked,
            self.assignment.budget - self._in_use(),
            self.peers,
            takers,
            cursor=self.cursor,
            epoch=self.epoch,
            start=self.pass_start,
            now=now,
        )
        for i, batches in asks.items():
            p = self.peers[i]
            assert p.session is not None
            if not p.outstanding():
                p.busy_since = now  # it was idle: its next batch's wait starts here
            p.session.pending.extend(batches)
            p.last_sent = now
            self._actions.append(SendCredit(i, tuple(batches)))
        if not self.unasked:
            for p in self.peers:
                self._speculate(p, now)

    def preferred(
        self, k: int, candidates: list[tuple[str, Peer]], epoch: int | None = None
    ) -> Peer | None:
        """Batch ``k`` (of ``epoch``, default this one)'s preferred server among
        ``candidates`` ((endpoint, peer) pairs). The next epoch is a whole pass (start 0)."""
        e = self.epoch if epoch is None else epoch
        start = self.pass_start if e == self.epoch else 0
        return self.assignment.preferred(k, candidates, e, start)

    def _speculate(self, p: Peer, now: float) -> None:
        """Start ``p`` on the next epoch once nothing of this one is left to ask for.

        Its session of this epoch owes nothing, so replacing it loses nothing; the next
        epoch's batches it is asked for wait in the receiver until that epoch starts.
        """
        if not self.speculation.ready(p) or not self.speculation.may(
            epoch=self.epoch,
            welcomed=self.welcome is not None,
            pass_start=self.pass_start,
            resizing=self.next_image_size != self.image_size,
            unasked=self.unasked,
            unasked_next=self.unasked_next,
        ):
            return
        batches = self.speculation.pick(
            p, self.unasked_next, self.peers, self.assignment, self.epoch + 1
        )
        if batches:  # else nothing of the next epoch prefers it
            self._hello(p, self.epoch + 1, batches, now)

    # ------------------------------------------------------------------ replies

    def _on_welcome(self, p: Peer, w: wire.Welcome, now: float) -> None:
        s = p.session
        if s is None or w.session != s.id:
            return  # the welcome of an older hello
        welcomes.check(
            p.endpoint, w, self.welcome, batch_size=self.batch_size, image_size=self.image_size
        )
        if self.welcome is None:
            self.welcome = w
            self.unasked.set_total(w.num_batches)
            self.unasked_next.set_total(w.num_batches)
        s.welcomed = p.ever_welcomed = True
        p.refusal, p.refusal_streak = None, 0
        if p.state is S.HELLO_SENT:
            p.move(E.WELCOMED)
            self._refill(now)

    def _on_error(self, p: Peer, e: wire.ErrorReply, now: float) -> None:
        s = p.session
        if s is None or (e.session is not None and e.session != s.id):
            # About a session we have given up on (e.g. we re-sent our hello after a silence
            # and the server then answered the old one): not an answer to the current hello.
            log.debug("pipeline-server at %s: error about an older session: %s", p.endpoint, e)
            return
        if e.reason == "transient":
            # It may pass (say, the server ran out of file descriptors): ask again, backing
            # off, for as long as the loader's timeout allows; ServerUnavailable quotes it.
            p.transient_streak += 1
            p.last_error = e.message
            delay = min(BACKOFF_MAX_S, ERROR_BACKOFF_S * 2 ** (p.transient_streak - 1))
            log.warning(
                "pipeline-server at %s: %s; asking again in %.2f s", p.endpoint, e.message, delay
            )
            self._back_off(p, E.ERROR, delay, now)
            return
        if p.state is S.SPECULATING:
            # A next-epoch hello refused: nothing of this epoch is at stake. Stop guessing for
            # the rest of it; if the server really refuses that epoch, the hello sent when it
            # starts is refused then.
            log.info(
                "pipeline-server at %s refused the next epoch early: %s", p.endpoint, e.message
            )
            self.speculation.refused(self.epoch)
            self._end_session(p)
            return
        if e.reason == "busy":  # not now, for a reason that clears by itself
            self._busy(p, e.message, now)
            return
        if not s.welcomed:  # the answer to our hello: this server will not serve us
            self._refused(p, e.message, now)
            return
        # After a welcome, an error can only concern a later message; start a clean session,
        # backing off, and give up with the server's own words if it keeps saying the same.
        p.error_streak = p.error_streak + 1 if e.message == p.last_error else 1
        p.last_error = e.message
        if p.error_streak >= ERRORS_BEFORE_RAISING:
            raise ServerError(p.endpoint, f"{e.message} (said {p.error_streak} times in a row)")
        delay = ERROR_BACKOFF_S * 2 ** (p.error_streak - 1)
        log.warning(
            "pipeline-server at %s: %s; re-sending hello in %.2f s", p.endpoint, e.message, delay
        )
        self._back_off(p, E.ERROR, delay, now)

    def _busy(self, p: Peer, message: str, now: float) -> None:
        """``p`` refused our hello for now, for a reason that clears by itself (another world
        size held by a session that is dropped once it leaves or falls silent, its
        --max-clients reached): asked again with back-off, within the loader's timeout (which
        `ServerUnavailable` then quotes); meanwhile the other servers serve its batches. Not a
        refusal for good: it never makes every server refuse (`ServerError`)."""
        p.refusal_streak += 1
        p.refusal = p.last_error = message
        delay = min(BACKOFF_MAX_S, ERROR_BACKOFF_S * 2 ** (p.refusal_streak - 1))
        self._back_off(p, E.ERROR, delay, now)
        log.log(
            logging.WARNING if p.refusal_streak == 1 else logging.DEBUG,
            "pipeline-server at %s cannot serve this loader yet: %s; asking again in %.2f s, "
            "for up to the loader's timeout (%g s)",
            p.endpoint,
            message,
            delay,
            self.config.timeout,
        )

    def _refused(self, p: Peer, message: str, now: float) -> None:
        """``p`` refused our hello: out of the assignment, asked again later; an error only
        when every server refuses."""
        p.refusal_streak += 1
        p.refusal = p.last_error = message
        delay = min(BACKOFF_MAX_S, ERROR_BACKOFF_S * 2 ** (p.refusal_streak - 1))
        self._back_off(p, E.REFUSED, delay, now)
        members = self._members() or [p]
        if all(q.state is S.REFUSED for q in members):
            raise ServerError.refused_by_all({q.endpoint: q.refusal or "" for q in members})
        log.log(
            logging.WARNING if p.refusal_streak == 1 else logging.DEBUG,
            "pipeline-server at %s refused this loader: %s; the other servers serve its "
            "batches, hello again in %.2f s",
            p.endpoint,
            message,
            delay,
        )

    # ------------------------------------------------------------------ checks

    def _check_shape(self, p: Peer, h: wire.BatchHeader, more: bool) -> None:
        w = self.welcome
        assert w is not None
        ok = (
            more
            and h.dtype == w.dtype
            and h.layout == w.layout
            and h.shape[1:] == w.shape[1:]
            and h.shape[0] <= w.shape[0]
            and h.views == w.views
            and h.label_width == w.label_width
        )
        if not ok:
            views = f" views {h.views}" if h.views else ""
            promised = f" views {w.views}" if w.views else ""
            raise ProtocolError(
                f"pipeline-server at {p.endpoint}: batch {h.batch_index} is "
                f"{h.shape}{views} {h.dtype} {h.layout}, but its welcome promised "
                f"{w.shape}{promised} {w.dtype} {w.layout}"
                f"{'' if more else ' (and it has no data frames)'}"
            )

    def waiting_note(self, now: float, since: float) -> str:
        """What the loader says while the consumer waits (every few seconds): where, how long,
        and what that server is doing (`liveness.waiting_note`)."""
        return liveness.waiting_note(self._waiting(), now, since)

    def _waiting(self) -> Waiting:
        return Waiting(self.peers, self.cursor, self.epoch, self.config.split, self.config.timeout)
