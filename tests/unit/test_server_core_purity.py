"""The server's protocol core is only policy: its modules import no thread, clock, socket or
telemetry (issue 31 item 1). Every event carries ``now``; what the core measured travels in
its actions (`SendBatch`'s figures, `Reply.counts`) and cancellation is an action (`Cancel`),
so the shell, server/app.py, is the one that locks, reads the clock and sets the producers'
flags. Read from the source (every import, function-level and TYPE_CHECKING ones too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"
# The core and its parts, and the data that crosses to the producers.
CORE = (
    "core.py",
    "actions.py",
    "admission.py",
    "lending.py",
    "scheduling.py",
    "housekeeping.py",
    "sessions.py",
    "jobs.py",
    "sharing.py",
    "peers.py",
    "budget.py",
    "delivery.py",
    "pacing.py",
    "lograte.py",
    "peer_names.py",
)
# What only a shell may touch: threads and locks, the clock, sockets, the telemetry.
FORBIDDEN = ("threading", "time", "zmq", "socket", "queue", "batchwire.server.telemetry")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("name", CORE)
def test_a_core_module_imports_no_thread_clock_socket_or_telemetry(name: str) -> None:
    found = {
        m
        for m in _imports(SERVER / name)
        if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)
    }
    assert not found, f"server/{name} imports {sorted(found)}: the shell's, not the core's"
