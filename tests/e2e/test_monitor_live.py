"""pipeline-monitor against a real pipeline-server process: --once --json, the live view in a
pseudo-terminal, and a trainer that stops reading showing up as "the trainers" bottleneck.

The trainers here are raw DEALER sockets speaking the protocol (`rawclient.RawTrainer`, with a
real LoaderStats riding on their credits), so each test controls exactly when a trainer reads and
when it stops.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from batchwire import wire
from batchwire.monitor.bottleneck import infer_bottleneck
from monitorcheck import MONITOR, check_server_json
from rawclient import PREFETCH_DEPTH, SERVER_ARGS, RawTrainer, wait_for
from serverproc import ServerProcess, default_sigint, free_tcp_endpoint, running_server

ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def client_row(stats: dict[str, Any], trainer: RawTrainer) -> dict[str, Any] | None:
    return next((c for c in stats["clients"] if c["id"] == trainer.id), None)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(*SERVER_ARGS) as srv:
        yield srv


def run_monitor(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*MONITOR, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
def test_once_json_against_a_live_server(server: ServerProcess, ctx: zmq.Context) -> None:
    trainer = RawTrainer(server.endpoint, b"bw-j0", ctx)
    try:
        trainer.start()
        trainer.credit(trainer.prefetch)
        trainer.consume(3)

        def loader_reported() -> bool:
            row = client_row(server.stats(), trainer)
            return row is not None and (row["loader"] or {}).get("images_per_s", 0) > 0

        wait_for(loader_reported, "the credits carrying the trainer's stats to be read")
        done = run_monitor(server.endpoint, "--once", "--json")
        assert done.returncode == 0, done.stderr
        snap = json.loads(done.stdout)
        check_server_json(snap, server.endpoint)
        assert snap["counters"]["batches_total"] >= 3
        assert snap["counters"]["images_total"] >= 12
        row = client_row(snap, trainer)
        assert row is not None, snap["clients"]
        assert (row["split"], row["rank"], row["world_size"]) == ("train", 0, 1)
        assert row["sent"] >= 3
        assert row["ready_capacity"] == PREFETCH_DEPTH
        assert row["loader"] is not None, "the loader stats sent with the credits are missing"
        assert row["loader"]["images_per_s"] > 0
    finally:
        trainer.leave()


@pytest.mark.timeout(120)
def test_remote_loader_figures_reach_the_monitor(server: ServerProcess) -> None:
    from batchwire.client.remote_loader import RemoteLoader

    loader = RemoteLoader(
        server.endpoint, "train", rank=0, world_size=1, prefetch=2, timeout=60, device="cpu"
    )
    try:
        batches = iter(loader)
        for _ in range(4):
            images, _labels = next(batches)
        assert images.shape[0] == 4
        own = loader.stats()
        assert set(own) == {
            "prefetch_depth",
            "wait_s_per_batch",
            "data_wait_fraction",
            "images_per_s",
        }
        assert own["images_per_s"] > 0 and 0.0 <= own["data_wait_fraction"] <= 1.0

        def reported() -> dict[str, Any] | None:
            rows = [
                c
                for c in server.stats()["clients"]
                if c["loader"] is not None and c["loader"].get("images_per_s", 0) > 0
            ]
            return rows[0] if len(rows) == 1 else None

        row = wait_for(reported, "the loader's stats to arrive with its credits")
        done = run_monitor(server.endpoint, "--once")
        assert done.returncode == 0, done.stderr
        line = next(x for x in done.stdout.splitlines() if row["id"] in x).split()
        assert line[9].endswith("%"), line  # the data-wait column, filled from the loader
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_live_json_is_one_snapshot_per_line(server: ServerProcess) -> None:
    proc = subprocess.Popen(
        [*MONITOR, server.endpoint, "--json", "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    try:
        snaps = [json.loads(proc.stdout.readline()) for _ in range(3)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for snap in snaps:
        check_server_json(snap, server.endpoint)
    uptimes = [s["uptime_s"] for s in snaps]
    assert uptimes == sorted(uptimes) and uptimes[0] < uptimes[-1]


@pytest.mark.timeout(30)
def test_no_server_is_a_clear_error_naming_the_endpoint() -> None:
    endpoint = free_tcp_endpoint()
    started = time.monotonic()
    done = run_monitor(endpoint, "--once", "--timeout", "1")
    assert done.returncode == 1
    assert f"no answer from {endpoint} within 1 s" in done.stderr
    assert done.stdout == ""
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("option", ["--timeout", "--interval"])
@pytest.mark.parametrize("value", ["0", "inf", "nan", "1e300"])
def test_unusable_durations_are_a_usage_error(option: str, value: str) -> None:
    done = run_monitor("tcp://127.0.0.1:1", "--once", option, value)
    assert done.returncode == 2 and f"{option} must be > 0" in done.stderr, done.stderr


@pytest.mark.timeout(30)
def test_malformed_endpoint_fails_at_once() -> None:
    done = run_monitor("localhost:5555")  # live mode: would otherwise retry forever
    assert done.returncode == 2
    assert "cannot connect to localhost:5555" in done.stderr


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _controlling_tty() -> None:
    """In the child: own session, with the pty (already its stdin) as controlling terminal,
    so ^C typed into the pty becomes SIGINT exactly as in a real terminal."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    default_sigint()


class PtyReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = b""

    def read_until(
        self, predicate: Callable[[bytes], bool], what: str, timeout: float = 30.0
    ) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.data):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"pty: no {what} within {timeout}s; got:\n"
                    f"{ANSI.sub(b'', self.data[-3000:]).decode(errors='replace')}"
                )
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: the child closed the pty
                    chunk = b""
                if not chunk:
                    if predicate(self.data):
                        return
                    raise AssertionError(f"pty closed before {what}")
                self.data += chunk


def frames(data: bytes) -> list[list[str]]:
    """Split pty output into full-screen frames (each starts at cursor-home), as plain lines."""
    out = []
    for chunk in data.split(b"\x1b[H")[1:]:
        text = ANSI.sub(b"", chunk).decode(errors="replace").replace("\r", "")
        out.append(text.split("\n"))
    return out


@pytest.mark.timeout(120)
def test_live_view_in_a_pseudo_terminal(server: ServerProcess, ctx: zmq.Context) -> None:
    trainer = RawTrainer(server.endpoint, b"bw-p0", ctx)
    trainer.start()
    trainer.credit(trainer.prefetch)
    trainer.consume(2)
    master, slave = pty.openpty()
    _set_winsize(slave, 30, 110)
    proc = subprocess.Popen(
        [*MONITOR, server.endpoint, "--interval", "0.3"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=_controlling_tty,
        close_fds=True,
    )
    os.close(slave)
    reader = PtyReader(master)
    try:

        def row_shown(data: bytes) -> bool:
            return any(
                any(trainer.id in line and "train" in line for line in frame)
                for frame in frames(data)
            )

        reader.read_until(row_shown, f"client row for {trainer.id}")
        frame = next(f for f in reversed(frames(reader.data)) if any(trainer.id in x for x in f))
        text = "\n".join(frame)
        assert "bottleneck:" in text and "queues" in text and "throughput" in text
        row = next(line for line in frame if trainer.id in line).split()
        assert row[:3] == [trainer.id, "train", "0/1"]
        assert row[5].endswith(f"/{PREFETCH_DEPTH}")  # ready / its capacity

        # A narrow terminal: redrawn to fit, the client row still there.
        mark = len(reader.data)
        _set_winsize(master, 30, 44)

        def narrow_frame(data: bytes) -> bool:
            new = frames(data[mark:])
            return any(
                f and all(len(line) <= 44 for line in f) and any(trainer.id in line for line in f)
                for f in new
            )

        reader.read_until(narrow_frame, "a frame redrawn for 44 columns")

        os.write(master, b"\x03")  # Ctrl-C, through the terminal's line discipline
        assert proc.wait(timeout=15) == 0
        reader.read_until(lambda d: b"\x1b[?1049l" in d, "the terminal restored")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        trainer.leave()


@pytest.mark.timeout(120)
def test_a_trainer_that_stops_reading_is_named_the_bottleneck(
    server: ServerProcess,
    ctx: zmq.Context,
) -> None:
    # The earlier tests' trainers said bye; wait until the server has dropped them.
    wait_for(lambda: not server.stats()["clients"], "earlier clients to leave")
    trainer = RawTrainer(server.endpoint, b"bw-s0", ctx)
    try:
        trainer.start()
        trainer.credit(trainer.prefetch)
        trainer.consume(1)

        # From here on the trainer never reads again: the server sends what it asked for and
        # then has nothing to produce for it (each asked batch is one credit).
        def served() -> dict[str, Any] | None:
            stats = server.stats()
            row = client_row(stats, trainer)
            done = row is not None and row["credits"] == 0 and row["ready"] == 0
            return stats if done else None

        stats = wait_for(served, "everything the stopped trainer asked for to be sent")
        assert infer_bottleneck(wire.ServerStats.from_map(stats)).kind == "trainers"

        done = run_monitor(server.endpoint, "--once")
        assert done.returncode == 0, done.stderr
        assert "bottleneck: the trainers" in done.stdout
        assert any(trainer.id in x for x in done.stdout.splitlines())
        # Still nothing produced for it a moment later: the server does not work past the ask.
        again = client_row(server.stats(), trainer)
        assert again["ready"] == 0 and again["credits"] == 0
    finally:
        trainer.leave()
