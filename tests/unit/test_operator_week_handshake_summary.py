"""docs/cli.md: rejected handshakes are logged "the first at once, then a summary every 10 s".
The failures after the first must reach the log once the interval is over, even when no
further connection fails (a misconfigured trainer that gave up): the server's loop asks."""

from __future__ import annotations

from batchwire.server.handshakes import HandshakeFailures


def test_a_burst_that_ends_is_still_summarised_once_its_interval_is_over() -> None:
    failures = HandshakeFailures(interval_s=10.0)
    first = failures.record("no_keys", "tcp://127.0.0.1:5555", now=0.0)
    assert first is not None and "1 x a client without keys" in first
    assert failures.record("unauthorized_key", "tcp://127.0.0.1:5555", now=1.0) is None
    assert failures.due(now=9.0) is None  # within the interval: held
    summary = failures.due(now=10.5)
    assert summary is not None and "1 x a client key this server does not admit" in summary
    assert "tcp://127.0.0.1:5555" in summary
    assert failures.due(now=30.0) is None  # nothing new: nothing to say
