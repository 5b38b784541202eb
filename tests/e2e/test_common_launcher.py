"""The launcher shared by tests, benchmarks and the demo, against a real `pipeline-server`.

A server of 4-image batches of 32 px from the embedded dataset's val split, one worker: each
start takes a few seconds on 2 cores, so the file starts three.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from batchwire.common.launcher import (
    PipelineServer,
    ServerStartError,
    Stopped,
    free_tcp_endpoint,
    listens_on,
    terminate,
)
from batchwire.pipeline.synthetic import default_dataset
from batchwire.wire.raw_client import RawClient
from batchwire.wire.stats_client import StatsTimeout, fetch_stats
from serverproc import running_server, small_server_args


def _args() -> list[str]:
    root = str(default_dataset().val_root)
    return ["--train", root, "--batch-size", "4", "--image-size", "32", "--workers", "1"]


def _refuses(endpoint: str) -> bool:
    try:
        fetch_stats(endpoint, timeout=0.3)
    except TimeoutError:
        return True
    return False


@pytest.mark.timeout(120)
def test_start_waits_until_it_serves_and_stop_is_a_clean_sigterm(tmp_path: Path) -> None:
    log_path = tmp_path / "server.log"
    server = PipelineServer([*_args(), "--log-level", "INFO"], log_path=log_path)
    assert server.endpoint.startswith("tcp://127.0.0.1:")
    with server as srv:  # the context manager starts it...
        assert srv.running
        # ...and returns only once a stats request is answered: no retry needed here.
        stats = fetch_stats(srv.endpoint, timeout=2.0)
        assert stats.v == 1 and [s.name for s in stats.stages]
        # A raw wire client sees the same server.
        ctx = zmq.Context()
        try:
            client = RawClient.connect(ctx, srv.endpoint, batches=(0,))
            welcome = client.start()
            assert welcome.batch_size == 4 and welcome.shape[2:] == [32, 32]
            client.close()
        finally:
            ctx.term()
    assert not server.running  # ...and stops it
    assert server.stop() == Stopped(0, False)  # stopping again is a no-op with the same answer
    assert server.log().startswith(f"$ {' '.join(server.command)}\n")
    assert _refuses(server.endpoint)


@pytest.mark.timeout(120)
def test_a_picked_port_taken_before_the_server_binds_it_moves_to_another(tmp_path: Path) -> None:
    """The race behind a flaky suite: any process (another test's connection) may take the
    port between the launcher's pick and the server's bind. Only a picked port moves."""
    server = PipelineServer(_args(), log_path=tmp_path / "server.log")
    taken = server.endpoint
    port = int(taken.rsplit(":", 1)[1])
    with socket.create_server(("127.0.0.1", port)):
        with server as srv:
            assert srv.endpoint != taken
            assert fetch_stats(srv.endpoint, timeout=2.0).v == 1
        assert f"cannot bind {taken}: Address already in use" in server.log()
        # Once it served, the port is the server's: a restart keeps it, taken or not.
        moved = server.endpoint
        moved_port = int(moved.rsplit(":", 1)[1])
        with (
            socket.create_server(("127.0.0.1", moved_port)),
            pytest.raises(ServerStartError, match="exited with code 2"),
        ):
            server.start()
        assert server.endpoint == moved


def test_listens_on_tells_which_process_holds_a_listening_port() -> None:
    """How the launcher tells its server's reply from another process's on the same port."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert listens_on(os.getpid(), port) is True
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert listens_on(child.pid, port) is False  # alive, but not the one listening
        finally:
            child.kill()
            child.wait()
    assert listens_on(os.getpid(), port) is False  # closed


@pytest.mark.timeout(120)
def test_a_picked_port_taken_by_another_pipeline_server_is_not_taken_for_ours(tmp_path):
    """When the process that takes the picked port is itself a pipeline-server, it answers the
    stats request before ours has failed to bind: that reply is not taken for ours (`listens_on`),
    and ours moves to another port."""
    args = small_server_args(seed=9)  # a server of its own: the other holds the port
    ours = PipelineServer(args, log_path=tmp_path / "ours.log")
    taken = ours.endpoint
    with running_server(*args, endpoint=taken):
        ours.start()
        try:
            assert ours.endpoint != taken, (
                f"start() returned on {taken}, which the other server holds; ours:\n"
                + ours.log(tail_chars=300)
            )
        finally:
            ours.stop()


@pytest.mark.timeout(60)
def test_an_explicit_endpoint_that_is_taken_does_not_move(tmp_path):
    """Only a port the launcher picked moves: an endpoint the caller chose is what clients
    were told, so a taken one is an error naming it, after one attempt."""
    with socket.create_server(("127.0.0.1", 0)) as holder:
        endpoint = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
        server = PipelineServer(small_server_args(seed=9), endpoint, log_path=tmp_path / "s.log")
        with pytest.raises(ServerStartError, match="Address already in use"):
            server.start(timeout=50)
    assert server.endpoint == endpoint
    assert server.log().count("$ ") == 1, server.log()


@pytest.mark.timeout(60)
def test_a_server_that_exits_fails_the_start_with_its_log(tmp_path: Path) -> None:
    server = PipelineServer(
        ["--train", str(tmp_path / "no-such-folder"), "--workers", "1"],
        f"ipc://{tmp_path}/s.sock",
        log_path=tmp_path / "server.log",
    )
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match="exited with code") as info:
        server.start(timeout=50)
    assert time.monotonic() - t0 < 40  # it noticed the exit, not the timeout
    assert "no-such-folder" in str(info.value)  # the server's own words are in the error
    assert not server.running and server.returncode not in (None, 0)


@pytest.mark.timeout(60)
def test_a_silent_server_is_killed_at_the_timeout_and_can_start_again(tmp_path: Path) -> None:
    server = PipelineServer(_args(), f"ipc://{tmp_path}/s.sock", log_path=tmp_path / "server.log")
    with pytest.raises(ServerStartError, match=r"did not answer .* within 0\.05s"):
        server.start(timeout=0.05)  # far less than an interpreter needs to start
    assert not server.running
    server.start()  # same endpoint, a fresh process
    try:
        assert server.running and fetch_stats(server.endpoint).clients == ()
    finally:
        assert server.stop(grace=20) == Stopped(0, False)


def test_terminate_kills_a_child_that_ignores_sigterm() -> None:
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1); time.sleep(60)"  # noqa: E501
    proc = subprocess.Popen([sys.executable, "-c", ignore], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "1\n"  # handler installed
    t0 = time.monotonic()
    assert terminate(proc, grace=0.5) is True
    assert proc.returncode == -9 and time.monotonic() - t0 < 10
    assert terminate(proc, grace=0.5) is False  # already gone: nothing to do
    proc.stdout.close()


def test_fetch_stats_times_out_without_a_server() -> None:
    with pytest.raises(StatsTimeout, match="no answer from") as info:
        fetch_stats(free_tcp_endpoint(), timeout=0.2)
    assert isinstance(info.value, TimeoutError)
