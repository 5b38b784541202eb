"""Where does the pipeline wait? A pure reading of stats snapshots (Stats schema).

A stage's ``depth`` counts the batches in that stage or waiting for it (pipeline-server reports
it so), and the clients' ready queues are what waits for the trainers. With one slow link the
queues up to and including that link fill (everything upstream is held back) and every queue
after it runs empty (everything downstream starves):

    read [full]  decode [full]  augment [empty]  ready [empty]   ->  decode is the bottleneck
    read [full]  decode [full]  augment [full]   ready [full]    ->  the trainers are

So the bottleneck is the stage whose full queue has an empty one right behind it. When several
such pairs show (a snapshot taken mid-flight), the one closest to the trainers wins: it is the
last link the batches could not get past. When every client's ready queue is full, the server
is ahead of everyone and the trainers are the limit; so it is when every batch the clients
asked for has been sent and none is asked for (each asked batch is a credit: a trainer that
does not ask is busy, or gone). When some trainer is starving (its
loader reports waiting for data, or it holds credits and nothing is ready for it) but the queues
show no clear edge (a few workers each moving a whole batch through the stages), the stage that
takes the longest per batch is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from batchwire.wire.stats import ServerStats

#: A queue at or above this share of its capacity counts as full ("or nearly").
FULL_FRACTION = 0.8
#: A queue at or below this share of its capacity counts as empty.
EMPTY_FRACTION = 0.1
#: Not a production stage: time in it is time spent waiting for the client's credits.
READY = "ready"
#: A trainer whose loader reports waiting for data this share of its time is starving.
STARVING_WAIT_FRACTION = 0.25

TRAINERS = "trainers"
STAGE = "stage"
BALANCED = "balanced"
IDLE = "idle"


@dataclass(frozen=True)
class Bottleneck:
    """``kind`` is one of trainers, stage, balanced, idle; ``stage`` names it for kind=stage."""

    kind: str
    stage: str | None
    reason: str

    @property
    def label(self) -> str:
        if self.kind == TRAINERS:
            return "the trainers"
        if self.kind == STAGE:
            return f"stage '{self.stage}'"
        if self.kind == IDLE:
            return "none (idle)"
        return "none (balanced)"


@dataclass(frozen=True)
class Link:
    """One queue of the chain; ``depth`` may be a mean over several snapshots (`smooth`)."""

    name: str
    depth: float
    capacity: float
    latency_ms: float


@dataclass(frozen=True)
class Trainer:
    """What the inference needs of one client; ``ready`` may be a mean (`smooth`)."""

    id: str
    credits: int
    ready: float
    ready_capacity: float
    data_wait_fraction: float | None  # as its loader reports it, None if it does not


@dataclass(frozen=True)
class Reading:
    """The queues and trainers of one snapshot, or of several averaged (`smooth`)."""

    stages: tuple[Link, ...]
    trainers: tuple[Trainer, ...]

    @classmethod
    def of(cls, snapshot: ServerStats) -> Reading:
        return cls(
            stages=tuple(Link(s.name, s.depth, s.capacity, s.latency_ms) for s in snapshot.stages),
            trainers=tuple(
                Trainer(
                    c.id,
                    c.credits,
                    c.ready,
                    c.ready_capacity,
                    None if c.loader is None else c.loader.data_wait_fraction,
                )
                for c in snapshot.clients
            ),
        )


def is_full(depth: float, capacity: float) -> bool:
    return capacity > 0 and depth / capacity >= FULL_FRACTION


def is_empty(depth: float, capacity: float) -> bool:
    return capacity > 0 and depth / capacity <= EMPTY_FRACTION


def _num(x: float) -> str:
    return f"{x:g}" if float(x).is_integer() else f"{x:.1f}"


def _chain(reading: Reading) -> list[tuple[str, float, float]]:
    """The queues in pipeline order; the clients' ready queues close the chain as one link."""
    chain = [(s.name, s.depth, s.capacity) for s in reading.stages]
    trainers = reading.trainers
    if trainers and not any(name == READY for name, _, _ in chain):
        chain.append(
            (
                READY,
                sum(t.ready for t in trainers),
                sum(t.ready_capacity for t in trainers),
            )
        )
    return chain


def infer_bottleneck(snapshot: ServerStats | Reading) -> Bottleneck:
    """Name the limiting part of the pipeline in ``snapshot`` (see the module docstring)."""
    reading = snapshot if isinstance(snapshot, Reading) else Reading.of(snapshot)
    trainers = reading.trainers
    if not trainers:
        return Bottleneck(IDLE, None, "no clients connected")

    if all(t.credits == 0 and t.ready == 0 for t in trainers):
        n = len(trainers)
        return Bottleneck(
            TRAINERS,
            None,
            f"every batch the {'trainers' if n != 1 else 'trainer'} asked for has been sent "
            "and none is asked for: the server waits for the trainers",
        )
    bounded = [t for t in trainers if t.ready_capacity > 0]
    if bounded and all(is_full(t.ready, t.ready_capacity) for t in bounded):
        n = len(bounded)
        return Bottleneck(
            TRAINERS,
            None,
            f"every client's ready queue is full ({n} client{'s' if n != 1 else ''}): "
            "the server is ahead of the trainers",
        )

    chain = _chain(reading)
    for (name, depth, cap), (next_name, next_depth, next_cap) in reversed(list(pairwise(chain))):
        if is_full(depth, cap) and is_empty(next_depth, next_cap):
            return Bottleneck(
                STAGE,
                name,
                f"'{name}' is full ({_num(depth)}/{_num(cap)}) and '{next_name}' behind it "
                f"is empty ({_num(next_depth)}/{_num(next_cap)})",
            )

    starving = [t for t in trainers if _starving(t)]
    timed = [s for s in reading.stages if s.name != READY and s.latency_ms > 0]
    if starving and timed:
        slowest = max(timed, key=lambda s: s.latency_ms)
        total = sum(s.latency_ms for s in timed)
        return Bottleneck(
            STAGE,
            slowest.name,
            f"trainers wait for batches; '{slowest.name}' takes "
            f"{slowest.latency_ms:.1f} of {total:.1f} ms per batch",
        )
    return Bottleneck(BALANCED, None, "no queue runs empty behind a full one")


def _starving(trainer: Trainer) -> bool:
    """Does this trainer wait for data? Its own report says best; else, it asked for batches
    (credits) and none is ready."""
    if trainer.data_wait_fraction is not None:
        return trainer.data_wait_fraction >= STARVING_WAIT_FRACTION
    cap = trainer.ready_capacity
    return cap > 0 and trainer.credits > 0 and is_empty(trainer.ready, cap)


def smooth(snapshots: Sequence[ServerStats]) -> Reading:
    """The last snapshot's reading with stage depths and client ready counts averaged over all.

    A single snapshot catches each worker in one stage; a few seconds of them show where the
    batches actually pile up. Stages and clients are matched by name and id; ones missing from
    older snapshots are averaged over the snapshots that have them.
    """
    if not snapshots:
        raise ValueError("smooth() needs at least one snapshot")
    stage_sums: dict[str, list[float]] = {}
    ready_sums: dict[str, list[float]] = {}
    for snap in snapshots:
        for s in snap.stages:
            stage_sums.setdefault(s.name, []).append(s.depth)
        for c in snap.clients:
            ready_sums.setdefault(c.id, []).append(c.ready)
    last = Reading.of(snapshots[-1])
    return Reading(
        stages=tuple(replace(s, depth=_mean(stage_sums[s.name])) for s in last.stages),
        trainers=tuple(replace(t, ready=_mean(ready_sums[t.id])) for t in last.trainers),
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
