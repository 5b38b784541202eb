"""The terminal view as text: content, width handling, colour codes."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
from batchwire import wire
from batchwire.monitor.render import human_bytes, human_duration, render
from monitorsnaps import SNAP, SNAP_MAP

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_wide_view_shows_everything() -> None:
    text = render(SNAP, 140, endpoint="tcp://127.0.0.1:5555")
    assert "\x1b" not in text  # colour off by default
    assert "tcp://127.0.0.1:5555" in text and "up 1h02m" in text
    assert "bottleneck: stage 'read'" in text
    for name, count in (
        ("read", "16/16"),
        ("decode", "0/16"),
        ("augment", "2/8"),
        ("ready", "5/8"),
    ):
        row = next(line for line in text.splitlines() if line.strip().startswith(name + " "))
        assert count in row and "[" in row
    assert "1234.5 img/s" in text and "185.0 MB/s" in text
    assert "images 123,456" in text and "malformed 1" in text
    row0 = next(line for line in text.splitlines() if "62772d7430" in line).split()
    assert row0 == [
        "62772d7430",
        "train",
        "0/2",
        "3",
        "2",
        "1/4",
        "2",
        "120",
        "600.0",
        "35%",
        "0.2s",
    ]
    row1 = next(line for line in text.splitlines() if "62772d7431" in line).split()
    assert row1[-2:] == ["-", "1m15s"]  # no loader stats yet; last seen 75 s ago


@pytest.mark.parametrize("width", [20, 45, 60, 80])
def test_narrow_terminal_is_clipped_not_wrapped(width: int) -> None:
    lines = render(SNAP, width).splitlines()
    assert all(len(line) <= width for line in lines)
    client_rows = [line for line in lines if "62772d743" in line]
    assert len(client_rows) == 2  # the id column is never dropped
    if width >= 45:
        assert all("/4" in row for row in client_rows)  # nor the ready column


def test_short_terminal_says_how_many_clients_are_hidden() -> None:
    full = render(SNAP, 120).splitlines()
    lines = render(SNAP, 120, height=len(full) - 1).splitlines()
    assert len(lines) == len(full) - 1
    assert lines[-1].strip() == "... and 2 more"  # room for the header row only


def test_colour_codes_do_not_count_towards_width(monkeypatch: pytest.MonkeyPatch) -> None:
    # The header's clock, fixed: two renders straddling a second differed by their time alone.
    monkeypatch.setattr(time, "strftime", lambda fmt, *args: "12:00:00")
    text = render(SNAP, 50, color=True)
    assert "\x1b[" in text
    assert all(len(ANSI.sub("", line)) <= 50 for line in text.splitlines())
    assert ANSI.sub("", text) == render(SNAP, 50, color=False)


def test_error_and_no_snapshot_yet() -> None:
    text = render(None, 80, endpoint="tcp://x:1", error="no answer from tcp://x:1 within 5 s")
    assert "no answer from tcp://x:1" in text and "waiting for the first answer" in text


def test_ascii_bars() -> None:
    text = render(SNAP, 100, unicode=False)
    assert "#" in text and "█" not in text


def test_human_formats() -> None:
    assert human_bytes(999) == "999 B"
    assert human_bytes(1_500_000) == "1.5 MB"
    assert human_duration(3.25) == "3.2s"
    assert human_duration(59) == "59s"
    assert human_duration(3600 * 25) == "1d01h"


def test_clients_beyond_the_listed_ones_are_counted() -> None:
    """A server with thousands of clients lists the most active and sums the rest."""
    unlisted = wire.UnlistedClients(
        count=3998, credits=0, ready=0, in_flight=0, sent=10, images_per_s=0.0
    )
    snap = dataclasses.replace(SNAP, clients_unlisted=unlisted)
    assert f"clients ({len(SNAP.clients) + 3998}, 3998 more not listed)" in render(snap, 140)


def test_the_live_view_draws_at_the_consoles_size() -> None:
    """`MonitorView` (what rich's Live redraws) fits whatever size the console has now."""
    import io

    from batchwire.monitor.render import MonitorView
    from rich.console import Console

    view = MonitorView("tcp://x:1", unicode=True)
    view.snapshot = SNAP
    for width in (44, 120):
        out = io.StringIO()
        Console(file=out, width=width, height=40, color_system=None).print(view)
        lines = out.getvalue().splitlines()
        assert all(len(line) <= width for line in lines)
        assert sum("62772d743" in line for line in lines) == 2


def test_the_bottleneck_line_is_wrapped_not_cut_in_a_pipe() -> None:
    """`pipeline-monitor --once | less` at the pipe's 120 columns, or a narrow terminal: the
    bottleneck's reason is the line a user acts on, so every word of it is shown."""
    from batchwire.monitor.bottleneck import Bottleneck

    reason = "the read queue is full while decode waits: " + "storage is slow " * 8 + "END"
    for width in (60, 120):
        text = render(SNAP, width, bottleneck=Bottleneck("stage", "read", reason))
        assert all(len(line) <= width for line in text.splitlines())
        assert "END)" in text and " ".join(text.split()).count("storage is slow") == 8


def _sharing_snapshot(clients: int) -> wire.ServerStats:
    snap = dict(SNAP_MAP, clients=SNAP_MAP["clients"][:clients])
    snap["counters"] = dict(SNAP_MAP["counters"], batches_produced_total=3386)
    snap["clients"] = [dict(c, sharing="solo") for c in snap["clients"]]
    return wire.ServerStats.from_map(snap)


def test_a_lone_client_reads_as_nothing_to_share() -> None:
    """One client: "share ratio 0.57" read as a fault; it is batches produced ahead of it."""
    lone = render(_sharing_snapshot(1), 160)
    assert "share ratio" not in lone
    assert "produced 3,386  sent 1,929 (one client: nothing to share)" in lone
    two = render(_sharing_snapshot(2), 160)
    assert "share ratio 0.57 (batches sent per batch produced)" in two
    # Every client gone (a trainer audit saw "one client" then): no client, not one.
    assert "sent 1,929 (no client now: nothing to share)" in render(_sharing_snapshot(0), 160)


def test_the_sharing_line_keeps_its_lagging_count_in_a_pipe() -> None:
    """`pipeline-monitor --once | tee log` renders at 120 columns: the sharing line's client
    counts (a lagging job is what an operator looks for) are wrapped, never cut off."""
    snap = _sharing_snapshot(2)
    snap = dataclasses.replace(
        snap, clients=[dataclasses.replace(c, sharing="lagging") for c in snap.clients]
    )
    for width in (80, 120):
        text = render(snap, width)
        assert all(len(line) <= width for line in text.splitlines())
        assert "0 shared, 0 solo, 2 lagging" in " ".join(text.split())


def test_a_mix_shows_each_parts_share_of_the_epoch_against_its_weight() -> None:
    """One line per mixture split: each part's share of the samples sent in the split's
    latest epoch (of all sent where a server gives no epoch count), and its weight."""
    parts = [
        {"name": "web", "weight": 0.7, "served_total": 9000, "served_this_epoch": 701},
        {"name": "curated", "weight": 0.3, "served_total": 1000, "served_this_epoch": 299},
    ]
    fresh = [{"name": "a", "weight": 0.25, "served_total": 0}, {**parts[0], "name": "b"}]
    fresh[1].pop("served_this_epoch")
    snap = wire.ServerStats.from_map(
        {
            **SNAP_MAP,
            "mixes": [
                {"split": "train", "parts": parts, "epoch": 4},
                {"split": "val", "parts": fresh},
            ],
        }
    )
    text = render(snap, 140)
    assert "mix train: web 70.1% (w 0.70)  curated 29.9% (w 0.30)  epoch 4" in text
    assert "mix val: a 0.0% (w 0.25)  b 100.0% (w 0.70)\n" in text
    empty = [{**p, "served_total": 0} for p in fresh]
    text = render(
        wire.ServerStats.from_map({**SNAP_MAP, "mixes": [{"split": "t", "parts": empty}]})
    )
    assert "mix t: a - (w 0.25)  b - (w 0.70)" in text
    assert "mix " not in render(SNAP, 140)  # no mixture: no line
