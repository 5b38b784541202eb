"""The metrics port (server/metrics_http.py): a real HTTP server on 127.0.0.1 in this process.

Requests go over real sockets, with urllib (no proxy) or, where the exact bytes on the wire matter
(a HEAD's missing body, malformed requests), a bare TCP socket. What is checked is what the module
promises: ``/metrics`` from the registry at each scrape, the probes from the ``health`` callable,
404 for every other path and 501 for every method but GET and HEAD (neither of which shows a
metric or asks the probe), errors for malformed and oversized requests, a client that sends
nothing cut off, a slow probe that holds up no scrape, and the bind to the host given. Every wait
has a deadline.
"""

from __future__ import annotations

import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from batchwire.server.metrics_http import HealthCheck, start_metrics_server
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter

WAIT_S = 5.0
METRIC = b"bw_unit_scrapes_total"
# urllib without the environment's proxies: a request to 127.0.0.1 must reach our server.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Probe:
    """A ``health`` callable: answers from ``answers`` and records the paths it was asked; while
    ``gate`` is set, it first waits (bounded) for the gate to open."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """As new: the usual answers, not asked yet, no gate."""
        self.asked: list[str] = []
        self.answers = {"/healthz": (200, b'{"status": "ok"}'), "/readyz": (200, b"{}")}
        self.entered = threading.Event()
        self.gate: threading.Event | None = None

    def __call__(self, path: str) -> tuple[int, bytes]:
        self.asked.append(path)
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(WAIT_S)
        return self.answers[path]


class Served:
    """A running metrics server: its handle, its thread and its base URL."""

    def __init__(self, registry: CollectorRegistry, health: HealthCheck | None, **kw: float):
        self.httpd, self.thread = start_metrics_server(0, "127.0.0.1", registry, health, **kw)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()  # waits for serve_forever's loop: up to its 0.5 s poll
        self.httpd.server_close()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("bw_unit_scrapes", "a counter the tests move", registry=reg).inc()
    return reg


@pytest.fixture(scope="module")
def module_probe() -> Probe:
    return Probe()


@pytest.fixture(scope="module")
def with_probe(registry: CollectorRegistry, module_probe: Probe) -> Iterator[Served]:
    """One server with a ``health`` callable for the module (each start costs a 0.5 s stop)."""
    served = Served(registry, module_probe)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def bare(registry: CollectorRegistry) -> Iterator[Served]:
    """One server without a ``health`` callable."""
    served = Served(registry, None)
    yield served
    served.stop()


@pytest.fixture
def probe(module_probe: Probe) -> Probe:
    """The module server's probe, as answering and unasked as new."""
    module_probe.reset()
    return module_probe


@pytest.fixture
def base(with_probe: Served, probe: Probe) -> str:
    return with_probe.base


def fetch(url: str, timeout: float = WAIT_S) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of a GET, error statuses included."""
    try:
        with OPENER.open(url, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), err.read()


def raw(base: str, request: bytes) -> bytes:
    """Everything the server sends back for ``request``, read until it closes the connection."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def status_of(response: bytes) -> int:
    """The status code of a raw response: its status line's (``HTTP/1.0 404 Not Found``), or
    where a request's version could not be read, the error page's (http.server then answers as
    HTTP/0.9 does: the body alone)."""
    if response.startswith(b"HTTP/"):
        return int(response.split(b"\r\n", 1)[0].split()[1])
    found = re.search(rb"Error code: (\d+)", response)
    assert found, response[:200]
    return int(found[1])


def test_metrics_are_the_registrys_at_each_scrape_with_type_length_and_no_store(
    base: str, registry: CollectorRegistry
) -> None:
    code, headers, body = fetch(f"{base}/metrics")
    assert code == 200
    assert headers["Content-Type"] == CONTENT_TYPE_LATEST
    assert int(headers["Content-Length"]) == len(body)
    assert headers["Cache-Control"] == "no-store"
    assert METRIC + b" 1.0\n" in body
    later = Counter("bw_unit_later", "registered after the start", registry=registry)
    try:
        later.inc(3)
        code, _, body = fetch(f"{base}/metrics?name[]=bw_unit_later")  # a query: the same page
        assert code == 200
        assert METRIC + b" 1.0\n" in body and b"bw_unit_later_total 3.0\n" in body
    finally:
        registry.unregister(later)


def test_head_gives_the_headers_and_no_body(base: str) -> None:
    _, _, body = fetch(f"{base}/metrics")
    head, _, rest = raw(base, b"HEAD /metrics HTTP/1.0\r\n\r\n").partition(b"\r\n\r\n")
    assert status_of(head) == 200
    assert f"Content-Length: {len(body)}".encode() in head.split(b"\r\n")
    assert rest == b""


