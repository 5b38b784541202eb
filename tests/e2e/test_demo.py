"""`python -m batchwire.train.demo` (the README's first command): a real pipeline-server on the
embedded dataset and 2 gloo DDP ranks under torchrun, to at least 90% validation top-1; and the
server is stopped whatever happens to the training.

Runtime on this 2-core machine (shared, load 6-8): about 80 s for the file (each test states
its own).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import pytest
from serverproc import default_sigint, free_tcp_endpoint

EPOCH = re.compile(r"^epoch (\d+): val top1=([\d.]+)% top5=([\d.]+)% data-wait=([\d.]+)%", re.M)


def _demo(endpoint: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "batchwire.train.demo", "--endpoint", endpoint, *args]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run_demo(endpoint: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run the demo to its end, stdout and stderr together in ``stdout``."""
    return subprocess.run(
        _demo(endpoint, *args),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
        check=False,
    )  # fmt: skip


def _refuses_connections(endpoint: str) -> bool:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


@pytest.mark.timeout(240)
def test_demo_reaches_90_percent_with_two_ranks_and_stops_the_server() -> None:
    """About 50 s on 2 cores (4 epochs of the small model at 32 px; 97% top-1 when measured)."""
    endpoint = free_tcp_endpoint()
    done = _run_demo(endpoint, "--epochs", "4", "--min-top1", "90", timeout=230)
    out = done.stdout
    assert done.returncode == 0, out
    assert "2 rank(s) on cpu" in out, out
    epochs = [(int(e), float(t1), float(t5), float(w)) for e, t1, t5, w in EPOCH.findall(out)]
    assert [e for e, *_ in epochs] == [0, 1, 2, 3], out
    _, top1, top5, wait = epochs[-1]
    assert top1 >= 90.0, out
    assert top5 >= top1 and 0.0 <= wait < 100.0
    assert "demo: done in" in out
    assert _refuses_connections(endpoint), "pipeline-server still listening after the demo"


@pytest.mark.timeout(90)
def test_demo_fails_when_training_fails_and_still_stops_the_server() -> None:
    """About 13 s on 2 cores: pipeline-train rejects --epochs 0, the demo exits non-zero."""
    endpoint = free_tcp_endpoint()
    done = _run_demo(endpoint, "--epochs", "0", "--ranks", "1", timeout=80)
    assert done.returncode != 0, done.stdout
    assert "demo: training failed" in done.stdout
    assert _refuses_connections(endpoint), "pipeline-server still listening after a failure"


@pytest.mark.timeout(90)
def test_ctrl_c_stops_trainer_and_server() -> None:
    """About 13 s on 2 cores: SIGINT to the demo once training has started."""
    endpoint = free_tcp_endpoint()
    proc = subprocess.Popen(
        _demo(endpoint, "--epochs", "50", "--ranks", "1", "--log-every", "1"),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=default_sigint,
    )  # fmt: skip
    seen = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step 1 "):
                break
        else:
            pytest.fail("the demo ended before training started:\n" + "".join(seen))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, "".join(seen) + rest
    assert _refuses_connections(endpoint), "pipeline-server still listening after Ctrl-C"
