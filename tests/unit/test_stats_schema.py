"""The Stats schema (wire/stats.py): round trips, a clear error for every wrong field, unknown
keys ignored, the server's lenient reading of a trainer's report, and fuzzed maps that never
raise anything but ProtocolError nor crash the monitor's view."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import fields
from typing import Any

import msgpack
import pytest
from batchwire import wire
from batchwire.monitor.bottleneck import infer_bottleneck, smooth
from batchwire.monitor.render import render
from batchwire.wire.stats import MAX_FIGURE_NAME, MAX_LOADER_FIGURES, MixPartStats, MixStats

LOADER = {
    "prefetch_depth": 2,
    "wait_s_per_batch": 0.01,
    "data_wait_fraction": 0.35,
    "images_per_s": 590.0,
}
ROW = {
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
    "loader": LOADER,
}
FULL = {
    "v": 1,
    "uptime_s": 3725.0,
    "time": 1.7e9,
    "stages": [
        {"name": "read", "depth": 16, "capacity": 16, "latency_ms": 1.5},
        {"name": "decode", "depth": 0, "capacity": 16, "latency_ms": 42.0},
        {"name": "augment", "depth": 2, "capacity": 8, "latency_ms": 6.0},
        {"name": "ready", "depth": 1, "capacity": 8, "latency_ms": 0.0},
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
    "clients": [ROW, {**ROW, "id": "62772d7431", "rank": 1, "loader": None}],
    "clients_unlisted": {
        "count": 3,
        "credits": 1,
        "ready": 0,
        "in_flight": 0,
        "sent": 9,
        "images_per_s": 0.5,
    },
    "buffers": {"held": 3, "allocated": 8, "max": 64, "batch_bytes": 1 << 20},
    "connections": 4,
    "mixes": [
        {
            "split": "train",
            "parts": [
                {"name": "web", "weight": 0.7, "served_total": 7010, "served_this_epoch": 701},
                {"name": "curated", "weight": 0.3, "served_total": 2990, "served_this_epoch": 299},
            ],
            "epoch": 9,
        }
    ],
}


def test_round_trip_through_msgpack_and_the_reply() -> None:
    stats = wire.ServerStats.from_map(FULL)
    assert stats.to_map() == FULL  # the map a server sends is exactly what it had
    assert wire.ServerStats.from_map(msgpack.unpackb(msgpack.packb(stats.to_map()))) == stats
    reply = wire.StatsReply(stats)
    assert wire.decode_server_message(reply.pack()) == reply
    assert stats.clients[0].loader == wire.LoaderReport(**LOADER)
    assert stats.clients[1].loader is None
    assert stats.stage("decode") == wire.StageStats("decode", 0, 16, 42.0)
    assert stats.stage("nope") is None


def test_numbers_are_normalised() -> None:
    """A float field may arrive as an integer (another msgpack writer); it reads as a float."""
    stats = wire.ServerStats.from_map({**FULL, "uptime_s": 3})
    assert stats.uptime_s == 3.0 and isinstance(stats.uptime_s, float)


def test_optional_sections_may_be_missing_and_stay_missing() -> None:
    optional = ("clients_unlisted", "buffers", "connections", "mixes")
    bare = {k: v for k, v in FULL.items() if k not in optional}
    stats = wire.ServerStats.from_map(bare)
    assert (stats.clients_unlisted, stats.buffers, stats.connections) == (None, None, None)
    assert stats.mixes is None  # a server serving no mixture, or an older one
    assert stats.to_map() == bare
    # A mix before its first batch sent: no epoch, nothing served this epoch.
    fresh = {"split": "train", "parts": [{"name": "a", "weight": 1.0, "served_total": 0}]}
    mixes = wire.ServerStats.from_map({**bare, "mixes": [fresh]}).mixes
    assert mixes == (MixStats("train", (MixPartStats("a", 1.0, 0),)),)
    assert mixes[0].to_map() == fresh
    # A client row's loader always travels, as nil when the trainer sent no report.
    assert stats.to_map()["clients"][1]["loader"] is None
    row = {k: v for k, v in ROW.items() if k != "loader"}
    assert wire.ClientRow.from_map(row).loader is None


def test_unknown_keys_are_ignored() -> None:
    """A newer server's extra fields do not stop an older monitor."""
    newer = copy.deepcopy(FULL)
    newer["gpu"] = {"util": 0.5}
    newer["v"] = 2
    newer["stages"][0]["p99_ms"] = 3.0
    newer["counters"]["timeouts_total"] = 5
    newer["clients"][0]["host"] = "node-3"
    newer["buffers"]["pinned"] = True
    stats = wire.ServerStats.from_map(newer)
    assert stats.v == 2
    assert wire.ServerStats.from_map({**newer, "v": 1}) == wire.ServerStats.from_map(FULL)


