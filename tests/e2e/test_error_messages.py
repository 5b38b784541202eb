"""Errors that name their cause, from real processes and without a server: a host name that
does not resolve is a DNS error at once (pipeline-train, pipeline-monitor, RemoteLoader), a port
where nothing listens says so, and a loader kept waiting says so every few seconds.

About 15 s on 2 cores, most of it the waiting test's 6 s timeout and the commands' imports.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from batchwire.client import RemoteLoader, ServerUnavailable
from serverproc import free_tcp_endpoint

BIN = Path(sys.executable).parent
NOWHERE = "tcp://nosuchhost.invalid:5555"  # .invalid never resolves (RFC 2606)


def run(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["pipeline-train", "pipeline-monitor"])
def test_an_unresolvable_host_is_a_dns_error_at_once(command: str) -> None:
    args = ["--server", NOWHERE] if command == "pipeline-train" else [NOWHERE, "--once"]
    proc = run(str(BIN / command), *args)
    assert proc.returncode == 2, proc.stderr
    assert "cannot resolve the host name 'nosuchhost.invalid'" in proc.stderr, proc.stderr
    assert "DNS lookup failed" in proc.stderr and "pipeline-server --bind" not in proc.stderr


def test_a_loader_names_dns_before_any_waiting() -> None:
    loader = RemoteLoader(NOWHERE, "train", rank=0, world_size=1, device="cpu", timeout=60)
    started = time.monotonic()
    with pytest.raises(ServerUnavailable, match="DNS lookup failed") as info:
        len(loader)
    assert time.monotonic() - started < 5 and info.value.endpoint == NOWHERE
    loader.close()


@pytest.mark.timeout(60)
def test_nothing_listening_is_said_while_waiting_and_in_the_error() -> None:
    endpoint = free_tcp_endpoint()  # nobody binds it
    train = str(BIN / "pipeline-train")
    proc = run(train, "--server", endpoint, "--timeout", "6", "--model", "small", "--device", "cpu")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("pipeline-train ") and f"connecting to {endpoint}" in proc.stdout
    waiting = f"waiting for pipeline-server at {endpoint} for 5 s (giving up after 6 s): "
    assert waiting + "nothing is listening there (connection refused)" in proc.stderr, proc.stderr
    assert "nothing is listening there, every connection was refused" in proc.stderr
    monitor = run(str(BIN / "pipeline-monitor"), endpoint, "--once", "--timeout", "1")
    assert monitor.returncode == 1
    assert f"no answer from {endpoint} within 1 s: nothing is listening there" in monitor.stderr
