"""The metrics port: ``GET /metrics`` (Prometheus) and the probes ``/healthz`` and ``/readyz``.

prometheus_client's own server answers any path with the metrics; ours answers only these
paths (404 elsewhere, 501 for any method but GET/HEAD: http.server's answer for a method it has
no handler for), so a scanner learns nothing from other paths, and it binds to
``--metrics-host`` (127.0.0.1 by default), not every interface. A connection silent for
`REQUEST_TIMEOUT_S` is closed: each holds a thread and a socket of the server's process while
it waits, and a scanner's or a stuck client's would otherwise pile up for ever.

The probes live here because a scheduler (a Kubernetes kubelet, a load balancer) already has
to reach this port to scrape: one port to open, one to protect. Their answers come from a
``health`` callable the server supplies; it only reads values the loop thread writes (a
heartbeat time, a draining flag), so a probe never waits on the loop or takes its locks, and
a loop that is stuck still gets a prompt 503 from ``/healthz``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

METRICS_PATH = "/metrics"
HEALTH_PATHS = ("/healthz", "/readyz")
#: Seconds a connection may take per read or write (a scrape or a probe takes milliseconds).
REQUEST_TIMEOUT_S = 10.0

#: ``health(path)`` -> (HTTP status, body): 200 when the check passes, 503 when it does not.
HealthCheck = Callable[[str], tuple[int, bytes]]


class _QuietHTTPServer(ThreadingHTTPServer):
    """A peer that hangs up or goes quiet mid-request (a scanner, a scraper that gave up) is
    not news: socketserver would write a traceback to stderr, the server's log, for each one,
    and a peer reconnecting in a loop would fill the disk."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # the peer hung up or went quiet; any other error is ours: its traceback
        super().handle_error(request, client_address)  # a bug of ours: its traceback


def start_metrics_server(
    port: int,
    host: str,
    registry: CollectorRegistry,
    health: HealthCheck | None = None,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread, and
    ``/healthz`` and ``/readyz`` from ``health`` when one is given (404 otherwise); a
    connection idle for ``request_timeout_s`` is closed."""

    class Handler(BaseHTTPRequestHandler):
        timeout = request_timeout_s  # StreamRequestHandler: the connection's socket timeout

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == METRICS_PATH:
                status, payload, kind = 200, generate_latest(registry), CONTENT_TYPE_LATEST
            elif path in HEALTH_PATHS and health is not None:
                status, payload = health(path)
                kind = "application/json"
            else:
                self.send_error(404, "only /metrics, /healthz and /readyz are served here")
                return
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
            pass

    httpd = _QuietHTTPServer((host, int(port)), Handler)
    thread = threading.Thread(target=httpd.serve_forever, name="bw-metrics", daemon=True)
    thread.start()
    return httpd, thread
