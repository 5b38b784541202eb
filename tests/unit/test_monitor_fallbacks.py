"""pipeline-monitor shows a GPU decoder's fallbacks to the CPU when there are any (issue 25,
defect 4), and nothing about them otherwise (an older server, or none fell back)."""

from __future__ import annotations

import dataclasses

from batchwire import wire
from batchwire.monitor.render import render
from batchwire.server.telemetry import Telemetry


def _snapshot(fallbacks: int | None) -> wire.ServerStats:
    snap = Telemetry().snapshot([], [])
    counters = dataclasses.replace(snap.counters, decode_fallbacks_total=fallbacks)
    return dataclasses.replace(snap, counters=counters)


def test_fallbacks_are_shown_when_non_zero() -> None:
    text = render(_snapshot(1234), 160)
    assert "CPU-decoded fallbacks 1,234" in text


def test_no_fallbacks_no_word() -> None:
    assert "fallback" not in render(_snapshot(0), 160)
    assert "fallback" not in render(_snapshot(None), 160)  # an older server's stats


def test_the_field_travels_and_an_older_map_still_reads() -> None:
    snap = _snapshot(7)
    m = snap.to_map()
    assert m["counters"]["decode_fallbacks_total"] == 7
    assert wire.ServerStats.from_map(m) == snap
    del m["counters"]["decode_fallbacks_total"]
    assert wire.ServerStats.from_map(m).counters.decode_fallbacks_total is None
