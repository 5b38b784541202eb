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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

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


def is_full(depth: float, capacity: float) -> bool:
    return capacity > 0 and depth / capacity >= FULL_FRACTION


def is_empty(depth: float, capacity: float) -> bool:
    return capacity > 0 and depth / capacity <= EMPTY_FRACTION


def _num(x: float) -> str:
    return f"{x:g}" if float(x).is_integer() else f"{x:.1f}"


def _chain(snapshot: Mapping[str, Any]) -> list[tuple[str, float, float]]:
    """The queues in pipeline order; the clients' ready queues close the chain as one link."""
    chain = [
        (str(s["name"]), float(s["depth"]), float(s["capacity"]))
        for s in snapshot.get("stages", [])
    ]
    clients = snapshot.get("clients", [])
    if clients and not any(name == READY for name, _, _ in chain):
        chain.append(
            (
                READY,
                sum(float(c.get("ready", 0)) for c in clients),
                sum(float(c.get("ready_capacity", 0)) for c in clients),
            )
        )
    return chain


def infer_bottleneck(snapshot: Mapping[str, Any]) -> Bottleneck:
    """Name the limiting part of the pipeline in ``snapshot`` (see the module docstring)."""
    clients: Sequence[Mapping[str, Any]] = snapshot.get("clients", [])
    if not clients:
        return Bottleneck(IDLE, None, "no clients connected")

    if all(int(c.get("credits", 0)) == 0 and float(c.get("ready", 0)) == 0 for c in clients):
        n = len(clients)
        return Bottleneck(
            TRAINERS,
            None,
            f"every batch the {'trainers' if n != 1 else 'trainer'} asked for has been sent "
            "and none is asked for: the server waits for the trainers",
        )
    bounded = [c for c in clients if float(c.get("ready_capacity", 0)) > 0]
    if bounded and all(
        is_full(float(c.get("ready", 0)), float(c["ready_capacity"])) for c in bounded
    ):
        n = len(bounded)
        return Bottleneck(
            TRAINERS,
            None,
            f"every client's ready queue is full ({n} client{'s' if n != 1 else ''}): "
            "the server is ahead of the trainers",
        )

    chain = _chain(snapshot)
    for (name, depth, cap), (next_name, next_depth, next_cap) in reversed(list(pairwise(chain))):
        if is_full(depth, cap) and is_empty(next_depth, next_cap):
            return Bottleneck(
                STAGE,
                name,
                f"'{name}' is full ({_num(depth)}/{_num(cap)}) and '{next_name}' behind it "
                f"is empty ({_num(next_depth)}/{_num(next_cap)})",
            )

    starving = [c for c in clients if _starving(c)]
    timed = [
        s
        for s in snapshot.get("stages", [])
        if s["name"] != READY and float(s.get("latency_ms", 0.0)) > 0
    ]
    if starving and timed:
        slowest = max(timed, key=lambda s: float(s["latency_ms"]))
        total = sum(float(s["latency_ms"]) for s in timed)
        return Bottleneck(
            STAGE,
            str(slowest["name"]),
            f"trainers wait for batches; '{slowest['name']}' takes "
            f"{float(slowest['latency_ms']):.1f} of {total:.1f} ms per batch",
        )
    return Bottleneck(BALANCED, None, "no queue runs empty behind a full one")


def _starving(client: Mapping[str, Any]) -> bool:
    """Does this trainer wait for data? Its own report says best; else, it asked for batches
    (credits) and none is ready."""
    loader = client.get("loader") or {}
    if "data_wait_fraction" in loader:
        return float(loader["data_wait_fraction"]) >= STARVING_WAIT_FRACTION
    cap = float(client.get("ready_capacity", 0))
    return (
        cap > 0
        and int(client.get("credits", 0)) > 0
        and is_empty(float(client.get("ready", 0)), cap)
    )


def smooth(snapshots: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The last snapshot with stage depths and client ready counts averaged over all of them.

    A single snapshot catches each worker in one stage; a few seconds of them show where the
    batches actually pile up. Stages and clients are matched by name and id; ones missing from
    older snapshots are averaged over the snapshots that have them.
    """
    if not snapshots:
        raise ValueError("smooth() needs at least one snapshot")
    last = snapshots[-1]
    stage_sums: dict[str, list[float]] = {}
    ready_sums: dict[str, list[float]] = {}
    for snap in snapshots:
        for s in snap.get("stages", []):
            stage_sums.setdefault(str(s["name"]), []).append(float(s["depth"]))
        for c in snap.get("clients", []):
            ready_sums.setdefault(str(c.get("id")), []).append(float(c.get("ready", 0)))
    return {
        **last,
        "stages": [
            {**s, "depth": _mean(stage_sums[str(s["name"])])} for s in last.get("stages", [])
        ],
        "clients": [
            {**c, "ready": _mean(ready_sums[str(c.get("id"))])} for c in last.get("clients", [])
        ],
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
