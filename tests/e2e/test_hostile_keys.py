"""A hostile peer against a keyed pipeline-server (``--keys``) and its metrics port.

tests/e2e/test_security.py shows that an anonymous or wrongly keyed ZeroMQ peer gets no reply;
here the port is probed below ZeroMQ (random bytes, a ZMTP greeting that offers no keys, then
junk) and the metrics port with malformed HTTP: no reply on the data port, one warning per
interval in the log (not one per connection), an honest key holder served in full, and no
secret key in the log, the stats or the metrics.
"""

from __future__ import annotations

import random
import shutil
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from batchwire import wire
from batchwire.client import RemoteLoader
from batchwire.server.handshakes import HandshakeFailures
from batchwire.wire.keys import ClientKeys, create_keys
from serverproc import ServerProcess, free_tcp_endpoint, running_server, small_server_args

pytestmark = pytest.mark.timeout(120)

# A ZMTP 3.0 greeting offering the NULL mechanism (no keys): signature, version, mechanism,
# as-server, filler (64 bytes).
_NULL_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
_HANDSHAKE_LINE = "in the security handshake (--keys is on)"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return create_keys(tmp_path_factory.mktemp("keys") / "keys")


@pytest.fixture(scope="module")
def keyed(keys) -> Iterator[ServerProcess]:
    port = int(free_tcp_endpoint().rsplit(":", 1)[1])
    args = (*small_server_args(seed=4), "--keys", str(keys), "--metrics-port", str(port))
    with running_server(*args) as srv:
        srv.metrics_url = f"http://127.0.0.1:{port}"
        yield srv


def _secrets(keys: Path) -> list[str]:
    """The Z85 text of every secret key in the folder."""
    return [
        zmq.auth.load_certificate(path)[1].decode() for path in sorted(keys.glob("*.key_secret"))
    ]


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def _answer(conn: socket.socket) -> bytes:
    """Everything the peer sent until it closed or went quiet for 2 s."""
    conn.settimeout(2)
    got = b""
    try:
        while chunk := conn.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionResetError):  # quiet, or hung up on us
        pass
    return got


def test_junk_below_zeromq_and_wrong_keys_get_nothing_and_one_warning_per_interval(
    keyed, keys, tmp_path
):
    """Random bytes, keyless greetings followed by junk, keyless and unknown-key ZeroMQ
    peers: none gets a byte of a reply past the greeting, the rejections are logged at most
    once per `HandshakeFailures` interval, and a key holder then gets its whole epoch."""
    rng = random.Random(3)
    host, port = _host_port(keyed.endpoint)
    log_before = len(keyed.log())
    started = time.monotonic()
    for i in range(150):
        with socket.create_connection((host, port), timeout=5) as conn:
            if i % 3:
                conn.sendall(rng.randbytes(rng.randrange(1, 300)))
            else:  # a keyless greeting, then junk: the server's greeting, then it hangs up
                conn.sendall(_NULL_GREETING + rng.randbytes(100))
                assert len(_answer(conn)) <= 64, "more than a greeting to a keyless peer"
    other = create_keys(tmp_path / "other")
    shutil.copy(keys / "server.key", other / "server.key")  # the right server, our key unknown
    ctx = zmq.Context()
    try:
        for i in range(40):
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            if i % 2:
                ClientKeys.load(other).apply(sock)
            sock.connect(keyed.endpoint)
            sock.send(wire.StatsRequest().pack())
            assert not sock.poll(50), "a peer without the keys got a reply"
            sock.close(0)
    finally:
        ctx.destroy(linger=0)
    kwargs = {"rank": 0, "world_size": 1, "device": "cpu", "timeout": 30, "keys": keys}
    with RemoteLoader(keyed.endpoint, "train", prefetch_next_epoch=False, **kwargs) as loader:
        assert sum(1 for _ in loader) == 25
    attack_s = time.monotonic() - started
    lines = keyed.log()[log_before:].count(_HANDSHAKE_LINE)
    assert 1 <= lines <= 2 + attack_s / HandshakeFailures().interval_s, (lines, attack_s)


def test_malformed_http_on_the_metrics_port_gets_an_http_error_and_scrapes_go_on(keyed):
    """A request line or header past http.server's limits, an unknown method, a path outside
    the three, an unknown HTTP version, bytes that are not HTTP: each gets its HTTP error;
    /metrics still answers."""
    cases = {
        b"GET /metrics?x=" + b"A" * 70_000 + b" HTTP/1.1\r\n\r\n": b" 414 ",
        b"GET /metrics HTTP/1.1\r\nX: " + b"y" * 100_000 + b"\r\n\r\n": b" 431 ",
        b"POST /metrics HTTP/1.1\r\nContent-Length: 100000000\r\n\r\n": b" 501 ",
        b"GET /../../etc/passwd HTTP/1.1\r\n\r\n": b" 404 ",
        b"GET /metrics HTTP/9.9\r\n\r\n": b" 505 ",
        b"GET /metrics \x00\xff\x16\x03\r\n\r\n": b" 400 ",
    }
    port = int(keyed.metrics_url.rsplit(":", 1)[1])
    for request, status in cases.items():
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(request)
            answer = _answer(c)
        assert answer.split(b"\r\n", 1)[0].find(status) > 0, (request[:40], answer[:80])
    with urllib.request.urlopen(f"{keyed.metrics_url}/metrics", timeout=10) as resp:
        assert b"batchwire_images_total" in resp.read()
    assert keyed.running


def test_no_secret_key_reaches_the_log_the_stats_or_the_metrics(keyed, keys):
    """After the probes above (and on their own): the secret keys' text appears nowhere a
    peer or an operator's tools read."""
    with urllib.request.urlopen(f"{keyed.metrics_url}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    seen = keyed.log() + repr(keyed.stats()) + metrics
    secrets = _secrets(keys)
    assert len(secrets) == 2 and all(len(s) == 40 for s in secrets)
    assert not [s for s in secrets if s in seen]
