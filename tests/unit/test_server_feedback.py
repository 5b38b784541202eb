"""What the server says: rejected handshakes (classified, rate-limited) and JSON log lines."""

from __future__ import annotations

import json
import logging
import sys

import zmq
from batchwire.server.handshakes import HandshakeFailures, classify
from batchwire.server.logformat import JsonFormatter


def test_handshake_failures_are_classified() -> None:
    protocol = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    assert classify(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400) == "unauthorized_key"
    assert classify(protocol, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) == "no_keys"
    assert classify(protocol, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC) == "wrong_server_key"
    assert classify(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32) == "other"


def test_the_first_failure_is_logged_at_once_then_one_summary_per_interval() -> None:
    failures = HandshakeFailures(interval_s=10.0)
    first = failures.record("no_keys", "tcp://0.0.0.0:5555", now=100.0)
    assert first is not None and "rejected 1 connection(s) on tcp://0.0.0.0:5555" in first
    assert "1 x a client without keys" in first
    for t in (100.1, 101.0, 105.0):  # a client reconnecting several times a second
        assert failures.record("unauthorized_key", "tcp://0.0.0.0:5555", now=t) is None
    summary = failures.record("unauthorized_key", "tcp://0.0.0.0:5555", now=111.0)
    assert summary is not None and "rejected 4 connection(s)" in summary
    assert "4 x a client key this server does not admit" in summary
    assert failures.total == {"no_keys": 1, "unauthorized_key": 4}


def test_json_log_lines() -> None:
    fmt = JsonFormatter()
    record = logging.LogRecord("batchwire.server", logging.WARNING, "f.py", 1, "x=%d", (3,), None)
    line = json.loads(fmt.format(record))
    assert line["level"] == "WARNING" and line["logger"] == "batchwire.server"
    assert line["message"] == "x=3" and line["time"].endswith("Z") and "exception" not in line
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record.exc_info = sys.exc_info()
    text = fmt.format(record)
    assert "\n" not in text  # a traceback stays inside its one line
    assert "ValueError: boom" in json.loads(text)["exception"]