def _paths(value: Any, path: str) -> list[tuple[str, Any]]:
    """Every leaf of the example map with its path, as error messages name it."""
    if isinstance(value, dict):
        out: list[tuple[str, Any]] = []
        for k, v in value.items():
            out += _paths(v, f"{path}.{k}")
        return out
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _paths(v, f"{path}[{i}]")]
    return [(path, value)]


def _set(d: Any, path: str, value: Any) -> None:
    """Set the leaf ``path`` (as `_paths` spells it, without the leading "stats") of ``d``."""
    parts = path.replace("[", ".[").split(".")[1:]
    for part in parts[:-1]:
        d = d[int(part[1:-1])] if part.startswith("[") else d[part]
    last = parts[-1]
    if last.startswith("["):
        d[int(last[1:-1])] = value
    else:
        d[last] = value


def _wrong_values(value: Any) -> list[Any]:
    """Values of the wrong type for a field whose example value is ``value``."""
    common = [[1], {"a": 1}, b"\x00"]
    if isinstance(value, str):
        return [*common, 1, None, 1.5]
    if isinstance(value, int):
        return [*common, "1", True, None, 1.5, -1, 2**64]
    return [*common, "1.0", True, None, math.nan, math.inf, -math.inf]


LEAVES = [(p, v) for p, v in _paths(FULL, "stats") if v is not None]


@pytest.mark.parametrize(("path", "value"), LEAVES, ids=[p for p, _ in LEAVES])
def test_every_wrong_type_is_a_protocol_error_naming_the_field(path: str, value: Any) -> None:
    optional = (
        path.startswith("stats.connections")
        or ".loader." in path
        or (path.endswith(("served_this_epoch", "].epoch")) and path.startswith("stats.mixes"))
    )
    for wrong in _wrong_values(value):
        if wrong is None and optional:
            continue  # nil is a fine value for an optional field
        bad = copy.deepcopy(FULL)
        _set(bad, path, wrong)
        with pytest.raises(wire.ProtocolError) as info:
            wire.ServerStats.from_map(bad)
        assert str(info.value).startswith(path), (wrong, str(info.value))


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"stages": 5}, "stats.stages must be a list, got 5"),
        ({"stages": [7]}, "stats.stages[0] must be a map, got 7"),
        ({"throughput": None}, "stats.throughput must be a map, got None"),
        ({"clients": [{**ROW, "loader": [1]}]}, "stats.clients[0].loader must be a map"),
        ({"buffers": "full"}, "stats.buffers must be a map"),
        ({"counters": {}}, "stats.counters.images_total is missing"),
    ],
)
def test_wrong_shapes_name_the_field(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(wire.ProtocolError) as info:
        wire.ServerStats.from_map({**FULL, **change})
    assert needle in str(info.value)


def test_every_required_field_missing_is_named() -> None:
    for f in fields(wire.ServerStats):
        if f.default is None:
            continue
        with pytest.raises(wire.ProtocolError, match=f"stats.{f.name} is missing"):
            wire.ServerStats.from_map({k: v for k, v in FULL.items() if k != f.name})
    with pytest.raises(wire.ProtocolError, match="stats must be a map"):
        wire.ServerStats.from_map([FULL])


def test_a_bad_reply_frame_is_a_protocol_error() -> None:
    frame = msgpack.packb(
        {"v": 2, "type": "stats", "stats": {**FULL, "clients": [{**ROW, "rank": "0"}]}}
    )
    with pytest.raises(wire.ProtocolError, match=r"stats\.clients\[0\]\.rank"):
        wire.decode_server_message(frame)
    with pytest.raises(wire.ProtocolError, match="stats must be a map"):
        wire.decode_server_message(msgpack.packb({"v": 2, "type": "stats"}))


# ------------------------------------------------------------------------- the loader's report


def test_loader_report_keeps_a_newer_trainers_figures() -> None:
    report = wire.LoaderReport.from_map({**LOADER, "gpu_util": 0.9, "note": "hi", "n": [1]})
    assert report == wire.LoaderReport(**LOADER, extra={"gpu_util": 0.9})
    assert report.to_map() == {**LOADER, "gpu_util": 0.9}
    partial = wire.LoaderReport.from_map({"data_wait_fraction": 0.25})
    assert partial.prefetch_depth is None and partial.to_map() == {"data_wait_fraction": 0.25}
    with pytest.raises(wire.ProtocolError, match=r"loader\.prefetch_depth"):
        wire.LoaderReport.from_map({"prefetch_depth": 1.5})


def test_loader_report_extra_figures_must_be_finite() -> None:
    """An extra figure that is not a finite number is dropped by the strict reading too."""
    report = wire.LoaderReport.from_map({"a": math.inf, "b": True, "c": 2})
    assert report.extra == {"c": 2}


def test_clean_is_the_servers_lenient_reading_of_a_credit() -> None:
    """Whatever a trainer sends, the server keeps finite numbers only, at most 32 of them under
    names of at most 64 characters, and never raises (what the server stores from each credit)."""
    assert wire.LoaderReport.clean(None) is None
    assert wire.LoaderReport.clean([1, 2]) is None
    raw = {
        "prefetch_depth": 3.0,
        "data_wait_fraction": 1,
        "wait_s_per_batch": math.nan,
        "images_per_s": "fast",
        "flag": True,
        "x" * 100: 1.5,
        7: 2,
    }
    report = wire.LoaderReport.clean(raw)
    assert report == wire.LoaderReport(
        prefetch_depth=3, data_wait_fraction=1.0, extra={"x" * MAX_FIGURE_NAME: 1.5, "7": 2}
    )
    assert wire.LoaderReport.clean({"prefetch_depth": -1}) == wire.LoaderReport()
    assert wire.LoaderReport.clean({"prefetch_depth": 2.5}) == wire.LoaderReport()
    many = {f"f{i}": float(i) for i in range(100)}
    assert len(wire.LoaderReport.clean(many).extra) == MAX_LOADER_FIGURES
    # What the server keeps reads back strictly on the monitor's side.
    kept = wire.LoaderReport.clean(raw).to_map()
    assert wire.LoaderReport.from_map(kept) == wire.LoaderReport.clean(raw)


# ------------------------------------------------------------------------- fuzzing


_ODD = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**63,
    2**64,
    -(2**63),
    0.0,
    -0.5,
    1e308,
    math.nan,
    math.inf,
    "",
    "x",
    "read",
    b"\xff",
    [],
    [1, "a"],
    {},
    {"a": 1},
    {1: 2},
]


