"""`pipeline-server --log-format json`: every line the server logs is one JSON object (a real
server process, a few seconds)."""

from __future__ import annotations

import json

import pytest
from serverproc import running_server, small_server_args


@pytest.mark.timeout(60)
def test_every_log_line_is_a_json_object() -> None:
    with running_server(*small_server_args(seed=3), "--log-format", "json") as srv:
        srv.stop()  # exit code 0 checked there
        text = srv.log()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("$ ")]
    records = [json.loads(line) for line in lines]  # fails on any line that is not JSON
    assert {"time", "level", "logger", "message"} <= set(records[0])
    messages = [r["message"] for r in records]
    assert any(m.startswith("serving train on tcp://") for m in messages), messages
    assert any(m.startswith("keys: off (plain sockets") for m in messages), messages
    assert records[-1]["message"] == "stopped"
