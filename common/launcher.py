"""Run a `pipeline-server` as a child process: start it, wait until it serves, stop it.

Tests, `pipeline-bench` and the demo all need the same three steps, and each step has a trap:

- "serving" means the server answered a `stats` request, not that a port is open: the reply
  comes from the same loop that serves batches, so once it arrives a client is served too.
  Waiting for it polls a socket, never sleeps a fixed time, and gives up as soon as the process
  exits (its log then says why) or stays silent for the timeout;
- the stats request is sent once: ZeroMQ queues it and delivers it when the server binds, so
  a server that is still generating its dataset is simply waited for;
- stopping is SIGTERM (the server tells its clients and exits 0), then SIGKILL after a grace
  period, so a child never outlives its parent's run, whatever went wrong.

Only `batchwire.wire` is used to talk to the server (its one stats client,
`wire.stats_client`), so this module loads no server code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from batchwire.wire.endpoints import tcp_host_port
from batchwire.wire.keys import ClientKeys
from batchwire.wire.stats import ServerStats
from batchwire.wire.stats_client import StatsClient

__all__ = [
    "PipelineServer",
    "ServerStartError",
    "Stopped",
    "free_tcp_endpoint",
    "server_executable",
    "terminate",
]

#: How often the start-up wait looks at the process while no reply has come (seconds).
POLL_S = 0.1
#: Starts before a server that lost its port is an error: only for a port the launcher picked
#: itself, which another process may take between the pick and the server's bind.
START_ATTEMPTS = 3


class ServerStartError(RuntimeError):
    """The server exited or stayed silent before it answered; the message carries its log."""


class Stopped(NamedTuple):
    """How a stop went: the exit code, and whether SIGTERM was ignored so SIGKILL was needed."""

    returncode: int | None
    killed: bool


def free_tcp_endpoint() -> str:
    """A tcp:// endpoint on 127.0.0.1 whose port was free a moment ago (bind it right away)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


