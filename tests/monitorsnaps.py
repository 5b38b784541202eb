"""A server's stats snapshot for the monitor's unit tests: `SNAP_MAP` as the wire carries it
(two clients, one with loader figures, one silent for a while) and `SNAP`, it read as a
`wire.ServerStats`. Shared by test_monitor_render.py, test_monitor_fleet.py and
test_sample_window.py."""

from __future__ import annotations

from batchwire import wire

SNAP_MAP = {
    "v": 1,
    "uptime_s": 3725.0,
    "time": 0.0,
    "stages": [
        {"name": "read", "depth": 16, "capacity": 16, "latency_ms": 1.5},
        {"name": "decode", "depth": 0, "capacity": 16, "latency_ms": 42.0},
        {"name": "augment", "depth": 2, "capacity": 8, "latency_ms": 6.0},
    ],
    "throughput": {"images_per_s": 1234.5, "batches_per_s": 19.29, "bytes_per_s": 185e6},
    "counters": {
        "images_total": 123456,
        "batches_total": 1929,
        "bytes_total": 11_800_000_000,
        "replaced_total": 3,
        "bad_total": 3,
        "errors_total": 0,
        "malformed_total": 1,
    },
    "clients": [
        {
            "id": "62772d7430",
            "split": "train",
            "rank": 0,
            "world_size": 2,
            "epoch": 3,
            "credits": 2,
            "ready": 1,
            "ready_capacity": 4,
            "in_flight": 2,
            "sent": 120,
            "images_per_s": 600.0,
            "last_seen_s": 0.2,
            "loader": {
                "prefetch_depth": 2,
                "wait_s_per_batch": 0.01,
                "data_wait_fraction": 0.35,
                "images_per_s": 590.0,
            },
        },
        {
            "id": "62772d7431",
            "split": "val",
            "rank": 1,
            "world_size": 2,
            "epoch": 0,
            "credits": 0,
            "ready": 4,
            "ready_capacity": 4,
            "in_flight": 0,
            "sent": 12,
            "images_per_s": 0.0,
            "last_seen_s": 75.0,
            "loader": None,
        },
    ],
}
SNAP = wire.ServerStats.from_map(SNAP_MAP)
