"""Rejected security handshakes: why each one failed, counted, and said in the log now and then.

A server started with ``--keys`` never hears from a client whose keys do not fit: ZeroMQ drops
the connection during its handshake, and the client sees only silence (`RemoteLoader` and
`pipeline-monitor` read their own monitor events and name the problem). The operator should
see it too, on the server: its socket monitor reports each failure, `RouterSocket` hands it
here, and the server logs it (the first at once, then at most one summary per
`LOG_INTERVAL_S`: a misconfigured client reconnects several times a second) and counts it
(``batchwire_handshake_failures_total{reason}``).
"""

from __future__ import annotations

import math
from collections import Counter

import zmq

LOG_INTERVAL_S = 10.0

#: reason label -> what it means for the operator
REASONS = {
    "no_keys": "a client without keys (give it the keys folder: keys=DIR or BATCHWIRE_KEYS=DIR)",
    "wrong_server_key": (
        "a client holding another server's key (its keys folder is not this server's)"
    ),
    "unauthorized_key": (
        "a client key this server does not admit (not the keys folder's client.key, nor in "
        "its authorized/ folder)"
    ),
    "other": (
        "a connection that failed the handshake without saying why (often a client without the "
        "keys that hung up first, or not a ZeroMQ client)"
    ),
}


def classify(event: int, value: int) -> str:
    """The reason label of a ``EVENT_HANDSHAKE_FAILED_*`` monitor event with this value."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "unauthorized_key"  # the ZAP handler (ServerKeys.callback) said no
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "no_keys"  # a NULL (plain) peer meeting our CURVE socket
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "wrong_server_key"  # it encrypted to another server's public key
    return "other"


class HandshakeFailures:
    """Counts failures by reason; `record` returns a log line when one is due."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.total: Counter[str] = Counter()
        self._since_log: Counter[str] = Counter()
        self._logged_at = -math.inf
        self._endpoint = ""  # where the latest failure happened (the summary names it)

    def record(self, reason: str, endpoint: str, now: float) -> str | None:
        """Count one failure on ``endpoint``; the warning to log now, or None."""
        self.total[reason] += 1
        self._since_log[reason] += 1
        self._endpoint = endpoint
        return self.due(now)

    def due(self, now: float) -> str | None:
        """The warning for the failures not yet logged, once `interval_s` has passed since the
        last one (the first at once); else None. The server asks at every turn of its loop too:
        a burst of failures that ends (a misconfigured client given up) is still said."""
        if not self._since_log or now - self._logged_at < self.interval_s:
            return None
        first = self._logged_at == -math.inf
        self._logged_at = now
        counts, self._since_log = self._since_log, Counter()
        what = "; ".join(f"{n} x {REASONS.get(r, r)}" for r, n in counts.most_common())
        when = "" if first else f" in the last {self.interval_s:g} s or more"
        return (
            f"rejected {sum(counts.values())} connection(s) on {self._endpoint}{when} in the "
            f"security handshake (--keys is on): {what}"
        )
