"""The build folder's lock with real processes: a holder killed mid-build (SIGKILL, so nothing
of its own cleans up) is taken over at once, with torch's own lock it left; a live holder is
waited on, and the wait is logged with who holds it and since when.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import batchwire.native.build as build
import pytest

HOLDER = """
import sys, time
from pathlib import Path
from batchwire.native.build import BuildLock
folder, hold_s = Path(sys.argv[1]), float(sys.argv[2])
lock = BuildLock(folder)
lock.acquire()
(folder / "lock").write_text("")  # torch's own baton, as during a compile
print("held", flush=True)
time.sleep(hold_s)
(folder / "lock").unlink()
lock.release()
print("released", flush=True)
"""


def _holder(folder: Path, hold_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder), str(hold_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(60)
def test_a_killed_holders_lock_is_taken_over_at_once(tmp_path, caplog):
    proc = _holder(tmp_path, 600)
    recorded = json.loads((tmp_path / build.LOCK_NAME).read_text())
    assert recorded["pid"] == proc.pid and recorded["host"] == socket.gethostname()
    assert abs(recorded["since"] - time.time()) < 60
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert (tmp_path / build.LOCK_NAME).exists() and (tmp_path / "lock").exists()

    lock = build.BuildLock(tmp_path)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="batchwire.native"):
        lock.acquire()
    took = time.monotonic() - t0
    try:
        assert took < 2.0, took
        assert not (tmp_path / "lock").exists(), "torch's lock of the dead build is removed"
        mine = json.loads((tmp_path / build.LOCK_NAME).read_text())
        assert mine["pid"] == os.getpid()
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "taking over the build lock" in text and f"pid {proc.pid}" in text
        assert "waiting" not in text
    finally:
        lock.release()
    assert not (tmp_path / build.LOCK_NAME).exists()


@pytest.mark.timeout(60)
def test_a_live_holder_is_waited_on_and_named(tmp_path, caplog):
    proc = _holder(tmp_path, 1.5)
    lock = build.BuildLock(tmp_path, poll_s=0.05)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="batchwire.native"):
        lock.acquire()
    took = time.monotonic() - t0
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "released"
        assert 0.8 < took < 30, took
        waits = [
            r.getMessage() for r in caplog.records if "waiting for the build" in r.getMessage()
        ]
        assert len(waits) == 1, waits
        assert f"pid {proc.pid} on {socket.gethostname()}, since " in waits[0]
        assert not any("taking over" in r.getMessage() for r in caplog.records)
        assert json.loads((tmp_path / build.LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
        proc.wait(timeout=10)
    assert proc.returncode == 0


def test_liveness_of_lock_owners(tmp_path):
    me = build.LockOwner(os.getpid(), socket.gethostname(), time.time(), None)
    assert build.owner_alive(me, heartbeat_age=10_000)  # same host: the pid decides
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    dead = build.LockOwner(done.pid, socket.gethostname(), time.time())
    assert not build.owner_alive(dead, heartbeat_age=0)
    reused = build.LockOwner(os.getpid(), socket.gethostname(), time.time(), "1")
    assert not build.owner_alive(reused, heartbeat_age=0), "a pid reused by another process"
    far = build.LockOwner(1, "some-other-host", time.time())
    assert build.owner_alive(far, heartbeat_age=5)
    assert not build.owner_alive(far, heartbeat_age=build.FOREIGN_STALE_S + 1)


# The smallest extension the build path makes like any other (plan, cache folder, lock, compile,
# load): the ROI decoder itself took 15 s of CPU to compile here, this 3 s.
PROBE_SOURCE = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""
BUILD_SCRIPT = """
import sys
from batchwire.native import build
spec = build.ExtensionSpec("bw_lock_probe", (sys.argv[1],), (), ("-O0",), (), python_module=True)
result = build.build_extension(spec)
print("built", result.compiled, result.plan.build_dir, result.module.answer())
"""


def probe_spec(tmp_path: Path) -> build.ExtensionSpec:
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE_SOURCE)
    return build.ExtensionSpec(
        "bw_lock_probe", (str(source),), (), ("-O0",), (), python_module=True
    )


@pytest.mark.timeout(240)
def test_a_build_after_a_killed_build_does_not_hang(monkeypatch, tmp_path):
    """The whole path: a build folder locked (ours and torch's) by a SIGKILLed builder, then a
    real build of a (tiny) extension into it."""
    monkeypatch.setenv("BATCHWIRE_NATIVE_CACHE", str(tmp_path / "cache"))
    spec = probe_spec(tmp_path)
    folder = build.make_plan(spec).build_dir
    folder.mkdir(parents=True)
    proc = _holder(folder, 600)
    proc.kill()
    proc.wait(timeout=10)
    command = [sys.executable, "-c", BUILD_SCRIPT, spec.sources[0]]
    run = subprocess.run(command, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr
    assert f"built True {folder} 42" in run.stdout
    assert "taking over the build lock" in run.stderr and f"pid {proc.pid}" in run.stderr
    assert not (folder / "lock").exists() and not (folder / build.LOCK_NAME).exists()
    again = subprocess.run(command, capture_output=True, text=True, timeout=100)
    assert f"built False {folder} 42" in again.stdout, again.stderr
