"""The end-to-end tier's session: a fork server for its Python children, the longest files first.

Fork server: every test worker starts one (tests/forkserver.py) and `subprocess.Popen` forks
the suite's `python -m ...`, `python -c ...` and console-script children from it, torch already
imported, instead of starting a fresh interpreter each time (what fresh processes would differ
in is exec'd for real: see its docstring). `BATCHWIRE_TEST_FORKSERVER=0` turns it off (e.g. to
compare), and a test marked `fresh_python` (it checks what a fresh process imports) gets real
execs; `BATCHWIRE_TEST_FORKSERVER_REPORT=DIR` writes each worker's count of forked and
exec'd children (and why) there.

Order:
`make test` spreads whole files over xdist workers in collection order (`--dist loadfile`); a long
file taken last would run alone at the end while the other workers idle. Measured per file on
2 cores with 4 workers (seconds of its tests, fork server on; 2026-11-27); files not listed keep
their order after these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from forkserver import ForkServer

LONGEST_FIRST = (
    "test_frameworks.py",  # 101 s: Lightning, Accelerate and torchrun, 2 ranks each
    "test_packaging.py",  # 53 s: a wheel into a fresh venv, and its native build
    "test_object_store.py",  # 43 s (+ a SeaweedFS start)
    "test_discovery.py",  # 36 s, mostly waiting on DNS re-resolves and servers
    "test_train_preemption.py",  # 22-27 s: SIGUSR1 checkpoints, 1 and 2 ranks
    "test_native_lock.py",  # 32 s: a real build
    "test_train_data.py",  # 30 s: multi-label, mixing, resize, resumes
    "test_prepared_identity.py",  # 28 s
    "test_sharing.py",  # 27 s
    "test_pipeline_store.py",  # 25 s
    "test_remote_loader_epochs.py",  # 25 s
    "test_progressive_resize.py",  # 25 s
    "test_demo.py",  # 25 s
    "test_native_build.py",  # 24 s: nvcc
    "test_bad_input_sources.py",  # 24 s
    "test_server_limits.py",  # 23 s
    "test_remote_loader_recovery.py",  # 22 s
    "test_native.py",  # 22 s
    "test_remote_loader.py",  # 21 s
    "test_train.py",  # 20 s
    "test_sources_identity.py",  # 19 s
    "test_object_store_readahead.py",  # 18 s alone: a store outage
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[ForkServer | None]:
    """This worker's fork server, installed into `subprocess.Popen` for the whole session."""
    if os.environ.get("BATCHWIRE_TEST_FORKSERVER", "1") == "0":
        yield None
        return
    with ForkServer.start() as server:
        server.install()
        yield server
        report = os.environ.get("BATCHWIRE_TEST_FORKSERVER_REPORT")
        if report:
            counts = {"forked": server.forked, "execd": server.execd}
            Path(report, f"worker-{os.getpid()}.json").write_text(json.dumps(counts))


@pytest.fixture(autouse=True)
def _fresh_python_when_marked(
    request: pytest.FixtureRequest, fork_server: ForkServer | None
) -> Iterator[None]:
    if fork_server is None or request.node.get_closest_marker("fresh_python") is None:
        yield
        return
    with fork_server.real_execs():
        yield
