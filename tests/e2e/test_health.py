"""/healthz and /readyz of a real pipeline-server, over real HTTP, and what SIGTERM does to them.

/healthz answers 200 while the server's loop turns; /readyz answers 200 while the server
serves and 503 from the moment SIGTERM starts the drain (a Kubernetes readiness probe then
takes the pod out of the Service's DNS name), while /healthz stays 200 (a liveness probe must
not kill a draining server). During the drain a new hello is refused as ``transient`` (the
client asks its other servers); a client mid-stream gets the batches already in production,
then `shutdown`; the process exits 0.

The drain stays open as long as the test looks at it: the server's producer waits at a gate (a
file the test creates) before each batch, installed in the real server process by Python's
start-up hook. A slow decode held it open before, for about 2 s; a loaded machine that paused
the test that long found the server gone (CI once did).

A producer thread that dies fails /healthz and ends the process with a non-zero exit code and
the traceback in its log (a liveness probe or any supervisor restarts it).
"""

from __future__ import annotations

import os
import signal
import socket
import textwrap
import time
from pathlib import Path

import pytest
import requests
from batchwire import wire
from batchwire.wire.raw_client import RawClient
from rawclient import wait_for
from serverproc import running_server, small_server_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def probe(port: int, path: str) -> tuple[int, dict]:
    resp = requests.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    assert resp.headers["Content-Type"] == "application/json"
    return resp.status_code, resp.json()


# Installed in the server process by Python's own start-up hook (sitecustomize on PYTHONPATH):
# each batch waits, at most 60 s, for the file BW_TEST_GATE names.
_GATED_PRODUCER = """
    import os
    import time
    from batchwire.pipeline.producer import BatchProducer

    produce_now = BatchProducer.produce

    def produce(self, *args, **kwargs):
        deadline = time.monotonic() + 60
        while not os.path.exists(os.environ["BW_TEST_GATE"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        return produce_now(self, *args, **kwargs)

    BatchProducer.produce = produce
"""


def hooked_env(tmp_path: Path, hook_source: str, **env: str) -> dict[str, str]:
    """PYTHONPATH with a sitecustomize.py of ``hook_source`` first, and ``env``."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(hook_source))
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **env}


@pytest.mark.timeout(120)
def test_probes_answer_on_the_metrics_port_only_where_asked() -> None:
    port = free_port()
    with running_server(*small_server_args(seed=1), "--metrics-port", str(port)):
        code, body = probe(port, "/healthz")
        assert code == 200 and body["status"] == "ok"
        assert body["checks"] == {"loop": True, "production": True}
        code, body = probe(port, "/readyz")
        assert code == 200, body
        assert body["checks"] == {
            "loop": True,
            "production": True,
            "splits": True,
            "producers": True,
            "accepting": True,
            "reads": True,
        }
        assert not body["draining"]
        head = requests.head(f"http://127.0.0.1:{port}/readyz?verbose", timeout=5)
        assert head.status_code == 200 and head.content == b""
        assert requests.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 404
        assert requests.post(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 501


@pytest.mark.timeout(120)
def test_sigterm_drains_readyz_503_healthz_200_batches_in_production_sent(tmp_path, ctx) -> None:
    port = free_port()
    gate = tmp_path / "gate"
    args = (
        *small_server_args(seed=3),
        *("--batch-size", "4", "--producers", "1", "--prefetch-depth", "2"),
        *("--metrics-port", str(port), "--drain-timeout", "30"),
    )
    env = hooked_env(tmp_path, _GATED_PRODUCER, BW_TEST_GATE=str(gate))
    with running_server(*args, env=env) as srv:
        client = RawClient.connect(ctx, srv.endpoint, batches=(0, 1, 2, 3))
        client.start()
        wait_for(
            lambda: srv.stats()["clients"] and srv.stats()["clients"][0]["sent"] == 0,
            "the client's stream",
            30,
        )
        assert probe(port, "/readyz")[0] == 200
        started = time.monotonic()
        srv._proc.send_signal(signal.SIGTERM)
        _, body = wait_for(lambda: (r := probe(port, "/readyz"))[0] == 503 and r, "readyz 503", 10)
        assert body["draining"] and body["checks"]["accepting"] is False
        assert probe(port, "/healthz")[0] == 200  # alive: a liveness probe must not kill it
        late = RawClient.connect(ctx, srv.endpoint, batches=(0,), session=9)
        late.send(late.hello)
        msg, _ = late.recv(10)
        assert isinstance(msg, wire.ErrorReply), msg
        assert msg.reason == "transient" and "draining" in msg.message
        gate.touch()  # the batches in production may now be made
        got = []
        while True:
            msg, _ = client.recv(30)
            if isinstance(msg, wire.Shutdown):
                break
            assert isinstance(msg, wire.BatchHeader), msg
            got.append(msg.batch_index)
        # --prefetch-depth 2: batches 0 and 1 were in production at SIGTERM; 2 and 3 never
        # start (the client asks other servers for them).
        assert got == [0, 1], srv.log()
        assert srv._proc.wait(20) == 0, srv.log()
        assert time.monotonic() - started < 20
        assert "drained in" in srv.log()
        late.close()
        client.close()


# Installed in the server process by Python's own start-up hook (sitecustomize on PYTHONPATH):
# the first batch a producer thread makes raises SystemExit, as library code calling
# sys.exit() in the middle of a batch would.
_DYING_PRODUCER = """
    import threading
    from batchwire.pipeline.producer import BatchProducer

    def produce(self, *args, **kwargs):
        raise SystemExit("sys.exit() called in " + threading.current_thread().name)

    BatchProducer.produce = produce
