"""The client's sans-I/O core (`client.fleet.Fleet`) driven by events with a fake clock.

`Shell` plays the receiver (it carries out the core's actions and keeps a reorder buffer of batch
indices) and the servers (each remembers what its session was asked for and sends it back on
`serve`); `streaming` is a shell whose servers are all connected and welcomed. Shared by
test_client_fleet.py, test_client_session.py and test_rendezvous.py.
"""

from __future__ import annotations

import wirefakes
from batchwire import wire
from batchwire.client.fleet import (
    Action,
    AdoptEarly,
    Connect,
    Disconnect,
    DropEarly,
    Fleet,
    FleetConfig,
    SendCredit,
    SendHello,
    Verdict,
)
from batchwire.client.session import PeerState
from fakeclock import FakeClock
from wirefakes import SHAPE

NUM_BATCHES = 12


def welcome_for(session: int, num_batches: int = NUM_BATCHES, shape=SHAPE) -> wire.Welcome:
    return wirefakes.welcome(session, num_batches, shape)


def header_for(session: int, epoch: int, k: int, shape=SHAPE) -> wire.BatchHeader:
    return wirefakes.header(session, k, epoch, shape)


class Shell:
    """The receiver and the servers, reduced to bookkeeping of batch indices."""

    def __init__(self, servers: int = 2, *, prefetch: int = 4, **kw) -> None:
        self.clock = FakeClock(0.0)
        kw.setdefault("timeout", 10.0)
        kw.setdefault("heartbeat", 1.0)
        self.endpoints = [f"tcp://server-{i}:5555" for i in range(servers)]
        config = FleetConfig(split="train", rank=0, world_size=1, prefetch=prefetch, **kw)
        self.fleet = Fleet(self.endpoints, config, now=self.clock(), first_session=100)
        self.log: list[Action] = []
        self.fail_sends_to: set[int] = set()
        # Per server: (session, epoch, batches asked and not sent) of the last hello it got.
        self.sessions: dict[int, tuple[int, int, list[int]]] = {}
        self.welcomed: set[int] = set()  # sessions the servers welcomed (they send only then)
        self.held: set[int] = set()  # the reorder buffer
        self.early: dict[int, list[int]] = {}  # next-epoch batches kept per server
        self.handed: list[int] = []
        self.closed: list[int] = []  # servers whose connection the core closed (Disconnect)

    # -------------------------------------------------------------- the receiver's side

    def carry_out(self, actions: list[Action]) -> None:
        for a in actions:
            self.log.append(a)
            if isinstance(a, SendHello | SendCredit) and a.server in self.fail_sends_to:
                self.carry_out(self.fleet.on_send_failed(a))
            elif isinstance(a, SendHello):
                self.sessions[a.server] = (a.hello.session, a.hello.epoch, list(a.hello.batches))
            elif isinstance(a, SendCredit):
                self.sessions[a.server][2].extend(a.batches)
            elif isinstance(a, AdoptEarly):
                self.held.update(self.early.pop(a.server))
            elif isinstance(a, DropEarly):
                self.early.pop(a.server)
            elif isinstance(a, Connect):
                assert a.server == len(self.endpoints)
                self.endpoints.append(a.endpoint)
            elif isinstance(a, Disconnect):
                self.closed.append(a.server)

    def connect(self, *servers: int) -> None:
        for i in servers or range(len(self.endpoints)):
            self.carry_out(self.fleet.on_connected(i))

    def start(self, epoch: int = 0, cursor: int = 0) -> None:
        self.held.clear()
        self.carry_out(self.fleet.start(epoch, cursor, self.clock()))

    def tick(self, waiting_since: float | None = None) -> None:
        self.carry_out(self.fleet.tick(self.clock(), waiting_since))

    def later(self, seconds: float, waiting_since: float | None = None) -> None:
        self.clock.t += seconds
        self.tick(waiting_since)

    def take(self) -> int:
        """The consumer takes the next batch (it must be in the reorder buffer)."""
        k = self.fleet.cursor
        assert k in self.held, f"batch {k} not here; held {sorted(self.held)}"
        self.held.remove(k)
        self.handed.append(k)
        self.carry_out(self.fleet.on_handed_out(k, self.clock()))
        return k

    # -------------------------------------------------------------- the servers' side

    def hellos(self, server: int) -> list[wire.Hello]:
        return [a.hello for a in self.log if isinstance(a, SendHello) and a.server == server]

    def session(self, server: int) -> int:
        return self.sessions[server][0]

    def asked(self, server: int) -> list[int]:
        return list(self.sessions[server][2])

    def reply(self, server: int, msg: wire.ServerMessage) -> None:
        self.carry_out(self.fleet.on_message(server, msg, self.clock()))

    def welcome(self, *servers: int) -> None:
        for i in servers or range(len(self.endpoints)):
            self.welcomed.add(self.session(i))
            self.reply(i, welcome_for(self.session(i)))

    def error(self, server: int, message: str, reason: str = "refused", session=None) -> None:
        self.reply(server, wire.ErrorReply(message=message, reason=reason, session=session))

    def serve(self, server: int, count: int | None = None) -> list[int]:
        """Server ``server`` sends the next ``count`` (default: all) batches it was asked for."""
        session, epoch, queue = self.sessions[server]
        sent: list[int] = []
        if session not in self.welcomed:
            return sent
        while queue and (count is None or len(sent) < count):
            k = queue.pop(0)
            verdict, actions = self.fleet.on_batch(
                server, header_for(session, epoch, k), True, self.clock()
            )
            if verdict is Verdict.DELIVER:
                self.held.add(k)
            elif verdict is Verdict.KEEP_EARLY:
                self.early.setdefault(server, []).append(k)
            self.carry_out(actions)
            sent.append(k)
        return sent

    def state(self, server: int) -> PeerState:
        return self.fleet.peers[server].state

    def run_epoch(self, servers: list[int]) -> list[int]:
        """Serve from ``servers`` and consume until the epoch is handed out."""
        while self.fleet.cursor < NUM_BATCHES:
            for i in servers:
                self.serve(i)
            while self.fleet.cursor in self.held:
                self.take()
        return self.handed


def streaming(servers: int = 2, **kw) -> Shell:
    """Every server connected, hello'd and welcomed for epoch 0."""
    shell = Shell(servers, **kw)
    shell.connect()
    shell.start()
    shell.welcome()
    return shell
