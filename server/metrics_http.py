"""The Prometheus endpoint: ``GET /metrics`` and nothing else, on the host asked for.

prometheus_client's own server answers any path with the metrics; ours answers only
``/metrics`` (404 elsewhere, 405 for anything but GET/HEAD), so a scanner learns nothing from
other paths, and it binds to ``--metrics-host`` (127.0.0.1 by default), not every interface.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

METRICS_PATH = "/metrics"


def start_metrics_server(
    port: int, host: str, registry: CollectorRegistry
) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            if self.path.split("?", 1)[0] != METRICS_PATH:
                self.send_error(404, "only /metrics is served here")
                return
            payload = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
            pass

    httpd = ThreadingHTTPServer((host, int(port)), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="bw-metrics", daemon=True)
    thread.start()
    return httpd, thread