#: /proc's TCP socket tables and the state of a listening socket in them (include/net/tcp_states.h).
PROC_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
TCP_LISTEN = "0A"


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (any address); None
    where /proc cannot tell (not Linux, or not our process to look into).

    How a launcher tells its own server's reply from another process's on the same port: the
    socket inodes of the process's descriptors against the kernel's table of listening
    sockets (what psutil's ``net_connections`` reads, without the dependency)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        tables = [Path(t).read_text() for t in PROC_TCP_TABLES if Path(t).exists()]
    except OSError:
        return None
    if not tables:
        return None
    sockets = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile: the process's threads run on
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                sockets.add(link[len("socket:[") : -1])
    for table in tables:
        for row in table.splitlines()[1:]:
            fields = row.split()  # sl local_address rem_address st ... uid timeout inode
            local, state, inode = fields[1], fields[3], fields[9]
            listening = state == TCP_LISTEN and int(local.rsplit(":", 1)[1], 16) == port
            if listening and inode in sockets:
                return True
    return False


def server_executable() -> list[str]:
    """The `pipeline-server` console script next to this interpreter, else ``python -m``.

    Never a `pipeline-server` found on PATH: it may belong to another installation, while this
    interpreter surely runs the same batchwire as its caller.
    """
    script = Path(sys.executable).parent / "pipeline-server"
    return [str(script)] if script.exists() else [sys.executable, "-m", "batchwire.server"]


def _keys_in(args: Sequence[str]) -> ClientKeys | None:
    """The client side of a ``--keys DIR`` (or ``--keys=DIR``) among a server's arguments."""
    for i, arg in enumerate(args):
        if arg == "--keys" and i + 1 < len(args):
            return ClientKeys.load(args[i + 1])
        if arg.startswith("--keys="):
            return ClientKeys.load(arg.split("=", 1)[1])
    return None


def terminate(proc: subprocess.Popen, grace: float) -> bool:
    """SIGTERM, wait up to ``grace`` seconds, then SIGKILL. True if it had to kill.

    For any child that must not outlive its parent's run (the server, the demo's trainer).
    """
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return True


class PipelineServer:
    """One `pipeline-server` child bound to ``endpoint``; the endpoint is kept across restarts.

    ``args`` are the CLI's (``--bind endpoint`` is added); no ``endpoint``: a free 127.0.0.1
    port, and another one if a second process takes it before the server binds it (the server
    then exits saying so, once started; its log must be kept to tell). A reply on the port from
    a process other than ours is never taken for our server's. ``env`` adds variables to this
    process's environment. ``log_path``: the child's stdout and stderr are appended there (and
    quoted in errors); None lets it write to this process's own stdout and stderr.
    As a context manager it starts (unless started) and stops the server.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        endpoint: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.args = tuple(str(a) for a in args)
        self._port_picked = endpoint is None  # so another may be picked if this one is taken
        self.endpoint = endpoint or free_tcp_endpoint()
        #: The server's own ``--keys`` folder, if any: our requests to it hold its client key.
        self.keys = _keys_in(self.args)
        self.env = None if env is None else {**os.environ, **env}
        self.log_path = None if log_path is None else Path(log_path)
        self._proc: subprocess.Popen | None = None

    @property
    def command(self) -> list[str]:
        return [*server_executable(), "--bind", self.endpoint, *self.args]

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("pipeline-server not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def log(self, tail_chars: int | None = None) -> str:
        """What the server wrote (all of it, or its last ``tail_chars``); "" without a log file."""
        if self.log_path is None:
            return ""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text if tail_chars is None else text[-tail_chars:]

    def start(self, timeout: float = 120.0) -> PipelineServer:
        """Start the process; return once it answers a stats request (see `wait_until_serving`).

        The default timeout is generous: a first start may generate the embedded dataset.
        """
        if self.running:
            raise RuntimeError(f"pipeline-server already running (pid {self.pid})")
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start_once(timeout)
            except ServerStartError:
                if attempt == START_ATTEMPTS or not self._lost_picked_port():
                    raise
                self.endpoint = free_tcp_endpoint()
            else:
                self._port_picked = False  # clients know this port now: restarts keep it
                return self
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _lost_picked_port(self) -> bool:
        """The server exited because another process took the port this launcher picked."""
        taken = f"cannot bind {self.endpoint}: Address already in use"
        return self._port_picked and not self.running and taken in self.log()

    def _start_once(self, timeout: float) -> None:
        command = self.command
        if self.log_path is None:
            self._proc = subprocess.Popen(command, env=self.env)
        else:
            with open(self.log_path, "a") as log:
                log.write(f"$ {' '.join(command)}\n")
                log.flush()
                self._proc = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=self.env
                )
        try:
            self.wait_until_serving(timeout)
        except BaseException:  # Ctrl-C or a bad reply included: no half-started child is left
            self.kill()
            raise

    def wait_until_serving(self, timeout: float) -> ServerStats:
        """Return the server's first stats once it answers; ServerStartError if the process
        exits first, or stays silent for ``timeout`` seconds (it is then killed)."""
        proc = self._proc
        if proc is None:
            raise RuntimeError("pipeline-server not started")
        deadline = time.monotonic() + timeout
        answered_elsewhere = False  # another process replied on our port
        with StatsClient(self.endpoint, keys=self.keys) as client:
            client.send()
            while True:
                # Checked before trusting a reply: if our server failed (say, its port was
                # taken), an answer can only have come from some other process.
                if proc.poll() is not None:
                    raise ServerStartError(
                        self._with_log(
                            f"pipeline-server exited with code {proc.returncode} before it "
                            f"answered on {self.endpoint}"
                        )
                    )
                stats = None if answered_elsewhere else client.receive(POLL_S)
                if stats is not None:
                    if not self._answered_by_another(proc.pid):
                        return stats
                    # Ours cannot bind a port another server holds: it exits, and a port the
                    # launcher picked is then picked again (`start`).
                    answered_elsewhere = True
                if answered_elsewhere:
                    time.sleep(POLL_S)
                if time.monotonic() > deadline:
                    self.kill()
                    held = " (another process answers there)" if answered_elsewhere else ""
                    raise ServerStartError(
                        self._with_log(
                            f"pipeline-server did not answer on {self.endpoint}{held} within "
                            f"{timeout:g}s (killed)"
                        )
                    )

    def _answered_by_another(self, pid: int) -> bool:
        """A reply on our TCP port while process ``pid`` (ours) does not listen there came from
        another process (say, a server that took the port first); where /proc cannot tell,
        the reply is trusted, as before."""
        host_port = tcp_host_port(self.endpoint)
        if host_port is None or not host_port[1].isdigit():
            return False
        return listens_on(pid, int(host_port[1])) is False

    def stop(self, grace: float = 10.0) -> Stopped:
        """SIGTERM and wait up to ``grace`` seconds, then SIGKILL; a no-op once it has exited."""
        if self._proc is None:
            return Stopped(None, False)
        killed = terminate(self._proc, grace)
        return Stopped(self._proc.returncode, killed)

    def kill(self) -> None:
        """SIGKILL (a crash, for restart tests, or a server past saving); no questions asked."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> PipelineServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _with_log(self, message: str) -> str:
        log = self.log()
        return f"{message}:\n{log}" if log else message
