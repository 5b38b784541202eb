"""A `ServerCore` driven by events with a fake clock: the stand-in shell its unit tests play on.

`Server` lends fake slots, keeps the jobs the core submits and records what it sends, replies
and releases, carrying actions out as `server/app.py` does (cancellation flags set on `Cancel`,
the telemetry recorded from `SendBatch`, `Reply.counts` and produced results); `split_info` is
the split every scene serves and `error_of` reads a reply as an `ErrorReply`. Shared by
test_server_core.py and the unit tests of the features built on the core (draining, sharing,
progressive resize, the sample window).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from batchwire.pipeline.sampler import ShardSampler
from batchwire.server.budget import BufferBudget
from batchwire.server.config import ServerConfig
from batchwire.server.core import (
    Action,
    Cancel,
    Release,
    Reply,
    ReplyStats,
    SendBatch,
    ServerCore,
    SplitInfo,
    Submit,
    TrimBuffers,
)
from batchwire.server.jobs import Job, JobResult
from batchwire.server.sessions import ClientSession
from batchwire.server.telemetry import Telemetry
from batchwire.wire import ErrorReply, Hello
from fakeclock import FakeClock

BATCH = 4
SAMPLES = 4000  # 1000 batches at world size 1


@dataclass(eq=False)
class FakeSlot:
    """Stands for a `bufpool.Slot`: the core only passes slots around."""

    n: int


def split_info(name: str = "train") -> SplitInfo:
    def sampler(batch: int, seed: int, rank: int, world_size: int) -> ShardSampler:
        return ShardSampler(
            SAMPLES, batch, seed=seed, shuffle=True, drop_last=True, rank=rank,
            world_size=world_size,
        )  # fmt: skip

    return SplitInfo(name, SAMPLES, 10, (0.5,) * 3, (0.25,) * 3, sampler)


@dataclass
class Server:
    """A core and a stand-in shell: it lends fake slots, keeps the jobs, records what was sent."""

    max_buffers: int = 70
    reserve: int = 3
    config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.clock = FakeClock(1000.0)
        # Sharing off unless a test turns it on (test_sharing_core.py): these scenes give
        # several clients the same batches and are about scheduling each one's own.
        settings = dict(
            batch_size=BATCH, image_size=8, producers=3, prefetch_depth=4, share_window=0
        )
        self.cfg = ServerConfig(**{**settings, **self.config})
        self.budget = BufferBudget(self.max_buffers, self.reserve)
        self.core = ServerCore(
            self.cfg,
            {"train": split_info("train"), "val": split_info("val")},
            self.cfg.batch_spec(),
            self.budget,
            self.clock(),
        )
        self.telemetry = Telemetry(clock=self.clock)
        self.cancels: dict[int, threading.Event] = {}
        self.jobs: list[Job] = []  # submitted, not yet finished
        self.submitted: list[bytes] = []  # whose session each job was for, in order
        self.sends: list[SendBatch] = []  # all batches sent
        self.in_flight: dict[bytes, list[int]] = defaultdict(list)  # tickets ZeroMQ holds
        self.replies: dict[bytes, list] = defaultdict(list)
        self.released: list[FakeSlot] = []
        self.trims: list[int] = []
        self._slots = 0

    # ---------------------------------------------------------------- the shell's side

    def run(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            if isinstance(a, Submit):
                self.submitted.append(self.core._by_serial[a.order.session_serial].identity)
                self._slots += 1
                a.order.attach(self.cancels.setdefault(a.order.production, threading.Event()))
                self.jobs.append(Job(a.order, FakeSlot(self._slots)))
            elif isinstance(a, Cancel):
                self.cancels[a.production].set()
            elif isinstance(a, SendBatch):
                self.telemetry.sent_batch(
                    a.images, a.nbytes, a.header.replaced, a.resent, a.ready_s
                )
                self.sends.append(a)
                self.in_flight[a.identity].append(a.ticket)
            elif isinstance(a, Reply):
                if a.counts:
                    self.telemetry.count(a.counts)
                self.replies[a.identity].append(a.message)
            elif isinstance(a, Release):
                self.released.append(a.slot)
            elif isinstance(a, TrimBuffers):
                self.trims.append(a.keep)
            else:
                assert isinstance(a, ReplyStats)
        return actions

    def tick(self, dt: float = 0.0) -> list[Action]:
        self.clock.t += dt
        return self.run(self.core.tick(self.clock()))

    def send(self, identity: bytes, msg) -> list[Action]:
        return self.run(self.core.on_message(identity, msg, self.clock()))

    def hello(self, identity: bytes, **fields) -> object:
        """Send a hello; returns the reply to it (a Welcome or an ErrorReply)."""
        h = dict(split="train", rank=0, world_size=1, epoch=0, batches=(0, 1), session=1)
        self.send(identity, Hello(**{**h, **fields}))
        return self.replies[identity][-1]

    def finish(
        self,
        n: int | None = None,
        *,
        error: str | None = None,
        reason: str = "failed",
        public: str | None = None,
    ):
        """Finish the oldest ``n`` jobs (all by default), successfully unless ``error``
        (``public``: why, in words the client may see)."""
        done, self.jobs = self.jobs[:n], self.jobs[len(self.jobs[:n]) :]
        for job in done:
            if error is None:
                result = JobResult(
                    job, 0.01, labels=np.zeros(BATCH, np.int64), indices=(1, 2, 3, 4)
                )
                self.telemetry.add_produced((job.order.spec or self.core.spec).batch_size)
            else:
                result = JobResult(job, 0.0, error=error, reason=reason, public=public)
            self.run(self.core.on_result(result, self.clock()))

    def deliver(self, identity: bytes) -> None:
        """The peer takes every batch ZeroMQ holds for it."""
        for ticket in self.in_flight.pop(identity, []):
            self.run(self.core.on_sent(ticket, self.clock()))

    def turn(self, readers: tuple[bytes, ...] = (), dt: float = 0.0) -> None:
        """One turn of the loop: jobs start, finish and are sent; readers take what came."""
        self.tick(dt)
        self.finish()
        self.tick()
        for identity in readers:
            self.deliver(identity)

    def sent_to(self, identity: bytes) -> list[int]:
        return [s.header.batch_index for s in self.sends if s.identity == identity]

    def holding(self, identity: bytes) -> int:
        return self.core.lender.holding(self.core.sessions[identity])


def session(
    identity: bytes = b"a",
    *,
    asked: tuple[int, ...] = (),
    depth: int = 4,
    now: float = 0.0,
    **hello: object,
) -> ClientSession:
    """A session of the core's parts' unit tests: a hello of split train (``hello``: other
    fields), its batches ``asked`` at ``now``, work-ahead ``depth``."""
    fields = dict(split="train", rank=0, world_size=1, epoch=0, batches=asked, session=1)
    h = Hello(**{**fields, **hello})  # type: ignore[arg-type]
    sampler = split_info().sampler(BATCH, 0, h.rank, h.world_size)
    s = ClientSession(identity, h, sampler, depth, now)
    assert s.ask(h.batches, now) is None
    return s


def error_of(reply) -> ErrorReply:
    assert isinstance(reply, ErrorReply), reply
    return reply