"""


@pytest.mark.timeout(120)
def test_a_dead_producer_fails_healthz_and_ends_the_server(tmp_path, ctx) -> None:
    """A producer thread that dies for any reason leaves no server that accepts clients and
    never produces: /healthz fails, the client is told `shutdown`, and the process exits with
    code 4 within seconds, its log naming the thread, the exception and the traceback.

    How the thread dies: a fault injected into the real server process at start-up (Python's
    standard sitecustomize hook), not a mock of the server: `BatchProducer.produce` raises
    SystemExit, which the per-batch guard (`except Exception`: a failed batch goes back to its
    client as an error) does not catch. It stands for anything that escapes that guard (a
    SystemExit or KeyboardInterrupt raised by library code, a bug in the thread's own
    bookkeeping); a user transform cannot be used, since its errors, SystemExit included, are
    caught where it is called.
    """
    port = free_port()
    args = (*small_server_args(seed=2), "--metrics-port", str(port), "--producers", "1")
    with running_server(*args, env=hooked_env(tmp_path, _DYING_PRODUCER)) as srv:
        assert probe(port, "/healthz")[0] == 200
        client = RawClient.connect(ctx, srv.endpoint, batches=(0,))
        client.start()
        died = time.monotonic()

        def healthz_fails() -> bool:
            try:
                code, body = probe(port, "/healthz")
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
                # The process is gone already, or went while it answered (a cut body): a
                # probe that gets no answer fails, as Kubernetes counts it.
                return True
            assert code in (200, 503), body
            return code == 503 and body["checks"]["production"] is False

        wait_for(healthz_fails, "/healthz 503", 10)
        msg, _ = client.recv(10)
        assert isinstance(msg, wire.Shutdown), msg
        assert srv._proc.wait(10) == 4, srv.log()
        assert time.monotonic() - died < 10
        client.close()
        log = srv.log()
    thread = "bw-producer-0"
    assert f"producer thread {thread} died: SystemExit: sys.exit() called in {thread}" in log
    assert "Traceback (most recent call last)" in log and "raise SystemExit" in log
    assert "exits with code 4" in log, log
