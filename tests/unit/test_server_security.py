"""Who may reach the server (server/security.py): the bind policy and owner-only ipc sockets.

`is_loopback` and `bind_policy` are checked on endpoints as an operator writes them (tcp to
loopback in both address families and by name, every interface, a host name, an interface
name, ipc and inproc), including malformed ones, which must count as reachable from elsewhere.
`owner_only` is checked on real files and a real ZeroMQ ipc socket bound in tmp_path, under a
umask the test sets (022, the usual one, which alone would let group and others in).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from batchwire.server.security import bind_policy, is_loopback, owner_only

USUAL_UMASK = 0o022


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5555",
        "tcp://127.0.0.1:*",  # ZeroMQ's any-free-port
        "tcp://127.8.9.10:5555",  # all of 127/8
        "tcp://[::1]:5555",
        "tcp://[::1]:*",
        "tcp://localhost:5555",
        "ipc:///tmp/batchwire.sock",
        "ipc://@abstract-name",
        "inproc://batches",
    ],
)
def test_loopback_and_local_endpoints_are_reachable_from_this_host_only(endpoint: str) -> None:
    assert is_loopback(endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5555",
        "tcp://0.0.0.0:5555",
        "tcp://[::]:5555",
        "tcp://10.1.2.3:5555",
        "tcp://192.168.0.7:*",
        "tcp://[fe80::1%eth0]:5555",
        "tcp://eth0:5555",  # an interface name: which addresses it has is not known here
        "tcp://lo:5555",  # even the loopback interface's name: refusing is the safe side
        "tcp://trainer-7.cluster.local:5555",
        "tcp://localhost.evil.example:5555",
        "tcp://127.0.0.1.nip.io:5555",  # a name that starts like a loopback address
        "tcp://2130706433:5555",  # 127.0.0.1 as one integer: a resolver's business
        "tcp://[::1]",  # no port: not an address we can read
        "tcp://",
        "",
        "ws://*:8080",
    ],
)
def test_other_endpoints_count_as_reachable_from_elsewhere(endpoint: str) -> None:
    assert not is_loopback(endpoint)


def test_binds_on_this_host_only_need_neither_keys_nor_insecure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.server")
    local = ["tcp://127.0.0.1:5555", "ipc:///tmp/x.sock", "tcp://[::1]:5556"]
    assert bind_policy(local, keys=None, insecure=False) is None
    assert bind_policy(local, keys=None, insecure=True) is None
    assert bind_policy([], keys=None, insecure=False) is None
    assert caplog.records == []  # nothing to warn of


def test_an_exposed_bind_without_keys_is_refused_naming_it_and_the_ways_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.server")
    endpoints = ["ipc:///tmp/x.sock", "tcp://*:5555", "tcp://127.0.0.1:5556", "tcp://eth0:5557"]
    refused = bind_policy(endpoints, keys=None, insecure=False)
    assert refused is not None
    assert refused.startswith("tcp://*:5555, tcp://eth0:5557 can be reached from other hosts")
    assert "ipc://" not in refused and "127.0.0.1" not in refused  # only the exposed ones
    for way_out in ("pipeline-keys DIR", "--keys DIR", "RemoteLoader(keys=", "--insecure"):
        assert way_out in refused
    assert caplog.records == []  # refused, not logged: the caller says it as a startup error


def test_keys_allow_an_exposed_bind_and_make_insecure_moot(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.server")
    for insecure in (False, True):
        assert bind_policy(["tcp://*:5555"], keys="/etc/keys", insecure=insecure) is None
    assert caplog.records == []  # with keys there is no risk to log


def test_insecure_allows_an_exposed_bind_and_logs_the_risk_at_every_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="batchwire.server")
    endpoints = ["tcp://0.0.0.0:5555", "tcp://127.0.0.1:5556"]
    for _start in range(2):
        assert bind_policy(endpoints, keys=None, insecure=True) is None
    assert len(caplog.records) == 2
    for record in caplog.records:
        assert record.levelno == logging.WARNING and record.name == "batchwire.server"
        message = record.getMessage()
        assert message.startswith("--insecure: tcp://0.0.0.0:5555 can be reached")
        assert "127.0.0.1" not in message and "without keys" in message


def umask_now() -> int:
    """The process's umask (reading it means setting it: it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.fixture
def usual_umask() -> Iterator[None]:
    """The process under umask 022 for the test, its own umask back after."""
    old = os.umask(USUAL_UMASK)
    yield
    os.umask(old)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_ipc_socket_is_born_owner_only(tmp_path: Path, ctx: zmq.Context, usual_umask) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    with owner_only(f"ipc://{tmp_path}/guarded.sock"):
        router.bind(f"ipc://{tmp_path}/guarded.sock")
    router.bind(f"ipc://{tmp_path}/plain.sock")  # the same bind outside: what 022 alone gives
    guarded, plain = tmp_path / "guarded.sock", tmp_path / "plain.sock"
    assert stat.S_ISSOCK(guarded.stat().st_mode)
    assert mode_of(guarded) == 0o700  # the docstring's promise: no group or other access
    assert mode_of(plain) == 0o755  # the control: 022 alone lets group and others connect
    assert umask_now() == USUAL_UMASK  # given back


def test_files_made_inside_are_owner_only_and_the_umask_is_given_back(
    tmp_path: Path, usual_umask
) -> None:
    with owner_only(f"ipc://{tmp_path}/s"):
        assert umask_now() == 0o077
        (tmp_path / "made-inside").touch(mode=0o666)
        (tmp_path / "dir-inside").mkdir(mode=0o777)
    assert umask_now() == USUAL_UMASK
    assert mode_of(tmp_path / "made-inside") == 0o600
    assert mode_of(tmp_path / "dir-inside") == 0o700


def test_the_umask_is_given_back_when_the_bind_fails(
    tmp_path: Path, ctx: zmq.Context, usual_umask
) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    endpoint = f"ipc://{tmp_path}/no-such-dir/x.sock"
    with pytest.raises(zmq.ZMQError), owner_only(endpoint):
        router.bind(endpoint)
    assert umask_now() == USUAL_UMASK


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:*", "tcp://*:5555", "inproc://x"])
def test_other_endpoints_leave_the_umask_alone(endpoint: str, usual_umask) -> None:
    with owner_only(endpoint):
        assert umask_now() == USUAL_UMASK
    assert umask_now() == USUAL_UMASK
