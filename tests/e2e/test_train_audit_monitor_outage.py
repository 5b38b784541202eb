"""pipeline-monitor --json with a server that goes away and comes back (docs/metrics.md: `--json`
prints one object per refresh, `stats` null with `error` for a server that did not answer; a
single server's --json has the fleet's shape, "so one script reads both")."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serverproc import running_server

MONITOR = Path(sys.executable).parent / "pipeline-monitor"


def _next_line(proc: subprocess.Popen, within: float) -> dict | None:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(within):
        return None
    return json.loads(proc.stdout.readline())


@pytest.mark.timeout(90)
def test_live_json_says_when_the_server_is_away_and_when_it_is_back() -> None:
    with running_server("--image-size", "32", "--batch-size", "8", endpoint="ipc") as srv:
        cmd = [str(MONITOR), srv.endpoint, "--json", "--interval", "0.5", "--timeout", "0.5"]
        mon = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = _next_line(mon, 10)
            assert first is not None and first["servers"][0]["stats"] is not None
            srv.kill()
            deadline, away = time.monotonic() + 5, None
            while away is None and time.monotonic() < deadline:
                line = _next_line(mon, 2)
                if line is not None and line["servers"][0]["stats"] is None:
                    away = line
            assert away is not None, "no JSON line said the server was away"
            [entry] = away["servers"]
            assert entry["endpoint"] == srv.endpoint and "no answer" in entry["error"]
            assert away["total"]["answering"] == 0
            srv.start()
            back = None
            while back is None or back["servers"][0]["stats"] is None:
                back = _next_line(mon, 10)
                assert back is not None, "no JSON line after the server came back"
            assert back["servers"][0]["error"] is None
        finally:
            mon.kill()
            mon.wait()
