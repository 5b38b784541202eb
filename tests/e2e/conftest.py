"""The end-to-end tier's session: a fork server for its Python children.

Fork server: every test worker starts one (tests/forkserver.py) and `subprocess.Popen` forks
the suite's `python -m ...`, `python -c ...` and console-script children from it, torch already
imported, instead of starting a fresh interpreter each time (what fresh processes would differ
in is exec'd for real: see its docstring). `BATCHWIRE_TEST_FORKSERVER=0` turns it off (e.g. to
compare), and a test marked `fresh_python` (it checks what a fresh process imports) gets real
execs; `BATCHWIRE_TEST_FORKSERVER_REPORT=DIR` writes each worker's count of forked and
exec'd children (and why) there.

Installed for each e2e module (not the session): where `make test` runs the unit tier in the
same workers, its tests get the real `subprocess.Popen`, as under `make test-fast`. The order of
the files: tests/conftest.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from forkserver import ForkServer


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> Iterator[ForkServer | None]:
    """This worker's fork server, started at its first e2e test (`_forked_children` installs it)."""
    if os.environ.get("BATCHWIRE_TEST_FORKSERVER", "1") == "0":
        yield None
        return
    with ForkServer.start() as server:
        yield server
        report = os.environ.get("BATCHWIRE_TEST_FORKSERVER_REPORT")
        if report:
            counts = {"forked": server.forked, "execd": server.execd}
            Path(report, f"worker-{os.getpid()}.json").write_text(json.dumps(counts))


@pytest.fixture(scope="module", autouse=True)
def _forked_children(fork_server: ForkServer | None) -> Iterator[None]:
    """`subprocess.Popen` forks from the fork server for this module's tests and its fixtures
    (autouse: set up before the module's servers, torn down after them)."""
    if fork_server is None:
        yield
        return
    fork_server.install()
    try:
        yield
    finally:
        fork_server.uninstall()


@pytest.fixture(autouse=True)
def _fresh_python_when_marked(
    request: pytest.FixtureRequest, fork_server: ForkServer | None
) -> Iterator[None]:
    if fork_server is None or request.node.get_closest_marker("fresh_python") is None:
        yield
        return
    with fork_server.real_execs():
        yield
