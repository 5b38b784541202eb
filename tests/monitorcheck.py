"""What the end-to-end monitor tests share: the `pipeline-monitor` command, and the checks of
its ``--json`` output against the Stats schema (wire/stats.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from batchwire import wire

_MONITOR = Path(sys.executable).parent / "pipeline-monitor"
MONITOR = [str(_MONITOR)] if _MONITOR.exists() else [sys.executable, "-m", "batchwire.monitor.cli"]


def check_stats(snap: dict[str, Any]) -> None:
    """One server's stats as it sent them: the Stats schema field by field, plus what the types
    cannot say."""
    stats = wire.ServerStats.from_map(snap)  # every field there, of its type
    assert stats.v == wire.STATS_VERSION == 1
    assert stats.to_map() == snap, "the monitor prints the map as the server sent it"
    assert stats.stages, "the server reports no stages"
    for client in stats.clients:
        if client.loader is not None:  # a RemoteLoader's report: all four figures
            assert None not in (
                client.loader.prefetch_depth,
                client.loader.wait_s_per_batch,
                client.loader.data_wait_fraction,
                client.loader.images_per_s,
            ), client.loader


def check_server_json(doc: dict[str, Any], endpoint: str) -> None:
    """``--json`` of one server: the fleet's shape (one entry in ``servers``, ``total``) with
    the server's stats as sent, which are also at the top level (scripts from before the
    fleet's shape read them there)."""
    assert (doc["fleet"], doc["dns_error"], doc["total"]["answering"]) == (endpoint, None, 1)
    (entry,) = doc["servers"]
    assert (entry["endpoint"], entry["error"]) == (endpoint, None)
    snap = entry["stats"]
    assert {key: doc[key] for key in snap} == snap, "the top level carries the stats as sent"
    check_stats(snap)
