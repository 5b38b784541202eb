"""The bottleneck inference, on hand-built snapshots of each situation it must tell apart.

A stage's depth counts batches in it or waiting for it (as pipeline-server reports). The live
counterpart, a real client that stops reading, is in test_monitor_live.py.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from batchwire import wire
from batchwire.monitor.bottleneck import infer_bottleneck, smooth


def snapshot(
    stages: list[tuple[str, int, int]],
    clients: list[tuple[int, int]],
    *,
    credits: int = 2,
    latency: dict[str, float] | None = None,
    loader: dict[str, Any] | None = None,
) -> wire.ServerStats:
    """stages: (name, depth, capacity); clients: (ready, ready_capacity), each with ``loader``."""
    latency = latency or {}
    snap = {
        "v": 1,
        "uptime_s": 10.0,
        "time": 0.0,
        "stages": [
            {"name": n, "depth": d, "capacity": c, "latency_ms": latency.get(n, 0.0)}
            for n, d, c in stages
        ],
        "throughput": {"images_per_s": 0.0, "batches_per_s": 0.0, "bytes_per_s": 0.0},
        "counters": dict.fromkeys(COUNTERS, 0),
        "clients": [
            {
                "id": f"c{i}",
                "split": "train",
                "rank": i,
                "world_size": len(clients),
                "epoch": 0,
                "credits": credits,
                "ready": r,
                "ready_capacity": cap,
                "in_flight": 0,
                "sent": 0,
                "images_per_s": 0.0,
                "last_seen_s": 0.0,
                "loader": loader,
            }
            for i, (r, cap) in enumerate(clients)
        ],
    }
    return wire.ServerStats.from_map(snap)


COUNTERS = [f.name for f in fields(wire.Counters)]


@pytest.mark.parametrize(
    ("stages", "clients", "expected"),
    [
        # Decoding is slow: batches held in read and decode, none reaches augment or ready.
        ([("read", 4, 4), ("decode", 2, 2), ("augment", 0, 2)], [(0, 4)], ("stage", "decode")),
        # Reading is slow (a cold disk): everything after it starves.
        ([("read", 4, 4), ("decode", 0, 2), ("augment", 0, 2)], [(0, 4)], ("stage", "read")),
        # Augmenting is slow, seen while the job backlog is counted in read: the link
        # closest to the trainers wins over the backlog's edge.
        ([("read", 4, 4), ("decode", 0, 2), ("augment", 2, 2)], [(0, 4)], ("stage", "augment")),
        # "Nearly" full counts as full; a single leftover item in a big queue counts as empty.
        ([("read", 14, 16), ("decode", 14, 16), ("augment", 1, 16)], [(0, 4)], ("stage", "decode")),
        # Batches are made but do not reach the clients' ready queues (the ready link is
        # built from the clients when the server does not list it).
        (
            [("read", 4, 4), ("decode", 2, 2), ("augment", 2, 2)],
            [(0, 4), (0, 4)],
            ("stage", "augment"),
        ),
        # Every trainer is behind: all ready queues full, whatever the stages look like.
        (
            [("read", 4, 4), ("decode", 0, 2), ("augment", 0, 2)],
            [(4, 4), (4, 4)],
            ("trainers", None),
        ),
        (
            [("read", 1, 4), ("decode", 1, 2), ("augment", 0, 2)],
            [(4, 4), (9, 10)],
            ("trainers", None),
        ),
        # One trainer behind and one keeping up is not "the trainers".
        (
            [("read", 2, 4), ("decode", 1, 2), ("augment", 1, 2)],
            [(4, 4), (2, 4)],
            ("balanced", None),
        ),
        # Queues half full everywhere: nothing to blame.
        ([("read", 2, 4), ("decode", 1, 2), ("augment", 1, 2)], [(2, 4)], ("balanced", None)),
        # Nobody connected.
        ([("read", 0, 4), ("decode", 0, 2), ("augment", 0, 2)], [], ("idle", None)),
    ],
)
def test_inference_from_queues(stages, clients, expected) -> None:
    b = infer_bottleneck(snapshot(stages, clients))
    assert (b.kind, b.stage) == expected, b.reason


def test_server_reported_ready_stage_is_used_not_duplicated() -> None:
    snap = snapshot([("read", 1, 4), ("augment", 2, 2), ("ready", 0, 8)], [(0, 4), (1, 4)])
    b = infer_bottleneck(snap)
    assert (b.kind, b.stage) == ("stage", "augment")
    assert b.reason == "'augment' is full (2/2) and 'ready' behind it is empty (0/8)"


def test_starving_trainers_without_a_clear_edge_blame_the_slowest_stage() -> None:
    # One worker caught in augment: no full-then-empty edge, but the trainers are starving,
    # and decode is where each batch spends most of its time.
    stages = [("read", 1, 2), ("decode", 0, 1), ("augment", 1, 1), ("ready", 0, 4)]
    latency = {"read": 2.0, "decode": 40.0, "augment": 8.0, "ready": 300.0}
    b = infer_bottleneck(snapshot(stages, [(0, 4)], latency=latency))
    assert (b.kind, b.stage) == ("stage", "augment")  # this one does show an edge
    stages = [("read", 1, 2), ("decode", 1, 2), ("augment", 0, 2), ("ready", 0, 4)]
    b = infer_bottleneck(snapshot(stages, [(0, 4)], latency=latency))
    assert (b.kind, b.stage) == ("stage", "decode")
    assert "40.0 of 50.0 ms" in b.reason
    # Without credits the trainers are not asking for anything: the server waits for them.
    b = infer_bottleneck(snapshot(stages, [(0, 4)], credits=0, latency=latency))
    assert b.kind == "trainers" and "none is asked for" in b.reason


def test_the_loaders_own_wait_report_decides_who_starves() -> None:
    stages = [("read", 1, 2), ("decode", 1, 2), ("augment", 0, 2), ("ready", 1, 4)]
    latency = {"read": 1.0, "decode": 2.0, "augment": 3.0}
    loader = {
        "prefetch_depth": 1,
        "wait_s_per_batch": 0.02,
        "data_wait_fraction": 0.9,
        "images_per_s": 100.0,
    }
    snap = snapshot(stages, [(1, 4)], credits=0, latency=latency, loader=loader)
    b = infer_bottleneck(snap)
    assert (b.kind, b.stage) == ("stage", "augment")
    # Nothing ready and credits held, but the trainer says it hardly waits: balanced.
    loader = {
        "prefetch_depth": 2,
        "wait_s_per_batch": 0.0,
        "data_wait_fraction": 0.05,
        "images_per_s": 100.0,
    }
    snap = snapshot(
        [*stages[:3], ("ready", 0, 4)], [(0, 4)], credits=2, latency=latency, loader=loader
    )
    assert infer_bottleneck(snap).kind == "balanced"


def test_unbounded_or_zero_capacity_queues_never_count() -> None:
    snap = snapshot([("read", 5, 0), ("decode", 0, 0)], [(0, 0)])
    assert infer_bottleneck(snap).kind == "balanced"


def test_smoothing_finds_where_batches_really_are() -> None:
    # A single worker sampled three times: twice in decode, once in augment.
    stages_at = [
        [("read", 2, 2), ("decode", 1, 1), ("augment", 0, 1)],
        [("read", 2, 2), ("decode", 1, 1), ("augment", 0, 1)],
        [("read", 2, 2), ("decode", 0, 1), ("augment", 1, 1)],
    ]
    snaps = [snapshot(s, [(0, 4)]) for s in stages_at]
    assert infer_bottleneck(snaps[-1]).stage == "augment"  # the last sample alone misleads
    averaged = smooth(snaps)
    assert [s.depth for s in averaged.stages] == [2.0, 2 / 3, 1 / 3]
    assert [s.capacity for s in averaged.stages] == [2, 1, 1]
    assert averaged.trainers[0].ready == 0.0
    assert infer_bottleneck(averaged).stage != "augment"
    with pytest.raises(ValueError):
        smooth([])


def test_labels() -> None:
    assert infer_bottleneck(snapshot([], [(4, 4)])).label == "the trainers"
    assert (
        infer_bottleneck(snapshot([("read", 4, 4), ("decode", 0, 4)], [(0, 4)])).label
        == "stage 'read'"
    )
    assert infer_bottleneck(snapshot([], [])).label == "none (idle)"
    assert infer_bottleneck(snapshot([("read", 1, 4)], [(1, 4)])).label == "none (balanced)"