def _mutate(value: Any, rng: random.Random, rate: float) -> Any:
    """A copy of ``value`` with about ``rate`` of its leaves, lists and maps replaced, dropped
    or joined by odd ones."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            roll = rng.random()
            if roll < rate / 2:
                continue  # dropped
            out[k] = rng.choice(_ODD) if roll < rate else _mutate(v, rng, rate)
        if rng.random() < rate:
            out[rng.choice(["zz", "v", "name", 3])] = rng.choice(_ODD)
        return out
    if isinstance(value, list):
        items = [_mutate(v, rng, rate) for v in value]
        if rng.random() < rate:
            items.append(rng.choice(_ODD))
        return items
    return rng.choice(_ODD) if rng.random() < rate else value


def test_fuzzed_maps_raise_only_protocol_errors_and_never_crash_the_monitor() -> None:
    """A hostile server cannot crash a monitor: whatever map arrives is either a ServerStats the
    view renders, or a ProtocolError the view shows as a message."""
    rng = random.Random(19)
    accepted = 0
    for _ in range(1500):
        fuzzed = _mutate(FULL, rng, rng.choice((0.005, 0.02, 0.1)))
        try:
            stats = wire.ServerStats.from_map(fuzzed)
        except wire.ProtocolError:
            continue
        accepted += 1
        render(stats, 100, height=30)
        render(stats, 30)
        infer_bottleneck(smooth([stats, stats]))
        assert wire.ServerStats.from_map(stats.to_map()) == stats
    assert accepted > 10  # the fuzzing also exercised valid-but-odd snapshots


def test_fuzzed_loader_reports_never_raise_in_clean() -> None:
    rng = random.Random(7)
    for _ in range(500):
        raw = _mutate({**LOADER, "extra": 1.0}, rng, 0.3)
        report = wire.LoaderReport.clean(raw)
        assert report is not None
        assert wire.LoaderReport.from_map(report.to_map()) == report