def test_probes_answer_with_the_health_callables_status_and_body(base: str, probe: Probe) -> None:
    code, headers, body = fetch(f"{base}/healthz")
    assert (code, body) == (200, b'{"status": "ok"}')
    assert headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store"
    probe.answers["/readyz"] = (503, b'{"draining": true}')
    code, headers, body = fetch(f"{base}/readyz?verbose")
    assert (code, body) == (503, b'{"draining": true}')
    assert int(headers["Content-Length"]) == len(body)
    assert probe.asked == ["/healthz", "/readyz"]  # the path without its query


def test_probes_are_not_found_without_a_health_callable(bare: Served) -> None:
    for path in ("/healthz", "/readyz"):
        code, _, body = fetch(bare.base + path)
        assert code == 404 and METRIC not in body


@pytest.mark.parametrize(
    "path",
    [
        "/",
        "/metrics/",
        "/metricsx",
        "/Metrics",
        "/metrics/../metrics",
        "/healthz/",
        "/favicon.ico",
        "http://127.0.0.1/metrics",  # the absolute form a proxy is sent
    ],
)
def test_other_paths_are_not_found_and_show_no_metric(base: str, probe: Probe, path: str) -> None:
    for method in (b"GET", b"HEAD"):
        response = raw(base, method + b" " + path.encode() + b" HTTP/1.0\r\n\r\n")
        assert status_of(response) == 404
        assert METRIC not in response
    assert probe.asked == []


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "BREW"])
def test_other_methods_are_refused_and_show_no_metric(base: str, probe: Probe, method: str) -> None:
    for path in (b"/metrics", b"/healthz"):
        response = raw(base, method.encode() + b" " + path + b" HTTP/1.0\r\n\r\n")
        assert status_of(response) == 501
        assert METRIC not in response
    assert probe.asked == []


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/9.9\r\n\r\n", 505),
        (b"GET /metrics HTTP/x\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.0 extra\r\n\r\n", 400),
        (bytes(range(256)) + b"\r\n\r\n", 400),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.0\r\n\r\n", 414),
        (b"GET /metrics HTTP/1.0\r\n" + b"X-Many: 1\r\n" * 101 + b"\r\n", 431),
        (b"GET /metrics HTTP/1.0\r\nX-Long: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    ],
    ids=[
        "version",
        "bad-version",
        "extra-word",
        "binary",
        "long-line",
        "many-headers",
        "long-header",
    ],
)
def test_malformed_and_oversized_requests_get_an_error_and_the_server_goes_on(
    base: str, probe: Probe, request_bytes: bytes, status: int
) -> None:
    response = raw(base, request_bytes)
    assert status_of(response) == status
    assert METRIC not in response
    assert probe.asked == []
    assert fetch(f"{base}/metrics")[0] == 200


def test_a_client_that_stops_sending_is_cut_off(registry: CollectorRegistry) -> None:
    """A connection that never finishes its request does not hold a thread (and a socket) for
    ever: a scanner's or a stuck client's connections would pile up in the server's process."""
    served = Served(registry, None, request_timeout_s=0.2)
    try:
        for sent in (b"", b"GET /metr"):  # nothing; half a request line
            host, port = served.httpd.server_address[:2]
            with socket.create_connection((host, port), timeout=WAIT_S) as sock:
                sock.sendall(sent)
                try:
                    left = sock.recv(65536)  # b"": the server closed the connection
                except TimeoutError:
                    pytest.fail(f"the server still holds a connection idle for {WAIT_S} s")
            assert METRIC not in left
        assert fetch(f"{served.base}/metrics")[0] == 200
    finally:
        served.stop()


def test_a_slow_probe_does_not_hold_up_a_scrape(base: str, probe: Probe) -> None:
    """Each request has its own thread: a probe that takes long keeps no scrape waiting."""
    probe.gate = threading.Event()
    answers: list[int] = []
    asker = threading.Thread(target=lambda: answers.append(fetch(f"{base}/healthz")[0]))
    asker.start()
    try:
        assert probe.entered.wait(WAIT_S)
        code, _, body = fetch(f"{base}/metrics", timeout=WAIT_S / 4)  # before the gate's end
        assert code == 200 and METRIC in body
        assert answers == []  # the probe is still waiting
    finally:
        probe.gate.set()
        asker.join(WAIT_S)
    assert answers == [200]


def test_it_binds_the_host_given_from_a_daemon_thread(bare: Served) -> None:
    assert bare.httpd.socket.getsockname()[0] == "127.0.0.1"  # not every interface
    assert bare.thread.daemon and bare.thread.name == "bw-metrics"  # never keeps a process up
    assert bare.httpd.daemon_threads  # nor does a request's thread
